"""What an attention mask means, in every form the kernel meets: a model's bias (bool or additive)
and the validity it implies, causal attention's mask made per block of rows, the finite fill that
never overflows to NaN, additive score masks, the explicit softmax weights, rows zeroed, and drops
packed as bits.

Shapes follow the attention scores: ``(B, H, T, S)`` = batch, heads, queries, keys. ``valid`` is a
boolean tensor broadcastable to that shape which is True where a query may attend to a key (a real,
non-padding key and, in causal attention, not a future one).
"""

from __future__ import annotations

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


def may_hold_true(flags: torch.Tensor) -> bool:
    """Whether ``flags`` may hold a True, so that the edit it guards must run. Looked at on a CPU,
    where the read is cheaper than the edit it spares; assumed on an accelerator, where the read
    would synchronise the stream, and while compiling, where it would break the graph."""
    if not on_host(flags):
        return True
    return bool(flags.any())


def finite_bias(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bias as an additive float tensor of ``dtype`` whose disallowed scores are a finite fill: a bool
    bias (True = may attend) becomes 0 or the fill, a float one is clamped to it (-inf included), so a
    padding bias plus a drop mask never overflows to NaN in half precision."""
    fill = mask_fill_value(dtype)
    if bias.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=bias.device).masked_fill(~bias, fill)
    return bias.to(dtype).clamp(min=fill)


def block_bias(bias_rows: Optional[torch.Tensor], dtype: torch.dtype, valid: Optional[torch.Tensor] = None):
    """A block's additive bias (finite fill where disallowed) and validity, from its rows of the bias
    (``valid``: their validity, when already known)."""
    if bias_rows is None:
        return None, None
    if valid is None:
        valid = valid_keys_from_bias(bias_rows)
    if bias_rows.dtype == torch.bool and not may_hold_true(~bias_rows):
        return None, valid  # nothing to add (no padding in the block): the drops are the mask
    return finite_bias(bias_rows, dtype), valid


# -- Each row's threshold and region (TopRegionRule's selection) --------------------------------
def as_bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as uint8 0/1, to sum or take minima in a narrow dtype: a view in eager, a cast
    while compiling, since Inductor cannot lower a bool->uint8 view (on CUDA, torch 2.11: "torch.bool
    is not supported by torch.iinfo")."""
    return mask.to(torch.uint8) if torch.compiler.is_compiling() else mask.view(torch.uint8)


def additive_mask(drop: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Turn a boolean drop mask into an additive score mask of ``dtype`` (0 kept, very negative dropped)."""
    # drop * fill: exact (fill is a power-of-two multiple of the dtype's minimum), and one
    # pass over the tensor instead of torch.where's broadcast of two scalars. Cast from bytes: a
    # CPU casts uint8 to float ~3x faster than bool. On a device one launch, not a cast and a
    # multiply: the bool times a 0-d fill of ``dtype`` (a host scalar there) is ``dtype``, the same bits.
    if not on_host(drop):
        return drop * torch.tensor(mask_fill_value(dtype), dtype=dtype)
    return as_bytes(drop).to(dtype).mul_(mask_fill_value(dtype))


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
    return flagged(~valid.any(dim=-1, keepdim=True))


def flagged(flags: torch.Tensor) -> Optional[torch.Tensor]:
    """``flags``, or None where they hold no True (looked at on a CPU only: :func:`may_hold_true`)."""
    return flags if may_hold_true(flags) else None


def zero_rows(x: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """``x`` with the rows flagged in ``rows`` (bool, broadcastable, or None: none) set to 0: a query
    made 0 attends uniformly, an output row with no valid key gives 0 and sends back no gradient."""
    return x if rows is None else x.masked_fill(rows, 0.0)


def broadcast_count(mask: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
    """The number of True entries of ``mask`` broadcast to ``shape``, without materialising it: a
    mask shared by heads (or rows) counts once in each. (count_nonzero: a third faster than a sum.)"""
    count = mask.count_nonzero()
    factor = math.prod(shape) // max(1, mask.numel())
    return count if factor == 1 else count * factor


def broadcast_counts(part: torch.Tensor, whole: torch.Tensor, shape: Tuple[int, ...]) -> Tuple[torch.Tensor, ...]:
    """:func:`broadcast_count` of ``part`` and of ``whole``, which broadcasts to ``part``'s shape. On a
    device both in one reduction (two or three launches, not three or four: a launch, not the bytes,
    sets a small step's time there); on a CPU each where it lies, without the stacked copy."""
    if on_host(whole) or torch.broadcast_shapes(part.shape, whole.shape) != part.shape:
        return broadcast_count(part, shape), broadcast_count(whole, shape)
    counts = torch.stack((part, whole.expand(part.shape))).flatten(1).count_nonzero(-1)
    factor = math.prod(shape) // max(1, part.numel())
    counts = counts if factor == 1 else counts * factor
    return counts[0], counts[1]


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
