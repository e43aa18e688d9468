"""Which regularized calls run on the fused Triton kernel (:mod:`.fused_edit`), and what it is given.

A device helper, on by default on a CUDA device (:func:`.devices.fused_route_asked`): there a call the
kernel covers runs on it instead of :class:`~.blockwise.EditAttention`, once the kernel has passed its
first-use check on that device, dtype and head size (:func:`check_against_pytorch`: three small calls
against PyTorch; a failure is logged as an error and the calls stay on the PyTorch path).
``ATTN_REG_FUSED=0`` turns the route off; ``ATTN_REG_FUSED=1`` turns it on wherever Triton runs, its CPU
interpreter included (the tests, the GPU-route counter), without the check. On the CPU the PyTorch path
serves by default. Covered: scheduled dropout (:class:`~.rules.BernoulliRule`), AD-DROP GA
(:class:`~.rules.TopRegionRule` over :class:`~.rules.GradientScores`, ``samples`` included) and a rule the
kernel draws itself (``rule.sampled_logits()``: AttendOut's Generator, whose batch then draws every action
with the kernels, :func:`policy_on_kernel`, its units the counted ones), with no bias, a key-padding one
or a materialised (B, 1, T, S) mask (padding and causal rows as transformers hands them over), causal or
not, the model's attention dropout inside the call or not, one head size of at most ``MAX_HEAD_DIM`` for
q, k and v; not with a bias per head or one that requires grad, rows made uniform, a ``droppable``
restriction by a rule the kernel does not draw, or the map returned. Each reason a call that asked the
route stays on the PyTorch path is named once in the log (:func:`name_once`).

AD-DROP's region is exact: each row's threshold, k and last tied key come from the kernel's own
product dO V^T (:func:`~.fused_edit.attribution_scores`, in the precision of
:func:`~.fused_edit.attribution_operands`). A call of up to ``fused_edit.MAX_REGION_KEYS`` keys ranks
whole rows in one launch (:func:`~.fused_edit.region_state`); a longer one by a radix select over the
scores recomputed tile by tile (:func:`~.fused_select.region_state_streamed`, one launch, nothing (T, S)
held). k is never read on the host, and no Python loop runs over blocks of rows. A ``torch.matmul`` may
round a score otherwise and move a key at the threshold. The kernel's coins, the rule's and the attention
dropout's, are Philox draws (:mod:`.fused_edit`): for one seed other weights than the PyTorch path's,
distributed alike."""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from typing import Dict, NamedTuple, Optional, Set, Tuple

import torch

from . import devices, fused_edit
from .devices import FUSED_ENV
from .fused_select import region_state_streamed
from .masks import valid_keys_from_bias
from .rules import BernoulliRule, GradientScores, SampledLogits, TopRegionRule

logger = logging.getLogger(__name__)

# The kernel holds a row tile's q, the attribution and the output in one block of (64, head dim):
# wider heads would take more shared memory than a GPU's multiprocessor has.
MAX_HEAD_DIM = 128
# The widest Generator policy the kernels take: its factors, like a head, are held a tile at a time in shared
# memory. Compiled for sm_90 at 64 with heads of 128, the bf16 dk/dv kernel takes 125 KB of the 227 KB an
# H200 gives a block, 174 KB at 128 and 272 KB at 256 (fp32 calls take more; their first-use check says).
MAX_POLICY_WIDTH = 64
# The least float32 above the kernel's padding threshold: where a valid key's bias is raised to, at most.
VALID_FLOOR = torch.nextafter(torch.tensor(fused_edit.MASKED_BIAS), torch.tensor(0.0)).item()


class FusedCall(NamedTuple):
    """What the kernel is given for a call besides q, k, v: its drops (the rule's and the model's attention
    dropout) and its bias (:func:`kernel_bias`, or None)."""

    drops: fused_edit.EditDrops
    key_bias: Optional[torch.Tensor]


