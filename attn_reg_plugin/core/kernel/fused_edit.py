"""One regularized attention call as a fused Triton kernel: FlashAttention-2's forward and backward
with the regularizer's drops and the model's attention dropout made inside the kernel, tile by tile,
from their seeds.

The forward loops over blocks of keys with an online softmax and keeps each query row's log-sum-exp;
the backward recomputes each tile's probabilities from it (one kernel for dq, which also stores each
row's delta = rowsum(dO O), then one for dk and dv). The drops are never stored: every tile makes them
again from (seed, sample, head, query, key) with Philox (``tl.randint``), as FlashAttention makes its
dropout, so nothing of size T x S is held.

Rules (``EditDrops.rule``):

- ``BERNOULLI``: every valid (query, key) dropped with probability ``rate`` (scheduled dropout,
  DropKey-like). A row whose coins drop every valid key attends uniformly over its valid keys
  instead (its query zeroed, its drops cleared), as ``masks.uniform_instead_of_empty``.
- ``AD_DROP``: AD-DROP GA. A key is a candidate when its attribution score ``dO_attr_i . V_attr_j``
  (the attribution pass's output gradient and values, which hidden dropout makes other than this
  call's v; summed in float32 from :func:`attribution_operands`, the kernels' one product:
  :func:`inspect`) is above the row's ``threshold``, or equal
  to it at a key ``<= last_tie`` (ties lowest key first); each candidate is dropped with probability
  ``rate``. A row whose drops would take every valid key keeps ``lowest_key`` (its lowest-scored
  valid key), as ``TopRegionRule._drop`` / ``masks.keep_one_valid_key``. The per-row state comes from
  the caller (:func:`region_ties` turns a row's threshold and k into it).
- ``GENERATOR``: AttendOut's Generator (``rules.SampledLogits``): (query i, key j) of sample b dropped
  where a Philox uniform u < sigmoid(gq_i . gk_j + offset), among the policy's units, one mask per
  sample for all heads (its counter (b, i, j)). The logit is every kernel's one product
  (:func:`_policy_action`), so the log-probability of the actions (:mod:`.fused_policy`) draws the
  very same. Rows the drops would empty attend uniformly, as BERNOULLI's; dropped / droppable count
  within the units.
- ``NONE``: plain attention (the baseline the kernel's cost is measured against).

The model's attention dropout (``EditDrops.dropout_p``, as ``blockwise.weight_dropout_kept`` on the
PyTorch path): a second Philox stream, keyed by ``dropout_seed``, at the same (b, h, i, j) counters,
drops each weight after the softmax with probability p and scales the kept ones by 1 / (1 - p). The
softmax's normaliser sums the weights before dropout; the backward is FlashAttention-2's with dropout
(dV = (P Z)^T dO, dS = P (dO V^T Z - delta)). A compile-time flag: a call without it compiles the
kernels without dropout.

Validity: an additive float bias the same for every head (a key whose bias is at or below -1e4 is
padding, as ``masks.MASKED_BIAS``; a bool one: True = may attend), either one key row per sample,
broadcastable to (B, 1, 1, S), or a materialised (B, 1, T, S) mask whose rows may differ (read row by
row); and causal attention: query i may attend key j <= i + S - T. A row with no valid key outputs 0
and sends no gradient. Grouped-query attention: head h reads key/value head h // (H / H_kv).

Whether a row's drops would empty it depends on all of its coins, so before the forward a counting
pass (:func:`_row_counts_kernel`) counts each row's valid and dropped keys: it writes each row's
``keep`` (O(B H T) numbers) and adds the call's (dropped, droppable) on the device.

Products: half-precision operands on tensor cores, float32 ones at :func:`dot_precision` (torch.matmul's:
IEEE float32 under torch's default "highest", TF32 under "high"), every sum in float32 (float64 for
float64 inputs).

The drops are a Philox draw: for a seed they are not the PyTorch path's (``rules.chunk_draws``),
only distributed alike. Tests: ``TRITON_INTERPRET=1 pytest tests/core/test_fused_edit.py``."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch

from .rules import SampledLogits

try:  # the optional extra `triton`: without it the package imports and available() is False
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

NONE, BERNOULLI, AD_DROP, GENERATOR = 0, 1, 2, 3
# GENERATOR's units (the kernels' UNITS): every (query, key) pair; real queries and keys; and not after the query.
EVERY_UNIT, REAL_UNITS, REAL_CAUSAL_UNITS = 0, 1, 2
# A row's ``keep`` value: -1 keeps nothing, j >= 0 keeps key j (AD-DROP), UNIFORM attends uniformly
# with no drop (a Bernoulli row its coins would empty).
UNIFORM = -2
MASKED_BIAS = -1e4  # masks.MASKED_BIAS: fairseq's and transformers' padding fills lie below it
# Bits of inspect()'s codes (WEIGHT_DROPPED: the model's attention dropout took the weight).
DROP, REGION, VALID, WEIGHT_DROPPED = 1, 2, 4, 8


def _constant(value):
    """``value`` as a kernel may read it: compiled kernels read only tl.constexpr globals."""
    return value if tl is None else tl.constexpr(value)


_NONE, _AD_DROP, _GENERATOR, _UNIFORM, _MASKED_BIAS = (
    _constant(x) for x in (NONE, AD_DROP, GENERATOR, UNIFORM, MASKED_BIAS)
)
_EVERY_UNIT, _REAL_CAUSAL_UNITS = _constant(EVERY_UNIT), _constant(REAL_CAUSAL_UNITS)
# The kernels' BIAS_KIND: no bias, an additive float32 one, a bool one (True = may attend).
NO_BIAS, FLOAT_BIAS, BOOL_BIAS = 0, 1, 2
_NO_BIAS, _BOOL_BIAS = _constant(NO_BIAS), _constant(BOOL_BIAS)
_DROP, _REGION, _VALID, _WEIGHT_DROPPED = (_constant(x) for x in (DROP, REGION, VALID, WEIGHT_DROPPED))
_FLOAT32_MAX = _constant(torch.finfo(torch.float32).max)


def _jit(fn):
    """``triton.jit`` when Triton is installed; else the plain function, never launched."""
    return fn if triton is None else triton.jit(fn)


def _helper(fn):
    """A function the kernels call: jit-compiled, or in Triton's interpreter called as it is (there a
    jit function patches triton.language again at every call, milliseconds each, most of a test's time)."""
    return fn if triton is None or triton.knobs.runtime.interpret else triton.jit(fn)


def available(q: torch.Tensor) -> bool:
    """Whether the fused kernel can run on ``q``: Triton installed and q on the device of Triton's
    active driver (a CUDA GPU), or Triton's interpreter on (TRITON_INTERPRET=1, the CPU tests) for
    any dtype but bf16: Triton 3.7.1's interpreter gets a bf16 tl.dot wrong (a one-line bf16 dot
    kernel is off by ~1e10). Triton, not a device type, answers: the core compares device types
    only in devices.py."""
    if triton is None:
        return False
    if triton.knobs.runtime.interpret:
        return q.dtype != torch.bfloat16
    try:
        return q.device == triton.runtime.driver.active.get_active_torch_device()
    except RuntimeError:  # no GPU driver ("0 active drivers")
        return False


