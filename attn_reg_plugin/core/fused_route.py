"""Which regularized calls run on the fused Triton kernel (:mod:`.fused_edit`), and what it is given.

A device helper, opt-in: with ``ATTN_REG_FUSED=1`` (:data:`.devices.FUSED`) a call
that the kernel covers runs there instead of :class:`~.kernel.EditAttention`, where Triton runs
(a CUDA GPU, or its interpreter in the CPU tests); any other call takes the PyTorch path as before.
Covered: scheduled dropout (:class:`~.rules.BernoulliRule`) and AD-DROP GA
(:class:`~.rules.TopRegionRule` over :class:`~.rules.GradientScores`, ``samples`` included), with
no bias, a key-padding one or a materialised (B, 1, T, S) mask (padding and causal rows as
transformers hands them over), causal or not, the model's attention dropout inside the call or not,
one head size of at most ``MAX_HEAD_DIM`` for q, k and v; not with a bias per head or one that
requires grad, rows made uniform, a ``droppable`` restriction or the map returned. Each reason a call
stays on the PyTorch path with the route on is named once in the log (:func:`name_once`).

AD-DROP's region is exact: each row's threshold, k and last tied key come from the kernel's own
product dO V^T (:func:`~.fused_edit.attribution_scores`). A call of up to ``fused_edit.MAX_REGION_KEYS``
keys ranks whole rows in one launch (:func:`~.fused_edit.region_state`); a longer one by a radix
select over the scores recomputed tile by tile (:func:`~.fused_select.region_state_streamed`, one
launch, nothing (T, S) held). k is never read on the host, and no Python loop runs over blocks of rows.
A ``torch.matmul`` may round a score otherwise and move a key at the threshold. The kernel's coins, the rule's and the attention dropout's, are Philox draws
(:mod:`.fused_edit`): for one seed other weights than the PyTorch path's, distributed alike."""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from typing import NamedTuple, Optional, Set, Tuple

import torch

from . import fused_edit
from .devices import FUSED_ENV
from .fused_select import region_state_streamed
from .masks import valid_keys_from_bias
from .rules import BernoulliRule, GradientScores, TopRegionRule

logger = logging.getLogger(__name__)

# The kernel holds a row tile's q, the attribution and the output in one block of (64, head dim):
# wider heads would take more shared memory than a GPU's multiprocessor has.
MAX_HEAD_DIM = 128
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
    """The kernel's drops and key bias for this call (a :class:`~.kernel.BlockCall`) when the kernel
    covers it, else None."""
    return fused_or_why_not(q, k, v, bias, call)[0]


def fused_or_why_not(q, k, v, bias, call) -> Tuple[Optional[FusedCall], Optional[str]]:
    """(the kernel's drops and bias, None) for a call the kernel covers; else (None, why not)."""
    rule = call.rule
    why = _not_covered(q, k, v, call)
    if why is not None:
        return None, why
    key_bias = None if bias is None else kernel_bias(bias, q.shape[0], q.shape[2])
    if bias is not None and key_bias is None:
        return None, "a bias per head, of another shape than (B, 1, T or 1, S), or requiring grad"
    seed = int(call.seed)
    # The model's attention dropout: the call's own seed, a 0-d int64 host tensor (its read is no device sync).
    dropout = dict(dropout_p=float(call.dropout_p), dropout_seed=int(call.dropout_seed) if call.dropout_p else 0)
    if isinstance(rule, BernoulliRule):
        drops = fused_edit.EditDrops(fused_edit.BERNOULLI, float(rule.probability), seed, **dropout)
        return FusedCall(drops, key_bias), None
    if isinstance(rule, TopRegionRule) and isinstance(rule.source, GradientScores):
        drops = dataclasses.replace(_ad_drop(q, k, bias, key_bias, call, rule, seed), **dropout)
        return FusedCall(drops, key_bias), None
    over = f" over {type(rule.source).__name__}" if isinstance(rule, TopRegionRule) else ""
    return None, f"its drop rule, {type(rule).__name__}{over}"