def kernel_bias(bias: Optional[torch.Tensor], batch: int, queries: int) -> Optional[torch.Tensor]:
    """``bias`` as the kernel's bias, (B or 1, 1, 1 or T, S): one key-padding row, or a materialised
    (B, 1, T, S) mask whose rows may differ. A bool or float32 one as it is (no launch: the kernel tells
    padding, at or below -1e4, in float32 itself), another float one as float32 with -inf where its own
    dtype says padding. None for one the kernel does not take (a bias per head, other shapes, one
    requiring grad): such a call stays on the PyTorch path."""
    if bias.dim() != 4 or bias.shape[1] != 1 or bias.shape[0] not in (1, batch) or bias.requires_grad:
        return None
    if bias.shape[2] not in (1, queries):
        return None
    if bias.shape[2] != 1 and bias.stride(2) == 0:  # one key row, expanded
        bias = bias[:, :, :1]
    if bias.dtype in (torch.bool, torch.float32):
        return bias
    # Padding is decided in the bias's own dtype, as the PyTorch path does (a bf16 -1e4 is -9984, padding
    # there, valid once cast). The kernel then reads float32 with -inf at padding, and a valid key
    # never at or below its -1e4 threshold (raised by at most float32's rounding there).
    return torch.where(valid_keys_from_bias(bias), bias.float().clamp(min=VALID_FLOOR), -math.inf)


def fused_drops(q, k, v, bias, call) -> Optional[FusedCall]:
    """The kernel's drops and key bias for this call (a :class:`~.blockwise.BlockCall`) when the kernel
    covers it, else None."""
    return fused_or_why_not(q, k, v, bias, call)[0]


def fused_or_why_not(q, k, v, bias, call) -> Tuple[Optional[FusedCall], Optional[str]]:
    """(the kernel's drops and bias, None) for a call the kernel covers; else (None, why not)."""
    if torch.compiler.is_compiling():  # before a rule is asked anything: the graph stays whole
        return None, "a compiled graph"
    rule = call.rule
    sampled = None if rule is None else rule.sampled_logits()
    why = _not_covered(q, k, v, call, sampled is not None)
    if why is not None:
        return None, why
    # The model's attention dropout: the call's own seed, a 0-d int64 host tensor (its read is no device sync).
    dropout = dict(dropout_p=float(call.dropout_p), dropout_seed=int(call.dropout_seed) if call.dropout_p else 0)
    if sampled is not None and sampled.query.shape[-1] > MAX_POLICY_WIDTH:
        return None, f"a sampled rule's policy wider than {MAX_POLICY_WIDTH}"
    if sampled is not None:  # its own seed: the pass gave the call none
        return _with_bias(
            fused_edit.EditDrops(fused_edit.GENERATOR, 0.0, int(sampled.seed), policy=sampled, **dropout), q, bias
        )
    seed = int(call.seed)
    if isinstance(rule, TopRegionRule) and isinstance(rule.source, GradientScores):
        return _ad_drop(q, k, bias, call, rule, seed, dropout)
    if not isinstance(rule, BernoulliRule):
        over = f" over {type(rule.source).__name__}" if isinstance(rule, TopRegionRule) else ""
        return None, f"its drop rule, {type(rule).__name__}{over}"
    return _with_bias(fused_edit.EditDrops(fused_edit.BERNOULLI, float(rule.probability), seed, **dropout), q, bias)


def _with_bias(drops: fused_edit.EditDrops, q, bias) -> Tuple[Optional[FusedCall], Optional[str]]:
    """(the call with :func:`kernel_bias`'s bias, None), or (None, why not) for a bias the kernel does not take."""
    key_bias = None if bias is None else kernel_bias(bias, q.shape[0], q.shape[2])
    if bias is not None and key_bias is None:
        return None, BIAS_NOT_TAKEN
    return FusedCall(drops, key_bias), None


BIAS_NOT_TAKEN = "a bias per head, of another shape than (B, 1, T or 1, S), or requiring grad"


