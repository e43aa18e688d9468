"""What one attention call does, fixed before the kernel runs, and what it hands back; a pass as
values: what it asks of each site (:class:`Plan`) and what its calls handed back (:class:`Record`).

A pass asks a *hook* of each site it names (an immutable :data:`Hook`: :class:`CaptureOutput`,
:class:`CaptureProbs`, the score edit :class:`EditScores` or the output edit :class:`EditOutputs`, what the
kernel does on top of ordinary attention),
as a :class:`Plan`: :meth:`~.controller.RegularizationController.hooks` builds it, registers it for
its forward (:func:`passing`) and yields its :class:`Record`. :func:`call_of` reads the plan the
call carried, or else the innermost one in progress on the call's site, once into an immutable
:class:`AttentionCall`; :func:`~attn_reg_plugin.core.kernel.attention.attention_kernel` computes from it
alone and returns what it captured and counted as a :class:`Captured`, which
:func:`~.attention.attend` adds to the pass's record. A site is ``(kind, layer)``: nothing writes it.

A checkpointed call carries its plan to its recompute (transformers' model kwargs, fairseq's
wrapped layers, :meth:`~.controller.RegularizationController.checkpoint`), which :func:`applied`
registers again for the recompute.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .devices import same_device
from .rules import AttentionScores, BlockRule, DenseRule


@dataclass(frozen=True, eq=False)
class AttentionSite:
    """One attention module: its kind and 0-based layer, and nothing else.

    A site is its own identity (compared and hashed as an object): a copy of a model (an EMA, a
    teacher, AttendOut's Attacker) has sites of its own, which no pass on the original reaches.
    What a pass does on a site is in the pass's :class:`Plan`, never on the site.
    """

    kind: str
    layer: int

    def __repr__(self) -> str:  # readable in error messages
        return f"{self.kind}[{self.layer}]"


# -- hooks: what the kernel does on a site for one pass (immutable values) ----------------------
@dataclass(frozen=True, eq=False)
class CaptureOutput:
    """Record what gradient attribution needs (each call's output and V); attention dropout is off.

    ``alpha``: the map is scaled by it (integrated gradients), so the output is alpha A V;
    ``keeps_weights``: also keep what the weights are recomputed from (``rules.AttentionScores``:
    q, k, bias). What the calls keep comes back in the pass's :class:`Record`.
    """

    alpha: float = 1.0
    keeps_weights: bool = False
    # A causal map longer than one block has its (T, S) validity made only for dense attributions;
    # training ranks it per block, which makes each block's own.
    keeps_long_causal_valid: bool = True
    # A zero leaf of the output's shape and dtype, added to it in a compiled call: the attribution's
    # leaf there (dF/dprobe = dF/dO), where making the output a leaf (requires_grad_) breaks the graph.
    probe: Optional[torch.Tensor] = None


@dataclass(frozen=True, eq=False)
class CaptureProbs:
    """Materialise the attention map, scaled by ``alpha`` (integrated gradients); the pass's
    :class:`Record` keeps it."""

    alpha: float = 1.0
    requires_grad: bool = True
    # AA's training pass: the map is kept as its inputs (``rules.AttentionScores``: q, k,
    # bias), its weights recomputed per block in pass 2, and the output is sdpa's at every length
    # (an explicit A V rounds otherwise in half precision: the drops would change with the length).
    keeps_inputs: bool = False


@dataclass(frozen=True, eq=False)
class EditScores:
    """The score edit: keys dropped from the scores before softmax (an additive mask), rows made uniform.

    ``drop``: bool, True where a key is removed from a row (broadcastable to (B, H, T, S)), or
    a :class:`~.rules.BlockRule` that the kernel evaluates per block of query rows (AD-DROP's
    regions, random draws of scheduled dropout).
    ``uniform_rows``: True (every row) or bool broadcastable to (B, H, T, 1), e.g. a (1, 1, 1, 1)
    per-pass flag; such rows attend uniformly to their valid keys (attention LayerDrop). A row whose every valid key is in ``drop`` is made
    uniform the same way (AttendOut Eq. 4), never left all-masked.
    ``counted``: each call hands the pass's :class:`Record` what it applied: the dropped and
    droppable units (a reduction over the map, so only when asked) and whether its rows-made-uniform
    flag was set. Counted where applied, a hook that never reaches the kernel (a module not routed
    through it) counts nothing.
    ``droppable``: bool broadcastable to (B, H, T, S), or a tuple of such whose AND it is (AttendOut's
    real queries (B, 1, T, 1) and real keys (B, 1, 1, S): nothing of size T x S), the units this edit
    could drop (the Generator never masks a padding query row); the count's denominator is the valid
    units inside it, so a logged rate is the fraction of what could have been dropped. None: every
    valid unit.
    ``replaces_weight_dropout``: the edit's drops take the place of the model's dropout of the attention
    weights, which the call then skips (DropKey moves the dropout from the weights to the keys).
    """

    drop: Optional[Union[torch.Tensor, BlockRule]] = None
    uniform_rows: Optional[Union[bool, torch.Tensor]] = None
    counted: bool = False
    droppable: Optional[Union[torch.Tensor, Tuple[torch.Tensor, ...]]] = None
    replaces_weight_dropout: bool = False

    def __post_init__(self) -> None:
        if self.drop is not None and not isinstance(self.drop, (torch.Tensor, BlockRule)):
            raise TypeError(f"EditScores.drop must be a bool tensor or a BlockRule, got {type(self.drop).__name__}")
        # ``drop`` as the BlockRule the kernel evaluates per block (a dense mask's rule slices it), or None.
        rule = self.drop if self.drop is None or isinstance(self.drop, BlockRule) else DenseRule(self.drop)
        object.__setattr__(self, "rule", rule)

    @property
    def edits_scores(self) -> bool:
        return self.drop is not None or self.uniform_rows is not None

    def uniform_rows_on(self, device) -> Optional[torch.Tensor]:
        """``uniform_rows`` as a bool tensor on ``device`` (True: every row, (1, 1, 1, 1)), or None
        (None or False: no row)."""
        uniform = self.uniform_rows
        if uniform is False:
            return None
        if uniform is True:  # every row (attention LayerDrop); made on q's device, no copy
            return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
        if isinstance(uniform, torch.Tensor):
            return uniform.to(device)  # a per-pass flag drawn on the host (LayerDrop): moved once
        return uniform

    @property
    def draws(self) -> bool:
        """Whether the edit's drops come from random numbers keyed by the site's seed."""
        return isinstance(self.drop, BlockRule) and self.drop.draws


@dataclass(frozen=True, eq=False)
class EditOutputs:
    """The output edit: the call's attention is ordinary, then each (sample, head) of its
    output is dropped with ``probability`` (a 0-d tensor), a sample's kept heads rescaled by heads /
    kept, by draws keyed by the site's seed. ``counted``: the call hands its pass's :class:`Record`
    the dropped and all (sample, head) pairs."""

    probability: torch.Tensor
    counted: bool = False
    draws = True  # its heads are drawn from the site's seed


EDITS = (EditScores, EditOutputs)  # the two kinds of edit: a call under either computes something else
Hook = Union[CaptureOutput, CaptureProbs, EditScores, EditOutputs]


def changes_output(hook: Optional[Hook]) -> bool:
    """Whether a call under ``hook`` computes something else than ordinary attention: an edit that
    drops or makes rows uniform, or a map scaled for integrated gradients. Only such a pass must be
    repeated by a checkpoint's recompute (a capture's gradient is taken inside its pass)."""
    if isinstance(hook, EditOutputs):
        return True
    if isinstance(hook, EditScores):
        return hook.edits_scores
    # A scaled CaptureOutput changes its output too, but its gradient, like GA's, is taken of that
    # output itself, inside the pass: a checkpoint may recompute it or not (nothing after it saved).
    return isinstance(hook, CaptureProbs) and hook.alpha != 1.0


@dataclass(frozen=True)
class AttentionCall:
    """What one call of the kernel does, fixed before it starts: the pass's ``hook`` for the site,
    whether the call is a ``recompute`` (its pass collects nothing more: an activation checkpoint
    recomputing the call in a backward, after the pass ended or its record was read; the same drops,
    nothing captured or counted), and the site's ``seed`` for the pass, which keys every random drop
    decision. No test of whether autograd is running a backward: the record's state says it."""

    hook: Optional[Hook] = None
    recompute: bool = False
    seed: Optional[torch.Tensor] = None
    record: Optional[Record] = None  # where the call's pass collects what it hands back


ORDINARY = AttentionCall()


@dataclass(frozen=True)
class Captured:
    """What a call hands back to its pass besides its output: GA's ``output`` (the leaf of the
    attribution) and ``values``; AA's or IGA's ``probs`` (a map, or for a long map the
    :class:`AttentionScores` it is recomputed from); the keys' ``valid``ity; an edit's ``dropped`` /
    ``droppable`` counts and ``uniform_call`` (1 when its rows-made-uniform flag was set)."""

    output: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    probs: Optional[Union[torch.Tensor, AttentionScores]] = None
    valid: Optional[torch.Tensor] = None
    dropped: Optional[torch.Tensor] = None
    droppable: Optional[torch.Tensor] = None
    uniform_call: Optional[torch.Tensor] = None
    compiled: bool = False  # the call ran in a compiled graph (GA: its pass keeps probes for the next)


def call_of(site: Optional[AttentionSite], plan: Optional[Plan] = None) -> AttentionCall:
    """What this call of ``site`` does: the hook and seed of the pass, read from the ``plan`` the call
    carried (transformers' model kwargs), or else from the innermost pass in progress on the site
    (:func:`passing`; a recompute's carried pass, :func:`applied`). Adapters ask it too: an ordinary
    call may take their stock path."""
    if site is None:
        return ORDINARY
    uncarried = plan is None
    if uncarried:
        plan = active_plan(site)
        if plan is None:
            return ORDINARY
        uncarried = plan.uncarried_here()
    hook, seed, record = plan.of(site)
    if hook is None:
        return ORDINARY
    if torch.compiler.is_compiling():
        # Traced: a compiled region recomputes from its own graph; the seed, a tensor, is an input
        # of that graph (no guard on its value, so a new pass compiles nothing).
        return AttentionCall(hook, False, seed, record)
    if uncarried:
        _refuse_uncarried_edit(site, hook)
    return AttentionCall(hook, record is None or not record.open, seed, record)


def _refuse_uncarried_edit(site: AttentionSite, hook: Hook) -> None:
    """Refuse an edit read from the pass in progress (not carried by the call) with autograd off: a
    forward under ``no_grad``, or of a bare reentrant ``torch.utils.checkpoint``, whose recompute in
    the backward would come after the pass, as ordinary attention: another function's gradients,
    silently. (A bare non-reentrant checkpoint's forward runs with autograd on, and only torch's
    private saved-tensor hooks tell it apart: its recompute meets torch's CheckpointError.)"""
    if not torch.is_grad_enabled() and isinstance(hook, EDITS) and changes_output(hook):
        raise RuntimeError(
            f"attention {site} ran a regularized pass with autograd off (a forward under torch.no_grad() or "
            "inference_mode, or of a bare reentrant torch.utils.checkpoint). A regularized pass is a training "
            "forward, and a bare checkpoint recomputes its layer in the backward after the pass, as ordinary "
            "attention, so its gradients would be wrong. Run no-grad forwards outside the pass, and checkpoint "
            "with controller.checkpoint(layer, *args, use_reentrant=...), which carries the pass into the recompute"
        )


# -- the pass: what it asks of each site, and what its calls handed back ------------------------
def zero_counts() -> List[torch.Tensor]:
    """A fresh ``[dropped, valid]`` (or ``[skipped, total]``) pair of counts."""
    return [torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)]