def _not_covered(q, k, v, call) -> Optional[str]:
    """Why the kernel does not take this call, from its options and shapes, or None."""
    if call.uniform is not None:
        return "rows made uniform (attention LayerDrop's skipped calls)"
    if call.droppable is not None:
        return "a restriction of the units counted (AttendOut's)"
    if call.dropout_p and call.dropout_seed is None:
        return "the model's attention dropout with no seed"
    if call.need_weights:
        return "the attention map returned"
    if not fused_edit.available(q):
        return f"no Triton that runs on {q.device.type} tensors"
    if torch.compiler.is_compiling():
        return "a compiled graph"
    if call.seed is None:
        return "a call with no seed"
    if not q.numel() or not k.shape[2]:
        return "an empty call"
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        return "a value head of its own size"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"a head wider than {MAX_HEAD_DIM}"
    return None


_NAMED: Set[str] = set()  # the reasons already in the log


def name_once(why: str) -> None:
    """Say in the log, once per reason and process, that a call stays on the PyTorch path with the fused
    route on: nothing is left to the route silently. Not while compiling (a log call would break the graph)."""
    if why in _NAMED or torch.compiler.is_compiling():
        return
    _NAMED.add(why)
    logger.warning("%s=1: a regularized call runs on the PyTorch path, not the fused kernel: %s", FUSED_ENV, why)


# Each AD-DROP rule's last region, kept while the rule lives (its pass): a checkpoint's recompute of the
# call, or a site called twice in one pass (R-Drop's two forwards over AD-DROP's masked pass), ranks the
# same scores again otherwise: one product a call, nine past fused_edit.MAX_REGION_KEYS keys.
_REGIONS: weakref.WeakKeyDictionary[TopRegionRule, tuple] = weakref.WeakKeyDictionary()


def _ad_drop(q, k, bias, key_bias, call, rule: TopRegionRule, seed: int) -> fused_edit.EditDrops:
    """AD-DROP GA's drops: per row the threshold, last tied key and lowest-scored key of the region
    over the kernel's own scores (``key_bias``: :func:`kernel_bias`'s of the call's ``bias``), on the
    device, k never read on the host: for a call of up to ``fused_edit.MAX_REGION_KEYS`` keys whole rows
    sorted in registers (two launches: the scores, then :func:`~.fused_edit.region_state`), for a longer
    one a radix select over the recomputed scores (one launch: :func:`~.fused_select.region_state_streamed`,
    nothing (T, S) held). Either way the same state, and as many launches at 16k keys as at 4k. A call
    of the rule again with the very same bias object (a recompute) reuses its region and inputs (:data:`_REGIONS`)."""
    same = (tuple(q.shape), tuple(k.shape), q.device, bool(call.causal))
    kept = _REGIONS.get(rule)
    if kept is None or kept[0] != same or kept[1]() is not bias:
        kept = (same, weakref.ref(bias) if bias is not None else _none, *_region(k, key_bias, call, rule))
        _REGIONS[rule] = kept
    return fused_edit.EditDrops(fused_edit.AD_DROP, rule.q, seed, *kept[2:])


def _region(k, key_bias, call, rule: TopRegionRule):
    """(the attribution, its values as the kernel reads them (repeated to k's heads, as attend's k and
    v), threshold, last_tie, lowest_key) of :func:`_ad_drop`'s call."""
    source = rule.source
    attribution = source.grad_output.neg() if source.negate else source.grad_output
    groups = k.shape[1] // source.values.shape[1]
    values = source.values if groups == 1 else source.values.repeat_interleave(groups, 1)
    if fused_edit.region_fits(k.shape[2], *rule.fraction):
        scores = fused_edit.attribution_scores(attribution, values)
        state = fused_edit.region_state(scores, key_bias, call.causal, *rule.fraction, rule.samples)
    else:
        state = region_state_streamed(attribution, source.values, key_bias, call.causal, *rule.fraction, rule.samples)
    return (attribution, values, *state)


def _none():
    """A weak reference's answer for a call without a bias."""
    return None
