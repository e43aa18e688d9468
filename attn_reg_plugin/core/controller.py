"""Which attention modules are regularized, and what each does during one forward pass.

Adapters register one :class:`AttentionSite` per attention module (its kind and 0-based
layer) with a :class:`RegularizationController`; the module keeps the site and passes it to
:func:`~attn_reg_plugin.core.attention.attend`. Regularizers never touch modules: they ask
the controller to set hooks (a :data:`Hook`: :class:`CaptureOutput`, :class:`CaptureProbs` or
:class:`EditScores`) on a selection of sites for the duration of a pass.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .block_rules import BlockRule, call_seed, key_seed
from .masks import uniform_instead_of_empty

logger = logging.getLogger(__name__)

ATTENTION_KINDS = ("encoder-self", "decoder-self", "encoder-decoder")
AUTO = "auto"  # encoder-self when the model has an encoder, else decoder-self


# -- hooks: what the kernel does on a site for one pass ------------------------------------------
@dataclass(frozen=True, eq=False)
class CaptureOutput:
    """Record what gradient attribution needs; attention dropout is off for this pass.

    Entries are appended in call order; ``sites[i]`` says whose entry ``i`` is. ``alpha``: the map
    is scaled by it (integrated gradients), so the output is alpha A V; ``keeps_weights``: also keep
    what the weights are recomputed from (``block_rules.AttentionScores``: q, k, bias) in ``weights``.
    """

    alpha: float = 1.0
    keeps_weights: bool = False
    # A causal map longer than one block has its (T, S) validity made only for dense attributions;
    # training ranks it per block, which makes each block's own.
    keeps_long_causal_valid: bool = True
    sites: List[AttentionSite] = field(default_factory=list)
    outputs: List[torch.Tensor] = field(default_factory=list)
    values: List[torch.Tensor] = field(default_factory=list)
    valid: List[torch.Tensor] = field(default_factory=list)
    weights: List[object] = field(default_factory=list)


@dataclass(frozen=True, eq=False)
class CaptureProbs:
    """Materialise the attention map, scaled by ``alpha`` (integrated gradients); keep it."""

    alpha: float = 1.0
    requires_grad: bool = True
    # AA's training pass: a map longer than one block of the kernel is kept as its inputs
    # (``block_rules.AttentionScores``: q, k, bias), its weights recomputed per block in pass 2.
    inputs_when_long: bool = False
    sites: List[AttentionSite] = field(default_factory=list)
    probs: List[torch.Tensor] = field(default_factory=list)
    valid: List[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True, eq=False)
class EditScores:
    """Edits applied to the scores before softmax.

    ``drop``: bool, True where a key is removed from a row (broadcastable to (B, H, T, S)), or
    a :class:`~.block_rules.BlockRule` that the kernel evaluates per block of query rows (AD-DROP's
    regions, random draws of scheduled dropout).
    ``uniform_rows``: True (every row) or bool broadcastable to (B, H, T, 1), e.g. a (1, 1, 1, 1)
    per-pass flag; such rows attend uniformly to their valid keys (attention LayerDrop). A row whose every valid key is in ``drop`` is made
    uniform the same way (AttendOut Eq. 4), never left all-masked.
    ``stats``: when given, ``[dropped, droppable]`` counts of this pass are added to it.
    ``droppable``: bool broadcastable to (B, H, T, S), the units this edit could drop (AttendOut's
    Generator never masks a padding query row); the count's denominator is the valid units inside
    it, so a logged rate is the fraction of what could have been dropped. None: every valid unit.
    ``calls``: when given, ``[calls whose uniform_rows flag was set, calls]`` are added to it.
    Both are counted by the kernel from what it applied, so a hook that never reaches the kernel
    (a module not routed through it) counts nothing.
    """

    drop: Optional[Union[torch.Tensor, BlockRule]] = None
    uniform_rows: Optional[Union[bool, torch.Tensor]] = None
    stats: Optional[List[torch.Tensor]] = None
    calls: Optional[List[torch.Tensor]] = None
    droppable: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.drop is not None and not isinstance(self.drop, (torch.Tensor, BlockRule)):
            raise TypeError(f"EditScores.drop must be a bool tensor or a BlockRule, got {type(self.drop).__name__}")

    def uniform_rows_on(self, device) -> Optional[torch.Tensor]:
        """``uniform_rows`` as a bool tensor on ``device`` (True: every row, (1, 1, 1, 1)), or None."""
        uniform = self.uniform_rows
        if uniform is True:  # every row (attention LayerDrop); made on q's device, no copy
            return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
        if isinstance(uniform, torch.Tensor):
            return uniform.to(device)  # a per-pass flag drawn on the host (LayerDrop): moved once
        return uniform

    def resolve(self, valid: torch.Tensor, shape: Tuple[int, int, int, int], device) -> ResolvedEdit:
        """The final (drop, uniform rows) of one call that is one block: a rule's drops made
        (:meth:`~.block_rules.BlockRule.whole`), emptied rows made uniform."""
        uniform = self.uniform_rows_on(device)
        drop = self.drop
        if isinstance(drop, BlockRule):
            drop = drop.whole(valid.expand(shape))
        if drop is not None:
            drop, uniform = uniform_instead_of_empty(drop, valid, uniform)
        return ResolvedEdit(drop, uniform)

    @property
    def draws(self) -> bool:
        """Whether the edit's drops, made block by block, come from random numbers keyed by the site's seed."""
        return isinstance(self.drop, BlockRule) and self.drop.draws


Hook = Union[CaptureOutput, CaptureProbs, EditScores]


def changes_output(hook: Optional[Hook]) -> bool:
    """Whether a call under ``hook`` computes something else than ordinary attention: an edit that
    drops or makes rows uniform, or a map scaled for integrated gradients. Only such a pass must be
    repeated by a checkpoint's recompute (a capture's gradient is taken inside its pass)."""
    if isinstance(hook, EditScores):
        return hook.drop is not None or hook.uniform_rows is not None
    # A scaled CaptureOutput changes its output too, but its gradient, like GA's, is taken of that
    # output itself, inside the pass: a checkpoint may recompute it or not (nothing after it saved).
    return isinstance(hook, CaptureProbs) and hook.alpha != 1.0


@dataclass(frozen=True)
class ResolvedEdit:
    """An :class:`EditScores` as one call applies it: ``drop`` (bool, True = key removed) and
    ``uniform`` (bool rows made uniform over their valid keys); None where nothing is edited."""

    drop: Optional[torch.Tensor] = None
    uniform: Optional[torch.Tensor] = None


def zero_counts() -> List[torch.Tensor]:
    """A fresh ``[dropped, valid]`` (or ``[skipped, total]``) pair for ``EditScores.stats`` / ``.calls``."""
    return [torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)]


# -- sites ------------------------------------------------------------------------------------
@dataclass(eq=False)
class PassLedger:
    """What :func:`~attn_reg_plugin.core.attention.attend` counts for one pass inside a training
    step: its forward calls that an activation checkpoint will recompute, and the recomputes. A
    pass whose checkpointed calls were not all recomputed when the next pass or the step ends was
    not back-propagated in time, and would be recomputed with another pass's drops or none."""

    checkpointed: int = 0
    recomputed: int = 0

    def check(self, when: str) -> None:
        if self.recomputed < self.checkpointed:
            raise RuntimeError(
                f"{self.checkpointed - self.recomputed} activation-checkpointed regularized attention calls were "
                f"not back-propagated before {when}: their recompute would repeat another pass's drops, or none. "
                "Back-propagate each regularized pass's loss inside the training step and before the next pass"
            )


