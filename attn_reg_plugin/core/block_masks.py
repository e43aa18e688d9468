"""One block of a call's query rows: how many rows a block has, the block's masks (the drops its
rule makes, or the forward kept as bits; its additive mask over the keys it covers; its validity)
and its attention through sdpa. A short call is one such block; :mod:`.blockwise` runs a long one
block by block."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from . import block_rules
from .block_rules import Block, BlockRule, block_bias, keys_of, rows_of
from .devices import on_host
from .masks import (
    additive_mask,
    broadcast_count,
    causal_bias,
    causal_key_span,
    explicit_weights,
    keyless_rows,
    uniform_instead_of_empty,
    unpack_bits,
    valid_keys_from_bias,
    zero_rows,
)

# A call whose rule is costly to evaluate again (a top-p region, coins) keeps its drops as bits for
# the backward while they take at most this many times q's bytes: linear in length, and measured
# faster than regenerating them (docs/PERFORMANCE.md). Past it the backward makes them again.
KEPT_DROPS_FACTOR = 8

# A block holds at most max(BLOCK_ELEMENTS, LINEAR_FACTOR * B*H*T*d) score-sized elements: a fixed
# floor (2**19 elements: ~12 MiB of block temporaries at ~24 bytes each) or as many as q has, so
# that a block's temporaries are a bounded multiple of what plain attention holds. (A factor of 2
# measured 1.35x plain's step memory at BERT-base width and 2,048 tokens, 1 gave 1.24x, at the same
# CPU time: the per-element work dominates, not the per-block overhead.)
BLOCK_ELEMENTS = 1 << 19
LINEAR_FACTOR = 1
# Rows of at most this many keys are one block whatever the batch (BERT-base at 128 tokens and
# batch 32, the benchmark's sizes): such a map holds at most 128 numbers per query row, linear in T.
ONE_BLOCK_KEYS = 128


def query_block_rows(batch: int, heads: int, queries: int, keys: int, head_dim: int) -> int:
    """Query rows per block for a call of this shape; ``queries`` when the call is one block."""
    if keys <= ONE_BLOCK_KEYS:
        return queries
    budget = max(BLOCK_ELEMENTS, LINEAR_FACTOR * batch * heads * queries * head_dim)
    rows = budget // max(1, batch * heads * keys)
    if rows >= queries:
        return queries
    chunk = block_rules.CHUNK_ROWS
    return max(chunk, rows // chunk * chunk)


def blockwise_rows(q: torch.Tensor, k: torch.Tensor) -> Optional[int]:
    """Rows per block when this regularized call should run blockwise, else None (one block)."""
    if torch.compiler.is_compiling() or k.shape[2] <= ONE_BLOCK_KEYS:
        return None  # a compiled region is one block (the block loop and its saved states are Python)
    b, h, t, d = q.shape
    rows = query_block_rows(b, h, t, k.shape[2], d)
    return rows if rows < t else None


@dataclass(frozen=True, eq=False)
class BlockCall:
    """Everything a blockwise call does besides q, k, v and the bias: fixed before the call."""

    rule: Optional[BlockRule]
    uniform: Optional[torch.Tensor]  # bool rows made uniform (LayerDrop flag), broadcastable
    droppable: Optional[Union[torch.Tensor, Tuple[torch.Tensor, ...]]]  # units the rate counts (EditScores.droppable)
    rows_per_block: int
    seed: Optional[torch.Tensor]  # 0-d int64 CPU, the pass's for the site; None when the rule draws nothing
    dropout_p: float
    scale: Optional[float]
    count: bool  # add dropped / droppable counts (a fresh forward; a recompute counts nothing)
    causal: bool = False  # future keys disallowed too (attend's is_causal), made per block
    # The model's attention dropout inside the call: this call's own draw (0-d int64 CPU), not the pass's
    # seed, so that a site called twice in a pass (R-Drop's two forwards) drops other weights each time.
    dropout_seed: Optional[torch.Tensor] = None
    need_weights: bool = False  # the map is returned too (the call is one block)


class KeptDrops(NamedTuple):
    """A block's drops kept for the backward: packed bits (:func:`~.masks.pack_bits`), the keys the
    block covers and its rows made uniform."""

    bits: torch.Tensor
    keys: int
    uniform: Optional[torch.Tensor]


def keeps_drops(q: torch.Tensor, k: torch.Tensor, rule: Optional[BlockRule]) -> bool:
    """Whether a call keeps its blocks' drops as bits rather than making them again in the backward."""
    if rule is None or isinstance(rule, block_rules.DenseRule):  # a dense mask is sliced again for free
        return False
    bits = math.prod(q.shape[:3]) * k.shape[2]  # one per (sample, head, query, key)
    return bits // 8 <= KEPT_DROPS_FACTOR * q.numel() * q.element_size()


