"""Regularized attention one block of query rows at a time, its drops made again, never stored.

A regularized call whose (B, H, T, S) maps exceed a block's budget runs here instead of building
dense masks: for each block of query rows, the hook's rule (:mod:`.rules`) makes the block's
drop decisions, the block's additive mask is built, sdpa runs, and all of it is dropped before the
next block. The backward (:class:`BlockwiseAttention`) makes the same decisions again, block by
block, and back-propagates through sdpa's backward (from the saved output and row log-sum-exp on a
CPU, through a recomputed block elsewhere), so autograd never saves a mask ("memory-efficient
attention", Rabe and Staats 2021, in plain PyTorch). What a call keeps beyond plain attention is
linear in length: q, k, v, the bias it was given, the output, and per query row a log-sum-exp, a
threshold and a count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from . import devices, rules
from .devices import FLASH_CPU, FLASH_CPU_BACKWARD, has_cpu_softmax_stats, on_host
from .masks import (
    additive_mask,
    as_bytes,
    block_bias,
    broadcast_counts,
    causal_bias,
    causal_key_span,
    explicit_weights,
    flagged,
    may_hold_true,
    pack_bits,
    unpack_bits,
    valid_keys_from_bias,
    zero_rows,
)
from .rules import WEIGHT_DROPOUT_STREAM, Block, BlockRule, DenseRule, all_last, keys_of, rows_of

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
    chunk = rules.CHUNK_ROWS
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
    if rule is None or isinstance(rule, DenseRule):  # a dense mask is sliced again for free
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
    # The keys not valid and the rows with none valid, made once for the rule's empty rows, the mask
    # and the rows zeroed (on a device each op is a launch, and a step of small calls is bound by them).
    invalid = None if bias_rows is None else ~valid
    keyless = None if bias_rows is None else flagged(all_last(invalid))
    if isinstance(state, KeptDrops):  # the forward's drops, unpacked: no rule evaluated again
        drop, uniform = unpack_bits(state.bits, keys), state.uniform
    else:
        drop, uniform, state = rule_drops(call, valid, rows, shape, keys, state, invalid, keyless, fresh_state)
    if drop is not None and (bias_rows is None or bias_rows.dtype == torch.bool):
        # Drops lie within the valid keys, so the mask is the fill wherever a key is dropped or not
        # valid: one cast and a scale.
        part = additive_mask(drop if bias_rows is None else drop | invalid, q_rows.dtype)
    else:
        # The additive bias of the keys the block covers only (half of a causal call's).
        part, _ = block_bias(keys_of(bias_rows, keys), q_rows.dtype, None if bias_rows is None else valid)
        if drop is not None:  # a float bias: the drops' fill added to it in place
            additive = additive_mask(drop, q_rows.dtype)
            fits = torch.broadcast_shapes(additive.shape, part.shape) == additive.shape
            part = additive.add_(part) if fits else additive + part
    return BlockMasks(keys, part, uniform, keyless, valid, drop, state)


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
    from keyed coins of their own stream (:meth:`~.rules.Block.coins`), so the backward makes
    them again from the call's dropout seed, as FlashAttention regenerates its dropout."""
    b, h = shape[:2]
    block = Block(rows, valid, (b, h, rows.stop - rows.start, keys), shape, call.dropout_seed)
    kept = 0.0 if call.dropout_p >= 1 else 1.0 / (1.0 - call.dropout_p)
    # The kept coins times the scale, torch.where(dropped, 0.0, kept)'s values in its dtype (the default):
    # on a CPU cast from bytes, about 4x faster than where; elsewhere in one op (where makes each scalar
    # a tensor first: three launches on a device).
    coins = block.kept(call.dropout_p, WEIGHT_DROPOUT_STREAM)
    if on_host(coins):
        return as_bytes(coins).to(torch.get_default_dtype()).mul_(kept)
    return coins * kept


