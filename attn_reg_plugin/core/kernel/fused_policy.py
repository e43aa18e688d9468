"""AttendOut's Generator on the fused route: its actions and their log-probability for REINFORCE, drawn
by Triton exactly as the fused attention kernel draws them (``fused_edit.GENERATOR``).

A policy is a :class:`~.rules.SampledLogits`: logit(b, i, j) = gq[b, i] . gk[b, j] + offset, one mask per
sample, and the action of unit (b, i, j) is drop where its Philox uniform (keyed by the policy's seed, at
counter (b, i, j)) is below sigmoid(logit). Every kernel here and in :mod:`.fused_edit` makes a tile's
logits and uniforms with the one helper ``fused_edit._policy_action``, on tiles of the same shape at the
same places (:func:`~.fused_edit.tile`), so the actions the Attacker's attention dropped are the actions
whose log-probability the Generator's update takes, bit for bit, with nothing (T, S) stored.

- :func:`policy_drops`: a block of rows' actions as a bool map, for a call the fused route does not
  take (the PyTorch path with this policy then drops the same units).
- :func:`policy_log_prob`: per sample the sum of log P(action) over its units, its units, and the sum of
  the drop probabilities; differentiable in gq, gk and the offset: d log P / d logit = action -
  sigmoid(logit). One launch forward (per-row sums, then summed by torch), two backward (gq's rows,
  gk's keys).
- :func:`inspect_policy`: the logits, uniforms, units and actions of a whole small policy (tests, the
  first-use check).

log sigmoid(x) is computed as min(x, 0) - log(1 + exp(-|x|)): within 6e-8 of torch's logsigmoid a unit.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch

from .fused_edit import (
    _REAL_CAUSAL_UNITS,
    _causal_end,
    _helper,
    _jit,
    _policy_action,
    _policy_tiles,
    dot_precision,
    policy_block,
    policy_operands,
    tile,
    tl,
    triton,
)
from .rules import SampledLogits


@_helper
def _log_sigmoid(x):
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))


@_jit
def _log_prob_kernel(GQ, GK, GOFF, QREAL, KREAL, LOG_PROB, UNIT_COUNT, PROBABILITY, seed, T, S, G,
                     UNITS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_G: tl.constexpr):  # fmt: skip
    """Per row of a block: the sum over its units of log P(action), their number, and their sum of
    sigmoid(logit) (B, T) each."""
    start_m, b = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    rows = start_m + tl.arange(0, BLOCK_M)
    policy = (GQ, GK, GOFF, QREAL, KREAL, G)
    log_prob = tl.zeros([BLOCK_M], tl.float32)
    probability = tl.zeros([BLOCK_M], tl.float32)
    count = tl.zeros([BLOCK_M], tl.int32)
    for start_n in range(0, _causal_end(start_m, BLOCK_M, T, S, UNITS == _REAL_CAUSAL_UNITS), BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        gq, gk = _policy_tiles(policy, b, rows, keys, T, S, BLOCK_G)
        action, units, unused_real, logit, unused_uniform = _policy_action(
            seed, b, rows, keys, T, S, gq, gk, policy, UNITS, DOT_PRECISION
        )
        log_prob += tl.sum(tl.where(units, _log_sigmoid(tl.where(action, logit, -logit)), 0.0), 1)
        probability += tl.sum(tl.where(units, tl.sigmoid(logit), 0.0), 1)
        count += tl.sum(units.to(tl.int32), 1)
    at, inside = b * T + rows, rows < T
    tl.store(LOG_PROB + at, log_prob, mask=inside)
    tl.store(PROBABILITY + at, probability, mask=inside)
    tl.store(UNIT_COUNT + at, count, mask=inside)


@_helper
def _grad_logit(action, units, logit, weight):
    """d (weight log P(action)) / d logit: (action - sigmoid(logit)) weight on the units, 0 elsewhere."""
    return tl.where(units, (action.to(tl.float32) - tl.sigmoid(logit)) * weight, 0.0)


@_jit
def _grad_query_kernel(GQ, GK, GOFF, QREAL, KREAL, GRAD_SUMS, DGQ, DOFFSET, seed, T, S, G, UNITS: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_G: tl.constexpr):  # fmt: skip
    """A block of rows' gradient of gq (sum over keys of dlogit gk), and per row the sum of dlogit (the
    offset's gradient, summed by torch)."""
    start_m, b = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    rows, gdims = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_G)
    policy = (GQ, GK, GOFF, QREAL, KREAL, G)
    weight = tl.load(GRAD_SUMS + b)
    dgq = tl.zeros([BLOCK_M, BLOCK_G], tl.float32)
    doffset = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, _causal_end(start_m, BLOCK_M, T, S, UNITS == _REAL_CAUSAL_UNITS), BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        gq, gk = _policy_tiles(policy, b, rows, keys, T, S, BLOCK_G)
        action, units, unused_real, logit, unused_uniform = _policy_action(
            seed, b, rows, keys, T, S, gq, gk, policy, UNITS, DOT_PRECISION
        )
        grad = _grad_logit(action, units, logit, weight)
        dgq += tl.dot(grad, gk, input_precision=DOT_PRECISION)
        doffset += tl.sum(grad, 1)
    tl.store(DGQ + b * T * G + rows[:, None] * G + gdims[None, :], dgq, mask=(rows[:, None] < T) & (gdims[None, :] < G))
    tl.store(DOFFSET + b * T + rows, doffset, mask=rows < T)