# -- the kernels' shared parts ---------------------------------------------------------------------
@_helper
def _load_rows(ptr, rows, n, dims, d):
    """Rows ``rows`` (< n) of a contiguous (n, d) matrix, columns ``dims`` (< d); 0 elsewhere."""
    return tl.load(ptr + rows[:, None] * d + dims[None, :], mask=(rows[:, None] < n) & (dims[None, :] < d), other=0.0)


@_helper
def _validity(BIAS, b, rows, keys, T, S, CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr, ROW_BIAS: tl.constexpr):
    """(valid (rows, keys), the additive bias of the tile, (1, keys) or (rows, keys)): in range, not
    padding, not in the future. The bias (BIAS_KIND: NO_BIAS, FLOAT_BIAS or BOOL_BIAS, True = may attend,
    adding 0) is a (B, S) key row, or with ROW_BIAS a (B, T, S) one per query."""
    inside = (rows[:, None] < T) & (keys[None, :] < S)
    bias = (keys * 0.0)[None, :]
    valid = inside
    if BIAS_KIND != _NO_BIAS:
        if ROW_BIAS:
            at = (b.to(tl.int64) * T + rows[:, None]) * S + keys[None, :]
            loaded = tl.load(BIAS + at, mask=inside, other=0)
        else:
            loaded = tl.load(BIAS + b * S + keys, mask=keys < S, other=0)[None, :]
        if BIAS_KIND == _BOOL_BIAS:
            valid = valid & (loaded != 0)
        else:
            bias = loaded
            valid = valid & (bias > _MASKED_BIAS)
    if CAUSAL:
        valid = valid & (keys[None, :] <= rows[:, None] + (S - T))
    return valid, bias


@_helper
def _attribution_score(attr, attr_v, DOT_PRECISION: tl.constexpr):
    """dO_attr V_attr^T of a tile in float32, NaN as 0 and +-inf as the largest finite values
    (TopRegionRule's nan_to_num): every kernel's one product, so that a threshold from
    attribution_scores is one the others compare exactly."""
    score = tl.dot(attr, tl.trans(attr_v), input_precision=DOT_PRECISION)
    return tl.clamp(tl.where(score == score, score, 0.0), -_FLOAT32_MAX, _FLOAT32_MAX)


@_helper
def _positions(bh, rows, keys, T, S):
    """The Philox counters of a tile: its (b, h, i, j) positions, the same in every kernel."""
    return (bh.to(tl.int64) * T + rows[:, None]) * S + keys[None, :]


@_helper
def _policy_tiles(policy, b, rows, keys, T, S, BLOCK_G: tl.constexpr):
    """The Generator's factors of a tile: its rows' gq (rows, G) and its keys' gk (keys, G), float32."""
    GQ, GK, unused_offset, unused_q_real, unused_k_real, G = policy
    gdims = tl.arange(0, BLOCK_G)
    return _load_rows(GQ + b * T * G, rows, T, gdims, G), _load_rows(GK + b * S * G, keys, S, gdims, G)