def add_counts(total: List[torch.Tensor], more: List[torch.Tensor]) -> List[torch.Tensor]:
    """``total + more``, element by element (tensors: no host sync)."""
    return [a + b for a, b in zip(total, more)]


@dataclass(eq=False)
class Record:
    """What the calls of one pass handed back, in call order: (site, ``Captured``) pairs, added by
    :func:`~.attention.attend` (never by the kernel). The pass
    (:meth:`~.controller.RegularizationController.hooks`) yields it; read it when the pass's
    forwards are done. It is ``open`` until the pass ends or it is first read: after that, calls
    (an activation checkpoint's recompute in the backward) add nothing, so what the pass collected
    is the forward's, whenever and however often its layers are recomputed."""

    entries: List[Tuple[AttentionSite, object]] = field(default_factory=list)
    open: bool = True

    def add(self, site: AttentionSite, captured) -> None:
        if self.open:
            self.entries.append((site, captured))

    def close(self) -> None:
        self.open = False

    @property
    def sites(self) -> List[AttentionSite]:
        self.close()
        return [site for site, _ in self.entries]

    def _field(self, name: str) -> list:
        self.close()
        return [getattr(captured, name) for _, captured in self.entries]

    outputs = property(lambda self: self._field("output"))  # GA: each call's output, the attribution's leaf
    values = property(lambda self: self._field("values"))
    valid = property(lambda self: self._field("valid"))
    probs = property(lambda self: self._field("probs"))  # AA/IGA maps, or what weights are recomputed from
    compiled = property(lambda self: self._field("compiled"))  # whether each call ran in a compiled graph

    def counts(self) -> List[torch.Tensor]:
        """``[dropped, droppable]`` units the pass's counted edits applied."""
        return self._summed("dropped", "droppable")

    def calls(self) -> List[torch.Tensor]:
        """``[calls whose rows-made-uniform flag was set, calls]`` of the pass's counted edits."""
        return self._summed("uniform_call", None)

    def _summed(self, part: str, whole: Optional[str]) -> List[torch.Tensor]:
        self.close()
        counted = [captured for _, captured in self.entries if getattr(captured, part) is not None]
        if whole is None:  # the calls counted: a number the host knows
            return [_total([getattr(c, part) for c in counted]), torch.tensor(len(counted), dtype=torch.long)]
        return [_total([getattr(c, name) for c in counted]) for name in (part, whole)]