@dataclass(eq=False)
class AttentionSite:
    """One attention module: its kind, its 0-based layer, and what the current pass does on it.

    ``hook``, ``seed``, ``through_backward``, ``ledger`` and ``ended_pass`` are set by the
    controller (:meth:`RegularizationController.hooks`, :meth:`RegularizationController.training_step`)
    and by nothing else: the kernel only reads them. ``seed`` keys the counter-based random numbers
    of a drop rule split into blocks (:mod:`.block_rules`), so every evaluation of the same pass on
    the same site (the forward, its backward, an activation-checkpoint recompute) makes the same
    drops. ``through_backward``: the pass runs inside a training step, so a checkpointed forward
    under it will find it when recomputed. ``ledger``: the pass's :class:`PassLedger`.
    ``ended_pass``: inside a training step, the (hook, seed, ledger) of the last pass that ended on
    the site, which a checkpointed layer recomputed in the step's backward repeats; cleared when the
    step ends or another pass of the controller begins.
    """

    kind: str
    layer: int
    hook: Optional[Hook] = None
    seed: Optional[int] = None
    through_backward: bool = False
    ledger: Optional[PassLedger] = None
    ended_pass: Optional[Tuple[Hook, Optional[int], PassLedger]] = None

    def __repr__(self) -> str:  # readable in error messages
        return f"{self.kind}[{self.layer}]"

    def __deepcopy__(self, memo) -> AttentionSite:
        # A copy of a model (an EMA, a teacher, a snapshot) taken during a pass gets sites of the
        # same kind and layer, with no pass on them.
        return AttentionSite(self.kind, self.layer)


