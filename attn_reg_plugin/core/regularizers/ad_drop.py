"""AD-DROP's two-pass training step (paper Sec. 2.3). Its options and schedule are in
:mod:`.ad_drop_config`, what the attribution pass runs under in :mod:`.attribution_pass`.

The step is framework-free: an adapter hands over two forward callables and a target, and
gets back pass 2's output plus drop statistics. Only pass 2's loss is back-propagated by the
adapter; pass 1's graph is released before pass 2 runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch.profiler import record_function

from ..kernel.attention_call import AttentionSite, CaptureOutput, CaptureProbs, EditScores, zero_counts
from ..kernel.controller import RegularizationController
from ..kernel.devices import on_host, rng_state, same_device, set_rng_state
from ..kernel.rules import (
    AttentionScores,
    GradientScores,
    IntegratedGradientScores,
    MapScores,
    RandomScores,
    ScoreSource,
    TopRegionRule,
    dense_gradient_attribution,
)
from ..training.checkpointing import activation_checkpointing_paused
from ..training.sharding import check_supported_sharding
from .ad_drop_config import ADDropConfig, ad_drop_epoch
from .attribution import GradientScale, output_gradients, probs_gradient
from .attribution_pass import (
    attribution_precision,
    cpu_has_native_bf16,
    frozen_parameters,
)

logger = logging.getLogger(__name__)

# output, fixed labels -> (scalar F, labels used). The first call gets None (make pseudo labels), or
# the gold labels under ADDropConfig.labels="gold"; IGA's later calls get what the first one used.
Target = Callable[[object, Optional[torch.Tensor]], Tuple[torch.Tensor, torch.Tensor]]
# What masked() yields: plain numbers, or 0-d tensors for an adapter that asks for them (tensors=True).
Stats = Dict[str, Union[int, float, torch.Tensor]]


def _finite(value: torch.Tensor, captured: List[torch.Tensor]) -> Union[bool, torch.Tensor]:
    """Whether the attribution target is finite: a bool on the host, looked at on CPU, where a look is
    free and a step that overflowed skips pass 2's edit; a 0-d bool tensor elsewhere, which
    :func:`_zeroed_unless` applies to the gradients without a host read (an accelerator's stream is
    not synchronised for it). True for an fp32 pass on an accelerator: overflow is a half-precision
    matter there."""
    if on_host(value):
        return bool(torch.isfinite(value).all())
    if not any(t.dtype in (torch.float16, torch.bfloat16) for t in captured):
        return True
    return torch.isfinite(value).all()


def _zeroed_unless(finite: Union[bool, torch.Tensor], grads: List[torch.Tensor]) -> List[torch.Tensor]:
    """``grads``, all zero where ``finite`` (a device flag of :func:`_finite`) is False: then no sample
    has a target (:func:`samples_with_target`), so pass 2 drops nothing and the step counts as skipped,
    as on the host, where such a step returns before pass 2."""
    if not isinstance(finite, torch.Tensor):
        return grads
    return [torch.where(finite, g, torch.zeros((), dtype=g.dtype, device=g.device)) for g in grads]


def _signature(inputs: object) -> object:
    """What of a pass's inputs decides the shapes of its attention calls, comparable where torch.compile
    traces: each tensor's shape, dtype and device, in the nesting of dicts, lists and tuples."""
    if isinstance(inputs, torch.Tensor):
        return tuple(inputs.shape), inputs.dtype, inputs.device
    if isinstance(inputs, dict):
        return tuple((key, _signature(value)) for key, value in inputs.items())
    if isinstance(inputs, (list, tuple)):
        return tuple(_signature(value) for value in inputs)
    return inputs if inputs is None or isinstance(inputs, (bool, int, float, str)) else type(inputs).__name__


def _fits(probe: torch.Tensor, leaf: torch.Tensor) -> bool:
    """Whether a call whose leaf is ``leaf`` takes ``probe``: shaped, typed and placed as it."""
    return probe.shape == leaf.shape and probe.dtype == leaf.dtype and same_device(probe, leaf)