def _total(values: List[torch.Tensor]) -> torch.Tensor:
    """The sum of 0-d counts, as ``zero_counts()[0] + values[0] + ...`` gives it: where they lie on one
    device, in two ops however many (on a device each op is a launch, one a call otherwise)."""
    if len(values) > 1 and all(same_device(v, values[0]) and v.dtype == values[0].dtype for v in values):
        return torch.stack(values).sum()
    total = zero_counts()[0]
    for value in values:
        total = total + value
    return total


Spec = Tuple[Optional[Hook], Optional[torch.Tensor], Optional[weakref.ref]]
NO_CALL: Spec = (None, None, None)


@dataclass(frozen=True, eq=False)
class Plan:
    """What one pass asks of each site, as a value: ``calls`` maps each site the plan speaks for to
    its (hook, seed, record), where no hook means ordinary attention there. A pass in progress is
    registered (:func:`passing`), and a call of a site reads the innermost plan that speaks for it;
    a plan also travels with the model's call (transformers' model kwargs, the arguments a
    checkpoint keeps for its recompute), so a layer recomputed in the backward, after the pass
    ended, repeats it (``carried``, :func:`applied`): the same hook and seed give the same drops,
    and its own record, closed by then, takes nothing. The record is held weakly: a checkpoint
    keeps a layer's arguments, the plan among them, until its backward, and must not keep what the
    pass captured alive with them (GA's outputs hold the attribution pass's whole graph)."""

    # A dict, built once and never written: torch.compile reads a plain dict keyed by objects
    # without a graph break (a mapping proxy breaks the graph at every call).
    calls: Mapping[AttentionSite, Spec]
    # Registered again for a recompute (applied): autograd's mode there, and the thread running
    # it, the only one whose calls read it; None: the pass itself, read by every thread.
    carried: Optional[bool] = None
    thread: Optional[int] = None

    def __bool__(self) -> bool:
        return any(hook is not None for hook, _, _ in self.calls.values())

    @staticmethod
    def asking(
        hooks: Mapping[AttentionSite, Optional[Hook]],
        record: Optional[Record] = None,
        seeds: Optional[Mapping[AttentionSite, torch.Tensor]] = None,
    ) -> Plan:
        """The plan that asks ``hooks`` (site -> hook; None: ordinary attention there), keys a site's
        random drops by its seed in ``seeds`` (a 0-d int64 tensor; none: each call draws one from
        torch's generator) and adds its calls' captures to ``record``."""
        ref = None if record is None else weakref.ref(record)
        return Plan({s: (h, None if seeds is None else seeds[s], ref) for s, h in hooks.items()})

    def uncarried_here(self) -> bool:
        """Whether a call reading this registered plan now would not be recomputed under it: the
        pass itself, or a carried plan read where autograd went off since (a bare reentrant
        checkpoint inside the carrying one)."""
        return self.carried is None or (self.carried and not torch.is_grad_enabled())

    def of(self, site: AttentionSite) -> Tuple[Optional[Hook], Optional[torch.Tensor], Optional[Record]]:
        """(hook, seed, record) of ``site`` in this pass; a record no longer alive is None."""
        hook, seed, record = self.calls.get(site, NO_CALL)
        return hook, seed, None if record is None else record()