def _not_covered(q, k, v, call, sampled: bool) -> Optional[str]:
    """Why the kernel does not take this call, from its options and shapes, or None. ``sampled``: its rule
    is one the kernel draws itself (its own seed; the units it counts are its policy's)."""
    if call.uniform is not None:
        return "rows made uniform (attention LayerDrop's skipped calls)"
    if call.droppable is not None and not sampled:
        return "a restriction of the units counted, by a rule the kernel does not draw"
    if call.dropout_p and call.dropout_seed is None:
        return "the model's attention dropout with no seed"
    if call.need_weights:
        return "the attention map returned"
    if not fused_edit.available(q):
        return f"no Triton that runs on {q.device.type} tensors"
    if call.seed is None and not sampled:
        return "a call with no seed"
    if not q.numel() or not k.shape[2]:
        return "an empty call"
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        return "a value head of its own size"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"a head wider than {MAX_HEAD_DIM}"
    if devices.FUSED is None:  # on by default: trusted once its first-use check on this device passed
        failed = _first_use_check(q)
        if failed is not None:
            return f"its first-use check on {q.device} {q.dtype} failed ({failed})"
    return None


def policy_on_kernel(query: torch.Tensor, width: int) -> bool:
    """Whether AttendOut's Generator draws a batch's actions with the fused kernels (``rules.SampledLogits``;
    :mod:`.fused_policy`) on ``query``'s device for a policy of ``width`` features: where the route is asked
    and Triton runs there, the policy at most ``MAX_POLICY_WIDTH`` wide, by default once the policy kernels
    passed their first-use check (:func:`check_policy_against_pytorch`) on it."""
    if width > MAX_POLICY_WIDTH or not devices.fused_route_asked(query) or not fused_edit.available(query):
        return False
    return devices.FUSED is not None or _first_use_check(query, policy=True) is None


# The first-use checks' verdicts: (device, dtype, head size, float32 product precision), or (device, "policy",
# precision) -> None (passed) or what differed. A process checks each once.
_CHECKED: Dict[tuple, Optional[str]] = {}


def _first_use_check(q, policy: bool = False) -> Optional[str]:
    """:func:`check_against_pytorch`'s verdict for ``q``'s device, dtype and head size (with ``policy``
    :func:`check_policy_against_pytorch`'s for its device), made once; a failure, or a check that raises (a
    kernel that does not compile on this GPU), is logged as an error."""
    key = (q.device, "policy", fused_edit.dot_precision()) if policy else (
        q.device, q.dtype, q.shape[-1], fused_edit.dot_precision()
    )  # fmt: skip
    if key not in _CHECKED:
        verdict = "disagrees with the PyTorch path"
        try:
            _CHECKED[key] = check_policy_against_pytorch(q.device) if policy else check_against_pytorch(
                q.device, q.dtype, q.shape[-1]
            )  # fmt: skip
        except Exception as error:  # a kernel that does not compile or launch here: the default must not stop training
            # (e.g. fp32 heads of 128: more shared memory than the GPU gives a block)
            verdict, _CHECKED[key] = "does not run", f"the check raised {type(error).__name__}: {error}"
        if _CHECKED[key] is not None:
            what = "AttendOut's Generator" if policy else f"{q.dtype} (head size {q.shape[-1]})"
            logger.error(
                "the fused Triton kernel %s on %s, %s: %s. The regularized calls there take the PyTorch path; "
                "please report it with your GPU and Triton version.",
                verdict, q.device, what, _CHECKED[key],
            )  # fmt: skip
    return _CHECKED[key]


def _small_policy(randn, b: int, t: int, s: int, device) -> SampledLogits:
    """A Generator's policy for the first-use checks: 40 features (not a power of two; the tiles of the widest
    policy taken, ``MAX_POLICY_WIDTH``), the second sample's last 4 queries and 5 keys not real, causal."""
    q_real, k_real = torch.ones((b, t), dtype=torch.bool), torch.ones((b, s), dtype=torch.bool)
    q_real[1, -4:], k_real[1, -5:] = False, False
    offset = torch.tensor(0.4, device=device)
    return SampledLogits(randn(b, t, 40).float(), randn(b, s, 40).float(), offset, q_real.to(device), k_real.to(device),
                         True, False, 4321)  # fmt: skip