@_jit
def _grad_key_kernel(GQ, GK, GOFF, QREAL, KREAL, GRAD_SUMS, DGK, seed, T, S, G, UNITS: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_G: tl.constexpr):  # fmt: skip
    """A block of keys' gradient of gk: the sum over rows of dlogit^T gq, over the row tiles that reach them."""
    start_n, b = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    keys, gdims = start_n + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_G)
    policy = (GQ, GK, GOFF, QREAL, KREAL, G)
    weight = tl.load(GRAD_SUMS + b)
    dgk = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    first = 0
    if UNITS == _REAL_CAUSAL_UNITS:  # the first block of rows whose units reach one of these keys
        first = tl.maximum(0, start_n - (S - T)) // BLOCK_M * BLOCK_M
    for start_m in range(first, T, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        gq, gk = _policy_tiles(policy, b, rows, keys, T, S, BLOCK_G)
        action, units, unused_real, logit, unused_uniform = _policy_action(
            seed, b, rows, keys, T, S, gq, gk, policy, UNITS, DOT_PRECISION
        )
        dgk += tl.dot(tl.trans(_grad_logit(action, units, logit, weight)), gq, input_precision=DOT_PRECISION)
    tl.store(DGK + b * S * G + keys[:, None] * G + gdims[None, :], dgk, mask=(keys[:, None] < S) & (gdims[None, :] < G))


@_jit
def _drops_kernel(GQ, GK, GOFF, QREAL, KREAL, DROPS, LOGITS, UNIFORMS, UNITS_OUT, seed, row_start, ROWS, KEYS, T, S, G,
                  UNITS: tl.constexpr, INSPECT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """One tile of the actions of rows ``row_start .. row_start + ROWS - 1`` over keys ``0 .. KEYS - 1``,
    (B, ROWS, KEYS) int8; with INSPECT also its logits, uniforms and units."""
    start_m, start_n, b = row_start + tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N, tl.program_id(2)
    rows, keys = start_m + tl.arange(0, BLOCK_M), start_n + tl.arange(0, BLOCK_N)
    policy = (GQ, GK, GOFF, QREAL, KREAL, G)
    gq, gk = _policy_tiles(policy, b, rows, keys, T, S, BLOCK_G)
    action, units, unused_real, logit, uniform = _policy_action(
        seed, b, rows, keys, T, S, gq, gk, policy, UNITS, DOT_PRECISION
    )
    at = (b * ROWS + rows[:, None] - row_start) * KEYS + keys[None, :]
    inside = (rows[:, None] < row_start + ROWS) & (keys[None, :] < KEYS)
    tl.store(DROPS + at, action.to(tl.int8), mask=inside)
    if INSPECT:
        tl.store(LOGITS + at, logit, mask=inside)
        tl.store(UNIFORMS + at, uniform, mask=inside)
        tl.store(UNITS_OUT + at, units.to(tl.int8), mask=inside)


def _launch_options(g: int) -> dict:
    return dict(DOT_PRECISION=dot_precision(), BLOCK_M=tile(), BLOCK_N=tile(), BLOCK_G=policy_block(g))


def _actions(policy: SampledLogits, rows: slice, keys: int, inspect: bool):
    """(actions (B, rows, keys) int8, and with ``inspect`` logits, uniforms, units) of a block of rows."""
    operands, units = policy_operands(policy)
    b, t, g = policy.query.shape
    s = policy.key.shape[1]
    block = tile()
    if rows.start % block or not 0 <= rows.start <= rows.stop <= t or not 0 <= keys <= s:
        raise ValueError(f"a policy's block starts at a multiple of {block} rows within {t} x {s}; got {rows}, {keys}")
    n = rows.stop - rows.start
    device = policy.query.device
    drops = torch.empty((b, n, keys), dtype=torch.int8, device=device)
    logits, uniforms = (torch.empty((b, n, keys) if inspect else (1,), device=device) for _ in range(2))
    unit_map = torch.empty((b, n, keys) if inspect else (1,), dtype=torch.int8, device=device)
    if drops.numel():
        grid = (triton.cdiv(n, block), triton.cdiv(keys, block), b)
        _drops_kernel[grid](*operands, drops, logits, uniforms, unit_map, int(policy.seed), rows.start, n, keys, t, s, g,
                            UNITS=units, INSPECT=inspect, **_launch_options(g))  # fmt: skip
    return drops, logits, uniforms, unit_map


def policy_drops(policy: SampledLogits, rows: slice, keys: int) -> torch.Tensor:
    """The actions of query ``rows`` (starting at a multiple of :func:`~.fused_edit.tile`) over keys
    ``0 .. keys - 1``, (B, 1, rows, keys) bool: what the fused kernel drops there (before a row its
    drops would empty is made uniform). An opaque operator, as ``rules.keyed_draws``: a compiled graph
    calls it, whatever torch.compile makes of a Triton launch."""
    p = policy
    seed = p.seed if isinstance(p.seed, torch.Tensor) else torch.tensor(p.seed, dtype=torch.int64)
    drops = _policy_drops(p.query, p.key, p.offset, p.query_real, p.key_real, p.causal, p.every_unit, seed,
                          rows.start, rows.stop, keys)  # fmt: skip
    return drops.unsqueeze(1).bool()


@torch.library.custom_op("attn_reg::policy_drops", mutates_args=())
def _policy_drops(
    query: torch.Tensor,
    key: torch.Tensor,
    offset: torch.Tensor,
    query_real: torch.Tensor,
    key_real: torch.Tensor,
    causal: bool,
    every_unit: bool,
    seed: torch.Tensor,
    row_start: int,
    row_stop: int,
    keys: int,
) -> torch.Tensor:
    policy = SampledLogits(query, key, offset, query_real, key_real, causal, every_unit, int(seed))
    return _actions(policy, slice(row_start, row_stop), keys, False)[0]


@_policy_drops.register_fake
def _policy_drops_shape(query, key, offset, query_real, key_real, causal, every_unit, seed, row_start, row_stop, keys):
    return torch.empty((query.shape[0], row_stop - row_start, keys), dtype=torch.int8, device=query.device)


class PolicyMaps(NamedTuple):
    """:func:`inspect_policy`'s maps, (B, T, S) each: actions, logits, uniforms, units."""

    drop: torch.Tensor
    logit: torch.Tensor
    uniform: torch.Tensor
    units: torch.Tensor


def inspect_policy(policy: SampledLogits) -> PolicyMaps:
    """A whole small policy as the kernels make it, for tests and the first-use check (a T x S map)."""
    t, s = policy.query.shape[1], policy.key.shape[1]
    drops, logits, uniforms, units = _actions(policy, slice(0, t), s, True)
    return PolicyMaps(drops.bool(), logits, uniforms, units.bool())


class _PolicyLogProb(torch.autograd.Function):
    """:func:`policy_log_prob` under autograd: the backward makes each tile's logits and actions again."""

    @staticmethod
    def forward(ctx, query, key, offset, policy: SampledLogits):
        policy = policy.with_factors(query, key, offset)
        operands, units = policy_operands(policy)
        b, t, g = query.shape
        s = key.shape[1]
        log_prob, probability = (torch.zeros((b, t), dtype=torch.float32, device=query.device) for _ in range(2))
        count = torch.zeros((b, t), dtype=torch.int32, device=query.device)
        if log_prob.numel() and s:
            grid = (triton.cdiv(t, tile()), b)
            _log_prob_kernel[grid](*operands, log_prob, count, probability, int(policy.seed), t, s, g, UNITS=units,
                                   **_launch_options(g))  # fmt: skip
        ctx.save_for_backward(*operands)
        ctx.policy = (int(policy.seed), units, t, s, g, offset.shape, offset.dtype)
        counts, total = count.sum(1), probability.sum()
        ctx.mark_non_differentiable(counts, total)
        return log_prob.sum(1), counts, total

    @staticmethod
    def backward(ctx, grad_sums, _counts, _probability):
        operands = ctx.saved_tensors
        seed, units, t, s, g, offset_shape, offset_dtype = ctx.policy
        b = operands[0].shape[0]
        grad_sums = grad_sums.float().contiguous()
        dgq = torch.zeros((b, t, g), dtype=torch.float32, device=grad_sums.device)
        dgk = torch.zeros((b, s, g), dtype=torch.float32, device=grad_sums.device)
        doffset = torch.zeros((b, t), dtype=torch.float32, device=grad_sums.device)
        if dgq.numel() and s:
            options = _launch_options(g)
            _grad_query_kernel[(triton.cdiv(t, tile()), b)](*operands, grad_sums, dgq, doffset, seed, t, s, g,
                                                             UNITS=units, **options)  # fmt: skip
            _grad_key_kernel[(triton.cdiv(s, tile()), b)](*operands, grad_sums, dgk, seed, t, s, g, UNITS=units,
                                                           **options)  # fmt: skip
        return dgq, dgk, doffset.sum().reshape(offset_shape).to(offset_dtype), None


def policy_log_prob(policy: SampledLogits) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per sample the sum of log P(action) over its units (B,), its units (B,), the sum of sigmoid(logit)
    over all units (0-d)) of the actions the fused kernel draws for ``policy``; the first differentiable in
    its query, key and offset. Three launches with the backward, nothing (T, S) held."""
    return _PolicyLogProb.apply(policy.query, policy.key, policy.offset, policy)