def takes_gradients(hook: Hook) -> bool:
    """Whether a pass that sets ``hook`` takes gradients of what its calls capture (GA, IGA)."""
    return isinstance(hook, CaptureOutput) or (isinstance(hook, CaptureProbs) and hook.requires_grad)


# The plans in progress, innermost last. Process-wide, not per thread or context: transformers'
# DataParallel runs its replicas' forwards in threads of their own, inside the caller's pass.
_ACTIVE: List[Plan] = []


def active_plan(site: AttentionSite) -> Optional[Plan]:
    """The innermost plan in progress that speaks for ``site`` in this thread, or None."""
    # A copy: other threads register and end plans meanwhile. A carried plan is its thread's own
    # (none is registered while compiling: applied).
    thread = None if torch.compiler.is_compiling() else threading.get_ident()
    for plan in reversed(_ACTIVE[:]):
        if site in plan.calls and (plan.thread is None or thread is None or plan.thread == thread):
            return plan
    return None


def hook_in_progress(site: AttentionSite) -> Optional[Hook]:
    """The hook the innermost plan in progress asks of ``site``, or None."""
    plan = active_plan(site)
    return None if plan is None else plan.of(site)[0]


@contextlib.contextmanager
def passing(plan: Plan) -> Iterator[Plan]:
    """``plan`` in progress for the block: its sites' calls read it."""
    _ACTIVE.append(plan)
    try:
        yield plan
    finally:
        # By identity, searched from the end: threads may end their plans out of order, and
        # torch.compile cannot compare a plan made in its graph with one made outside.
        for index in range(len(_ACTIVE) - 1, -1, -1):
            if _ACTIVE[index] is plan:
                del _ACTIVE[index]
                break


