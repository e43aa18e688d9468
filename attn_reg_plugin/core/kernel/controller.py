"""Which attention modules are regularized, and what each does during one forward pass.

Adapters register one :class:`AttentionSite` per attention module (its kind and 0-based
layer) with a :class:`RegularizationController`; the module keeps the site and passes it to
:func:`~attn_reg_plugin.core.kernel.attention.attend`. Regularizers never touch modules: they ask
the controller for a pass: a hook (a :data:`Hook`: :class:`CaptureOutput`, :class:`CaptureProbs` or
:class:`EditScores`) for each of a selection of sites, for the duration of the pass.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import re
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

import torch

from .attention_call import (
    EDITS,
    AttentionSite,
    Hook,
    Plan,
    Record,
    _with_the_pass,
    changes_output,
    hook_in_progress,
    passing,
    plan_of,
    takes_gradients,
)
from .rules import call_seed, key_seed

logger = logging.getLogger(__name__)

ATTENTION_KINDS = ("encoder-self", "decoder-self", "encoder-decoder")
AUTO = "auto"  # encoder-self when the model has an encoder, else decoder-self


def parse_layers(spec: Union[str, Sequence[int], None], option: str) -> Optional[List[int]]:
    """``'all'`` / None -> None (every layer); ``'0,2'`` or ``[0, 2]`` -> sorted unique ints.

    An index is an integer (not a bool, not a float: ``0.9`` is no layer) or a string of ASCII
    digits (``int()`` would also read ``'١'``, an Arabic-Indic one)."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "all"):
        return None
    wanted = f"{option} must be 'all' or a comma-separated list of 0-based layer indices, got {spec!r}"
    if isinstance(spec, str):
        parts = [s.strip() for s in spec.split(",")]  # an empty entry ('0,,1', '1,') is refused, not skipped
        if not any(parts):
            raise ValueError(f"{option} must name at least one layer, got {spec!r}")
        if not all(re.fullmatch(r"-?[0-9]+", s) for s in parts):
            raise ValueError(wanted)
        layers = [int(s) for s in parts]
    elif not isinstance(spec, Iterable) or isinstance(spec, (bytes, Mapping)):
        raise ValueError(f"{wanted}: give a string ('0,2') or a list of integers ([0, 2]), also for one layer")
    else:
        bad = [x for x in spec if isinstance(x, bool) or not hasattr(type(x), "__index__")]
        if bad:
            raise ValueError(f"{wanted}: {bad[0]!r} is not an integer")
        layers = [operator.index(x) for x in spec]
    if not layers:
        raise ValueError(f"{option} must name at least one layer, got {spec!r}")
    bad = [x for x in layers if x < 0]
    if bad:
        raise ValueError(f"{option}: layer indices are 0-based and >= 0, got {bad}")
    return sorted(set(layers))


def parse_kinds(spec: Union[str, Iterable[str]], option: str) -> List[str]:
    """``'encoder-self,decoder-self'`` or a list -> validated list of attention kinds; ``'auto'`` ->
    ``['auto']``, resolved against the model by :meth:`RegularizationController.select`."""
    if not isinstance(spec, Iterable) or isinstance(spec, (bytes, Mapping)):
        raise ValueError(
            f"{option} must be 'auto' or a comma-separated list of attention kinds ({', '.join(ATTENTION_KINDS)}), "
            f"got {spec!r}"
        )
    kinds = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    kinds = [s for s in kinds if s]
    if not kinds:
        raise ValueError(f"{option} must name at least one of {', '.join(ATTENTION_KINDS)}")
    if AUTO in kinds:
        if len(kinds) > 1:
            raise ValueError(f"{option}: 'auto' stands alone; got {spec!r}")
        return [AUTO]
    unknown = [s for s in kinds if s not in ATTENTION_KINDS]
    if unknown:
        raise ValueError(f"{option}: unknown attention kind {unknown[0]!r}; accepted: {', '.join(ATTENTION_KINDS)}")
    return list(dict.fromkeys(kinds))


