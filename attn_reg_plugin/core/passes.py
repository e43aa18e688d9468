"""A pass as values: what it asks of each site (:class:`Plan`) and what its calls handed back
(:class:`PassRecord`).

:meth:`~.controller.RegularizationController.hooks` sets a pass on its sites for its forward and
yields its record; the plan is the same pass as an immutable value that a checkpointed call carries
to its recompute (transformers' model kwargs, fairseq's wrapped layers,
:meth:`~.controller.RegularizationController.checkpoint`), which :func:`applied` sets again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:  # the site and hook types; controller imports this module
    from .attention_call import Hook
    from .controller import AttentionSite


def zero_counts() -> List[torch.Tensor]:
    """A fresh ``[dropped, valid]`` (or ``[skipped, total]``) pair of counts."""
    return [torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)]


def add_counts(total: List[torch.Tensor], more: List[torch.Tensor]) -> List[torch.Tensor]:
    """``total + more``, element by element (tensors: no host sync)."""
    return [a + b for a, b in zip(total, more)]


@dataclass(eq=False)
class PassRecord:
    """What the calls of one pass handed back, in call order: (site, ``Captured``) pairs, added by
    :func:`~.attention.attend` (never by the kernel, never in a recompute). The pass
    (:meth:`RegularizationController.hooks`) yields it; read it when the pass's forwards are done."""

    entries: List[Tuple[AttentionSite, object]] = field(default_factory=list)

    def add(self, site: AttentionSite, captured) -> None:
        self.entries.append((site, captured))

    @property
    def sites(self) -> List[AttentionSite]:
        return [site for site, _ in self.entries]

    def _field(self, name: str) -> list:
        return [getattr(captured, name) for _, captured in self.entries]

    outputs = property(lambda self: self._field("output"))  # GA: each call's output, the attribution's leaf
    values = property(lambda self: self._field("values"))
    valid = property(lambda self: self._field("valid"))
    probs = property(lambda self: self._field("probs"))  # AA/IGA maps, or what weights are recomputed from
    weights = probs

    def counts(self) -> List[torch.Tensor]:
        """``[dropped, droppable]`` units the pass's counted edits applied."""
        return self._summed("dropped", "droppable")

    def calls(self) -> List[torch.Tensor]:
        """``[calls whose rows-made-uniform flag was set, calls]`` of the pass's counted edits."""
        return self._summed("uniform_call", None)

    def _summed(self, part: str, whole: Optional[str]) -> List[torch.Tensor]:
        total = zero_counts()
        for _, captured in self.entries:
            value = getattr(captured, part)
            if value is not None:
                total = add_counts(
                    total, [value, getattr(captured, whole) if whole else torch.ones((), dtype=torch.long)]
                )
        return total


# -- sites ------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Plan:
    """What one pass asks of each site, as a value: ``calls`` maps each site the pass hooks to its
    (hook, seed). It travels with the model's call (transformers' model kwargs, the arguments a
    checkpoint keeps for its recompute), so a layer recomputed in the backward, after the pass
    ended, repeats it: the same hook and seed give the same drops."""

    calls: Mapping[AttentionSite, Tuple[Hook, Optional[int]]]

    def __bool__(self) -> bool:
        return bool(self.calls)


def plan_of(sites: Iterable[AttentionSite]) -> Plan:
    """The pass set on ``sites`` now, as a :class:`Plan` (empty when none is)."""
    return Plan(MappingProxyType({s: (s.hook, s.seed) for s in sites if s.hook is not None}))


@contextlib.contextmanager
def applied(plan: Optional[Plan], sites: Sequence[AttentionSite]) -> Iterator[None]:
    """Fill the slots of ``sites`` with what ``plan`` asks (nothing where it asks nothing) for the
    block: a checkpointed function recomputed in the backward runs under the pass of its forward."""
    calls = plan.calls if plan is not None else {}
    previous = [(s, s.hook, s.seed) for s in sites]
    try:
        for site in sites:
            site.hook, site.seed = calls.get(site, (None, None))
        yield
    finally:
        for site, hook, seed in previous:
            site.hook, site.seed = hook, seed


def _with_the_pass(function: Callable, sites: Sequence[AttentionSite], plan: Plan, *args, **kwargs):
    with applied(plan, sites):
        return function(*args, **kwargs)