def check_against_pytorch(device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Run the fused kernel on two small calls on ``device`` in ``dtype`` with heads of ``head_dim``, and
    compare them with the same attention computed by PyTorch in float32 from the kernel's own drops
    (:func:`~.fused_edit.inspect`): AD-DROP GA at q = 1 with padding and grouped heads, and scheduled
    dropout with the model's attention dropout, causal, lengths off the tile. None when the output, dq, dk,
    dv and the drop counts agree and each AD-DROP row's region holds its ceil(p n) keys; else what differed.
    What it guards against: a compiled kernel whose drops or sums differ from the others' on this GPU (its
    forward and backward would then disagree, and the gradients be wrong with no error)."""
    generator = torch.Generator().manual_seed(0)  # the global streams are left alone
    b, h, h_kv, t, s = 2, 2, 1, 19, 21

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q, k, v = randn(b, h, t, head_dim), randn(b, h_kv, s, head_dim), randn(b, h_kv, s, head_dim)
    bias = torch.zeros((b, 1, 1, s), device=device)
    bias[1, ..., -5:] = -math.inf  # the second sample's last 5 keys are padding
    with torch.no_grad():
        attribution, values = fused_edit.attribution_operands(randn(b, h, t, head_dim), randn(b, h_kv, s, head_dim))
        scores = fused_edit.attribution_scores(attribution, values)
        region = fused_edit.region_state(scores, bias, False, 3, 10)
    ad_drop = fused_edit.EditDrops(fused_edit.AD_DROP, 1.0, 1234, attribution, values, *region)
    bernoulli = fused_edit.EditDrops(fused_edit.BERNOULLI, 0.3, 99, dropout_p=0.2, dropout_seed=7)
    sampled = fused_edit.EditDrops(fused_edit.GENERATOR, 0.0, 4321, policy=_small_policy(randn, b, t, s, device))
    tolerance = 1e-4 if dtype == torch.float32 and fused_edit.dot_precision() == "ieee" else 3e-2
    names = {id(ad_drop): "AD-DROP", id(bernoulli): "scheduled dropout", id(sampled): "AttendOut's Generator"}
    for drops, causal in ((ad_drop, False), (bernoulli, True), (sampled, True)):
        with torch.enable_grad(), torch.autocast(torch.device(device).type, enabled=False):
            failed = _compare_call(q, k, v, bias, drops, causal, randn(b, h, t, head_dim), tolerance)
        if failed is not None:
            return f"{names[id(drops)]}: {failed}"
    return None


def check_policy_against_pytorch(device) -> Optional[str]:
    """Run the Generator's kernels (:mod:`.fused_policy`) on a small policy on ``device`` and compare them with
    PyTorch in float32 from the kernels' own logits and uniforms: the logits, the actions (uniform <
    sigmoid(logit) within the units), the log-probability's sums, units and probability, and its gradients in
    the factors and the offset. None when they agree; else what differed. What it guards against: actions the
    REINFORCE update would credit other than those the Attacker's attention dropped."""
    from .fused_policy import inspect_policy, policy_log_prob

    generator = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    policy = _small_policy(randn, 2, 19, 21, device)
    tolerance = 1e-4 if fused_edit.dot_precision() == "ieee" else 3e-2
    seen = inspect_policy(policy)
    logits = policy.query @ policy.key.transpose(1, 2) + policy.offset
    if not (seen.logit - logits).abs().max().item() <= tolerance * max(1.0, logits.abs().max().item()):
        return "the logits differ from torch's product"
    q_real, k_real = policy.query_real[:, :, None], policy.key_real[:, None, :]
    causal = torch.ones(logits.shape[1:], dtype=torch.bool, device=device).tril(logits.shape[2] - logits.shape[1])
    if not torch.equal(seen.units, q_real & k_real & causal):
        return "the units differ"
    if not torch.equal(seen.drop, seen.units & (seen.uniform < torch.sigmoid(seen.logit))):
        return "an action is not uniform < sigmoid(logit)"
    factors = [x.detach().clone().requires_grad_() for x in (policy.query, policy.key, policy.offset)]
    weights = torch.tensor([0.7, -1.3], device=device)
    with torch.enable_grad(), torch.autocast(torch.device(device).type, enabled=False):
        sums, counts, probability = policy_log_prob(policy.with_factors(*factors))
        got = (sums, *torch.autograd.grad((sums * weights).sum(), factors))
        reference = [x.detach().clone().requires_grad_() for x in (policy.query, policy.key, policy.offset)]
        logits = reference[0] @ reference[1].transpose(1, 2) + reference[2]
        chosen = torch.where(seen.drop, torch.nn.functional.logsigmoid(logits), torch.nn.functional.logsigmoid(-logits))
        expected_sums = chosen.masked_fill(~seen.units, 0.0).sum((1, 2))
        expected = (expected_sums, *torch.autograd.grad((expected_sums * weights).sum(), reference))
    for name, a, e in zip(
        ("the log-probability", "its gradient in gq", "its gradient in gk", "its gradient in the offset"), got, expected
    ):
        error = (a - e).abs().max().item()
        if not error <= tolerance * max(1.0, e.abs().max().item()):
            return f"{name} off by {error:.3g} (tolerance {tolerance:g} of its largest value)"
    if not torch.equal(counts, seen.units.sum((1, 2))):
        return "the units counted differ"
    expected_probability = torch.sigmoid(seen.logit)[seen.units].sum()
    if not (probability - expected_probability).abs().item() <= tolerance * expected_probability.item():
        return "the sum of the drop probabilities differs"
    return None


