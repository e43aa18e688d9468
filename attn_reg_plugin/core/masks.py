"""Attention masks: each row's exact threshold for AD-DROP's candidate region (the k-th largest score,
and the keys at or above it, ties lowest key first), Bernoulli(q) drops and additive score masks.

Shapes follow the attention scores: ``(B, H, T, S)`` = batch, heads, queries, keys.
``valid`` is a boolean tensor broadcastable to that shape which is True where a query may
attend to a key (a real, non-padding key and, in causal attention, not a future one).
Everything here is vectorised over whole tensors: no loop over heads or rows.
"""

from __future__ import annotations

import fractions
import math
from typing import Optional, Tuple

import torch

from .devices import on_host

try:  # torch's CPU wheels come with numpy, but do not require it
    import numpy as _numpy
except ImportError:  # pragma: no cover
    _numpy = None


def mask_fill_value(dtype: torch.dtype) -> float:
    """A finite, very negative score for ``dtype``.

    A quarter of the dtype's most negative value: adding two such masks (e.g. a padding mask and a
    drop mask) still stays finite, so no mask ever turns a score into ``-inf`` by overflow,
    and ``exp`` of it underflows to exactly 0 after softmax's max-subtraction.
    """
    if not dtype.is_floating_point:
        raise TypeError(f"mask_fill_value needs a floating dtype, got {dtype}")
    return torch.finfo(dtype).min / 4


# A bias at or below this counts as "masked": fairseq masks with -inf, -1e8 or (fp16) -1e4,
# transformers with the dtype's minimum; no real score bias comes near it.
MASKED_BIAS = -1e4


def valid_keys_from_bias(bias: torch.Tensor) -> torch.Tensor:
    """Which (query, key) pairs an attention bias allows.

    Accepts a boolean "allowed" mask (returned as is) or an additive float bias in which
    disallowed positions hold ``-inf`` or a very negative finite value (fairseq and
    transformers both use one of these conventions, see ``MASKED_BIAS``).
    """
    if bias.dtype == torch.bool:
        return bias
    return bias > MASKED_BIAS