def rule_drops(call: BlockCall, valid, rows: slice, shape, keys: int, state, invalid, keyless, fresh_state: bool):
    """(drop, rows made uniform, the rule's state) of a block, from the call's rule. ``invalid``: ~valid
    (None: every key valid); ``keyless``: the rows with no valid key (None: none)."""
    b, h, _, _ = shape
    block = Block(rows, valid, (b, h, rows.stop - rows.start, keys), shape, call.seed, invalid)
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
        drop, uniform = _uniform_instead_of_empty(drop & valid, invalid, keyless, uniform)
    return drop, uniform, state


def _uniform_instead_of_empty(drop, invalid, keyless, uniform):
    """:func:`~.rules.uniform_instead_of_empty` of drops within the valid keys, from the block's
    ``invalid`` keys and ``keyless`` rows (made once by :func:`block_masks`): a row whose valid keys are
    all dropped, and that has one, attends uniformly instead."""
    emptied = all_last(drop if invalid is None else drop | invalid)
    if keyless is not None:
        emptied = emptied > keyless  # emptied & ~keyless, in one op (bools compare as 0 < 1)
    if may_hold_true(emptied):
        drop = drop > emptied  # drop & ~emptied
        uniform = emptied if uniform is None else (uniform | emptied)
    return drop, uniform


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
    return broadcast_counts(drop & units, units, block_shape)


# -- the Function ---------------------------------------------------------------------------
# sdpa's CPU backward runs on groups of forward blocks covering at least this many rows per unit of
# head dimension (:func:`_backward_group`): at BERT-base width and 2,048 tokens, 64-row calls took
# 423 ms a layer against 300 ms at 256 rows and 229 ms for one call over all rows.
BACKWARD_ROWS_PER_DIM = 4


# -- the kernel ------------------------------------------------------------------------------------
# sdpa's own CPU kernel (devices.FLASH_CPU), called directly so that the forward can keep each row's
# log-sum-exp and the backward need not run the block's forward again (sdpa dispatches these very
# calls on a CPU, so the results are the same bits). Elsewhere the backward recomputes the block.
_FLASH_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _keeps_softmax_stats(q, k, v, bias, call: BlockCall, bias_grad: bool) -> bool:
    """Whether this call runs on sdpa's CPU kernel with the row log-sum-exp kept for the backward."""
    return (
        has_cpu_softmax_stats(q, k, v)
        and q.numel() > 0
        and k.numel() > 0  # the op divides by these sizes: an empty call (a last empty shard) takes sdpa
        and call.dropout_p == 0.0
        and not call.need_weights
        and not bias_grad
        and q.dtype in _FLASH_CPU_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[1] == k.shape[1]
    )


def _block_rows(call: BlockCall, t: int) -> List[slice]:
    """The query rows of each block of a call of ``t`` queries, in order."""
    return [slice(start, min(t, start + call.rows_per_block)) for start in range(0, t, max(1, call.rows_per_block))]


def _accumulated(dtype: torch.dtype) -> torch.dtype:
    """What sums over blocks (and sdpa's CPU row log-sum-exp) are kept in: float32, or float64's own."""
    return torch.promote_types(dtype, torch.float32)


class OneBlockKept(NamedTuple):
    """What a call of one block keeps for its backward, as autograd would keep it: its additive mask
    (None where the weights stand for it), its rows made uniform and rows with no valid key, and, on
    the explicit path, its weights and the model's attention-dropout multipliers."""

    mask: Optional[torch.Tensor] = None
    uniform: Optional[torch.Tensor] = None
    keyless: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None
    dropout_kept: Optional[torch.Tensor] = None


