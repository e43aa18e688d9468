"""Which attention modules are regularized, and what each does during one forward pass.

Adapters register one :class:`AttentionSite` per attention module (its kind and 0-based
layer) with a :class:`RegularizationController`; the module keeps the site and passes it to
:func:`~attn_reg_plugin.core.attention.attend`. Regularizers never touch modules: they ask
the controller to set hooks on a selection of sites for the duration of a pass.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Union

import torch

from .checkpointing import recomputing

logger = logging.getLogger(__name__)

ATTENTION_KINDS = ("encoder-self", "decoder-self", "encoder-decoder")
AUTO = "auto"  # encoder-self when the model has an encoder, else decoder-self


@dataclass(eq=False)
class AttentionSite:
    """One attention module: its kind, its 0-based layer, and the hook of the current pass.

    ``replay`` is what the site's last forward call did (set by the kernel), kept so that a
    checkpointed layer recomputed in backward applies exactly the same masks, after the pass
    that set the hook has ended. ``None``: that call was ordinary attention.
    """

    kind: str
    layer: int
    hook: object = None
    replay: object = None

    def __repr__(self) -> str:  # readable in error messages
        return f"{self.kind}[{self.layer}]"

    def idle(self) -> bool:
        """Whether this call is ordinary attention, so an adapter may run its stock attention.

        In a forward: no hook is set (and the site forgets its last edit). In a recompute:
        the forward it replays was ordinary attention.
        """
        if torch.compiler.is_compiling():
            return self.hook is None  # traced: no replay record (see core.attention)
        if recomputing():
            return self.replay is None
        if self.hook is None:
            self.replay = None
            return True
        return False


def parse_layers(spec: Union[str, Sequence[int], None], option: str) -> Optional[List[int]]:
    """``'all'`` / None -> None (every layer); ``'0,2'`` or ``[0, 2]`` -> sorted unique ints."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "all"):
        return None
    if isinstance(spec, str):
        parts = [s.strip() for s in spec.split(",") if s.strip()]
        try:
            layers = [int(s) for s in parts]
        except ValueError:
            raise ValueError(
                f"{option} must be 'all' or a comma-separated list of 0-based layer indices, got {spec!r}"
            ) from None
    else:
        layers = [int(x) for x in spec]
    if not layers:
        raise ValueError(f"{option} must name at least one layer, got {spec!r}")
    bad = [x for x in layers if x < 0]
    if bad:
        raise ValueError(f"{option}: layer indices are 0-based and >= 0, got {bad}")
    return sorted(set(layers))


def parse_kinds(spec: Union[str, Iterable[str]], option: str) -> List[str]:
    """``'encoder-self,decoder-self'`` or a list -> validated list of attention kinds; ``'auto'`` ->
    ``['auto']``, resolved against the model by :meth:`RegularizationController.select`."""
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
        raise ValueError(
            f"{option}: unknown attention kind {unknown[0]!r}; accepted: {', '.join(ATTENTION_KINDS)}"
        )
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
            raise ValueError(f"register: {site.kind} layer {site.layer} is registered already; register one site per "
                             "attention module (and per depth for a module shared by several depths)")
        self.sites.append(site)
        return site

    def auto_kind(self) -> str:
        """What ``attention='auto'`` means for this model: encoder-self if it has any, else decoder-self."""
        return "encoder-self" if self.num_layers("encoder-self") or not self.sites else "decoder-self"

    def num_layers(self, kind: str) -> int:
        return sum(1 for s in self.sites if s.kind == kind)

    def select(
        self, kinds: Sequence[str], layers: Optional[Sequence[int]], option: str = "layers", kinds_option: str = "attention"
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
    def hooks(self, assignment: Dict[AttentionSite, object]) -> Iterator[None]:
        """Set ``site.hook`` for the sites given, for the duration of one pass."""
        previous = {site: site.hook for site in assignment}
        try:
            for site, hook in assignment.items():
                site.hook = hook
            yield
        finally:
            for site, hook in previous.items():
                site.hook = hook
