"""Regularized attention one block of query rows at a time, its drops made again, never stored.

A regularized call whose (B, H, T, S) maps exceed a block's budget runs here instead of building
dense masks: for each block of query rows, the hook's rule (:mod:`.block_rules`) makes the block's
drop decisions, the block's additive mask is built, sdpa runs, and all of it is dropped before the
next block. The backward (:class:`BlockwiseAttention`) makes the same decisions again, block by
block, and back-propagates through sdpa's backward (from the saved output and row log-sum-exp on a
CPU, through a recomputed block elsewhere), so autograd never saves a mask ("memory-efficient
attention", Rabe and Staats 2021, in plain PyTorch). What a call keeps beyond plain attention is
linear in length: q, k, v, the bias it was given, the output, and per query row a log-sum-exp, a
threshold and a count.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from .block_masks import (
    BlockCall,
    BlockMasks,
    KeptDrops,
    attend_block,
    block_counts,
    block_masks,
    keeps_drops,
    weight_dropout_kept,
)
from .block_rules import rows_of
from .devices import FLASH_CPU, FLASH_CPU_BACKWARD, has_cpu_softmax_stats
from .masks import pack_bits, zero_rows

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


class EditAttention(torch.autograd.Function):
    """sdpa with a regularizer's drops, every length: a short call is one block. The forward keeps
    q, k, v, the bias, the call (its seed among it) and per block what remakes its drops (a rule's
    small state, or the drops packed as bits); the one backward regenerates each block and takes
    its gradients by the softmax's own formula (:func:`_block_gradients`), or on a CPU call that
    kept its rows' log-sum-exp, by sdpa's CPU backward (:func:`_backward_from_softmax_stats`).
    No ``torch.autograd.grad`` inside: torch.compile traces the whole Function."""

    @staticmethod
    def forward(ctx, q, k, v, bias, call: BlockCall):
        b, h, t, _ = q.shape
        shape = (b, h, t, k.shape[2])
        # One block keeps what autograd would (its mask, or weights and dropout): the backward remakes
        # nothing, faster than remaking the drops (PERFORMANCE.md, "One Function for every length").
        one_block = 0 < t <= call.rows_per_block
        out = None if one_block else q.new_empty((b, h, t, v.shape[-1]))  # one block's is sdpa's own
        weights = q.new_zeros(shape) if call.need_weights else None
        dropped, droppable = (torch.zeros((), dtype=torch.long, device=q.device) for _ in range(2))
        states: List[object] = []
        kept_bits: List[torch.Tensor] = []  # saved for the backward (an activation checkpoint drops them)
        keep_stats = _keeps_softmax_stats(q, k, v, bias, call, bias is not None and bias.requires_grad)
        keep_drops = keeps_drops(q, k, call.rule)
        # Every block reads all of k and v: once contiguous, sdpa's CPU kernel reads them faster.
        # The copies live for the call; the backward saves the originals (views the model keeps).
        k_in, v_in, k, v = k, v, k.contiguous(), v.contiguous()
        lse = q.new_empty((b, h, t), dtype=_accumulated(q.dtype)) if keep_stats and not one_block else None
        kept_block: List[Optional[torch.Tensor]] = [None] * 5
        for rows in _block_rows(call, t):
            q_rows = q[:, :, rows]
            m = block_masks(call, q_rows, rows_of(bias, rows), rows, shape, fresh_state=True)
            if one_block:
                states.append(m.keys)
                kept_block[:3] = m.mask, m.uniform, m.keyless
            elif keep_drops and m.drop is not None:
                # Drops shared by the heads (AttendOut's, one mask per sample) are kept once, not per head.
                block_shape = (b, 1 if m.drop.shape[1] == 1 else h, rows.stop - rows.start, m.keys)
                kept_bits.append(pack_bits(m.drop.expand(block_shape)))
                states.append(KeptDrops(None, m.keys, m.uniform))
            else:
                states.append(m.state)
            if keep_stats:
                o, block_lse = FLASH_CPU(
                    zero_rows(q_rows, m.uniform), k[:, :, : m.keys], v[:, :, : m.keys], 0.0, False,
                    attn_mask=m.mask, scale=call.scale,
                )  # fmt: skip
                if one_block:  # no copies into the call's output and statistics
                    out, lse = zero_rows(o, m.keyless), block_lse
                else:
                    out[:, :, rows], lse[:, :, rows] = zero_rows(o, m.keyless), block_lse
            else:
                block_out, block_weights, block_kept = attend_block(q_rows, k, v, m, call, rows, shape)
                if weights is not None:
                    weights[:, :, rows, : m.keys] = block_weights
                if one_block:
                    out, kept_block[3:] = block_out, (block_weights, block_kept)
                    if block_weights is not None:  # the weights stand for the mask in the backward
                        kept_block[0] = None
                else:
                    out[:, :, rows] = block_out
            if call.count and m.drop is not None:
                dropped, droppable = (
                    a + n for a, n in zip((dropped, droppable), block_counts(m, call.droppable, rows, b, h))
                )
        # The kept bits go through save_for_backward, not ctx: a checkpointed call's saved tensors are
        # dropped until its recompute, which makes the same bits again.
        ctx.save_for_backward(q, k_in, v_in, bias, out if keep_stats else None, lse, *kept_block, *kept_bits)
        ctx.call, ctx.states, ctx.one_block = call, states, one_block
        ctx.mark_non_differentiable(dropped, droppable)
        return out, weights, dropped, droppable

    @staticmethod
    def backward(ctx, grad_out, grad_weights, _dropped, _droppable):
        q, k, v, bias, out, lse, mask, uniform, keyless, probs, kept, *kept_bits = ctx.saved_tensors
        call: BlockCall = ctx.call
        saved = BlockMasks(ctx.states[0], mask, uniform, keyless, None, None, None) if ctx.one_block else None
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
                q, k, v, saved, call, slice(0, t), shape, grad_out, grad_weights, acc, probs, kept
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
                q_rows, k, v, m, call, rows, shape, grad_out[:, :, rows], g_weights, acc, probs, kept
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


def _block_gradients(q_rows, k, v, m, call: BlockCall, rows: slice, shape, grad_out, grad_weights, acc, probs, kept):
    """(dq, dk, dv, dscores) of one block in ``acc``, by the softmax's formula: P = softmax(q k^T s +
    mask) (``probs`` when the forward kept it, else made again from the block's masks), W = P under
    the model's attention dropout (``kept``: the forward's multipliers, else its keyed coins made
    again), O = W v; dv = W^T dO, dP = (dO v^T) under the same dropout (+ the map's own gradient when
    it was returned), dS = P (dP - rowsum(dP P)), dq = dS k s, dk = dS^T q s. Rows made uniform had
    their query zeroed (no gradient to it); rows without a valid key gave 0."""
    scale = call.scale if call.scale is not None else q_rows.shape[-1] ** -0.5
    k, v = k[:, :, : m.keys].to(acc), v[:, :, : m.keys].to(acc)
    q_used = zero_rows(q_rows, m.uniform).to(acc)
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
    inside. The backward runs outside any autocast, so the function must not depend on it: it
    then sees the very dtypes its forward saw."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return EditAttention.apply(q, k, v, bias, call)
    dtype = torch.get_autocast_dtype(device)
    q, k, v = (x.to(dtype) if x.is_floating_point() else x for x in (q, k, v))
    with torch.autocast(device, enabled=False):
        return EditAttention.apply(q, k, v, bias, call)


__all__: Sequence[str] = ("edit_attention",)