def causal_allowed(rows: slice, keys: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """(1, 1, rows, keys) bool: True where query ``i`` of ``rows`` may attend key ``j`` under causal
    attention, ``j <= i + kv_len - q_len`` (queries aligned to the last keys, as with a cache; sdpa's
    ``is_causal`` when ``q_len == kv_len``). Built for the rows asked for only: a block's, not (T, S)."""
    last = torch.arange(rows.start, rows.stop, device=device)[:, None] + (kv_len - q_len)
    return (last >= torch.arange(keys, device=device)[None, :]).view(1, 1, rows.stop - rows.start, keys)


def causal_key_span(rows: slice, q_len: int, kv_len: int) -> int:
    """Keys ``0 .. n - 1`` hold every key that causal ``rows`` may attend (at least one key)."""
    return max(1, min(kv_len, rows.stop + kv_len - q_len))


def causal_bias(bias: Optional[torch.Tensor], rows: slice, keys: int, q_len: int, kv_len: int, device):
    """``bias`` (the call's ``rows`` over keys ``0 .. keys - 1``; bool: True = may attend, or additive
    float; None: everything allowed) disallowing also the keys causal attention does not allow
    (:func:`causal_allowed`), in the bias's own convention."""
    allowed = causal_allowed(rows, keys, q_len, kv_len, device)
    if bias is None:
        return allowed
    if bias.dtype == torch.bool:
        return bias & allowed
    return bias.masked_fill(~allowed, float("-inf"))


# A decimal with at most this many places has a denominator dividing 10**18 < 2**62,
# which keeps every intermediate of :func:`ceil_of_product` below 2**63.
MAX_DECIMAL_PLACES = 18


def decimal_fraction(p: float) -> Tuple[int, int]:
    """``p`` as the decimal it is written as, ``(numerator, denominator)`` in lowest terms: 0.2 ->
    (1, 5), 0.2000000001 -> (2000000001, 10000000000). Python's ``repr`` is the shortest decimal
    that reads back as the same float, so this is the value the user typed, not the binary
    float's expansion (0.2 as a float is 0.2000000000000000111…, whose ceil(10 p) would be 3)."""
    value = fractions.Fraction(repr(float(p)))
    if value.denominator > 10**MAX_DECIMAL_PLACES:
        raise ValueError(
            f"p = {p!r} has more than {MAX_DECIMAL_PLACES} decimal places; "
            "the candidate count ceil(p * n) is computed exactly for decimals up to that"
        )
    return value.numerator, value.denominator


def ceil_of_product(n: torch.Tensor, numerator: int, denominator: int, n_max: int) -> torch.Tensor:
    """``ceil(n * numerator / denominator)`` exactly, for an integer tensor ``0 <= n <= n_max`` and
    ``0 <= numerator <= denominator <= 10**18`` (in integers: no float rounding, no tolerance)."""
    n = n.long()
    if n_max * numerator + denominator < 2**63:  # the usual case (p with a few decimals)
        return torch.div(n * numerator + (denominator - 1), denominator, rounding_mode="floor")
    # Long multiplication over n's bits, reducing modulo the denominator at every step, so that
    # no intermediate exceeds 2 * denominator < 2**63: quotient * den + remainder = n * num so far.
    quotient, remainder = torch.zeros_like(n), torch.zeros_like(n)
    for bit in reversed(range(max(n_max, 1).bit_length())):
        quotient, remainder = quotient * 2, remainder * 2
        for addend in (None, ((n >> bit) & 1) * numerator):
            if addend is not None:
                remainder = remainder + addend
            carry = remainder >= denominator
            quotient, remainder = quotient + carry, remainder - carry * denominator
    return quotient + (remainder > 0)


def may_hold_true(flags: torch.Tensor) -> bool:
    """Whether ``flags`` may hold a True, so that the edit it guards must run. Looked at on a CPU,
    where the read is cheaper than the edit it spares; assumed on an accelerator, where the read
    would synchronise the stream, and while compiling, where it would break the graph."""
    if not on_host(flags):
        return True
    return bool(flags.any())


def all_last(mask: torch.Tensor) -> torch.Tensor:
    """``mask.all(-1, keepdim=True)``; on a CPU as the byte minimum, which is vectorised where the
    boolean reduction is not (about 5x faster). Inductor cannot lower a bool->uint8 view, and off
    the CPU the plain reduction is as fast."""
    if mask.shape[-1] == 0 or not on_host(mask):
        return mask.all(-1, keepdim=True)
    return mask.view(torch.uint8).amin(-1, keepdim=True).bool()


def uniform_instead_of_empty(
    drop: torch.Tensor, valid: torch.Tensor, uniform: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(drop, uniform rows) where a row that would lose every valid key attends uniformly to them
    instead (AttendOut Eq. 4): softmax over an all-masked row is NaN or padding-weighted otherwise."""
    emptied = all_last(drop | ~valid) & valid.any(-1, keepdim=True)
    if may_hold_true(emptied):
        drop = drop & ~emptied
        uniform = emptied if uniform is None else (uniform | emptied)
    return drop, uniform


def keep_one_valid_key(
    drop: torch.Tensor, valid: torch.Tensor, attribution: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Un-drop one key in every row that would otherwise lose all its valid keys.

    The key kept is the valid key of lowest attribution (the least important one, so the
    regularizer's intent is kept as far as possible); without attribution, the first valid key.
    Rows with no valid key at all (fully padded queries) are left alone.
    """
    drop = drop & valid
    n_valid = valid.sum(-1, keepdim=True)  # before broadcasting (see block_rules.candidate_region)
    emptied = (drop.sum(-1, keepdim=True) == n_valid) & (n_valid > 0)
    if not may_hold_true(emptied):  # emptied rows are rare: the search below is spared
        return drop
    if attribution is None:
        rank_source = torch.arange(drop.shape[-1], device=drop.device, dtype=torch.float32)
    else:
        rank_source = attribution.float().nan_to_num(0.0)
    lowest = torch.where(valid, rank_source, float("inf")).argmin(dim=-1, keepdim=True)
    restore = torch.zeros_like(drop).scatter_(-1, lowest.expand(emptied.shape), emptied)
    return drop & ~restore


def broadcast_count(mask: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
    """The number of True entries of ``mask`` broadcast to ``shape``, without materialising it: a
    mask shared by heads (or rows) counts once in each. (count_nonzero: a third faster than a sum.)"""
    return mask.count_nonzero() * (math.prod(shape) // max(1, mask.numel()))


def attention_weights(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax over the keys in at least float32 (half-precision exponentials lose the small weights),
    then in ``dtype``: the weights a model in ``dtype`` computes, for the kernel's explicit path and
    for AA's weights recomputed per block alike."""
    half = scores.dtype in (torch.float16, torch.bfloat16)
    return torch.softmax(scores.float() if half else scores, dim=-1).to(dtype)


def explicit_weights(q: torch.Tensor, k: torch.Tensor, bias: Optional[torch.Tensor], scale: Optional[float]):
    """softmax(q k^T scale + bias) in q's dtype (:func:`attention_weights`), ``scale`` None: sdpa's
    1 / sqrt(d): the kernel's explicit path, where the map itself is wanted or the weights are dropped
    by keyed coins."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    return attention_weights(scores if bias is None else scores + bias, q.dtype)


def keyless_rows(bias: Optional[torch.Tensor], valid: torch.Tensor) -> Optional[torch.Tensor]:
    """(…, T, 1) True for query rows with no valid key (a padding query under left-padded causal
    attention); None when there are none (looked at on a CPU, :func:`may_hold_true`), or no bias.

    Such a row attends to nothing: its output is 0, as stock sdpa gives with a boolean mask. With
    the finite fill instead, softmax would spread it over padding keys, and torch's fused CPU
    backward gets those rows' gradients wrong (it differs from the math backend by O(1)); zeroed
    rows send no gradient back, so both backends agree with the explicit softmax path.
    """
    if bias is None:
        return None
    rows = ~valid.any(dim=-1, keepdim=True)
    return rows if may_hold_true(rows) else None


def zero_rows(x: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """``x`` with the rows flagged in ``rows`` (bool, broadcastable, or None: none) set to 0: a query
    made 0 attends uniformly, an output row with no valid key gives 0 and sends back no gradient."""
    return x if rows is None else x.masked_fill(rows, 0.0)


def finite_bias(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bias as an additive float tensor of ``dtype`` whose disallowed scores are a finite fill: a bool
    bias (True = may attend) becomes 0 or the fill, a float one is clamped to it (-inf included), so a
    padding bias plus a drop mask never overflows to NaN in half precision."""
    fill = mask_fill_value(dtype)
    if bias.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=bias.device).masked_fill(~bias, fill)
    return bias.to(dtype).clamp(min=fill)


def additive_mask(drop: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Turn a boolean drop mask into an additive score mask of ``dtype`` (0 kept, very negative dropped)."""
    # drop * fill: exact (fill is a power-of-two multiple of the dtype's minimum), and one
    # pass over the tensor instead of torch.where's broadcast of two scalars. Cast from bytes: a
    # CPU casts uint8 to float ~3x faster than bool.
    return as_bytes(drop).to(dtype).mul_(mask_fill_value(dtype))


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool ``(..., n)`` as uint8 ``(..., ceil(n / 8))``: bit i of byte j is ``mask[..., 8 j + i]``.

    On a CPU numpy's ``packbits`` (about 17x faster than the shifts below on a (1, 12, 64, 2,048)
    block); elsewhere shifts and ors on 64-bit words, an eighth as many as the mask has elements (no
    multiply, so no overflow). The bytes are the same either way. Its bytes are taken as they are:
    0 or 1, as every torch operation makes a bool tensor (a bool viewed from other bytes is not one)."""
    n = mask.shape[-1]
    if _numpy is not None and on_host(mask) and n > 0:
        # Cloned into torch's allocator, which memory measurements (and its caching) see.
        return torch.from_numpy(_numpy.packbits(mask.detach().numpy(), axis=-1, bitorder="little")).clone()
    if n % 8 or n == 0:
        mask = torch.cat([mask, mask.new_zeros(mask.shape[:-1] + (8 - n % 8,))], dim=-1)
    elif not mask.is_contiguous() or mask.storage_offset() % 8:
        mask = mask.clone(memory_format=torch.contiguous_format)  # 64-bit words must start aligned
    words = mask.view(torch.uint8).view(torch.int64)  # byte i of a word: element i (0 or 1)
    words = words | (words >> 7)  # byte i: elements i, i + 1 in bits 0, 1
    words = words | (words >> 14)  # bits 0-3: elements i .. i + 3
    words = words | (words >> 28)  # byte 0: the word's eight elements
    return (words & 0xFF).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The bool ``(..., n)`` that :func:`pack_bits` packed (numpy's ``unpackbits`` on a CPU)."""
    if _numpy is not None and on_host(packed) and n > 0:
        bits = _numpy.unpackbits(packed.numpy(), axis=-1, count=n, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool).clone()
    words = packed.to(torch.int64)
    words = (words | (words << 28)) & 0x0000000F0000000F  # bits 4-7 to the upper half
    words = (words | (words << 14)) & 0x0003000300030003
    words = (words | (words << 7)) & 0x0101010101010101  # bit i in byte i
    return words.view(torch.uint8).view(torch.bool)[..., :n]


# -- Each row's threshold and region (TopRegionRule's selection) --------------------------------
def as_bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as uint8 0/1, to sum or take minima in a narrow dtype: a view in eager, a cast
    while compiling, since Inductor cannot lower a bool->uint8 view (on CUDA, torch 2.11: "torch.bool
    is not supported by torch.iinfo")."""
    return mask.to(torch.uint8) if torch.compiler.is_compiling() else mask.view(torch.uint8)


def kth_largest(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Each row's k-th largest score, (..., 1); ``k`` (..., 1) per row, at least 1 where it matters
    (a row with k = 0 gets its largest). On a CPU, numpy's selection on the values alone, one
    partition per group of rows sharing k: for 128 rows of 4,096 keys and one k, 0.65 ms against
    torch.topk's 4.4 ms; for a causal block (20 values of k over 256 rows) 0.70 ms against 5.0 ms
    for one partition at every k. Elsewhere (another device, bfloat16, which numpy lacks), torch.topk;
    while torch.compile traces, a sort (a top-k's size would be read from k on the host)."""
    rows = scores.shape[:-1] + (1,)
    k = k.clamp(min=1, max=scores.shape[-1]).expand(rows)
    on_numpy = on_host(scores) and scores.dtype in (torch.float32, torch.float64, torch.float16)
    if torch.compiler.is_compiling():  # no host read of k: a sorted row, traced whatever k holds
        return scores.sort(dim=-1, descending=True).values.gather(-1, k - 1)
    if _numpy is not None and on_numpy:
        return _kth_largest_numpy(scores, k)
    k_top, k_least = int(k.max()), int(k.min())
    # An unsorted top-k (half the cost of a sorted one on a CPU), then each row's k-th largest
    # from the few smallest of it: rows of a block differ in k by a few (padding, causality).
    top = scores.topk(k_top, dim=-1, sorted=False).values
    if k_least == k_top:  # every row takes the same k (no padding or causality in the block)
        return top.amin(-1, keepdim=True)
    ascending = top.topk(k_top - k_least + 1, dim=-1, largest=False, sorted=True).values
    return ascending.gather(-1, k_top - k)  # the k-th largest, counted from the least


def _kth_largest_numpy(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    keys = scores.shape[-1]
    values = scores.detach().numpy().reshape(-1, keys)
    position = (keys - k).reshape(-1).numpy()  # in ascending order; invalid keys (-inf) come first
    out = _numpy.empty(position.shape, dtype=values.dtype)
    order = _numpy.argsort(position, kind="stable")
    for group in _numpy.split(order, _numpy.flatnonzero(_numpy.diff(position[order])) + 1):
        at = position[group[0]]
        part = values[group]  # a copy, partitioned in place
        part.partition(at, axis=-1)
        out[group] = part[:, at]
    return torch.from_numpy(out).view(k.shape)


def lowest_keys_first(scores, threshold, k, region, at_least) -> torch.Tensor:
    """The region when ties straddle the threshold in some row: the keys above it, then of the keys
    equal to it the lowest-indexed ones, up to k per row."""
    if at_least is None:
        at_least = as_bytes(region).sum(-1, keepdim=True, dtype=torch.int32)
    if not on_host(scores):  # no host reads on an accelerator, no data-dependent shapes in a graph
        return _ranked_by_scan(scores == threshold, region, k, at_least)
    # On a CPU, the rows where ties straddle the threshold are ranked (gathered, where they are at
    # most half of the rows: the others keep their region), by a scan or from positions.
    keys = scores.shape[-1]
    rows = scores.shape[:-1] + (1,)
    straddling = (at_least > k).expand(rows).reshape(-1)
    tied = straddling.nonzero().squeeze(1) if 2 * int(straddling.sum()) <= straddling.numel() else None

    def of_tied(x):
        x = x.expand(rows if x.shape[-1] == 1 else scores.shape).reshape(-1, x.shape[-1])
        return x if tied is None else x.index_select(0, tied)

    tied_scores, tied_threshold, tied_k = of_tied(scores), of_tied(threshold), of_tied(k)
    equal = tied_scores == tied_threshold
    # A row's scan (cumsum) costs about 5 ns a key. Where the tied keys are many (a row whose
    # attribution is 0, as a padding query's, or under a classifier's [CLS] pooling every other
    # query's in the last layer: every valid key ties), the rows are scanned; where they are few
    # (repeated tokens' values tie) they are ranked from their positions, 2.4x faster than a scan
    # on a (1, 4, 64, 4096) block of a causal LM's first layer.
    positions = equal.nonzero(as_tuple=True)
    if 16 * positions[0].numel() >= equal.numel():
        ranked = _ranked_by_scan(equal, of_tied(region), tied_k, of_tied(at_least))
    else:
        ranked = _ranked_by_position(positions, equal.shape[0], tied_scores > tied_threshold, tied_k)
    if tied is None:
        return ranked.view(scores.shape)
    out = region.clone(memory_format=torch.contiguous_format)  # the caller's region stays as it was
    out.view(-1, keys).index_copy_(0, tied, ranked)
    return out


def _ranked_by_scan(equal, region, k, at_least) -> torch.Tensor:
    """Of each row's keys equal to the threshold, the first ``k - (at_least - equal)``, by a scan."""
    take = k - (at_least - as_bytes(equal).sum(-1, keepdim=True, dtype=torch.int32))
    return (region & ~equal) | (equal & (equal.cumsum(-1, dtype=torch.int32) <= take))


def _ranked_by_position(positions, n_rows: int, above, k) -> torch.Tensor:
    """(R, S) rows: ``above`` and of the keys equal to the threshold (at ``positions``, as
    ``nonzero`` gives them) the first ``k - above``, ranked from their positions (no scan of a row)."""
    take = k - as_bytes(above).sum(-1, keepdim=True, dtype=torch.int32)
    rows, cols = positions
    counts = torch.bincount(rows, minlength=n_rows)
    rank = torch.arange(rows.numel(), device=rows.device) - (counts.cumsum(0) - counts)[rows]
    keep = rank < take.reshape(-1)[rows]
    above[rows[keep], cols[keep]] = True
    return above