def parse_layers(spec: Union[str, Sequence[int], None], option: str) -> Optional[List[int]]:
    """``'all'`` / None -> None (every layer); ``'0,2'`` or ``[0, 2]`` -> sorted unique ints.

    An index is an integer (not a bool, not a float: ``0.9`` is no layer) or a string of ASCII
    digits (``int()`` would also read ``'١'``, an Arabic-Indic one)."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "all"):
        return None
    wanted = f"{option} must be 'all' or a comma-separated list of 0-based layer indices, got {spec!r}"
    if isinstance(spec, str):
        parts = [s.strip() for s in spec.split(",") if s.strip()]
        if not all(re.fullmatch(r"-?[0-9]+", s) for s in parts):
            raise ValueError(wanted)
        layers = [int(s) for s in parts]
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
        self._held: Optional[set] = None  # inside training_step: the sites whose ended_pass it clears

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
    def hooks(self, assignment: Dict[AttentionSite, Optional[Hook]]) -> Iterator[None]:
        """Set ``site.hook`` for the sites given, for the duration of one pass.

        Inside :meth:`training_step` each site keeps the pass as its ``ended_pass`` when it ends,
        until the step ends or the next pass begins: a checkpointed layer recomputed in the backward
        repeats it (same hook, same seed, same drops), while forwards after the pass see it no more.
        When some edit draws random numbers, the pass takes one seed from torch's global generator
        and each site a seed keyed by it and the site.
        """
        nested = [s for s, h in assignment.items() if changes_output(h) and changes_output(s.hook)]
        if nested:
            raise RuntimeError(
                f"a regularized pass began on {nested[0]} inside another one on the same site: a recompute in "
                "the backward could not tell which to repeat. Run one regularized pass per site at a time"
            )
        for site in (*self.sites, *assignment):
            # A pass that began after it: what is recomputed from now on ran under this pass or none,
            # so the ended pass must have been back-propagated already.
            if site.ended_pass is not None:
                site.ended_pass[2].check("the next regularized pass began")
                site.ended_pass = None
        previous = {site: (site.hook, site.seed, site.through_backward, site.ledger) for site in assignment}
        ledger = PassLedger()
        draws = any(isinstance(h, EditScores) and h.draws for h in assignment.values())
        pass_seed = call_seed() if draws else None
        through_backward = self._held is not None
        try:
            for site, hook in assignment.items():
                site.hook = hook
                site.seed = None if pass_seed is None else key_seed(pass_seed, _site_key(site))
                site.through_backward = through_backward
                site.ledger = ledger
            yield
        finally:
            for site, (hook, seed, through, ledger_before) in previous.items():
                if self._held is not None and changes_output(site.hook):
                    site.ended_pass = (site.hook, site.seed, site.ledger)
                    self._held.add(site)
                site.hook, site.seed, site.through_backward, site.ledger = hook, seed, through, ledger_before

    @contextlib.contextmanager
    def training_step(self) -> Iterator[None]:
        """One training step, forward and backward: a pass that ends inside it stays what its sites
        repeat when a checkpointed layer is recomputed in the backward, until the step ends. Every
        driver of the plugin runs its steps inside one; a custom loop whose model checkpoints
        activations does too (:func:`~attn_reg_plugin.core.attention.attend` refuses a checkpointed
        regularized forward outside one, whose recompute would find no pass)."""
        if self._held is not None:  # nested: the outer step clears
            yield
            return
        self._held = set()
        # A pass begun before the step (and set on its sites) stays until the step's backward too.
        begun_before = [s for s in self.sites if s.hook is not None and not s.through_backward]
        for site in begun_before:
            site.through_backward = True
        try:
            yield
            for ledger in {id(s.ended_pass[2]): s.ended_pass[2] for s in self._held if s.ended_pass}.values():
                ledger.check("the training step ended")
        finally:
            held, self._held = self._held, None
            for site in held:
                site.ended_pass = None
            for site in begun_before:
                site.through_backward = False


def _site_key(site: AttentionSite) -> int:
    """A number naming the site within its model: its kind and layer."""
    return ATTENTION_KINDS.index(site.kind) << 32 | site.layer
