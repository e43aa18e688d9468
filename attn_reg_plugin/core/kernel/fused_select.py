"""AD-DROP's per-row region state for any number of keys, in one Triton launch: exactly what
:func:`.fused_edit.attribution_scores` then :func:`.fused_edit.region_state` give, with no (B, H, T, S)
score map and no host read, whatever S (``region_state`` sorts whole rows in registers, S <= 1024).

Method (:func:`region_state_streamed`): one program per block of query rows and head, its rows'
scores recomputed tile by tile, never stored.

- Scores: each key tile's ``dO V^T`` by the fused kernels' own product (``fused_edit._attribution_score``:
  ``tl.dot`` of ``fused_edit.attribution_operands``, at ``fused_edit.dot_precision``, summed in float32,
  NaN as 0, +-inf clamped to the largest finite float32), on tiles of ``fused_edit._grid_sizes``' shape, as ``attribution_scores`` makes them: the same
  bits as the map the caller would rank. A score of -0 ranks (and is returned) as +0 (they compare
  equal; the product gives no -0).
- Selection: an exact radix select of the k-th largest valid score per row, k = ceil(p n) in 64-bit
  integers (n the row's valid keys), over the order-preserving uint32 transform of the float bits, 4 bits
  a level, most significant first: each of 8 levels streams the row's keys once and counts, for each of
  the 16 values of the level's digit, the valid keys matching the prefix chosen so far whose digit is at
  least that value; the row's digit is the largest one with at least ``need`` such keys, where ``need``
  is k less the keys already known to be above (those of a larger digit at an earlier level). After 8
  levels the prefix is the threshold's bits and k - above the number of ties taken. A ninth stream, in
  key order, takes ties lowest key first (``last_tie``: the key of the (k - above)-th tied key, a running
  count plus a cumsum in each tile) and finds the lowest-scored valid key (first of equals).
- Rows with k = 0 (no valid key, or a sample ``samples`` leaves out) get threshold +inf and last tie -1;
  k > n (p > 1) gives -inf and -1, as ``region_state``. A sample left out skips the 8 levels (only its
  lowest keys are wanted): its rows cost one pass.

Why recompute, not a scratch buffer: remaking a score takes d_pad float32 FMAs from a (d,)-vector pair
already in cache, the same order of work as the 16 digit counts a level spends on each score anyway,
while a scratch of a row block's whole rows (BLOCK_M x S floats per program) needs memory growing with S
and, to bound it, a persistent grid too small to fill the GPU once S is long. Recomputing keeps the
attention kernels' own grid (cdiv(T, BLOCK_M) x B H programs, each of ``NUM_WARPS`` warps) and memory
O(B H T). Its price: the product is made 9 times here (the fused forward and backward already make it 4
times a call); a scratch variant (persistent programs streaming a (BLOCK_M, S) uint32 scratch 9 times
after one product) is the alternative should a GPU timing show the product dominating.

Cost of a call, whatever T and S: 1 Triton launch, plus 3 output allocations and, only where the inputs
are not already so, float32 / contiguous copies of the attribution and values and the bias's
normalisation (a few elementwise operations); no host read. FLOPs: 9 products, 9 x 2 B H T' S' d_pad
(T' = T rounded up to the row block of ``fused_edit._grid_sizes``, 64 compiled; S' the keys a row block
reaches: S, or up to its last row's causal limit; d_pad = max(16, next power of two of d)), plus about
8 x 16 x 3 integer operations per (query, key) for the digit counts and ~20 for the tie pass. Memory:
each pass reads the head's (S, d) values once per row block (cache-resident across the row blocks of a
head), the bias (a key row, or the caller's (B, T, S) mask), and writes 12 bytes per row; nothing of size
T x S is held. Tests: tests/core/test_fused_select.py."""

from __future__ import annotations

from typing import Optional

import torch

from . import fused_edit
from .fused_edit import _attribution_score, _bias_kind, _grid_sizes, _helper, _jit, _kernel_bias, _validity

try:  # the optional extra `triton`
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None


def _constant(value):
    """``value`` as a kernel may read it: compiled kernels read only tl.constexpr globals."""
    return value if tl is None else tl.constexpr(value)


_DIGITS = _constant(16)  # the radix select's digit values: 8 levels of 4 bits
_LAST_KEY = _constant(2**31 - 1)  # above every key index
# Warps of a compiled program: the 64 x 64 tile's float32 FMA product (the fused kernels' own) and the
# digit counts fit 16 warps' registers (ptxas for sm_90: 128 registers, ~150 bytes spilled; 4 warps
# spill ~2 KB). Chosen from ptxas's counts, not yet timed on a GPU. The interpreter ignores it.
NUM_WARPS = 16