def _compare_call(q, k, v, bias, drops, causal: bool, grad_out, tolerance: float) -> Optional[str]:
    """:func:`check_against_pytorch`'s comparison of one call."""
    seen = fused_edit.inspect(q, k, v, drops, bias, causal)
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    out, dropped, droppable = fused_edit.fused_edit_attention(*inputs, drops, bias, causal)
    got = (out, *torch.autograd.grad(out, inputs, grad_out))
    reference = [x.detach().float().requires_grad_() for x in (q, k, v)]
    q_ref, k_ref, v_ref = reference
    groups = q.shape[1] // k.shape[1]
    k_heads, v_heads = (x.repeat_interleave(groups, 1) for x in (k_ref, v_ref))
    q_ref = torch.where(seen.uniform[..., None], 0.0, q_ref)  # a row made uniform attends with a zero query
    attend = seen.valid & ~seen.drop
    weights = torch.softmax(
        (q_ref @ k_heads.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~attend, -math.inf), -1
    )
    weights = torch.where(attend.any(-1, keepdim=True), weights, 0.0)
    if drops.dropout_p:
        weights = torch.where(seen.weight_dropped, 0.0, weights / (1 - drops.dropout_p))
    out_ref = weights @ v_heads
    expected = (out_ref, *torch.autograd.grad(out_ref, reference, grad_out.float()))
    for name, a, e in zip(("output", "dq", "dk", "dv"), got, expected):
        error = (a.float() - e).abs().max().item()
        if not error <= tolerance * max(1.0, e.abs().max().item()):
            return f"{name} off by {error:.3g} (tolerance {tolerance:g} of its largest value)"
    # a row made uniform counts all its valid keys as dropped (blockwise.block_counts); its map shows no drop.
    # The Generator's counted units are its region (its valid real units); the other rules' every valid key.
    units = seen.region if drops.rule == fused_edit.GENERATOR else seen.valid
    counts = (int(seen.drop.sum() + (units & seen.uniform[..., None]).sum()), int(units.sum()))
    if (int(dropped), int(droppable)) != counts:
        return f"(dropped, droppable) counted {int(dropped)}, {int(droppable)} against the map's {counts}"
    if drops.rule == fused_edit.AD_DROP:
        n = seen.valid.sum(-1)
        if not torch.equal(seen.region.sum(-1), (n * 3 + 9) // 10):
            return "a row's region does not hold ceil(p n) of its n valid keys"
    return None


_NAMED: Set[str] = set()  # the reasons already in the log


def name_once(why: str) -> None:
    """Say in the log, once per reason and process, that a call that asked the fused route stays on the
    PyTorch path: nothing is left to the route silently. Not while compiling (a log call would break the graph)."""
    if why in _NAMED or torch.compiler.is_compiling():
        return
    _NAMED.add(why)
    logger.warning(
        "the fused route: a regularized call runs on the PyTorch path, not the fused kernel: %s (%s=0 turns the "
        "route off)", why, FUSED_ENV,
    )  # fmt: skip


# Each AD-DROP rule's last call on the route, kept while the rule lives (its pass): a checkpoint's recompute
# of the call, or a site called twice in one pass (R-Drop's two forwards over AD-DROP's masked pass), ranks
# the same scores again otherwise: one product a call, nine past fused_edit.MAX_REGION_KEYS keys.
_REGIONS: weakref.WeakKeyDictionary[TopRegionRule, tuple] = weakref.WeakKeyDictionary()


def _ad_drop(q, k, bias, call, rule: TopRegionRule, seed: int, dropout: dict):
    """(AD-DROP GA's :class:`FusedCall`, None), or (None, why not): per row the threshold, last tied key and
    lowest-scored key of the region over the kernel's own scores, with :func:`kernel_bias`'s bias, on the
    device, k never read on the host: for a call of up to ``fused_edit.MAX_REGION_KEYS`` keys whole rows
    sorted in registers (two launches: the scores, then :func:`~.fused_edit.region_state`), for a longer
    one a radix select over the recomputed scores (one launch: :func:`~.fused_select.region_state_streamed`,
    nothing (T, S) held). Either way the same state, and as many launches at 16k keys as at 4k.

    A call of the rule again with the very same bias object (:data:`_REGIONS`) reuses its region, bias and
    inputs; with the same seeds too (a checkpoint's recompute) it is the very same FusedCall, whose drops
    object the kernel keeps its row counts for (``fused_edit.fused_edit_attention``): no product is made
    again but the attention's own."""
    same = (tuple(q.shape), tuple(k.shape), q.device, bool(call.causal))
    kept = _REGIONS.get(rule)
    if kept is not None and kept[0] == same and kept[1]() is bias:
        fused = kept[2]
        if (fused.drops.seed, fused.drops.dropout_p, fused.drops.dropout_seed) == (
            seed, dropout["dropout_p"], dropout["dropout_seed"]
        ):  # fmt: skip
            return fused, None
        fused = FusedCall(dataclasses.replace(fused.drops, seed=seed, **dropout), fused.key_bias)
    else:
        key_bias = None if bias is None else kernel_bias(bias, q.shape[0], q.shape[2])
        if bias is not None and key_bias is None:
            return None, BIAS_NOT_TAKEN
        region = _region(k, key_bias, call, rule)
        fused = FusedCall(fused_edit.EditDrops(fused_edit.AD_DROP, rule.q, seed, *region, **dropout), key_bias)
    _REGIONS[rule] = (same, fused_edit.weak_ref(bias), fused)
    return fused, None


def _region(k, key_bias, call, rule: TopRegionRule):
    """(the attribution, its values as the kernel reads them (repeated to k's heads, as attend's k and
    v), threshold, last_tie, lowest_key) of :func:`_ad_drop`'s call."""
    source = rule.source
    attribution = source.grad_output.neg() if source.negate else source.grad_output
    attribution, key_values = fused_edit.attribution_operands(attribution, source.values)  # once, for every kernel
    groups = k.shape[1] // key_values.shape[1]
    values = key_values if groups == 1 else key_values.repeat_interleave(groups, 1)
    if fused_edit.region_fits(k.shape[2], *rule.fraction):
        scores = fused_edit.attribution_scores(attribution, values)
        state = fused_edit.region_state(scores, key_bias, call.causal, *rule.fraction, rule.samples)
    else:
        state = region_state_streamed(attribution, key_values, key_bias, call.causal, *rule.fraction, rule.samples)
    return (attribution, values, *state)