class _CallOutputs:
    """The forward's results, filled block by block: the output, each row's log-sum-exp (CPU
    softmax statistics), the returned map and the drop counts."""

    def __init__(self, q, v, shape, call: BlockCall, one_block: bool, keep_stats: bool):
        b, h, t, _ = shape
        self.out = None if one_block else q.new_empty((b, h, t, v.shape[-1]))  # one block's is sdpa's own
        self.lse = q.new_empty((b, h, t), dtype=_accumulated(q.dtype)) if keep_stats and not one_block else None
        self.weights = q.new_zeros(shape) if call.need_weights else None
        self.device = q.device
        # (dropped, droppable) summed over the blocks: the first block's own, no zeros added to
        self._counts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def count(self, m: BlockMasks, call: BlockCall, rows: slice, b: int, h: int) -> None:
        if call.count and m.drop is not None:
            counts = block_counts(m, call.droppable, rows, b, h)
            if self._counts is not None:
                counts = (self._counts[0] + counts[0], self._counts[1] + counts[1])
            self._counts = counts

    def counts(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(dropped, droppable) of the call; zeros where nothing was counted."""
        if self._counts is None:
            return tuple(torch.zeros((), dtype=torch.long, device=self.device) for _ in range(2))
        return self._counts


def _block_state(m: BlockMasks, one_block: bool, keep_drops: bool, kept_bits: List[torch.Tensor], shape, rows):
    """What the backward remakes a block's drops from: for one block its key span (its masks are kept
    whole, :class:`OneBlockKept`); the drops packed as bits (appended to ``kept_bits``); or the rule's
    small state."""
    if one_block:
        return m.keys
    if keep_drops and m.drop is not None:
        # Drops shared by the heads (AttendOut's, one mask per sample) are kept once, not per head.
        b, h = shape[:2]
        block_shape = (b, 1 if m.drop.shape[1] == 1 else h, rows.stop - rows.start, m.keys)
        kept_bits.append(pack_bits(m.drop.expand(block_shape)))
        return KeptDrops(None, m.keys, m.uniform)
    return m.state


def _attend_keeping_softmax_stats(q_rows, k, v, m: BlockMasks, call: BlockCall, rows, results, one_block) -> None:
    """One block on sdpa's CPU kernel, its rows' log-sum-exp kept for the backward (no recompute)."""
    o, block_lse = FLASH_CPU(
        zero_rows(q_rows, m.uniform), k[:, :, : m.keys], v[:, :, : m.keys], 0.0, False,
        attn_mask=m.mask, scale=call.scale,
    )  # fmt: skip
    if one_block:  # no copies into the call's output and statistics
        results.out, results.lse = zero_rows(o, m.keyless), block_lse
    else:
        results.out[:, :, rows], results.lse[:, :, rows] = zero_rows(o, m.keyless), block_lse


def _attend(q_rows, k, v, m: BlockMasks, call: BlockCall, rows, shape, results, one_block):
    """One block through :func:`attend_block` (sdpa, or the explicit weights under the model's attention
    dropout or when the map is returned); returns (weights, dropout multipliers) where made explicit."""
    block_out, block_weights, block_kept = attend_block(q_rows, k, v, m, call, rows, shape)
    if results.weights is not None:
        results.weights[:, :, rows, : m.keys] = block_weights
    if one_block:
        results.out = block_out
    else:
        results.out[:, :, rows] = block_out
    return block_weights, block_kept


class EditAttention(torch.autograd.Function):
    """sdpa with a regularizer's drops, every length: a short call is one block. The forward keeps
    q, k, v, the bias, the call (its seed among it) and per block what remakes its drops (a rule's
    small state, or the drops packed as bits; :func:`_block_state`); a call of one block keeps its
    masks (:class:`OneBlockKept`). The one backward regenerates each block and takes its gradients by
    the softmax's own formula (:func:`_block_gradients`), or on a CPU call that kept its rows'
    log-sum-exp, by sdpa's CPU backward (:func:`_backward_from_softmax_stats`).
    No ``torch.autograd.grad`` inside: torch.compile traces the whole Function."""

    @staticmethod
    def forward(ctx, q, k, v, bias, call: BlockCall):
        b, h, t, _ = q.shape
        shape = (b, h, t, k.shape[2])
        # One block keeps what autograd would (its mask, or weights and dropout): the backward remakes
        # nothing, faster than remaking the drops (PERFORMANCE.md, "One Function for every length").
        one_block = 0 < t <= call.rows_per_block
        keep_stats = _keeps_softmax_stats(q, k, v, bias, call, bias is not None and bias.requires_grad)
        keep_drops = keeps_drops(q, k, call.rule)
        results = _CallOutputs(q, v, shape, call, one_block, keep_stats)
        states: List[object] = []
        kept_bits: List[torch.Tensor] = []  # saved for the backward (an activation checkpoint drops them)
        one = OneBlockKept()
        # Every block reads all of k and v: once contiguous, sdpa's CPU kernel reads them faster.
        # The copies live for the call; the backward saves the originals (views the model keeps).
        k_in, v_in, k, v = k, v, k.contiguous(), v.contiguous()
        # On a device, a call of one block whose backward recomputes from its masks keeps the query as it
        # attended (rows made uniform zeroed, contiguous as its products copy it), and k contiguous where
        # the weights were kept (its one product there, dS k, copies it so): the backward then neither
        # zeroes nor copies them again (each a launch there), and its products are the same bits. The same
        # bytes where nothing else holds the model's views; the CPU keeps the views. (v, and k where the
        # scores are made again, enter the backward transposed: copied as before.)
        compact = one_block and not keep_stats and not on_host(q)
        q_kept = q
        for rows in _block_rows(call, t):
            q_rows = q[:, :, rows]
            m = block_masks(call, q_rows, rows_of(bias, rows), rows, shape, fresh_state=True)
            states.append(_block_state(m, one_block, keep_drops, kept_bits, shape, rows))
            if keep_stats:
                _attend_keeping_softmax_stats(q_rows, k, v, m, call, rows, results, one_block)
                weights, dropout_kept = None, None
            elif compact:
                q_kept = zero_rows(q_rows, m.uniform).contiguous()
                m_kept = m._replace(uniform=None)  # the rows are zeroed in q_kept already
                weights, dropout_kept = _attend(q_kept, k, v, m_kept, call, rows, shape, results, one_block)
            else:
                weights, dropout_kept = _attend(q_rows, k, v, m, call, rows, shape, results, one_block)
            if one_block:  # the weights, where made, stand for the mask in the backward
                one = OneBlockKept(m.mask if weights is None else None, m.uniform, m.keyless, weights, dropout_kept)
            results.count(m, call, rows, b, h)
        # The kept bits go through save_for_backward, not ctx: a checkpointed call's saved tensors are
        # dropped until its recompute, which makes the same bits again.
        out = results.out
        q, k = (q_kept, k if one.weights is not None else k_in) if compact else (q, k_in)
        ctx.save_for_backward(q, k, v_in, bias, out if keep_stats else None, results.lse, *one, *kept_bits)
        ctx.call, ctx.states, ctx.one_block, ctx.zeroed = call, states, one_block, compact
        dropped, droppable = results.counts()
        ctx.mark_non_differentiable(dropped, droppable)
        return out, results.weights, dropped, droppable

    @staticmethod
    def backward(ctx, grad_out, grad_weights, _dropped, _droppable):
        # The forward ran with autocast off (edit_attention), and so does the backward, wherever it is
        # taken: inside autocast (a loop that wraps its backward in it, AD-DROP's bf16 attribution
        # pass) the portable path's matmuls ran in bf16 beside a float32 softmax, and
        # _softmax_backward_data refused the mix. One dtype rule: the forward's, summed in _accumulated's.
        with torch.autocast(grad_out.device.type, enabled=False):
            return EditAttention._backward(ctx, grad_out, grad_weights)

    @staticmethod
    def _backward(ctx, grad_out, grad_weights):
        q, k, v, bias, out, lse, *rest = ctx.saved_tensors
        one, kept_bits = OneBlockKept(*rest[: len(OneBlockKept._fields)]), rest[len(OneBlockKept._fields) :]
        probs, kept = one.weights, one.dropout_kept
        call: BlockCall = ctx.call
        saved = (
            BlockMasks(ctx.states[0], one.mask, one.uniform, one.keyless, None, None, None) if ctx.one_block else None
        )
        states = _with_kept_bits(ctx.states, kept_bits)
        if lse is not None:
            grads = _backward_from_softmax_stats(
                call, states, ctx.needs_input_grad, grad_out, q, k, v, bias, out, lse, saved
            )
            return (*grads, None)
        b, h, t, _ = q.shape
        shape = (b, h, t, k.shape[2])
        # Accumulated over blocks in at least float32: half-precision partial sums would round each block.
        acc = _accumulated(q.dtype)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        bias_grad = bias is not None and ctx.needs_input_grad[3]
        if saved is not None and saved.keys == k.shape[2] and not bias_grad:  # one block: nothing to sum
            gq, gk, gv, _ = _block_gradients(
                q, k, v, saved, call, slice(0, t), shape, grad_out, grad_weights, acc, probs, kept, ctx.zeroed
            )
            return tuple(
                g.to(x.dtype) if need else None for g, x, need in ((gq, q, need_q), (gk, k, need_k), (gv, v, need_v))
            ) + (None, None)
        grad_q = torch.zeros_like(q, dtype=acc) if need_q else None
        grad_k = torch.zeros_like(k, dtype=acc)
        grad_v = torch.zeros_like(v, dtype=acc)
        grad_bias = torch.zeros_like(bias, dtype=_accumulated(bias.dtype)) if bias_grad else None
        for i, rows in enumerate(_block_rows(call, t)):
            q_rows = q[:, :, rows]
            m = saved or block_masks(call, q_rows, rows_of(bias, rows), rows, shape, states[i])
            g_weights = None if grad_weights is None else grad_weights[:, :, rows, : m.keys]
            gq, gk, gv, gs = _block_gradients(
                q_rows, k, v, m, call, rows, shape, grad_out[:, :, rows], g_weights, acc, probs, kept, ctx.zeroed
            )
            if grad_q is not None:
                grad_q[:, :, rows] = gq
            grad_k[:, :, : m.keys] += gk
            grad_v[:, :, : m.keys] += gv
            if grad_bias is not None:  # the block's rows (all of them where the bias broadcasts over rows)
                target = grad_bias if bias.shape[-2] == 1 else grad_bias[..., rows, :]
                target = target if bias.shape[-1] == 1 else target[..., : m.keys]
                target += gs.sum_to_size(target.shape)
        cast = [
            None if g is None or not need else g.to(x.dtype)
            for g, x, need in (
                (grad_q, q, need_q),
                (grad_k, k, need_k),
                (grad_v, v, need_v),
                (grad_bias, bias, bias_grad),
            )
        ]
        return (*cast, None)


def _block_gradients(
    q_rows, k, v, m, call: BlockCall, rows: slice, shape, grad_out, grad_weights, acc, probs, kept, zeroed=False
):
    """(dq, dk, dv, dscores) of one block in ``acc``, by the softmax's formula: P = softmax(q k^T s +
    mask) (``probs`` when the forward kept it, else made again from the block's masks), W = P under
    the model's attention dropout (``kept``: the forward's multipliers, else its keyed coins made
    again), O = W v; dv = W^T dO, dP = (dO v^T) under the same dropout (+ the map's own gradient when
    it was returned), dS = P (dP - rowsum(dP P)), dq = dS k s, dk = dS^T q s. Rows made uniform had
    their query zeroed (no gradient to it; ``zeroed``: the forward kept it zeroed); rows without a
    valid key gave 0."""
    scale = call.scale if call.scale is not None else q_rows.shape[-1] ** -0.5
    k, v = k[:, :, : m.keys].to(acc), v[:, :, : m.keys].to(acc)
    q_used = (q_rows if zeroed else zero_rows(q_rows, m.uniform)).to(acc)
    if probs is None:
        scores = torch.matmul(q_used, k.transpose(-2, -1)) * scale
        probs = torch.softmax(scores if m.mask is None else scores + m.mask.to(acc), dim=-1)
    probs = probs.to(acc)
    grad_out = zero_rows(grad_out, m.keyless).to(acc)
    grad_probs = torch.matmul(grad_out, v.transpose(-2, -1))
    used = probs
    if call.dropout_p > 0:
        kept = (kept if kept is not None else weight_dropout_kept(call, m.valid, rows, shape, m.keys)).to(acc)
        used = probs * kept
        grad_probs = grad_probs * kept
    if grad_weights is not None:
        grad_probs = grad_probs + zero_rows(grad_weights, m.keyless).to(acc)
    grad_v = torch.matmul(used.transpose(-2, -1), grad_out)
    grad_scores = torch.ops.aten._softmax_backward_data(grad_probs, probs, -1, probs.dtype)  # P (dP - rowsum(dP P))
    grad_q = zero_rows(torch.matmul(grad_scores, k) * scale, m.uniform)
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q_used) * scale
    return grad_q, grad_k, grad_v, grad_scores


def _with_kept_bits(states: List[object], bits: List[torch.Tensor]) -> List[object]:
    """The forward's block states with their kept drops' bits back from the saved tensors, in order."""
    bits_of = iter(bits)
    return [state._replace(bits=next(bits_of)) if isinstance(state, KeptDrops) else state for state in states]


def _backward_from_softmax_stats(call: BlockCall, states, needs_input_grad, grad_out, q, k, v, bias, out, lse, saved):
    """The backward of a call that kept its rows' log-sum-exp (a CPU's sdpa kernel): per group of
    blocks, the drops are unpacked (or made again; a call of one block kept its ``saved`` masks) and
    sdpa's CPU backward runs from the saved output, with no forward recompute."""
    k, v = k.contiguous(), v.contiguous()  # as in the forward: every block reads all of them
    b, h, t, _ = q.shape
    shape = (b, h, t, k.shape[2])
    need_q, need_k, need_v = needs_input_grad[:3]
    if saved is not None:  # one block: the op's gradients as they are, over the keys it covered
        gq, gk, gv = FLASH_CPU_BACKWARD(
            zero_rows(grad_out, saved.keyless).to(q.dtype), zero_rows(q, saved.uniform), k[:, :, : saved.keys],
            v[:, :, : saved.keys], out, lse, 0.0, False, attn_mask=saved.mask, scale=call.scale,
        )  # fmt: skip
        if saved.keys < k.shape[2]:  # keys past every valid one: no gradient
            gk, gv = (F.pad(g, (0, 0, 0, k.shape[2] - saved.keys)) for g in (gk, gv))
        return [zero_rows(gq, saved.uniform) if need_q else None, gk if need_k else None, gv if need_v else None, None]
    # Accumulated in at least float32: half-precision partial sums would round each block.
    acc = _accumulated(q.dtype)
    grad_q = torch.zeros_like(q, dtype=acc) if need_q else None
    grad_k = torch.zeros_like(k, dtype=acc) if need_k else None
    grad_v = torch.zeros_like(v, dtype=acc) if need_v else None
    blocks = len(states)
    group = _backward_group(call, q.shape[-1], states)
    for first in range(0, blocks, group):
        rows, keys, mask, uniform, keyless = _group_masks(call, q, bias, shape, states, first, group)
        q_rows, grad_rows = q[:, :, rows], grad_out[:, :, rows]
        grad_rows = zero_rows(grad_rows, keyless)  # the forward zeroed these rows: no gradient flows back
        gq, gk, gv = FLASH_CPU_BACKWARD(
            grad_rows.to(q.dtype), zero_rows(q_rows, uniform), k[:, :, :keys], v[:, :, :keys],
            out[:, :, rows], lse[:, :, rows], 0.0, False, attn_mask=mask, scale=call.scale,
        )  # fmt: skip
        if grad_q is not None:
            grad_q[:, :, rows] += zero_rows(gq, uniform)
        if grad_k is not None:
            grad_k[:, :, :keys] += gk
        if grad_v is not None:
            grad_v[:, :, :keys] += gv
    return [None if g is None else g.to(x.dtype) for g, x in ((grad_q, q), (grad_k, k), (grad_v, v))] + [None]