class RegularizationController:
    """The registry of a model's attention sites and the per-pass hooks on them."""

    def __init__(self) -> None:
        self.sites: List[AttentionSite] = []

    def register(self, kind: str, layer: int) -> AttentionSite:
        """A new site of ``kind`` at 0-based ``layer``; each (kind, layer) once. Any order, but a
        kind's layers must end up 0..n-1 (checked when sites are selected)."""
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention kind {kind!r}; accepted: {', '.join(ATTENTION_KINDS)}")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"register: layer must be a 0-based integer index >= 0, got {layer!r}")
        return self.add(AttentionSite(kind, layer))

    def add(self, site: AttentionSite) -> AttentionSite:
        """Register an existing site (checked like :meth:`register`)."""
        if any(s.kind == site.kind and s.layer == site.layer for s in self.sites):
            raise ValueError(
                f"register: {site.kind} layer {site.layer} is registered already; register one site per "
                "attention module (and per depth for a module shared by several depths)"
            )
        self.sites.append(site)
        return site

    def auto_kind(self) -> str:
        """What ``attention='auto'`` means for this model: encoder-self if it has any, else decoder-self."""
        return "encoder-self" if self.num_layers("encoder-self") or not self.sites else "decoder-self"

    def num_layers(self, kind: str) -> int:
        return sum(1 for s in self.sites if s.kind == kind)

    def select(
        self,
        kinds: Sequence[str],
        layers: Optional[Sequence[int]],
        option: str = "layers",
        kinds_option: str = "attention",
    ) -> List[AttentionSite]:
        """The sites of the given kinds and layers, in registration order.

        Errors name the option (``option`` for layers, ``kinds_option`` for kinds) and what the model has.
        """
        if list(kinds) == [AUTO]:
            kinds = [self.auto_kind()]
            logger.info("%s auto: %s attention", kinds_option, kinds[0])
        for kind in kinds:
            n = self.num_layers(kind)
            registered = sorted(s.layer for s in self.sites if s.kind == kind)
            if registered != list(range(n)):
                # Layer options are 0-based depths: a gap would make `layers` name the wrong modules.
                raise ValueError(
                    f"the model registered {kind} attention at layers {registered}, but layer indices must be "
                    f"0..{n - 1} (0-based, one per depth, no gaps): fix the layer numbers given to register()"
                )
            if n == 0:
                have = sorted({s.kind for s in self.sites}) or ["none"]
                raise ValueError(
                    f"{kinds_option}: attention kind {kind!r} was asked for, but this model has no such attention "
                    f"(it has: {', '.join(have)})"
                )
            if layers is not None and max(layers) >= n:
                raise ValueError(
                    f"{option}: layer {max(layers)} does not exist; the model's {kind} attention has "
                    f"{n} layers, so accepted indices are 0..{n - 1}"
                )
        return [s for s in self.sites if s.kind in kinds and (layers is None or s.layer in layers)]

    @contextlib.contextmanager
    def hooks(self, assignment: Dict[AttentionSite, Optional[Hook]]) -> Iterator[Record]:
        """One pass: ``assignment``'s hooks on its sites (None: ordinary attention there) for the
        block, as a :class:`Plan` in progress; yields the pass's :class:`Record`, which the sites'
        calls fill (``with controller.hooks(...) as record:``).

        A layer recomputed in the backward, after the pass ended, finds it in the plan its call
        carried (:meth:`checkpoint`; transformers' model kwargs; fairseq's checkpointed layers).
        When some edit draws random numbers, the pass takes one seed from torch's global generator
        and each site a seed keyed by it and the site.
        """
        nested = [s for s, h in assignment.items() if changes_output(h) and changes_output(hook_in_progress(s))]
        if nested:
            raise RuntimeError(
                f"a regularized pass began on {nested[0]} inside another one on the same site. "
                "Run one regularized pass per site at a time"
            )
        draws = any(isinstance(h, EDITS) and h.draws for h in assignment.values())
        pass_seed = call_seed() if draws else None
        record = Record()
        seeds = None
        if pass_seed is not None:
            sites = list(assignment)
            seeds = dict(zip(sites, site_seeds(pass_seed, [_site_key(site) for site in sites]).unbind(0)))
        try:
            with passing(Plan.asking(assignment, record, seeds)):
                yield record
        finally:
            record.close()  # a recompute in the backward, after the pass, adds nothing

    def checkpoint(self, function: Callable, *args, use_reentrant: bool = False, **kwargs):
        """``torch.utils.checkpoint.checkpoint(function, *args, ...)`` that carries the pass set now
        on this controller's sites into its recompute (a custom model's checkpointed layer: a
        recompute in the backward, after the pass ended, makes the forward's drops again)."""
        import torch.utils.checkpoint

        plan = plan_of(self.sites)
        carried = functools.partial(_with_the_pass, function, list(self.sites), plan)
        if use_reentrant and any(takes_gradients(hook) for hook, _, _ in plan.calls.values()):
            # A reentrant checkpoint runs the forward without autograd and refuses autograd.grad, which
            # AD-DROP's attribution pass takes: that pass runs the layer unchecked, as
            # checkpointing.activation_checkpointing_paused does for a model's own checkpoints.
            return carried(*args)
        return torch.utils.checkpoint.checkpoint(carried, *args, use_reentrant=use_reentrant, **kwargs)


@torch.library.custom_op("attn_reg::site_seeds", mutates_args=())
def site_seeds(pass_seed: torch.Tensor, keys: List[int]) -> torch.Tensor:
    """The seed of each key (a site's, :func:`_site_key`) under ``pass_seed`` (0-d int64, on the CPU):
    ``key_seed(pass_seed, key)``, an int64 CPU tensor shaped as ``keys``. An operator, so that the
    pass seed is read on the host inside it: in a graph torch.compile traces, ``int(pass_seed)``
    would break it."""
    seed = int(pass_seed)
    return torch.tensor([key_seed(seed, key) for key in keys], dtype=torch.int64)


@site_seeds.register_fake
def _site_seeds_shape(pass_seed: torch.Tensor, keys: List[int]) -> torch.Tensor:
    return pass_seed.new_empty((len(keys),))


def _site_key(site: AttentionSite) -> int:
    """A number naming the site within its model: its kind and layer."""
    return ATTENTION_KINDS.index(site.kind) << 32 | site.layer