def _eagerly(forward: Callable[[], object]) -> object:
    """``forward()`` with torch.compile off: inside a compiled region a call dynamo skips, elsewhere
    every compiled function run as written (a compiled model the forward calls too)."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(forward)()
    with torch.compiler.set_stance("force_eager"):
        return forward()


def samples_with_target(attributions: List[Union[torch.Tensor, GradientScores]]) -> torch.Tensor:
    """(B,) True for samples whose attribution is non-zero somewhere in some selected map: the
    samples the attribution target depends on (for a map kept as dF/dO and V: dF/dO is non-zero).
    No host synchronisation."""
    found = None
    for a in attributions:
        a = a.gradient if isinstance(a, IntegratedGradientScores) else a
        a = a.grad_output if isinstance(a, GradientScores) else a
        nonzero = a.reshape(a.shape[0], -1).any(dim=1)  # a float's any: nonzero (NaN too); one launch
        found = nonzero if found is None else found | nonzero
    return found


def _given_labels(target: Target, labels: torch.Tensor) -> Target:
    """``target`` whose first call takes ``labels`` where it would make pseudo labels (fixed None)."""
    return lambda output, fixed: target(output, labels if fixed is None else fixed)


@dataclasses.dataclass
class AttributionPass:
    """How a framework runs one step's pass 1: ``forward`` calls the bare model (no DDP wrapper) as the
    framework's loss calls it, ``target`` ranks by its output (:data:`Target`), ``frozen`` is the module
    whose parameters the pass freezes, ``labels`` the batch's gold labels as the target takes them (under
    ``labels="gold"``, else None), ``inputs`` the tensors ``forward`` reads (see :meth:`ADDrop.masked`)."""

    forward: Callable[[], object]
    target: Target
    frozen: Optional[torch.nn.Module] = None
    labels: Optional[torch.Tensor] = None
    inputs: object = None


def _finish(stats: Stats, tensors: bool) -> None:
    """The counts' rate, and every value a plain number unless ``tensors`` (a host read, once a step).
    The rate of a step that could drop nothing (a skipped one) is 0.0: no NaN to poison a mean."""
    dropped, droppable = stats["dropped"], stats["droppable"]
    if tensors:
        stats["rate"] = dropped / droppable.clamp(min=1)  # dropped is 0 wherever droppable is
        return
    for key in ("skipped", "dropped", "droppable"):
        stats[key] = int(stats[key])
    stats["rate"] = stats["dropped"] / stats["droppable"] if stats["droppable"] else 0.0


class ADDrop:
    """Runs AD-DROP steps on the attention sites of one model."""

    def __init__(self, config: ADDropConfig, controller: RegularizationController):
        self.config = config.validate()
        self.controller = controller
        # fp16 attribution backwards are scaled so small gradients do not flush to zero.
        self.gradient_scale: Optional[GradientScale] = GradientScale()
        self._warned_slow_bf16 = False
        self._checked_sharding: set = set()  # ids of the models check_supported_sharding has seen
        self.sites: List[AttentionSite] = config.select_sites(controller)
        # Each site's probe, the zero leaf its next compiled GA attribution call adds to its output, and
        # the signature of the inputs of a pass all of whose calls fit them (None: not known).
        self._probes: Dict[AttentionSite, torch.Tensor] = {}
        self._probe_inputs: object = None

    # -- attribution ---------------------------------------------------------------------
    def _labelled(self, target: Target, labels: Optional[torch.Tensor]) -> Target:
        """``target``, its first call given the gold labels under ``labels="gold"``. Gold labels are
        given exactly when the config asks for them: a target handed None makes pseudo labels, so a
        gold config run without them would silently be the paper's pseudo run."""
        option = self.config.name("labels")
        if self.config.labels == "gold" and labels is None:
            raise ValueError(
                f"{option} is gold (accepted: pseudo, gold), but no gold labels were given: pass the batch's "
                "labels, as the target takes them for its second argument, with masked(..., labels=...) (or "
                "attributions(..., labels=...)); without them the attribution target would use pseudo labels "
                "(pass 1's argmax)"
            )
        if self.config.labels != "gold" and labels is not None:
            raise ValueError(
                f"labels were given, but {option} is {self.config.labels} (accepted: pseudo, gold): the "
                "attribution target uses pass 1's argmax and would ignore them. Set it to gold to use them, "
                "or pass no labels"
            )
        return target if labels is None else _given_labels(target, labels)

    def attributions(
        self,
        forward: Callable[[], object],
        target: Target,
        frozen: Optional[torch.nn.Module] = None,
        dense: bool = True,
        labels: Optional[torch.Tensor] = None,
        inputs: object = None,
    ) -> Optional[Tuple[List[AttentionSite], List[Union[torch.Tensor, ScoreSource]], List[torch.Tensor]]]:
        """Pass 1 (and IGA's extra passes): the sites in call order, their attributions and validity.
        ``labels``: the batch's gold labels, exactly when ``config.labels`` is gold (:meth:`masked`).
        ``inputs``: what the forward reads (:meth:`masked`).

        ``dense=False`` (training): a GA map longer than one block of the kernel stays
        :class:`GradientScores` (dF/dO and V, linear in length), formed per block in pass 2, and
        IGA's maps are :class:`IntegratedGradientScores` (its summed dF/dO, V, q and k) at any length.
        None when the target is not finite (a half-precision overflow): no ranking survives, and
        masks from all-zero attributions would drop arbitrary keys.
        """
        target = self._labelled(target, labels)
        method = self.config.attribution
        traced = method == "ga" and self._traced_by_probes(inputs)
        # Profiler labels (free when no profiler runs) let benchmarks split a step into its passes.
        with (
            record_function("ad_drop::attribution_pass"),
            # Traced, only the pass's vjp in its probes records a graph (:meth:`_traced_gradient_attributions`):
            # nothing to freeze, and a freeze (requires_grad_) would break the graph.
            frozen_parameters(None if traced else frozen),
            activation_checkpointing_paused(frozen),
            torch.enable_grad(),
            attribution_precision(self.config.attribution_precision),
        ):
            if traced:
                return self._traced_gradient_attributions(forward, target, dense)
            if method == "ga":
                capture = CaptureOutput(keeps_long_causal_valid=dense)
                hooks = {s: dataclasses.replace(capture, probe=self._probes.get(s)) for s in self.sites}
                # The gradient is taken inside the pass: a layer the model checkpoints itself is
                # recomputed by it and must see the same hooks.
                first = not self._probes
                with self.controller.hooks(hooks) as record:
                    # The first pass runs eagerly even in a compiled model: it makes the outputs leaves
                    # (requires_grad_, a graph break at every layer that dynamo would keep) and the
                    # probes that later, compiled, passes take instead.
                    output = _eagerly(forward) if first else forward()
                    value, _ = target(output, None)
                    del output
                    self._check_captured(record.sites, record.outputs)
                    finite = _finite(value, record.outputs)
                    if finite is False:
                        return None
                    grads = _zeroed_unless(finite, output_gradients(value, record.outputs, self.gradient_scale))
                    self._keep_probes(record, first, inputs)
                attributions = [
                    # dF/dO and V, linear in length, at every length: pass 2 ranks each call's keys
                    # from them (no (T, S) map is kept between the passes). Contiguous: each block
                    # multiplies them, ~3x faster than on the model's layout (and a copy of V frees
                    # the fused projection output it may be a view of).
                    GradientScores(g.contiguous(), v.contiguous()) if not dense else dense_gradient_attribution(g, v)
                    for g, v in zip(grads, record.values)
                ]
                return record.sites, attributions, record.valid
            if method == "aa":
                capture = CaptureProbs(requires_grad=False, keeps_inputs=not dense)
                with torch.no_grad(), self.controller.hooks({s: capture for s in self.sites}) as record:
                    forward()
                self._check_captured(record.sites, record.probs)
                maps = [p if isinstance(p, AttentionScores) else p.float() for p in record.probs]
                return record.sites, maps, record.valid
            if method == "iga":
                if dense:
                    return self._integrated_gradients(forward, target)
                return self._integrated_gradient_scores(forward, target)
        raise AssertionError(method)

    def _traced_by_probes(self, inputs: object) -> bool:
        """Whether this GA pass runs where torch.compile traces it, each call taking its site's probe
        (:meth:`_traced_gradient_attributions`): its ``inputs`` are shaped as those of the pass the
        probes were made for (a call that took no probe would make its output a leaf inside
        ``torch.func.vjp``, which refuses it). Not in fp16, whose gradients are scaled by retrying on
        a host read of their finiteness (:class:`GradientScale`)."""
        return (
            torch.compiler.is_compiling()
            and inputs is not None
            and self._probe_inputs == _signature(inputs)
            and all(s in self._probes for s in self.sites)
            and not any(p.dtype == torch.float16 for p in self._probes.values())
        )

    def _traced_gradient_attributions(self, forward, target, dense: bool):
        """GA's pass where torch.compile traces it, in the step's graph: dF/dO is the gradient of F in
        each site's probe, taken by ``torch.func.vjp``, which dynamo traces (``autograd.grad`` breaks
        the graph). The vjp differentiates in the probes only and no graph is recorded around it, so
        the parameters need no freeze (whose ``requires_grad_`` breaks the graph) and no ``.grad``
        is touched."""
        capture = CaptureOutput(keeps_long_causal_valid=dense)
        sites: List[AttentionSite] = []

        def attribution_target(*probes):
            hooks = {s: dataclasses.replace(capture, probe=p) for s, p in zip(self.sites, probes)}
            with self.controller.hooks(hooks) as record:
                output = forward()
                value, _ = target(output, None)
                del output
                self._check_captured(record.sites, record.outputs)
            sites.extend(record.sites)  # not tensors, which are all vjp's auxiliary output takes
            return value, (record.outputs, record.values, record.valid)

        probes = [self._probes[s] for s in self.sites]
        # Outside the vjp nothing records a graph: the pass saves for its gradient what it would with
        # the parameters frozen.
        with torch.no_grad():
            value, pullback, (leaves, values, valid) = torch.func.vjp(attribution_target, *probes, has_aux=True)
            by_site = dict(zip(self.sites, pullback(torch.ones_like(value))))
        missed = [s for s, leaf in zip(sites, leaves) if not _fits(self._probes[s], leaf)]
        if missed:  # decided where the graph is traced, not in it
            raise RuntimeError(
                f"AD-DROP: under torch.compile, attention {missed[0]} made an output of another shape than its "
                "probe although the pass's inputs had the shapes of the pass that made it: give masked() (or "
                "attributions()) every tensor the forward reads as inputs="
            )
        finite = _finite(value, leaves)
        grads = _zeroed_unless(finite, [by_site[s].float() for s in sites])
        attributions = [
            GradientScores(g.contiguous(), v.contiguous()) if not dense else dense_gradient_attribution(g, v)
            for g, v in zip(grads, values)
        ]
        return sites, attributions, valid

    def _keep_probes(self, record, first: bool, inputs: object) -> None:
        """Each site's probe for later passes (:class:`CaptureOutput`'s ``probe``): a zero leaf shaped as
        its output, made by the first pass (run eagerly) and again where a compiled call's output was
        its own leaf (another shape), kept while the shape holds (autograd.grad leaves it zero and adds
        to no ``.grad``). A compiled call takes it and meets no ``requires_grad_``, which breaks its
        graph at every layer (issue 80); an eager call makes its output the leaf, which costs nothing.
        The pass's ``inputs`` are kept with them when every call fits its probe: a traced pass with
        inputs of those shapes takes them (:meth:`_traced_by_probes`)."""
        for site, leaf, compiled in zip(record.sites, record.outputs, record.compiled):
            if (first or compiled) and leaf is not self._probes.get(site):
                self._probes[site] = torch.zeros_like(leaf, memory_format=torch.contiguous_format).requires_grad_()
        fitted = inputs is not None and all(_fits(self._probes[s], o) for s, o in zip(record.sites, record.outputs))
        self._probe_inputs = _signature(inputs) if fitted else None

    def _integrated_gradients(self, forward, target):
        """Paper Eq. 3 per layer (as Hao et al.): only that layer's map is scaled by k/m, its
        gradients summed; A ⊙ sum / m. Dense maps: what the lab's tools read."""
        found = self._integrate(
            forward, target, CaptureProbs(alpha=1.0), lambda a: CaptureProbs(alpha=a), probs_gradient
        )
        if found is None:
            return None
        record, totals = found
        m = self.config.iga_steps
        probs = [p.detach() for p in record.probs]
        return record.sites, [p.float() * t / m for p, t in zip(probs, totals)], record.valid

    def _integrated_gradient_scores(self, forward, target):
        """Eq. 3 for training, linear in length. A map scaled by alpha gives output alpha A V over
        the same V (only that layer is scaled, and every forward sees the first's dropout draws),
        so the sum of its m gradients dF/dA is (sum of dF/dO) V^T: each layer keeps the summed
        dF/dO (B, H, T, d), V and what its weights are recomputed from, and pass 2 ranks
        A ⊙ (sum dF/dO) V^T / m per block of queries (:class:`IntegratedGradientScores`)."""
        first = CaptureOutput(keeps_weights=True, keeps_long_causal_valid=False)

        def scaled(alpha):
            return CaptureOutput(alpha=alpha, keeps_long_causal_valid=False)

        found = self._integrate(forward, target, first, scaled, output_gradients)
        if found is None:
            return None
        record, totals = found
        scores = [
            IntegratedGradientScores(w, GradientScores(t.contiguous(), v.contiguous()), self.config.iga_steps)
            for w, t, v in zip(record.probs, totals, record.values)
        ]
        return record.sites, scores, record.valid

    def _integrate(self, forward, target, first, scaled, gradient):
        """(the k = m step's record, each site's gradient summed over k = 1..m), or None when the
        target is not finite. The k = m step (nothing scaled) is the model's own forward, run once
        for all layers: it fixes the pseudo labels and the unscaled maps. The other m - 1 steps run
        per layer (``scaled(k / m)``), so IGA costs about (m - 1) * layers + 1 passes."""
        m = self.config.iga_steps
        # Every forward of the integral sees the hidden-dropout draw of the first, so the
        # integral is over one function; afterwards the stream is where one forward leaves it.
        start = rng_state()
        leaves = "probs" if isinstance(first, CaptureProbs) else "outputs"  # what the gradient is taken of
        with self.controller.hooks({s: first for s in self.sites}) as record:  # gradients inside: see attributions
            output = forward()
            after_one_forward = rng_state()
            value, labels = target(output, None)
            del output
            captured = getattr(record, leaves)
            self._check_captured(record.sites, captured)
            finite = _finite(value, captured)
            if finite is False:
                set_rng_state(after_one_forward)
                return None
            totals = gradient(value, captured, self.gradient_scale)
        for i, site in enumerate(record.sites):
            for k in range(1, m):
                set_rng_state(start)
                with self.controller.hooks({site: scaled(k / m)}) as step:
                    output = forward()
                    value, _ = target(output, labels)
                    del output
                    if step.sites != [site]:
                        raise RuntimeError(f"integrated gradients: expected one call of {site}, saw {step.sites}")
                    totals[i] = totals[i] + gradient(value, getattr(step, leaves), self.gradient_scale)[0]
        set_rng_state(after_one_forward)
        return record, _zeroed_unless(finite, totals)

    def _check_captured(self, seen: List[AttentionSite], captured: List[torch.Tensor]) -> None:
        if len(seen) != len(self.sites) or set(seen) != set(self.sites):
            twice = sorted({repr(s) for s in seen if seen.count(s) > 1})
            why = (
                f"{', '.join(twice)} called more than once in one forward: gradient attribution (ga, iga, aa) "
                "needs one call per site (attribution='rd' draws its region per call and takes any number)"
                if twice
                else "the model's attention modules are not routed through attn_reg_plugin's kernel"
            )
            raise RuntimeError(
                f"AD-DROP expected one attention call on each of {self.sites} during the attribution pass but "
                f"saw {seen}: {why}"
            )
        if (
            self.config.attribution_precision == "bf16"
            and not self._warned_slow_bf16
            and captured
            and on_host(captured[0])
            and not cpu_has_native_bf16()
        ):
            self._warned_slow_bf16 = True
            logger.warning(
                "%s bf16: this CPU has no AVX-512, so torch multiplies bf16 matrices without oneDNN and the "
                "attribution pass is much slower than in fp32 (15 to 30 times a plain step on an AVX2 CPU, "
                "docs/PERFORMANCE.md); use auto",
                self.config.name("attribution_precision"),
            )
        if self.config.attribution_precision == "fp32":
            half = sorted({str(t.dtype) for t in captured if t.dtype != torch.float32})
            if half:
                # Autocast off cannot make half-precision weights fp32 (fairseq --fp16, a model cast to half).
                raise ValueError(
                    f"{self.config.name('attribution_precision')} fp32 needs fp32 weights, but the attribution pass "
                    f"ran in {', '.join(half)}: the model itself is in half precision. Use auto or bf16"
                )

    # -- the step ------------------------------------------------------------------------
    @contextlib.contextmanager
    def masked(
        self,
        attribution_forward: Callable[[], object],
        target: Target,
        frozen: Optional[torch.nn.Module] = None,
        *,
        labels: Optional[torch.Tensor] = None,
        tensors: bool = False,
        inputs: object = None,
    ) -> Iterator[Stats]:
        """Run the attribution pass now; inside the block, forwards are masked (pass 2).

        ``attribution_forward`` should run the bare model (no DDP wrapper: attribution needs
        no gradient sync). ``labels``: the batch's gold labels, as ``target`` takes them for its
        second argument; required with ``config.labels`` gold, refused with pseudo.
        ``inputs``: the tensors ``attribution_forward`` reads (any nesting of dicts, lists and tuples),
        whose shapes decide those of its attention calls. Given, a GA step that torch.compile traces
        whole takes its attribution in the step's graph (``torch.func.vjp`` of zero probes kept from a
        pass on inputs of those shapes); without them, the pass breaks that graph.

        The yielded dict is filled in when the block ends: ``dropped`` / ``droppable`` (the units
        dropped, and those the rate is over), ``rate`` (dropped / droppable, 0.0 when nothing was
        droppable) and ``skipped``, 1 when the attribution target was not finite, in which case
        nothing is masked and the block's loss is the plain one. Plain Python numbers (reading them
        synchronises an accelerator once a step); ``tensors=True`` keeps them 0-d tensors on the
        model's device, for a caller that sums them over steps without a host sync (the adapters).
        A block that ran no forward through the selected sites raises ``RuntimeError``. Randomness comes
        from torch's global generator, which frameworks seed per update, so masks are
        reproducible and survive a resume. A layer checkpointed with ``controller.checkpoint`` (or
        by transformers or fairseq) carries the pass in its call and repeats the masked pass when
        recomputed, whenever the loss is back-propagated.
        """
        self._labelled(target, labels)  # checked also where no target runs (rd): no config and call at odds
        p, q = self.config.p, self.config.q
        if frozen is not None and id(frozen) not in self._checked_sharding:
            check_supported_sharding(frozen, "ADDrop")  # before this step trains anything
            self._checked_sharding.add(id(frozen))
        stats = {"skipped": torch.zeros((), dtype=torch.long)}
        if self.config.attribution == "rd":
            # A random candidate region needs no attribution pass: it is drawn inside the kernel,
            # where the shape of every map is known (per block of queries for long maps).
            rule = TopRegionRule(RandomScores(), p, q)
            edits = {s: EditScores(drop=rule, counted=True) for s in self.sites}
        else:
            found = self.attributions(attribution_forward, target, frozen, dense=False, labels=labels, inputs=inputs)
            if found is None:  # not finite: this step trains with the plain loss, counted as skipped
                stats["skipped"] = torch.ones((), dtype=torch.long)
                yield stats
                stats["dropped"], stats["droppable"] = zero_counts()
                _finish(stats, tensors)
                return
            with record_function("ad_drop::masks"):
                # (found[2], the validity, is not needed: the kernel reads it from pass 2's mask)
                edits = self._edits(found[0], found[1], stats)
            del found  # pass 1 is gone before pass 2 allocates
        with self.controller.hooks(edits) as record:
            yield stats
        if not record.sites:
            # Its counts would be 0 / 0 (a NaN rate), and the step would train nothing of AD-DROP.
            raise RuntimeError(
                f"ADDrop.masked: the block ran no forward through the selected attention sites ({self.sites}): "
                "run the training forward inside the `with` block, whose loss you then back-propagate"
            )
        dropped, droppable = record.counts()
        if self.config.attribution in ("ga", "iga"):
            # A skipped step (no sample targeted: a device's non-finite target too) counts 0 of 0, as
            # the host's early return does; a product on the device, not a read.
            droppable = droppable * (1 - stats["skipped"])
        stats["dropped"], stats["droppable"] = dropped, droppable
        _finish(stats, tensors)

    @contextlib.contextmanager
    def around_loss(self, epoch: int, attribution: Callable[[], AttributionPass]) -> Iterator[Dict[str, object]]:
        """AD-DROP around one training step's loss, which the framework computes as it always does:
        in an epoch its schedule picks (1-based ``epoch``), pass 1 runs on entry (``attribution()`` says
        how) and every forward inside the block is the masked pass; in another epoch, nothing.

        Yields the step's counts, complete when the block ends (0-d tensors: no host read):
        ``ad_drop_on`` (1 or 0) and ``ad_drop_steps`` (1), and for an AD-DROP step ``ad_drop_dropped``,
        ``ad_drop_droppable`` and ``ad_drop_skipped`` (:meth:`masked`'s ``dropped``, ``droppable``,
        ``skipped``). fairseq's criterion logs them as they are, the Trainer sums them to its log."""
        counts: Dict[str, object] = {"ad_drop_on": 0, "ad_drop_steps": 1}
        if not ad_drop_epoch(self.config.schedule, epoch):
            yield counts
            return
        pass_1 = attribution()
        with self.masked(
            pass_1.forward, pass_1.target, pass_1.frozen, labels=pass_1.labels, tensors=True, inputs=pass_1.inputs
        ) as stats:
            yield counts
        counts.update(
            ad_drop_on=1,
            ad_drop_dropped=stats["dropped"],
            ad_drop_droppable=stats["droppable"],
            ad_drop_skipped=stats["skipped"],
        )

    def _edits(self, sites, attributions, stats) -> Dict[AttentionSite, EditScores]:
        """Pass 2's edit of each site from pass 1's attributions: a :class:`TopRegionRule` at every
        length, which the kernel evaluates from the site's seed, the call as one block or block by
        block, from a map pass 1 kept whole (IGA; GA or AA on a short map), from dF/dO and V (GA) or
        from q and k (AA): the same drops whether the call is split or not."""
        p, q, bottom = self.config.p, self.config.q, self.config.region == "bottom"
        targeted = None
        if self.config.attribution != "aa":
            # A sample the target does not depend on (every label ignored) has all-zero gradient
            # attributions: its candidates would be the tie order, so it is not masked. (AA's
            # attention weights do not come from the target.)
            targeted = samples_with_target(attributions)
            stats["skipped"] = (~targeted.any()).long()
        edits = {}
        for site, attribution in zip(sites, attributions):
            source = attribution if isinstance(attribution, ScoreSource) else MapScores(attribution)
            # The bottom-p by attribution is the top-p of its negation (the kept key of an emptied row too).
            source = dataclasses.replace(source, negate=True) if bottom else source
            edits[site] = EditScores(drop=TopRegionRule(source, p, q, targeted), counted=True)
        return edits

    def step(
        self,
        attribution_forward: Callable[[], object],
        train_forward: Callable[[], object],
        target: Target,
        frozen: Optional[torch.nn.Module] = None,
        *,
        labels: Optional[torch.Tensor] = None,
        tensors: bool = False,
        inputs: object = None,
    ) -> Tuple[object, Stats]:
        """One AD-DROP step: attribution pass, masks, and the masked pass whose output is returned."""
        with self.masked(attribution_forward, target, frozen, labels=labels, tensors=tensors, inputs=inputs) as stats:
            output = train_forward()
        return output, stats