def _backward_group(call: BlockCall, head_dim: int, states) -> int:
    """Forward blocks per call of sdpa's CPU backward. Each call writes a (B, H, S, d) gradient of k
    and of v whatever its rows, so a group covers at least BACKWARD_ROWS_PER_DIM * d rows: that write
    is then at most a small part of the (B, H, rows, S) work. Blocks group only when their drops
    were kept (their key spans are known before any is unpacked)."""
    wanted = -(-BACKWARD_ROWS_PER_DIM * head_dim // call.rows_per_block)
    if wanted <= 1 or not all(isinstance(state, KeptDrops) for state in states):
        return 1
    return wanted


def _group_masks(call: BlockCall, q, bias, shape, states, first: int, group: int):
    """(rows, keys, additive mask, rows made uniform, rows without a valid key) of forward blocks
    ``first .. first + group - 1`` as one call, from their kept drops stacked (:func:`_stacked_drops`)."""
    b, h, t, _ = shape
    blocks = states[first : first + group]
    spans = _block_rows(call, t)[first : first + len(blocks)]
    rows = slice(spans[0].start, spans[-1].stop)
    state = blocks[0] if len(blocks) == 1 else _stacked_drops(blocks, spans, b, h, q.device)
    m = block_masks(call, q[:, :, rows], rows_of(bias, rows), rows, shape, state)
    return rows, m.keys, m.mask, m.uniform, m.keyless


def _stacked_drops(blocks: List[KeptDrops], spans, b: int, h: int, device) -> KeptDrops:
    """Consecutive blocks' kept drops as one block's: over the most keys any of them covers, no drop
    at the keys beyond a block's own (none is valid for its rows, so the mask fills them anyway)."""
    keys = max(block.keys for block in blocks)
    heads = blocks[0].bits.shape[1]  # 1 for drops shared by the heads
    bits = blocks[0].bits.new_zeros((b, heads, spans[-1].stop - spans[0].start, -(-keys // 8)))
    for block, span in zip(blocks, spans):
        bits[:, :, span.start - spans[0].start : span.stop - spans[0].start, : block.bits.shape[-1]] = block.bits
    return KeptDrops(bits, keys, _stacked_rows([block.uniform for block in blocks], spans, b, h, device))


def _stacked_rows(flags, spans, b: int, h: int, device) -> Optional[torch.Tensor]:
    """Per-row flags of consecutive blocks (each bool, broadcastable to (B, H, rows, 1), or None)
    as one (B, H, rows, 1) tensor; None when no block has any."""
    if all(f is None for f in flags):
        return None
    return torch.cat([
        torch.zeros((b, h, s.stop - s.start, 1), dtype=torch.bool, device=device)
        if f is None else f.expand(b, h, s.stop - s.start, 1)
        for f, s in zip(flags, spans)
    ], dim=2)  # fmt: skip


def edit_attention(q, k, v, bias, call: BlockCall):
    """(output (B, H, T, d), the map or None, dropped, droppable) of a regularized call.

    Under autocast the call runs in autocast's dtype, as sdpa itself would: q, k and v are cast
    here (differentiably, so their gradients come back in their own dtypes) and autocast is off
    inside. The backward turns autocast off too (``EditAttention.backward``), wherever it is taken:
    it then sees the very dtypes its forward saw."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return _fused(q, k, v, bias, call) if devices.fused_route_asked(q) else EditAttention.apply(q, k, v, bias, call)
    dtype = torch.get_autocast_dtype(device)
    q, k, v = (x.to(dtype) if x.is_floating_point() else x for x in (q, k, v))
    with torch.autocast(device, enabled=False):
        return _fused(q, k, v, bias, call) if devices.fused_route_asked(q) else EditAttention.apply(q, k, v, bias, call)


def _fused(q, k, v, bias, call: BlockCall):
    """The call on the fused Triton kernel where it covers it (:mod:`.fused_route`), else EditAttention."""
    from .fused_edit import fused_edit_attention  # Triton is imported only when asked for
    from .fused_route import fused_or_why_not, name_once

    fused, why = fused_or_why_not(q, k, v, bias, call)
    if fused is None:
        name_once(why)
        return EditAttention.apply(q, k, v, bias, call)
    out, dropped, droppable = fused_edit_attention(q, k, v, fused.drops, fused.key_bias, call.causal, call.scale)
    return out, None, dropped, droppable