class BlockMasks(NamedTuple):
    """What a block attends with: keys ``0 .. keys - 1`` of the call, the additive mask over them,
    rows made uniform, rows with no valid key, validity, the drops and the rule's state."""

    keys: int
    mask: Optional[torch.Tensor]
    uniform: Optional[torch.Tensor]
    keyless: Optional[torch.Tensor]
    valid: torch.Tensor
    drop: Optional[torch.Tensor]
    state: object


def key_span(valid: torch.Tensor, keys: int) -> int:
    """Keys ``0 .. n - 1`` hold every valid key of the block's rows: a causal block's last row, or
    the longest sequence of a padded batch. On a CPU only (the look is a host read, which on an
    accelerator would stall the stream once per block, and while compiling would break the graph);
    there it halves a causal call's work."""
    if not on_host(valid) or valid.shape[-1] != keys or not valid.numel():
        return keys  # (an empty block, no batch or no rows, has nothing to look at)
    # A max over bytes: ~12x faster than any(0) across rows on a CPU.
    seen = valid.reshape(-1, keys).view(torch.uint8).amax(0).nonzero()
    return int(seen.max()) + 1 if seen.numel() else 1


def block_masks(call: BlockCall, q_rows, bias_rows, rows: slice, shape, state=None, fresh_state=False) -> BlockMasks:
    """A block's masks. ``bias_rows``: the block's rows of the call's bias; ``rows``: which rows of
    the call they are; ``fresh_state``: the forward's first evaluation of the rule (else ``state``)."""
    b, h, t, s = shape
    span = s
    if call.causal:  # the block's rows of the causal mask, over the keys they may attend only
        span = causal_key_span(rows, t, s)
        bias_rows = causal_bias(keys_of(bias_rows, span), rows, span, t, s, q_rows.device)
    if bias_rows is None:  # every key valid; the key dimension is kept, since rules count along it
        valid = torch.ones((1, 1, 1, span), dtype=torch.bool, device=q_rows.device)
    else:
        valid = valid_keys_from_bias(bias_rows)
    keys = state.keys if isinstance(state, KeptDrops) else key_span(valid, span)
    valid = keys_of(valid, keys)
    if isinstance(state, KeptDrops):  # the forward's drops, unpacked: no rule evaluated again
        drop, uniform = unpack_bits(state.bits, keys), state.uniform
    else:
        drop, uniform, state = rule_drops(call, valid, rows, shape, keys, state, fresh_state)
    if drop is not None and (bias_rows is None or bias_rows.dtype == torch.bool):
        # Drops lie within the valid keys, so the mask is the fill wherever a key is dropped or not
        # valid: one cast and a scale.
        part = additive_mask(drop if bias_rows is None else drop | ~valid, q_rows.dtype)
    else:
        # The additive bias of the keys the block covers only (half of a causal call's).
        part, _ = block_bias(keys_of(bias_rows, keys), q_rows.dtype, None if bias_rows is None else valid)
        if drop is not None:  # a float bias: the drops' fill added to it in place
            additive = additive_mask(drop, q_rows.dtype)
            fits = torch.broadcast_shapes(additive.shape, part.shape) == additive.shape
            part = additive.add_(part) if fits else additive + part
    return BlockMasks(keys, part, uniform, keyless_rows(bias_rows, valid), valid, drop, state)