@_helper
def _score_tile(attr, AV, BIAS, b, kv, rows, keys, dims, T, S, D, CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr,
                ROW_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """(valid, score, order key) of a tile: the fused kernels' product (-0 as +0), and its float bits
    made an unsigned integer of the same order (sign bit flipped; every bit of a negative one)."""
    at = kv.to(tl.int64) * S * D + keys[:, None] * D + dims[None, :]
    attr_v = tl.load(AV + at, mask=(keys[:, None] < S) & (dims[None, :] < D), other=0.0)
    score = _attribution_score(attr, attr_v, DOT_PRECISION)
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return _validity(BIAS, b, rows, keys, T, S, CAUSAL, BIAS_KIND, ROW_BIAS)[0], score, key


@_jit
def _select_kernel(ATTR, AV, BIAS, SAMPLES, THRESHOLD, LAST_TIE, LOWEST, T, S, H, GROUP, D, NUM, DEN,
                   CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr, ROW_BIAS: tl.constexpr, HAS_SAMPLES: tl.constexpr,
                   WIDE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):  # fmt: skip
    """One block of query rows' AD-DROP state by radix select over their recomputed scores (module doc)."""
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b, kv = bh // H, bh // GROUP  # GQA: (b H + h) // G = b H_kv + h // G
    rows, dims = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    at = bh.to(tl.int64) * T * D + rows[:, None] * D + dims[None, :]
    attr = tl.load(ATTR + at, mask=(rows[:, None] < T) & (dims[None, :] < D), other=0.0)
    end = S
    if CAUSAL:  # the keys any of these rows may attend lie below this
        end = tl.minimum(S, start_m + BLOCK_M + S - T)
    ranks = end  # the keys the radix select streams: none in a sample ``samples`` leaves out (k = 0)
    if HAS_SAMPLES:
        chosen_sample = tl.load(SAMPLES + b) != 0
        ranks = tl.where(chosen_sample, end, 0)
    digits = tl.arange(0, _DIGITS)
    prefix = tl.zeros([BLOCK_M], tl.uint32)  # the threshold's order key, a digit more each level
    above = tl.zeros([BLOCK_M], tl.int64)  # valid keys known to score above the threshold
    n = tl.zeros([BLOCK_M], tl.int64)
    k = tl.zeros([BLOCK_M], tl.int64)
    for level in range(0, 8):  # 4 bits a level, most significant first
        shift = 28 - 4 * level
        # at_least[:, v]: valid keys of the prefix so far whose digit at this level is >= v
        at_least = tl.zeros([BLOCK_M, _DIGITS], tl.int32)
        for start_n in range(0, ranks, BLOCK_N):
            keys = start_n + tl.arange(0, BLOCK_N)
            valid, _, key = _score_tile(
                attr, AV, BIAS, b, kv, rows, keys, dims, T, S, D, CAUSAL, BIAS_KIND, ROW_BIAS, DOT_PRECISION
            )
            high = key >> shift  # two shifts: the prefix's bits above this digit (none at level 0)
            match = valid & ((high >> 4) == ((prefix >> shift) >> 4)[:, None])
            digit = high & 15
            if WIDE:  # one (rows, keys, digits) comparison: few operations, for the interpreter
                wide = match[:, :, None] & (digit[:, :, None] >= digits[None, None, :])
                at_least += tl.sum(wide.to(tl.int32), 1)
            else:  # a (rows, keys) count a digit value: the registers of a compiled tile
                for v in tl.static_range(0, 16):
                    count = tl.sum((match & (digit >= v)).to(tl.int32), 1)
                    at_least += tl.where(digits[None, :] == v, count[:, None], 0)
        if level == 0:  # every valid key matches the empty prefix
            n = tl.sum(tl.where(digits[None, :] == 0, at_least, 0), 1).to(tl.int64)
            k = (n * NUM + DEN - 1) // DEN  # ceil(p n) in integers: exact for the decimal p = NUM / DEN
            if HAS_SAMPLES:  # other samples lose nothing: no region
                k = tl.where(chosen_sample, k, 0)
        need = k - above  # of this prefix's keys, the need-th largest is the threshold
        chosen = tl.maximum(tl.sum((at_least >= need[:, None]).to(tl.int32), 1) - 1, 0)
        above += tl.sum(tl.where(digits[None, :] == chosen[:, None] + 1, at_least, 0), 1).to(tl.int64)
        prefix = prefix | (chosen.to(tl.uint32) << shift)
    ranked = (k > 0) & (k <= n)
    take = tl.where(ranked, k - above, 0)  # ties taken, lowest key first
    seen = tl.zeros([BLOCK_M], tl.int64)
    last_tie = tl.full([BLOCK_M], -1, tl.int32)
    lowest_score = tl.full([BLOCK_M], float("inf"), tl.float32)
    lowest = tl.full([BLOCK_M], -1, tl.int32)
    for start_n in range(0, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        valid, score, key = _score_tile(
            attr, AV, BIAS, b, kv, rows, keys, dims, T, S, D, CAUSAL, BIAS_KIND, ROW_BIAS, DOT_PRECISION
        )
        tied = valid & (key == prefix[:, None])
        order = tl.cumsum(tied.to(tl.int64), 1) + seen[:, None]
        last_tie = tl.maximum(last_tie, tl.max(tl.where(tied & (order == take[:, None]), keys[None, :], -1), 1))
        seen += tl.sum(tied.to(tl.int64), 1)
        candidate = tl.where(valid, score, float("inf"))  # valid scores are finite: -1 stays without one
        tile_lowest = tl.min(candidate, 1)
        tile_key = tl.min(tl.where(valid & (candidate == tile_lowest[:, None]), keys[None, :], _LAST_KEY), 1)
        lower = tile_lowest < lowest_score  # strictly: an earlier key keeps an equal score
        lowest, lowest_score = tl.where(lower, tile_key, lowest), tl.where(lower, tile_lowest, lowest_score)
    bits = tl.where((prefix >> 31) != 0, prefix & 0x7FFFFFFF, prefix ^ 0xFFFFFFFF)
    threshold = tl.where(ranked, bits.to(tl.float32, bitcast=True), tl.where(k > 0, float("-inf"), float("inf")))
    at, kept = bh * T + rows, rows < T
    tl.store(THRESHOLD + at, threshold, mask=kept)
    tl.store(LAST_TIE + at, last_tie, mask=kept)
    tl.store(LOWEST + at, lowest, mask=kept)


def region_state_streamed(attribution, values, key_bias, causal: bool, numerator: int, denominator: int,
                          samples=None, *, wide: Optional[bool] = None):  # fmt: skip
    """(threshold (B, H, T) float32, last_tie (B, H, T) int32, lowest_key (B, H, T) int32) of AD-DROP's
    region over the scores dO V^T of ``attribution`` (B, H, T, d) and ``values`` (B, H_kv, S, d) (H_kv
    dividing H; head h reads value head h // (H / H_kv)): bit for bit ``fused_edit.region_state`` over
    ``fused_edit.attribution_scores(attribution, values)``, for any S, in one launch and no host read,
    without the (B, H, T, S) map (module doc). Per row, the k = ceil(p n) largest of its n valid keys
    (p = numerator / denominator exactly); the threshold their k-th largest (+inf where k = 0), ties
    taken lowest key first up to ``last_tie`` (-1: none), and the valid key of lowest score (first of
    equals; -1 in a row with no valid key). ``key_bias``: None, or a float (padding at or below -1e4) or
    bool (True = may attend) bias of one key row, (B, S) or (B, 1, 1, S), or a row per query (B, 1, T, S);
    ``causal``: key j valid for query i when j <= i + S - T; ``samples`` (B,) bool: other samples get k = 0. ``wide``: count a level's digits in one
    (rows, keys, 16) comparison (the interpreter's default: fewer operations) or digit by digit (compiled:
    a tile's registers); the same answer."""
    b, h, t, d = attribution.shape
    s = values.shape[2]
    if h % values.shape[1] or values.shape[0] != b or values.shape[3] != d:
        raise ValueError(f"attribution {tuple(attribution.shape)} cannot read values {tuple(values.shape)}")
    if s * numerator + denominator >= 2**63 or numerator < 0 or denominator <= 0:
        raise ValueError(f"ceil(p n) for p = {numerator} / {denominator} and {s} keys overflows 64-bit integers")
    device = attribution.device
    threshold = torch.empty((b, h, t), dtype=torch.float32, device=device)
    last_tie, lowest = (torch.empty((b, h, t), dtype=torch.int32, device=device) for _ in range(2))
    if not threshold.numel():
        return threshold, last_tie, lowest
    attribution, values = fused_edit.attribution_operands(attribution, values)
    bias, row_bias = _kernel_bias(key_bias, b, t, s)
    kind = _bias_kind(bias)
    block, block_d = _grid_sizes(attribution)
    wide = bool(triton.knobs.runtime.interpret) if wide is None else bool(wide)
    grid = (triton.cdiv(t, block), b * h)
    _select_kernel[grid](
        attribution, values, values if bias is None else bias, values if samples is None else samples.contiguous(), threshold,
        last_tie, lowest, t, s, h, h // values.shape[1], d, numerator, denominator, CAUSAL=bool(causal),
        BIAS_KIND=kind, ROW_BIAS=row_bias, HAS_SAMPLES=samples is not None, WIDE=wide, DOT_PRECISION=fused_edit.dot_precision(), BLOCK_M=block, BLOCK_N=block,
        BLOCK_D=block_d, num_warps=NUM_WARPS,
    )  # fmt: skip
    return threshold, last_tie, lowest


__all__ = ("region_state_streamed",)