def plan_of(sites: Iterable[AttentionSite]) -> Plan:
    """The pass in progress on ``sites`` now, as one :class:`Plan` (empty when none is)."""
    calls = {}
    for site in sites:
        plan = active_plan(site)
        spec = NO_CALL if plan is None else plan.calls[site]
        if spec[0] is not None:
            if not torch.is_grad_enabled() and plan.uncarried_here():
                _refuse_uncarried_edit(site, spec[0])
            calls[site] = spec
    return Plan(calls)


@contextlib.contextmanager
def applied(plan: Optional[Plan], sites: Sequence[AttentionSite]) -> Iterator[None]:
    """``plan`` in progress on ``sites`` (ordinary attention where it asks nothing) for the block,
    carried, in this thread: a checkpointed function recomputed in the backward runs under the pass
    of its forward."""
    if torch.compiler.is_compiling():
        # Traced: the calls read the pass in progress, which this plan was taken from; a compiled
        # region recomputes from its own graph. (A plan made in the graph and registered would be
        # a side effect torch.compile cannot replay.)
        yield
        return
    calls = {site: NO_CALL if plan is None else plan.calls.get(site, NO_CALL) for site in sites}
    with passing(Plan(calls, carried=torch.is_grad_enabled(), thread=threading.get_ident())):
        yield


def _with_the_pass(function: Callable, sites: Sequence[AttentionSite], plan: Plan, *args, **kwargs):
    with applied(plan, sites):
        return function(*args, **kwargs)