def attend_block(q_rows, k, v, m: BlockMasks, call: BlockCall, rows: slice, shape):
    """(output, the block's weights and the dropout's multipliers where made explicit) of one block (query ``rows`` of a call whose
    maps are ``shape``) over its masks ``m`` and the call's keys ``0 .. m.keys - 1``, as the kernel's
    ordinary path: a zero query row is uniform over its valid keys, and a row with no valid key gives 0
    (and so sends back no gradient). sdpa, or with the model's attention dropout or the map returned the
    explicit weights, their drops keyed by the call's dropout seed (sdpa takes no mask of drops, and its own
    would come from the global stream, which no block could regenerate)."""
    k, v = k[:, :, : m.keys], v[:, :, : m.keys]
    q_rows = zero_rows(q_rows, m.uniform)
    if call.dropout_p == 0 and not call.need_weights:
        out = F.scaled_dot_product_attention(q_rows, k, v, attn_mask=m.mask, scale=call.scale)
        return zero_rows(out, m.keyless), None, None
    weights = zero_rows(explicit_weights(q_rows, k, m.mask, call.scale), m.keyless)
    if call.dropout_p == 0:
        return torch.matmul(weights, v), weights, None
    kept = weight_dropout_kept(call, m.valid, rows, shape, m.keys).to(weights.dtype)
    return torch.matmul(weights * kept, v), weights, kept


def weight_dropout_kept(call: BlockCall, valid, rows: slice, shape, keys: int) -> torch.Tensor:
    """The model's attention dropout inside a regularized call, for query ``rows`` over keys
    ``0 .. keys - 1``: 0 where a weight is dropped, 1 / (1 - p) where kept (as ``F.dropout`` scales),
    from keyed coins of their own stream (:meth:`~.block_rules.Block.coins`), so the backward makes
    them again from the call's dropout seed, as FlashAttention regenerates its dropout."""
    b, h = shape[:2]
    block = Block(rows, valid, (b, h, rows.stop - rows.start, keys), shape, call.dropout_seed)
    kept = 0.0 if call.dropout_p >= 1 else 1.0 / (1.0 - call.dropout_p)
    dropped = block.coins(call.dropout_p, block_rules.WEIGHT_DROPOUT_STREAM)
    return torch.where(dropped, 0.0, kept)


def rule_drops(call: BlockCall, valid, rows: slice, shape, keys: int, state, fresh_state: bool):
    """(drop, rows made uniform, the rule's state) of a block, from the call's rule."""
    b, h, _, _ = shape
    block = Block(rows, valid, (b, h, rows.stop - rows.start, keys), shape, call.seed)
    drop = None
    if call.rule is not None:
        if fresh_state:
            drop, state = call.rule.forward_drops(block)
        else:
            drop = call.rule.backward_drops(block, state)
    uniform = call.uniform
    if uniform is not None and uniform.dim() >= 2:
        uniform = rows_of(uniform, rows)
    if drop is not None and not call.rule.keeps_rows:
        drop, uniform = uniform_instead_of_empty(drop & valid, valid, uniform)
    return drop, uniform, state


def block_counts(m: BlockMasks, droppable, rows: slice, b: int, h: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dropped, droppable) units of a block of a (``b``, ``h``, ...) call: drops within the units the
    edit could drop, and those units among the valid ones (``droppable``: a bool tensor or a tuple of
    them, whose AND the units are; None: every valid unit). A
    row the drops emptied attends uniformly instead (its drops cleared): its valid keys count as
    dropped, so a rate of 1 is counted as 1."""
    block_shape = (b, h, rows.stop - rows.start, m.keys)
    drop = m.drop if m.uniform is None else m.drop | m.uniform
    units = m.valid
    for part in () if droppable is None else droppable if isinstance(droppable, tuple) else (droppable,):
        units = units & keys_of(rows_of(part, rows), m.keys).to(m.valid.device)
    return broadcast_count(drop & units, block_shape), broadcast_count(units, block_shape)


__all__: Sequence[str] = (
    "BlockCall", "BlockMasks", "KeptDrops", "attend_block", "block_counts", "block_masks", "blockwise_rows",
    "keeps_drops", "query_block_rows", "weight_dropout_kept",
)  # fmt: skip