@_helper
def _policy_action(seed, b, rows, keys, T, S, gq, gk, policy, UNITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(action, units, real, logit, uniform) of a tile of GENERATOR's policy: the logit gq gk^T + offset
    (float32, every kernel's one product, on tiles of the same shape and place), the unit's Philox uniform
    at (b, i, j) of ``seed``, real = in range, real query and real key, units = real and (REAL_CAUSAL_UNITS)
    not after the query, action = units & (uniform < sigmoid(logit)): the Gumbel-max of {keep: 0, drop: logit}."""
    unused_gq, unused_gk, OFFSET, Q_REAL, K_REAL, unused_g = policy
    logit = tl.dot(gq, tl.trans(gk), input_precision=DOT_PRECISION) + tl.load(OFFSET)
    uniform = tl.rand(seed, _positions(b, rows, keys, T, S))
    real = (rows[:, None] < T) & (keys[None, :] < S)
    if UNITS != _EVERY_UNIT:
        q_real = tl.load(Q_REAL + b * T + rows, mask=rows < T, other=0) != 0
        k_real = tl.load(K_REAL + b * S + keys, mask=keys < S, other=0) != 0
        real = real & q_real[:, None] & k_real[None, :]
    units = real
    if UNITS == _REAL_CAUSAL_UNITS:
        units = units & (keys[None, :] <= rows[:, None] + (S - T))
    return units & (uniform < tl.sigmoid(logit)), units, real, logit, uniform


@_helper
def _drops(seed, limit, b, bh, rows, keys, T, S, valid, attr, attr_v, threshold, last_tie, keep, policy,
           RULE: tl.constexpr, UNITS: tl.constexpr, BLOCK_G: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """(drop, candidate region) of a tile. A coin drops when its 31-bit Philox number is <= limit
    (probability (limit + 1) / 2**31, as rules.coin_limit); the counter is the (b, h, i, j)
    position, so any tile, forward or backward, draws the same coin for a position. GENERATOR's region
    is its valid real units (what its rate counts), its drops the policy's actions (:func:`_policy_action`)."""
    region = valid
    if RULE == _NONE:
        drop = valid & (keys[None, :] < 0)
    elif RULE == _GENERATOR:
        gq, gk = _policy_tiles(policy, b, rows, keys, T, S, BLOCK_G)
        action, unused_units, real, unused_logit, unused_uniform = _policy_action(
            seed, b, rows, keys, T, S, gq, gk, policy, UNITS, DOT_PRECISION
        )
        region = valid & real
        drop = valid & action & (keep != _UNIFORM)[:, None]
    else:
        coin = (tl.randint(seed, _positions(bh, rows, keys, T, S)) >> 1).to(tl.int32) <= limit
        drop = valid & coin & (keys[None, :] != keep[:, None]) & (keep != _UNIFORM)[:, None]
        if RULE == _AD_DROP:
            score = _attribution_score(attr, attr_v, DOT_PRECISION)
            above = score > threshold[:, None]
            tied = (score == threshold[:, None]) & (keys[None, :] <= last_tie[:, None])
            region = valid & (above | tied)
            drop = drop & region
    return drop, region


@_helper
def _weight_kept(dseed, dlimit, bh, rows, keys, T, S):
    """The model's attention dropout of a tile: True where a weight is kept. Its own Philox stream (the
    dropout seed) at the drop coins' positions; a weight is dropped when its 31-bit number is <= dlimit."""
    return (tl.randint(dseed, _positions(bh, rows, keys, T, S)) >> 1).to(tl.int32) > dlimit


@_helper
def _region_row_state(THR, TIE, bh, rows, T, RULE: tl.constexpr):
    """A row's AD-DROP threshold and last tied key (+inf and -1 unless AD_DROP: nothing read)."""
    threshold = (rows * 0).to(tl.float32) + float("inf")
    last_tie = rows * 0 - 1
    if RULE == _AD_DROP:
        at, inside = bh * T + rows, rows < T
        threshold = tl.load(THR + at, mask=inside, other=float("inf"))
        last_tie = tl.load(TIE + at, mask=inside, other=-1)
    return threshold, last_tie


@_helper
def _row_state(THR, TIE, KEEP, bh, rows, T, RULE: tl.constexpr):
    """A row's AD-DROP threshold and last tied key, and its ``keep`` (-1, a key, or UNIFORM; -1 for NONE)."""
    threshold, last_tie = _region_row_state(THR, TIE, bh, rows, T, RULE)
    keep = rows * 0 - 1
    if RULE != _NONE:
        keep = tl.load(KEEP + bh * T + rows, mask=rows < T, other=-1)
    return threshold, last_tie, keep


@_helper
def _scores(q, k_tile, attr_v, attr, BIAS, b, bh, rows, keys, state, policy, seed, limit, scale, T, S,
            ACC: tl.constexpr, RULE: tl.constexpr, CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr, ROW_BIAS: tl.constexpr,
            UNITS: tl.constexpr, BLOCK_G: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """A tile's scores q k^T scale + bias, -inf where a key is not attended (invalid or dropped)."""
    valid, bias = _validity(BIAS, b, rows, keys, T, S, CAUSAL, BIAS_KIND, ROW_BIAS)
    threshold, last_tie, keep = state
    drop, _ = _drops(seed, limit, b, bh, rows, keys, T, S, valid, attr, attr_v, threshold, last_tie, keep, policy,
                     RULE, UNITS, BLOCK_G, DOT_PRECISION)  # fmt: skip
    s = tl.dot(q, tl.trans(k_tile), out_dtype=ACC, input_precision=DOT_PRECISION) * scale + bias
    return tl.where(valid & ~drop, s, float("-inf"))


@_helper
def _query_tiles(Q, ATTR, bh, rows, T, dims, D, keep, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                 RULE: tl.constexpr):  # fmt: skip
    """(q zeroed in UNIFORM rows, the attribution pass's output gradient rows or zeros)."""
    q = _load_rows(Q + bh * T * D, rows, T, dims, D)
    q = tl.where((keep == _UNIFORM)[:, None], tl.zeros_like(q), q)
    attr = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if RULE == _AD_DROP:
        attr = _load_rows(ATTR + bh * T * D, rows, T, dims, D)
    return q, attr


@_helper
def _attribution_values(AV, kv, keys, S, dims, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, RULE: tl.constexpr):
    """A key tile of the attribution pass's values (float32), or zeros where the rule ranks nothing."""
    attr_v = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if RULE == _AD_DROP:
        attr_v = _load_rows(AV + kv * S * D, keys, S, dims, D)
    return attr_v


@_helper
def _key_tiles(K, V, AV, kv, keys, S, dims, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, RULE: tl.constexpr):
    """A key tile's k, v and attribution values: what the forward and both backward kernels read."""
    k_tile = _load_rows(K + kv * S * D, keys, S, dims, D)
    v_tile = _load_rows(V + kv * S * D, keys, S, dims, D)
    return k_tile, v_tile, _attribution_values(AV, kv, keys, S, dims, D, BLOCK_N, BLOCK_D, RULE)


@_helper
def _causal_end(start_m, BLOCK_M: tl.constexpr, T, S, CAUSAL: tl.constexpr):
    """The keys a block of query rows may attend lie below this (all S unless causal)."""
    end = S
    if CAUSAL:
        end = tl.minimum(S, start_m + BLOCK_M + S - T)
    return end


# -- forward, backward, inspection ----------------------------------------------------------------
@_jit
def _forward_kernel(Q, K, V, BIAS, ATTR, AV, GQ, GK, GOFF, QREAL, KREAL, THR, TIE, KEEP, OUT, LSE, seed, limit, dseed,
                    dlimit, dscale, scale, T, S, H, GROUP, D, G, RULE: tl.constexpr, CAUSAL: tl.constexpr,
                    BIAS_KIND: tl.constexpr, ROW_BIAS: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr,
                    UNITS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """A block of query rows' output and log-sum-exp. The softmax's normaliser sums the probabilities
    before the model's dropout; the output sums them after it (dropped 0, kept times dscale) times v."""
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b, kv = bh // H, bh // GROUP  # GQA: (b H + h) // G = b H_kv + h // G
    policy = (GQ, GK, GOFF, QREAL, KREAL, G)
    rows, dims = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    state = _row_state(THR, TIE, KEEP, bh, rows, T, RULE)
    q, attr = _query_tiles(Q, ATTR, bh, rows, T, dims, D, state[2], BLOCK_M, BLOCK_D, RULE)
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for start_n in range(0, _causal_end(start_m, BLOCK_M, T, S, CAUSAL), BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k_tile, v_tile, attr_v = _key_tiles(K, V, AV, kv, keys, S, dims, D, BLOCK_N, BLOCK_D, RULE)
        s = _scores(q, k_tile, attr_v, attr, BIAS, b, bh, rows, keys, state, policy, seed, limit, scale, T, S, ACC,
                    RULE, CAUSAL, BIAS_KIND, ROW_BIAS, UNITS, BLOCK_G, DOT_PRECISION)  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing attended yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(_weight_kept(dseed, dlimit, bh, rows, keys, T, S), p * dscale, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, out_dtype=ACC, input_precision=DOT_PRECISION)
        m_i = m_new
    attended = l_i > 0  # else no valid key: output 0, log-sum-exp +inf (the backward's P is then 0)
    out = tl.where(attended[:, None], acc / tl.where(attended, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(attended, m_i + tl.log(tl.where(attended, l_i, 1.0)), float("inf"))
    at = bh * T * D + rows[:, None] * D + dims[None, :]
    tl.store(OUT + at, out.to(OUT.dtype.element_ty), mask=(rows[:, None] < T) & (dims[None, :] < D))
    tl.store(LSE + bh * T + rows, lse, mask=rows < T)


@_jit
def _backward_q_kernel(Q, K, V, BIAS, ATTR, AV, GQ, GK, GOFF, QREAL, KREAL, THR, TIE, KEEP, DO, OUT, LSE, DELTA, DQ,
                       seed, limit, dseed, dlimit, dscale, scale, T, S, H, GROUP, D, G, RULE: tl.constexpr,
                       CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr, ROW_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                       ACC: tl.constexpr, UNITS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """dq of a block of query rows (0 in UNIFORM rows: their query was zeroed), and the rows' delta =
    rowsum(dO O), FlashAttention-2's D, stored for the dk, dv kernel launched after this one."""
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b, kv = bh // H, bh // GROUP
    policy = (GQ, GK, GOFF, QREAL, KREAL, G)
    rows, dims = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    state = _row_state(THR, TIE, KEEP, bh, rows, T, RULE)
    q, attr = _query_tiles(Q, ATTR, bh, rows, T, dims, D, state[2], BLOCK_M, BLOCK_D, RULE)
    lse = tl.load(LSE + bh * T + rows, mask=rows < T, other=float("inf"))
    grad_out = _load_rows(DO + bh * T * D, rows, T, dims, D)
    delta = tl.sum(grad_out.to(ACC) * _load_rows(OUT + bh * T * D, rows, T, dims, D).to(ACC), 1)
    tl.store(DELTA + bh * T + rows, delta, mask=rows < T)
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for start_n in range(0, _causal_end(start_m, BLOCK_M, T, S, CAUSAL), BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k_tile, v_tile, attr_v = _key_tiles(K, V, AV, kv, keys, S, dims, D, BLOCK_N, BLOCK_D, RULE)
        s = _scores(q, k_tile, attr_v, attr, BIAS, b, bh, rows, keys, state, policy, seed, limit, scale, T, S, ACC,
                    RULE, CAUSAL, BIAS_KIND, ROW_BIAS, UNITS, BLOCK_G, DOT_PRECISION)  # fmt: skip
        p = tl.exp(s - lse[:, None])
        dp = tl.dot(grad_out, tl.trans(v_tile), out_dtype=ACC, input_precision=DOT_PRECISION)
        if DROPOUT:
            dp = tl.where(_weight_kept(dseed, dlimit, bh, rows, keys, T, S), dp * dscale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_tile.dtype), k_tile, out_dtype=ACC, input_precision=DOT_PRECISION)
    dq = tl.where((state[2] == _UNIFORM)[:, None], 0.0, dq * scale)
    at = bh * T * D + rows[:, None] * D + dims[None, :]
    tl.store(DQ + at, dq.to(DQ.dtype.element_ty), mask=(rows[:, None] < T) & (dims[None, :] < D))


@_jit
def _backward_kv_kernel(Q, K, V, BIAS, ATTR, AV, GQ, GK, GOFF, QREAL, KREAL, THR, TIE, KEEP, DO, LSE, DELTA, DK, DV,
                        seed, limit, dseed, dlimit, dscale, scale, T, S, H, GROUP, D, G, RULE: tl.constexpr,
                        CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr, ROW_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                        ACC: tl.constexpr, UNITS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """dk, dv of a block of keys of one key/value head, summed over the query heads of its group. Under
    the model's dropout (Z: 0 where dropped, dscale where kept): dv = (P Z)^T dO, dS = P (dO V^T Z - D)."""
    start_n, kv = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    b = kv // (H // GROUP)
    policy = (GQ, GK, GOFF, QREAL, KREAL, G)
    keys, dims = start_n + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    k_tile, v_tile, attr_v = _key_tiles(K, V, AV, kv, keys, S, dims, D, BLOCK_N, BLOCK_D, RULE)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    first = 0
    if CAUSAL:  # the first block of rows that may attend one of these keys
        first = tl.maximum(0, start_n - (S - T)) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        bh = kv * GROUP + g
        for start_m in range(first, T, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            state = _row_state(THR, TIE, KEEP, bh, rows, T, RULE)
            q, attr = _query_tiles(Q, ATTR, bh, rows, T, dims, D, state[2], BLOCK_M, BLOCK_D, RULE)
            s = _scores(q, k_tile, attr_v, attr, BIAS, b, bh, rows, keys, state, policy, seed, limit, scale, T, S,
                        ACC, RULE, CAUSAL, BIAS_KIND, ROW_BIAS, UNITS, BLOCK_G, DOT_PRECISION)  # fmt: skip
            lse = tl.load(LSE + bh * T + rows, mask=rows < T, other=float("inf"))
            delta = tl.load(DELTA + bh * T + rows, mask=rows < T, other=0.0)
            grad_out = _load_rows(DO + bh * T * D, rows, T, dims, D)
            p = tl.exp(s - lse[:, None])
            dp = tl.dot(grad_out, tl.trans(v_tile), out_dtype=ACC, input_precision=DOT_PRECISION)
            weights = p
            if DROPOUT:
                kept = _weight_kept(dseed, dlimit, bh, rows, keys, T, S)
                weights = tl.where(kept, p * dscale, 0.0)
                dp = tl.where(kept, dp * dscale, 0.0)
            dv += tl.dot(tl.trans(weights.to(grad_out.dtype)), grad_out, out_dtype=ACC, input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, out_dtype=ACC, input_precision=DOT_PRECISION)
    at = kv * S * D + keys[:, None] * D + dims[None, :]
    inside = (keys[:, None] < S) & (dims[None, :] < D)
    tl.store(DK + at, (dk * scale).to(DK.dtype.element_ty), mask=inside)
    tl.store(DV + at, dv.to(DV.dtype.element_ty), mask=inside)


@_jit
def _row_counts_kernel(BIAS, ATTR, AV, GQ, GK, GOFF, QREAL, KREAL, THR, TIE, LOWEST, KEEP, COUNTS, seed, limit, T, S,
                       H, GROUP, D, G, RULE: tl.constexpr, CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr,
                       ROW_BIAS: tl.constexpr, UNITS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """Each row's ``keep`` from its valid keys and the keys its coins drop among them: where the drops
    would take all of a row's keys, AD-DROP's keeps its lowest-scored key (``LOWEST``) and Bernoulli's
    attends uniformly; else -1. Adds the call's (dropped, droppable) to ``COUNTS`` (zeroed int64): AD-DROP's
    dropped leaves out a row's kept key, a uniform row counts all its valid keys (blockwise.block_counts)."""
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b, kv = bh // H, bh // GROUP
    policy = (GQ, GK, GOFF, QREAL, KREAL, G)
    rows, dims = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    threshold, last_tie = _region_row_state(THR, TIE, bh, rows, T, RULE)
    keep = rows * 0 - 1
    attr = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if RULE == _AD_DROP:
        attr = _load_rows(ATTR + bh * T * D, rows, T, dims, D)
    n_valid = tl.zeros([BLOCK_M], tl.int32)
    n_dropped = tl.zeros([BLOCK_M], tl.int32)
    n_units = tl.zeros([BLOCK_M], tl.int32)  # GENERATOR's rate counts its valid real units, not every valid key
    for start_n in range(0, _causal_end(start_m, BLOCK_M, T, S, CAUSAL), BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        valid, unused_bias = _validity(BIAS, b, rows, keys, T, S, CAUSAL, BIAS_KIND, ROW_BIAS)
        attr_v = _attribution_values(AV, kv, keys, S, dims, D, BLOCK_N, BLOCK_D, RULE)  # no k or v needed
        drop, region = _drops(seed, limit, b, bh, rows, keys, T, S, valid, attr, attr_v, threshold, last_tie,
                              keep, policy, RULE, UNITS, BLOCK_G, DOT_PRECISION)  # fmt: skip
        n_valid += tl.sum(valid.to(tl.int32), 1)
        n_dropped += tl.sum(drop.to(tl.int32), 1)
        if RULE == _GENERATOR:
            n_units += tl.sum(region.to(tl.int32), 1)
    emptied = (n_dropped == n_valid) & (n_valid > 0)
    if RULE == _AD_DROP:
        keep = tl.where(emptied, tl.load(LOWEST + bh * T + rows, mask=rows < T, other=-1), -1)
        n_dropped -= emptied.to(tl.int32)
    else:
        keep = tl.where(emptied, _UNIFORM, -1)
    tl.store(KEEP + bh * T + rows, keep.to(tl.int32), mask=rows < T)
    if RULE != _GENERATOR:
        n_units = n_valid
    # (an emptied GENERATOR row's valid keys are all its units: its drops, all of them, lie among its units)
    tl.atomic_add(COUNTS, tl.sum(n_dropped.to(tl.int64), 0))
    tl.atomic_add(COUNTS + 1, tl.sum(n_units.to(tl.int64), 0))


@_jit
def _inspect_kernel(BIAS, ATTR, AV, GQ, GK, GOFF, QREAL, KREAL, THR, TIE, KEEP, CODES, SCORES, seed, limit, dseed,
                    dlimit, T, S, H, GROUP, D, G, RULE: tl.constexpr, CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr,
                    ROW_BIAS: tl.constexpr, DROPOUT: tl.constexpr, UNITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """One tile's drops, region, validity and dropped weights as DROP | REGION | VALID | WEIGHT_DROPPED
    bits, and its attribution scores."""
    start_m, start_n, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N, tl.program_id(2)
    b, kv = bh // H, bh // GROUP
    policy = (GQ, GK, GOFF, QREAL, KREAL, G)
    rows, keys, dims = start_m + tl.arange(0, BLOCK_M), start_n + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    threshold, last_tie, keep = _row_state(THR, TIE, KEEP, bh, rows, T, RULE)
    attr = _load_rows(ATTR + bh * T * D, rows, T, dims, D)
    attr_v = _load_rows(AV + kv * S * D, keys, S, dims, D)
    valid, _ = _validity(BIAS, b, rows, keys, T, S, CAUSAL, BIAS_KIND, ROW_BIAS)
    drop, region = _drops(seed, limit, b, bh, rows, keys, T, S, valid, attr, attr_v, threshold, last_tie, keep,
                          policy, RULE, UNITS, BLOCK_G, DOT_PRECISION)  # fmt: skip
    codes = drop.to(tl.int8) * _DROP + region.to(tl.int8) * _REGION + valid.to(tl.int8) * _VALID
    if DROPOUT:
        codes += (~_weight_kept(dseed, dlimit, bh, rows, keys, T, S)).to(tl.int8) * _WEIGHT_DROPPED
    at = bh * T * S + rows[:, None] * S + keys[None, :]
    inside = (rows[:, None] < T) & (keys[None, :] < S)
    tl.store(CODES + at, codes, mask=inside)
    tl.store(SCORES + at, _attribution_score(attr, attr_v, DOT_PRECISION), mask=inside)


@_jit
def _scores_kernel(ATTR, AV, SCORES, T, S, H, GROUP, D, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):  # fmt: skip
    """One tile of attribution_scores."""
    start_m, start_n, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N, tl.program_id(2)
    rows, keys, dims = start_m + tl.arange(0, BLOCK_M), start_n + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    attr = _load_rows(ATTR + bh * T * D, rows, T, dims, D)
    attr_v = _load_rows(AV + (bh // GROUP) * S * D, keys, S, dims, D)
    at = bh * T * S + rows[:, None] * S + keys[None, :]
    tl.store(
        SCORES + at, _attribution_score(attr, attr_v, DOT_PRECISION), mask=(rows[:, None] < T) & (keys[None, :] < S)
    )


@_jit
def _region_kernel(SCORES, BIAS, SAMPLES, THRESHOLD, LAST_TIE, LOWEST, T, S, H, NUM, DEN, CAUSAL: tl.constexpr,
                   BIAS_KIND: tl.constexpr, ROW_BIAS: tl.constexpr, HAS_SAMPLES: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_S: tl.constexpr):  # fmt: skip
    """One block of query rows' AD-DROP state (:func:`region_state`) from their whole rows of scores."""
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b = bh // H
    rows, keys = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_S)
    valid, _ = _validity(BIAS, b, rows, keys, T, S, CAUSAL, BIAS_KIND, ROW_BIAS)
    score = tl.load(SCORES + bh * T * S + rows[:, None] * S + keys[None, :], mask=valid, other=-float("inf"))
    n = tl.sum(valid.to(tl.int64), axis=1)
    k = (n * NUM + DEN - 1) // DEN  # ceil(p n) in integers: exact for the decimal p = NUM / DEN
    if HAS_SAMPLES:  # other samples lose nothing: no region
        k = tl.where(tl.load(SAMPLES + b) != 0, k, 0)
    ranked = tl.sort(score, dim=1, descending=True)
    kth = tl.max(tl.where(keys[None, :] == (k - 1)[:, None], ranked, -float("inf")), axis=1)
    threshold = tl.where(k > 0, kth, float("inf"))
    above = tl.sum((valid & (score > threshold[:, None])).to(tl.int64), axis=1)
    tied = valid & (score == threshold[:, None])
    taken = tied & (tl.cumsum(tied.to(tl.int64), axis=1) <= (k - above)[:, None])  # ties: lowest key first
    last_tie = tl.max(tl.where(taken, keys[None, :], -1), axis=1)
    lowest = tl.argmin(tl.where(valid, score, float("inf")), axis=1, tie_break_left=True)
    lowest = tl.where(n > 0, lowest, -1)
    at, kept = bh * T + rows, rows < T
    tl.store(THRESHOLD + at, threshold, mask=kept)
    tl.store(LAST_TIE + at, last_tie.to(tl.int32), mask=kept)
    tl.store(LOWEST + at, lowest.to(tl.int32), mask=kept)


# -- the Python side -------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class EditDrops:
    """What the kernel drops in one call: ``rule`` (NONE, BERNOULLI, AD_DROP or GENERATOR), its ``rate``
    (the Bernoulli p; AD-DROP's q), the Philox ``seed`` (an int), and for AD-DROP the attribution pass's
    output gradient (B, H, T, d) and values (v's shape: the pass's own, not this call's), and each
    row's (threshold, last_tie, lowest_key), (B, H, T) each (:func:`region_ties`); for GENERATOR its
    ``policy`` (``rules.SampledLogits``, whose seed is ``seed``). ``dropout_p``: the model's attention
    dropout inside the call, its coins from their own Philox ``dropout_seed`` (an int)."""

    rule: int
    rate: float
    seed: int
    attribution: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    threshold: Optional[torch.Tensor] = None
    last_tie: Optional[torch.Tensor] = None
    lowest_key: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    dropout_seed: int = 0
    policy: Optional[SampledLogits] = None


def region_ties(scores, valid, threshold, k) -> Tuple[torch.Tensor, torch.Tensor]:
    """(last_tie, lowest_key), (B, H, T) int32, of rows whose candidates are the ``k`` largest valid
    ``scores`` (B, H, T, S) with the ``threshold`` the k-th largest (+inf where k = 0), ties lowest key
    first: the key of the last tie taken (-1: none), and the valid key of lowest score (first of
    equals; -1 in a row without valid key) that a row keeps if its drops would take every key.
    ``valid``, ``threshold`` and ``k`` broadcast to (B, H, T, S), (B, H, T, 1), (B, H, T, 1)."""
    scores = scores.float().nan_to_num(0.0)
    valid = valid.expand(scores.shape)
    above = ((scores > threshold) & valid).sum(-1, keepdim=True)
    tied = (scores == threshold) & valid
    taken = tied & (tied.cumsum(-1) <= k - above)
    keys = torch.arange(scores.shape[-1], device=scores.device)
    last_tie = torch.where(taken, keys, -1).amax(-1)
    lowest = torch.where(valid, scores, math.inf).argmin(-1)
    return last_tie.to(torch.int32), torch.where(valid.any(-1), lowest, -1).to(torch.int32)


class _Call(NamedTuple):
    """A call's kernel arguments besides q, k, v: the bias ((B, S), or (B, T, S) with ``row_bias``) or
    None, the rule's tensors (the attribution and its values, and per row threshold, last tie, keep;
    a tensor the kernels never read where the rule has none; GENERATOR's policy), the scalars and the tile size."""

    bias: Optional[torch.Tensor]
    row_bias: bool
    attribution: torch.Tensor
    values: torch.Tensor
    threshold: torch.Tensor
    last_tie: torch.Tensor
    keep: torch.Tensor
    policy: Tuple[torch.Tensor, ...]  # GENERATOR's gq, gk, offset, real queries, real keys (else stand-ins)
    units: int  # GENERATOR's UNITS
    seed: int
    limit: int
    dropout_seed: int
    dropout_limit: int  # -1: no dropout
    dropout_scale: float  # 1 / (1 - p); 0 at p = 1
    scale: float
    rule: int
    causal: bool
    block: int


def _kernel_bias(bias: Optional[torch.Tensor], b: int, t: int, s: int) -> Tuple[Optional[torch.Tensor], bool]:
    """(the bias as the kernels read it, whether it has a row per query): contiguous, a (B, S) key row
    when it broadcasts as (B, 1, 1, S) (an expanded (B, 1, T, S) too), else (B, T, S) from a (B, 1, T, S)
    one whose rows may differ; float32, or bool (True = may attend) as it is."""
    if bias is None:
        return None, False
    if bias.dim() == 4 and bias.shape[1] != 1:
        raise ValueError(f"the kernel takes one bias for all heads, (B, 1, T or 1, S); got {tuple(bias.shape)}")
    if bias.dim() >= 3 and bias.shape[-2] != 1 and bias.stride(-2) == 0:
        bias = bias[..., :1, :]  # one key row, expanded
    if bias.dtype != torch.bool:
        bias = bias.float()
    if bias.dim() < 3 or bias.shape[-2] == 1:
        return bias.reshape(-1, bias.shape[-1]).expand(b, s).contiguous(), False
    if bias.shape[-2] != t:
        raise ValueError(f"a bias of {bias.shape[-2]} rows for {t} queries")
    return bias.reshape(-1, t, s).expand(b, t, s).contiguous(), True


def _bias_kind(bias: Optional[torch.Tensor]) -> int:
    """The kernels' BIAS_KIND of a bias as :func:`_kernel_bias` gives it."""
    return NO_BIAS if bias is None else BOOL_BIAS if bias.dtype == torch.bool else FLOAT_BIAS


def dot_precision() -> str:
    """The kernels' input precision for float32 products, torch.matmul's on a GPU: IEEE float32 under torch's
    float32 matmul precision "highest" (its default), TF32 tensor cores under "high" or "medium"
    (``torch.set_float32_matmul_precision``). Half-precision operands run on tensor cores either way."""
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def attribution_operands(attribution: torch.Tensor, values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """AD-DROP's attribution dO and its values V as every kernel's product dO V^T reads them (contiguous, one
    dtype): in the values' dtype when the attribution pass ran in half precision (its dO and V are then exact
    in it: the product runs on tensor cores with float32 sums, as the float32 product of the same numbers but
    for the order of the sums), else float32. In Triton's interpreter float32 (its bf16 tl.dot is wrong, see
    :func:`available`; the float32 product of bf16 numbers is what the tensor cores compute). No launch when
    they already are (a region's, reused by the edit)."""
    half = values.dtype in (torch.bfloat16, torch.float16)
    dtype = values.dtype if half and not triton.knobs.runtime.interpret else torch.float32
    return attribution.to(dtype).contiguous(), values.to(dtype).contiguous()


def _grid_sizes(q: torch.Tensor) -> Tuple[int, int]:
    """(rows and keys per tile, padded head dim): :func:`tile`; the head dim to a power of two, at least 16."""
    return tile(), max(16, triton.next_power_of_2(q.shape[-1]))


def tile() -> int:
    """Rows and keys per tile of every kernel: 64 compiled; 16 in the interpreter, fast on tiny shapes."""
    return 16 if triton.knobs.runtime.interpret else 64


def _launch_args(q, k, call: _Call):
    """The kernels' shared scalars and compile-time options, by the kernels' argument names."""
    b, h, t, d = q.shape
    block, block_d = _grid_sizes(q)
    g = call.policy[0].shape[-1]
    scalars = dict(seed=call.seed, limit=call.limit, dseed=call.dropout_seed, dlimit=call.dropout_limit,
                   dscale=call.dropout_scale, scale=call.scale, T=t, S=k.shape[2], H=h, GROUP=h // k.shape[1], D=d,
                   G=g)  # fmt: skip
    acc = tl.float64 if q.dtype == torch.float64 else tl.float32
    options = dict(RULE=call.rule, CAUSAL=call.causal, BIAS_KIND=_bias_kind(call.bias), ROW_BIAS=call.row_bias,
                   DROPOUT=call.dropout_limit >= 0, ACC=acc, UNITS=call.units, DOT_PRECISION=dot_precision(),
                   BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d, BLOCK_G=policy_block(g))  # fmt: skip
    return scalars, options


def _only(args: dict, *names: str) -> dict:
    """The entries of ``args`` a kernel of fewer arguments takes."""
    return {name: args[name] for name in names}


_COIN_SCALARS = ("seed", "limit", "T", "S", "H", "GROUP", "D", "G")
_SHARED_OPTIONS = (
    "RULE", "CAUSAL", "BIAS_KIND", "ROW_BIAS", "UNITS", "DOT_PRECISION", "BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_G"
)  # fmt: skip


def policy_block(g: int) -> int:
    """The tile width of GENERATOR's factors: ``g`` rounded up to a power of two, at least 16 (tl.dot's least)."""
    return max(16, triton.next_power_of_2(g))


def policy_operands(policy: SampledLogits) -> Tuple[Tuple[torch.Tensor, ...], int]:
    """((gq, gk, offset (1,), real queries, real keys) as the kernels read them, their UNITS): float32 and
    contiguous, not differentiated; the real masks as bool (not read with every unit)."""
    factors = tuple(x.detach().float().contiguous() for x in (policy.query, policy.key, policy.offset.reshape(1)))
    real = tuple(x.to(torch.bool).contiguous() for x in (policy.query_real, policy.key_real))
    units = EVERY_UNIT if policy.every_unit else REAL_CAUSAL_UNITS if policy.causal else REAL_UNITS
    return (*factors, *real), units


def _prepare(q, k, v, drops: EditDrops, key_bias, causal: bool, scale: Optional[float]):
    """(the call's kernel arguments, dropped, droppable): one counting launch finds the rows a rule would
    empty (AD-DROP's keep their lowest-scored key, Bernoulli's attend uniformly) and counts the drops."""
    b, h, t, d = q.shape
    if h % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"{h} query heads cannot share {k.shape[1]} key and {v.shape[1]} value heads")
    if drops.rule not in (NONE, BERNOULLI, AD_DROP, GENERATOR):
        raise ValueError(f"unknown rule {drops.rule}")
    generator = drops.rule == GENERATOR
    if generator and (drops.policy is None or tuple(drops.policy.query.shape[:2]) != (b, t)
                      or tuple(drops.policy.key.shape[:2]) != (b, k.shape[2])):  # fmt: skip
        got = None if drops.policy is None else (tuple(drops.policy.query.shape), tuple(drops.policy.key.shape))
        raise ValueError(f"GENERATOR's policy covers (B, T, G) queries and (B, S, G) keys of the call; got {got}")
    if not 0.0 <= drops.dropout_p <= 1.0:
        raise ValueError(f"the attention dropout's p is a probability, got {drops.dropout_p}")
    ad_drop = drops.rule == AD_DROP
    if ad_drop and (drops.values is None or drops.values.shape != v.shape):
        got = None if drops.values is None else tuple(drops.values.shape)
        raise ValueError(f"AD_DROP ranks the attribution pass's values, of v's shape {tuple(v.shape)}; got {got}")
    dropout_p = float(drops.dropout_p)
    # q stands in for the tensors a rule does not have: the kernels never read them (no copy, no launch).
    keep = q if drops.rule == NONE else torch.empty((b, h, t), dtype=torch.int32, device=q.device)
    policy, units = policy_operands(drops.policy) if generator else ((q[..., :1],) * 5, EVERY_UNIT)
    call = _Call(
        *_kernel_bias(key_bias, b, t, k.shape[2]),
        *(attribution_operands(drops.attribution, drops.values) if ad_drop else (q, q)),
        drops.threshold.float().contiguous() if ad_drop else q,
        drops.last_tie.to(torch.int32).contiguous() if ad_drop else q,
        keep,
        policy,
        units,
        int(drops.seed),
        round(drops.rate * 2**31) - 1,  # rules.coin_limit
        int(drops.dropout_seed),
        round(dropout_p * 2**31) - 1,
        0.0 if dropout_p >= 1 else 1.0 / (1.0 - dropout_p),
        d**-0.5 if scale is None else float(scale),
        drops.rule,
        bool(causal),
        _grid_sizes(q)[0],
    )
    if drops.rule == NONE:
        zero = torch.zeros((), dtype=torch.long, device=q.device)
        return call, zero, zero
    counts = torch.zeros(2, dtype=torch.long, device=q.device)  # (dropped, droppable), added to by the kernel
    lowest = drops.lowest_key.to(torch.int32).contiguous() if ad_drop else keep
    scalars, options = _launch_args(q, k, call)
    grid = (triton.cdiv(t, call.block), b * h)
    _row_counts_kernel[grid](*_tensors(call, k)[:10], lowest, keep, counts, **_only(scalars, *_COIN_SCALARS),
                             **_only(options, *_SHARED_OPTIONS))  # fmt: skip
    return call, counts[0], counts[1]


def _tensors(call: _Call, k):
    """The call's tensors in the kernels' argument order (k stands in where there is no bias)."""
    return (
        k if call.bias is None else call.bias,
        call.attribution,
        call.values,
        *call.policy,
        call.threshold,
        call.last_tie,
        call.keep,
    )


def _forward(q, k, v, call: _Call):
    b, h, t, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, t), dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    scalars, options = _launch_args(q, k, call)
    grid = (triton.cdiv(t, call.block), b * h)
    _forward_kernel[grid](q, k, v, *_tensors(call, k), out, lse, **scalars, **options)
    return out, lse


def _backward(grad_out, q, k, v, out, lse, call: _Call):
    """dq, dk, dv in two launches: dq's kernel also stores each row's delta = rowsum(dO O), which dk
    and dv's kernel, launched after it, reads."""
    b, h, t, d = q.shape
    grad_out = grad_out.contiguous()
    delta = torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scalars, options = _launch_args(q, k, call)
    tensors = _tensors(call, k)
    grid = (triton.cdiv(t, call.block), b * h)
    _backward_q_kernel[grid](q, k, v, *tensors, grad_out, out, lse, delta, dq, **scalars, **options)
    grid = (triton.cdiv(k.shape[2], call.block), b * k.shape[1])
    _backward_kv_kernel[grid](q, k, v, *tensors, grad_out, lse, delta, dk, dv, **scalars, **options)
    return dq, dk, dv


class FusedEditAttention(torch.autograd.Function):
    """The fused call under autograd: the forward keeps q, k, v, the output and each row's
    log-sum-exp (no mask); the backward makes the drops and the dropout again in its kernels."""

    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _forward(q, k, v, call)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_backward(grad_out, q, k, v, out, lse, ctx.call), None)


def fused_edit_attention(q, k, v, drops: EditDrops, key_bias=None, causal: bool = False, scale=None):
    """(output (B, H, T, d), dropped, droppable) of attention with ``drops`` (the rule's, and the model's
    attention dropout at ``drops.dropout_p``): q (B, H, T, d), k and v (B, H_kv, S, d) with H_kv dividing
    H; ``key_bias`` an additive float (or bool, True = may attend) bias of one key row, (B, 1, 1, S), or a
    row per query, (B, 1, T, S), the same for every head, not differentiated; ``causal``: query i attends
    keys j <= i + S - T; ``scale`` None: 1 / sqrt(d). dk, dv sum over a group's heads. The same ``drops``
    object again, with the same shapes and ``key_bias`` object (a checkpoint's recompute), reuses the call's
    row counts (:data:`_PREPARED`): its ``keep`` and counts, not the counting launch again."""
    same = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.device, q.dtype, bool(causal), scale)
    kept = _PREPARED.get(drops)
    if kept is None or kept[0] != same or kept[1]() is not key_bias:
        kept = (
            same,
            weak_ref(key_bias),
            *_prepare(q, k, v, drops, key_bias, causal, scale),
        )
        _PREPARED[drops] = kept
    call, dropped, droppable = kept[2:]
    return FusedEditAttention.apply(q, k, v, call), dropped, droppable


# A call's prepared arguments and counts, kept while its drops object lives: the same drops again with the
# same bias object (a checkpoint's recompute of the call) skips the counting launch, its product included.
_PREPARED: weakref.WeakKeyDictionary[EditDrops, tuple] = weakref.WeakKeyDictionary()


def weak_ref(x: Optional[torch.Tensor]) -> Callable[[], Optional[torch.Tensor]]:
    """A weak reference to ``x``, or to nothing for None (both answer None once gone): how the caches of a
    call's row counts and of a rule's region tell the very same bias object from another."""
    return _none if x is None else weakref.ref(x)


def _none():
    return None


def attribution_scores(attribution: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(B, H, T, S) float32 dO V^T of ``attribution`` (B, H, T, d) and ``values`` (B, H_v, S, d), by the
    kernels' own product (NaN as 0): the scores a caller ranks to give AD_DROP's per-row state."""
    b, h, t, d = attribution.shape
    s = values.shape[2]
    scores = torch.empty((b, h, t, s), dtype=torch.float32, device=attribution.device)
    block, block_d = _grid_sizes(attribution)
    grid = (triton.cdiv(t, block), triton.cdiv(s, block), b * h)
    args = (*attribution_operands(attribution, values), scores, t, s, h, h // values.shape[1], d)
    _scores_kernel[grid](*args, DOT_PRECISION=dot_precision(), BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d)
    return scores


# The most keys region_state ranks in one program: a row block's whole rows are sorted in registers.
MAX_REGION_KEYS = 1024


def region_fits(keys: int, numerator: int, denominator: int) -> bool:
    """Whether :func:`region_state` takes a call of ``keys`` keys and p = numerator / denominator (its
    ceil(p n) in 64-bit integers)."""
    return keys <= MAX_REGION_KEYS and keys * numerator + denominator < 2**63


def region_state(scores, key_bias, causal: bool, numerator: int, denominator: int, samples=None):
    """(threshold, last_tie, lowest_key), (B, H, T) each, of AD-DROP's region over ``scores`` (B, H, T, S),
    :func:`attribution_scores`' map, in one launch: per row the k = ceil(p n) largest of its n valid keys
    (p = numerator / denominator exactly; ``key_bias``: fused_route.kernel_bias's, a key row or a row per
    query, or None; ``causal``: key j valid for query i when j <= i + S - T), the threshold their k-th
    largest (+inf where k = 0), ties taken lowest key first up to ``last_tie``, and the valid key of lowest
    score (first of equals; -1 in a row with no valid key). ``samples`` (B,) bool: other samples get k = 0.
    The same state as ``TopRegionRule.region`` then :func:`region_ties`, with no host read: k is never
    sized on the host."""
    b, h, t, s = scores.shape
    if not region_fits(s, numerator, denominator):
        raise ValueError(f"region_state ranks at most {MAX_REGION_KEYS} keys in 64-bit integers, got {s}")
    threshold = torch.empty((b, h, t), dtype=torch.float32, device=scores.device)
    last_tie, lowest = (torch.empty((b, h, t), dtype=torch.int32, device=scores.device) for _ in range(2))
    bias, row_bias = _kernel_bias(key_bias, b, t, s)
    block = 16
    grid = (triton.cdiv(t, block), b * h)
    _region_kernel[grid](
        scores.contiguous(), bias if bias is not None else scores, samples if samples is not None else scores,
        threshold, last_tie, lowest, t, s, h, numerator, denominator, CAUSAL=causal, BIAS_KIND=_bias_kind(bias),
        ROW_BIAS=row_bias, HAS_SAMPLES=samples is not None, BLOCK_M=block, BLOCK_S=max(16, triton.next_power_of_2(s)),
    )  # fmt: skip
    return threshold, last_tie, lowest


class KernelDrops(NamedTuple):
    """inspect()'s maps, (B, H, T, S) each: the drops as the kernel applies them (after a row keeps
    its key), the candidate region (the valid keys for Bernoulli), the validity, the attribution
    scores the kernel ranks (0 unless AD-DROP); the rows made uniform, (B, H, T); and the weights the
    model's attention dropout takes (its coins at every position; none without dropout)."""

    drop: torch.Tensor
    region: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor
    uniform: torch.Tensor
    weight_dropped: torch.Tensor


def inspect(q, k, v, drops: EditDrops, key_bias=None, causal: bool = False) -> KernelDrops:
    """The kernel's drops materialised, for tests on tiny shapes only (a T x S map)."""
    b, h, t, d = q.shape
    s = k.shape[2]
    call, _, _ = _prepare(q, k, v, drops, key_bias, causal, None)
    codes = torch.empty((b, h, t, s), dtype=torch.int8, device=q.device)
    scores = torch.empty((b, h, t, s), dtype=torch.float32, device=q.device)
    scalars, options = _launch_args(q, k, call)
    ad_drop = drops.rule == AD_DROP
    attribution = call.attribution if ad_drop else torch.zeros_like(q, dtype=torch.float32)
    values = call.values if ad_drop else torch.zeros_like(v, dtype=torch.float32)
    tensors = (k if call.bias is None else call.bias, attribution, values, *_tensors(call, k)[3:])  # GQ .. KEEP
    grid = (triton.cdiv(t, call.block), triton.cdiv(s, call.block), b * h)
    _inspect_kernel[grid](*tensors, codes, scores, **_only(scalars, "dseed", "dlimit", *_COIN_SCALARS),
                          **_only(options, "DROPOUT", *_SHARED_OPTIONS))  # fmt: skip
    flags = [(codes & bit) != 0 for bit in (DROP, REGION, VALID)]
    no_rule = drops.rule == NONE  # keep is then a placeholder
    uniform = torch.zeros((b, h, t), dtype=torch.bool, device=q.device) if no_rule else call.keep == UNIFORM
    return KernelDrops(*flags, scores, uniform, (codes & WEIGHT_DROPPED) != 0)


__all__: Sequence[str] = (
    "AD_DROP", "BERNOULLI", "GENERATOR", "NONE", "EditDrops", "FusedEditAttention", "KernelDrops", "attribution_scores",
    "attribution_operands", "available", "dot_precision", "fused_edit_attention", "inspect", "region_ties",
)  # fmt: skip
