"""Regularized attention one block of query rows at a time, its drops regenerated, never stored.

A regularized call whose (B, H, T, S) maps exceed a block's budget runs here instead of building
dense masks: for each block of query rows, the block's drop decisions are made, its additive mask
is built, sdpa runs, and all of it is dropped before the next block. The backward
(:class:`BlockwiseAttention`) makes the same decisions again, block by block, and back-propagates
through a recomputed sdpa, so autograd never saves a mask ("memory-efficient attention", Rabe and
Staats 2021, in plain PyTorch). What a call keeps beyond plain attention is linear in length:
q, k, v, the bias it was given, and per query row at most a threshold and a count.

Decisions are regenerated rather than stored, as FlashAttention's dropout is: every random number
comes from a generator seeded by (the call's seed, the 64-row chunk of queries), so any split into
blocks on chunk boundaries, in the forward, the backward and an activation-checkpoint recompute,
sees the same coins. The call's seed is one draw from torch's global generator, which frameworks
seed per update.

What a hook drops is described by a :class:`BlockRule`: dense masks sliced per block
(:class:`DenseRule`, AttendOut's Generator output), Bernoulli coins (:class:`BernoulliRule`,
scheduled dropout), and AD-DROP's top-p region with Bernoulli(q) drops (:class:`TopRegionRule`)
ranked by gradient attribution recomputed per block from dF/dO and V (:class:`GradientScores`) or
by random scores (:class:`RandomScores`, the RD control). A region is fixed per row by one number,
the ceil(p n)-th largest score among the row's valid keys; ties at it are taken lowest key first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .masks import (
    ad_drop_masks,
    ceil_of_product,
    decimal_fraction,
    keep_one_valid_key,
    mask_fill_value,
    valid_keys_from_bias,
)

# Coins are drawn per chunk of this many query rows; blocks are whole chunks.
CHUNK_ROWS = 64
# A block holds at most max(BLOCK_ELEMENTS, LINEAR_FACTOR * B*H*T*d) score-sized elements: a fixed
# floor (2**19 elements: ~12 MiB of block temporaries at ~24 bytes each) or a multiple of the
# call's own q, so that the block's memory is a bounded multiple of what plain attention holds.
BLOCK_ELEMENTS = 1 << 19
LINEAR_FACTOR = 2


def query_block_rows(batch: int, heads: int, queries: int, keys: int, head_dim: int) -> int:
    """Query rows per block for a call of this shape; ``queries`` when the call is one block."""
    budget = max(BLOCK_ELEMENTS, LINEAR_FACTOR * batch * heads * queries * head_dim)
    rows = budget // max(1, batch * heads * keys)
    if rows >= queries:
        return queries
    return max(CHUNK_ROWS, rows // CHUNK_ROWS * CHUNK_ROWS)


def _chunk_seed(seed: int, chunk: int) -> int:
    """A 63-bit seed for one chunk (splitmix64 of seed + chunk): nearby chunks get unrelated streams."""
    z = (seed + 0x9E3779B97F4A7C15 * (chunk + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def chunk_uniform(seed: int, shape: Tuple[int, int, int, int], rows: slice, device) -> torch.Tensor:
    """Uniform [0, 1) numbers for query rows ``rows`` of a call whose maps are ``shape`` (B, H, T, S).

    Chunk c (rows 64c .. 64c+63) is always filled by its own generator, seeded by (seed, c), so the
    numbers of a row depend on the seed and the row, not on how the rows are split into blocks.
    """
    b, h, _, s = shape
    generator = torch.Generator(device=device)
    first, end = rows.start // CHUNK_ROWS, -(-rows.stop // CHUNK_ROWS)
    if end == first + 1 and rows.start == first * CHUNK_ROWS and rows.stop == min(end * CHUNK_ROWS, shape[2]):
        # The rows are exactly one chunk (the usual block): its numbers, without a copy.
        generator.manual_seed(_chunk_seed(seed, first))
        return torch.rand((b, h, rows.stop - rows.start, s), generator=generator, device=device)
    out = torch.empty((b, h, rows.stop - rows.start, s), device=device)
    for chunk in range(first, end):
        lo, hi = chunk * CHUNK_ROWS, (chunk + 1) * CHUNK_ROWS
        generator.manual_seed(_chunk_seed(seed, chunk))
        drawn = torch.rand((b, h, min(hi, shape[2]) - lo, s), generator=generator, device=device)
        take_lo, take_hi = max(lo, rows.start), min(hi, rows.stop)
        out[:, :, take_lo - rows.start : take_hi - rows.start] = drawn[:, :, take_lo - lo : take_hi - lo]
    return out


@dataclass(frozen=True)
class Block:
    """One block of a call: query ``rows``, their validity (bool, broadcastable to ``shape``), the
    call's full map shape and its seed."""

    rows: slice
    valid: torch.Tensor
    shape: Tuple[int, int, int, int]  # (B, H, rows, S)
    call_shape: Tuple[int, int, int, int]  # (B, H, T, S)
    seed: int

    def uniform(self, stream: int) -> torch.Tensor:
        """This block's uniform numbers of ``stream`` (0: coins, 1: random scores)."""
        return chunk_uniform(_chunk_seed(self.seed, -1 - stream), self.call_shape, self.rows, self.valid.device)


def rows_of(x: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    """``x[..., rows, :]``, or ``x`` itself where its query dimension broadcasts (size 1)."""
    if x is None or x.dim() < 2 or x.shape[-2] == 1:
        return x
    return x[..., rows, :]


class BlockRule:
    """What a hook drops, regenerated per block. ``first`` runs in the forward and returns the
    block's drops and a state (a threshold per row, say) that ``again`` is handed in the backward
    to make the same drops. ``keeps_rows``: the drops never touch an invalid key and never empty a
    row by construction, so the kernel need not check (a full pass over the block each)."""

    keeps_rows = False

    def first(self, block: Block) -> Tuple[torch.Tensor, object]:
        return self.again(block, None), None

    def again(self, block: Block, state) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, valid: torch.Tensor) -> torch.Tensor:
        """The drops of a call that is one block (``valid`` expanded to the call's shape)."""
        block = Block(slice(0, valid.shape[-2]), valid, tuple(valid.shape), tuple(valid.shape), call_seed())
        return self.first(block)[0]


@dataclass(frozen=True, eq=False)
class DenseRule(BlockRule):
    """A mask given whole (bool, broadcastable to (B, H, T, S)): each block takes its rows."""

    mask: torch.Tensor

    def again(self, block: Block, state) -> torch.Tensor:
        return rows_of(self.mask, block.rows).to(block.valid.device)


@dataclass(frozen=True, eq=False)
class BernoulliRule(BlockRule):
    """Each (sample, head, query, key) dropped with probability ``probability`` (a 0-d tensor)."""

    probability: torch.Tensor

    def again(self, block: Block, state) -> torch.Tensor:
        return block.uniform(0) < self.probability.to(block.valid.device)

    def __call__(self, valid: torch.Tensor) -> torch.Tensor:
        # One block draws from torch's global stream, as the kernel always did for short maps.
        return torch.rand(valid.shape, device=valid.device) < self.probability


class ScoreSource:
    """Scores that rank a block's keys per row (higher: more likely a candidate)."""

    def scores(self, block: Block) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class GradientScores(ScoreSource):
    """Gradient attribution dF/dA = (dF/dO) V^T (times -1 for the bottom region), per block of rows."""

    grad_output: torch.Tensor  # (B, H, T, d), float32
    values: torch.Tensor  # (B, H, S, d)
    negate: bool = False

    def scores(self, block: Block) -> torch.Tensor:
        device = self.grad_output.device
        with torch.autocast(device.type, enabled=False):
            # float32, as the dense path: bf16 would tie keys the ranking must tell apart.
            out = torch.matmul(self.grad_output[:, :, block.rows], self.values.float().transpose(-2, -1))
        return out.neg_() if self.negate else out


@dataclass(frozen=True, eq=False)
class AttentionScores(ScoreSource):
    """Attention weights softmax(q k^T scale + bias) of a block's rows, recomputed from q and k (AA):
    the same operations as the kernel's dense weights, row by row."""

    query: torch.Tensor  # (B, H, T, d)
    key: torch.Tensor  # (B, H, S, d)
    bias: Optional[torch.Tensor]  # as the model gave it (bool: True = may attend; or float)
    scale: float

    @property
    def device(self) -> torch.device:
        return self.query.device

    def scores(self, block: Block) -> torch.Tensor:
        q_rows = self.query[:, :, block.rows]
        logits = torch.matmul(q_rows, self.key.transpose(-2, -1)) * self.scale
        part, _ = _block_bias(rows_of(self.bias, block.rows), q_rows.dtype)
        if part is not None:
            logits = logits + part
        # Softmax in at least float32, then the model's dtype, as the dense weights are.
        half = logits.dtype in (torch.float16, torch.bfloat16)
        return torch.softmax(logits.float() if half else logits, dim=-1).to(q_rows.dtype).float()


@dataclass(frozen=True, eq=False)
class RandomScores(ScoreSource):
    """Uniform random scores: a random candidate region (AD-DROP's RD control)."""

    def scores(self, block: Block) -> torch.Tensor:
        return block.uniform(1)


@dataclass(frozen=True, eq=False)
class TopRegionRule(BlockRule):
    """AD-DROP: each row's top ceil(p n) valid keys by ``source`` are candidates, each dropped with
    probability q; a row never loses its last valid key (the lowest-scored one is kept);
    ``samples`` (B,) bool, when given, limits drops to those samples."""

    source: ScoreSource
    p: float
    q: float
    samples: Optional[torch.Tensor] = None
    # Invalid keys score -inf against a finite threshold, and a row whose region is all its keys
    # keeps one (``_drop``).
    keeps_rows = True

    def _scores(self, block: Block) -> torch.Tensor:
        """The block's scores, -inf at invalid keys (so they are never above a row's threshold)."""
        scores = self.source.scores(block).nan_to_num_(0.0)
        valid = block.valid
        if valid.device.type != "cpu" or not bool(valid.all()):
            # An add of a (broadcast) -inf bias: several times faster than torch.where on a CPU.
            scores.add_(
                torch.zeros(valid.shape, dtype=scores.dtype, device=valid.device).masked_fill_(~valid, -math.inf)
            )
        return scores

    def _counts(self, block: Block) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per row: valid keys n, and candidates k = ceil(p n) (exact: :func:`ceil_of_product`)."""
        n_valid = block.valid.sum(-1, keepdim=True)
        numerator, denominator = decimal_fraction(self.p)
        return n_valid, ceil_of_product(n_valid, numerator, denominator, block.shape[-1])

    def first(self, block: Block):
        """Each row's threshold, the ceil(p n)-th largest valid score (+inf where k = 0), then the drops."""
        scores = self._scores(block)
        n_valid, k = self._counts(block)
        k_top = max(1, min(scores.shape[-1], int(k.max())))
        if scores.device.type == "cpu" and int(k.min()) == k_top:
            # Every row takes the same k (no padding or causality in the block): the k-th largest is
            # the least of an unsorted top-k, half the cost of a sorted one.
            threshold = scores.topk(k_top, dim=-1, sorted=False).values.amin(-1, keepdim=True)
        else:
            top = scores.topk(k_top, dim=-1, sorted=True).values
            threshold = top.gather(-1, (k - 1).clamp(min=0).expand(*top.shape[:-1], 1))
        threshold = threshold.masked_fill(k.expand_as(threshold) == 0, math.inf)
        region = scores >= threshold
        at_least = region.view(torch.uint8).sum(-1, keepdim=True, dtype=torch.int32)
        # Whether ties straddle the threshold in some row: kept, so the backward need not count.
        tied = scores.device.type != "cpu" or bool((at_least > k).any())
        state = (threshold, k, tied)
        return self._drop(block, scores, state, n_valid, region, at_least), state

    def again(self, block: Block, state) -> torch.Tensor:
        return self._drop(block, self._scores(block), state, None)

    def _drop(self, block: Block, scores, state, n_valid, region=None, at_least=None) -> torch.Tensor:
        threshold, k, tied = state
        if region is None:
            region = scores >= threshold
        if tied:
            # Ties straddle the threshold in some row: take the lowest key indices first.
            if at_least is None:
                at_least = region.view(torch.uint8).sum(-1, keepdim=True, dtype=torch.int32)
            equal = scores == threshold
            take = k - (at_least - equal.view(torch.uint8).sum(-1, keepdim=True, dtype=torch.int32))
            region = (region & ~equal) | (equal & (equal.cumsum(-1, dtype=torch.int32) <= take))
        drop = block.uniform(0) < self.q
        drop &= region
        if self.samples is not None:
            drop &= self.samples.view(-1, 1, 1, 1)
        if n_valid is None:
            n_valid = block.valid.sum(-1, keepdim=True)
        if scores.device.type != "cpu" or bool((k >= n_valid).any()):
            # A row whose every key is a candidate can lose them all: it keeps its lowest-scored one.
            drop = keep_one_valid_key(drop, block.valid.expand(drop.shape), scores)
        return drop

    def __call__(self, valid: torch.Tensor) -> torch.Tensor:
        if isinstance(self.source, RandomScores) and self.samples is None:
            # One block draws from torch's global stream, as the kernel always did for short maps.
            return ad_drop_masks(torch.rand(valid.shape, device=valid.device), valid, self.p, self.q)
        return super().__call__(valid)


# -- the kernel ------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class BlockCall:
    """Everything a blockwise call does besides q, k, v and the bias: fixed before the call."""

    rule: Optional[BlockRule]
    uniform: Optional[torch.Tensor]  # bool rows made uniform (LayerDrop flag), broadcastable
    droppable: Optional[torch.Tensor]  # units the rate counts (see EditScores.droppable)
    rows_per_block: int
    seed: int
    dropout_p: float
    scale: Optional[float]
    count: bool  # add dropped / droppable counts (a fresh forward; a recompute counts nothing)


def _all_last(mask: torch.Tensor) -> torch.Tensor:
    """``mask.all(-1, keepdim=True)``; on a CPU as the byte minimum, which is vectorised."""
    if mask.device.type != "cpu" or mask.shape[-1] == 0:
        return mask.all(-1, keepdim=True)
    return mask.view(torch.uint8).amin(-1, keepdim=True).bool()


def _block_bias(bias_rows: Optional[torch.Tensor], dtype: torch.dtype):
    """A block's additive bias (finite fill where disallowed) and validity, from its rows of the bias."""
    if bias_rows is None:
        return None, None
    valid = valid_keys_from_bias(bias_rows)
    if bias_rows.dtype == torch.bool:
        if bias_rows.device.type == "cpu" and bool(bias_rows.all()):
            return None, valid  # nothing to add (no padding in the block): the drops are the mask
        part = torch.zeros((), dtype=dtype, device=bias_rows.device).masked_fill(~bias_rows, mask_fill_value(dtype))
    else:
        part = bias_rows.to(dtype).clamp(min=mask_fill_value(dtype))
    return part, valid


def _block_masks(call: BlockCall, q_rows, bias_rows, rows: slice, shape, state=None, fresh_state: bool = False):
    """A block's additive mask, uniform rows, keyless rows, validity, drops and rule state.
    ``bias_rows``: the block's rows of the call's bias; ``rows``: which rows of the call they are."""
    b, h, t, s = shape
    block_shape = (b, h, rows.stop - rows.start, s)
    part, valid = _block_bias(bias_rows, q_rows.dtype)
    if valid is None:  # every key valid; the key dimension is kept, since rules count along it
        valid = torch.ones((1, 1, 1, s), dtype=torch.bool, device=q_rows.device)
    block = Block(rows, valid, block_shape, shape, call.seed)
    drop = None
    if call.rule is not None:
        if fresh_state:
            drop, state = call.rule.first(block)
        else:
            drop = call.rule.again(block, state)
    uniform = call.uniform
    if uniform is not None and uniform.dim() >= 2:
        uniform = rows_of(uniform, rows)
    if drop is not None and not call.rule.keeps_rows:
        drop = drop & valid
        # A row that would lose every real key attends uniformly to them (AttendOut Eq. 4).
        emptied = _all_last(drop | ~valid) & valid.any(-1, keepdim=True)
        if emptied.device.type != "cpu" or bool(emptied.any()):
            drop = drop & ~emptied
            uniform = emptied if uniform is None else (uniform | emptied)
    if drop is not None:
        # Cast from bytes (a CPU casts uint8 to float ~3x faster than bool), scale, then add the
        # bias in place: several times faster than one add of a bool to a float.
        additive = drop.view(torch.uint8).to(q_rows.dtype).mul_(mask_fill_value(q_rows.dtype))
        if part is not None:
            fits = torch.broadcast_shapes(additive.shape, part.shape) == additive.shape
            additive = additive.add_(part) if fits else additive + part
        part = additive
    keyless = None if bias_rows is None else ~valid.any(-1, keepdim=True)
    return part, uniform, keyless, valid, drop, state


def _attend_block(q_rows, k, v, mask, uniform, keyless, call: BlockCall):
    """One block through sdpa, as the kernel's prepared path: a zero query row is uniform over its
    valid keys, and a row with no valid key gives 0 (and so sends back no gradient)."""
    if uniform is not None:
        q_rows = q_rows.masked_fill(uniform, 0.0)
    out = F.scaled_dot_product_attention(q_rows, k, v, attn_mask=mask, dropout_p=call.dropout_p, scale=call.scale)
    return out if keyless is None else out.masked_fill(keyless, 0.0)


# sdpa's own CPU kernel, called directly so that the forward can keep each row's log-sum-exp and the
# backward need not run the block's forward again (sdpa dispatches these very calls on a CPU, so
# the results are the same bits). Elsewhere the backward recomputes the block through sdpa.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_FLASH_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _keeps_softmax_stats(q, k, v, bias, call: BlockCall, bias_grad: bool) -> bool:
    """Whether this call runs on sdpa's CPU kernel with the row log-sum-exp kept for the backward."""
    return (
        _FLASH_CPU is not None
        and _FLASH_CPU_BACKWARD is not None
        and q.device.type == "cpu"
        and call.dropout_p == 0.0
        and not bias_grad
        and q.dtype in _FLASH_CPU_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[1] == k.shape[1]
    )


def _zero_query_rows(q_rows, uniform):
    return q_rows if uniform is None else q_rows.masked_fill(uniform, 0.0)


def _get_rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _devices(q: torch.Tensor) -> List[torch.device]:
    return [q.device] if q.device.type == "cuda" else []


class BlockwiseAttention(torch.autograd.Function):
    """sdpa with a regularizer's drops, block by block; the backward regenerates every block."""

    @staticmethod
    def forward(ctx, q, k, v, bias, call: BlockCall):
        b, h, t, _ = q.shape
        shape = (b, h, t, k.shape[2])
        out = q.new_empty((b, h, t, v.shape[-1]))
        dropped = torch.zeros((), dtype=torch.long, device=q.device)
        droppable = torch.zeros((), dtype=torch.long, device=q.device)
        states: List[object] = []
        rng_states: List[object] = []
        keep_stats = _keeps_softmax_stats(q, k, v, bias, call, bias is not None and bias.requires_grad)
        # Every block reads all of k and v: once contiguous, sdpa's CPU kernel reads them faster.
        k, v = k.contiguous(), v.contiguous()
        lse = q.new_empty((b, h, t), dtype=torch.float32) if keep_stats else None
        for start in range(0, t, call.rows_per_block):
            rows = slice(start, min(t, start + call.rows_per_block))
            q_rows = q[:, :, rows]
            mask, uniform, keyless, valid, drop, state = _block_masks(
                call, q_rows, rows_of(bias, rows), rows, shape, fresh_state=True
            )
            states.append(state)
            if call.dropout_p > 0:  # sdpa's dropout draws, replayed in the backward
                rng_states.append(_get_rng_state(q.device))
            if keep_stats:
                o, lse[:, :, rows] = _FLASH_CPU(
                    _zero_query_rows(q_rows, uniform), k, v, 0.0, False, attn_mask=mask, scale=call.scale
                )
                out[:, :, rows] = o if keyless is None else o.masked_fill(keyless, 0.0)
            else:
                out[:, :, rows] = _attend_block(q_rows, k, v, mask, uniform, keyless, call)
            if call.count and drop is not None:
                block_shape = (b, h, rows.stop - rows.start, shape[3])
                units = valid if call.droppable is None else valid & rows_of(call.droppable, rows).to(valid.device)
                counted = drop if call.droppable is None else drop & units  # drops are within valid
                dropped += counted.expand(block_shape).count_nonzero()
                droppable += units.sum() * (math.prod(block_shape) // max(1, units.numel()))
        ctx.save_for_backward(q, k, v, bias, out if keep_stats else None, lse)
        ctx.call, ctx.states, ctx.rng_states = call, states, rng_states
        ctx.mark_non_differentiable(dropped, droppable)
        return out, dropped, droppable

    @staticmethod
    def backward(ctx, grad_out, _dropped, _droppable):
        q, k, v, bias, out, lse = ctx.saved_tensors
        call: BlockCall = ctx.call
        b, h, t, _ = q.shape
        shape = (b, h, t, k.shape[2])
        if lse is not None:
            return (*_backward_from_softmax_stats(ctx, grad_out, q, k, v, bias, out, lse), None)
        # Accumulated over blocks in float32: half-precision partial sums would round each block.
        grad_q = torch.zeros_like(q, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        grad_k = torch.zeros_like(k, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_v = torch.zeros_like(v, dtype=torch.float32) if ctx.needs_input_grad[2] else None
        bias_grad = bias is not None and ctx.needs_input_grad[3]
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias_grad else None
        k_leaf, v_leaf = k.detach().requires_grad_(grad_k is not None), v.detach().requires_grad_(grad_v is not None)
        for i, start in enumerate(range(0, t, call.rows_per_block)):
            rows = slice(start, min(t, start + call.rows_per_block))
            q_rows = q[:, :, rows].detach().requires_grad_(grad_q is not None)
            bias_rows = rows_of(bias, rows)
            if bias_grad:  # the block's rows stand for the bias, so their gradient is the block's
                bias_rows = bias_rows.detach().requires_grad_(True)
            with torch.enable_grad(), torch.random.fork_rng(devices=_devices(q), enabled=call.dropout_p > 0):
                if call.dropout_p > 0:
                    _set_rng_state(ctx.rng_states[i], q.device)
                mask, uniform, keyless, _, _, _ = _block_masks(call, q_rows, bias_rows, rows, shape, ctx.states[i])
                out = _attend_block(q_rows, k_leaf, v_leaf, mask, uniform, keyless, call)
            inputs = [x for x in (q_rows, k_leaf, v_leaf) if x.requires_grad]
            if bias_grad:
                inputs.append(bias_rows)
            grads = list(torch.autograd.grad(out, inputs, grad_out[:, :, rows], allow_unused=True))
            if grad_q is not None:
                g = grads.pop(0)
                if g is not None:
                    grad_q[:, :, rows] += g
            for acc in (grad_k, grad_v):
                if acc is not None:
                    g = grads.pop(0)
                    if g is not None:
                        acc += g
            if bias_grad:
                g = grads.pop(0)
                if g is not None:
                    if bias.shape[-2] == 1:
                        grad_bias += g
                    else:
                        grad_bias[..., rows, :] += g
        cast = [
            None if g is None else g.to(x.dtype) for g, x in ((grad_q, q), (grad_k, k), (grad_v, v), (grad_bias, bias))
        ]
        return (*cast, None)


def _backward_from_softmax_stats(ctx, grad_out, q, k, v, bias, out, lse):
    """The backward of a call that kept its rows' log-sum-exp: per block, the drops are made again
    and sdpa's CPU backward runs from the saved output, with no forward recompute."""
    call: BlockCall = ctx.call
    b, h, t, _ = q.shape
    shape = (b, h, t, k.shape[2])
    need_q, need_k, need_v = ctx.needs_input_grad[:3]
    # Accumulated in float32: half-precision partial sums would round each block.
    grad_q = torch.zeros_like(q, dtype=torch.float32) if need_q else None
    grad_k = torch.zeros_like(k, dtype=torch.float32) if need_k else None
    grad_v = torch.zeros_like(v, dtype=torch.float32) if need_v else None
    for i, start in enumerate(range(0, t, call.rows_per_block)):
        rows = slice(start, min(t, start + call.rows_per_block))
        q_rows = q[:, :, rows]
        mask, uniform, keyless, _, _, _ = _block_masks(call, q_rows, rows_of(bias, rows), rows, shape, ctx.states[i])
        grad_rows = grad_out[:, :, rows]
        if keyless is not None:  # the forward zeroed these rows: no gradient flows back from them
            grad_rows = grad_rows.masked_fill(keyless, 0.0)
        gq, gk, gv = _FLASH_CPU_BACKWARD(
            grad_rows.to(q.dtype), _zero_query_rows(q_rows, uniform), k, v, out[:, :, rows], lse[:, :, rows],
            0.0, False, attn_mask=mask, scale=call.scale,
        )  # fmt: skip
        if grad_q is not None:
            grad_q[:, :, rows] += gq if uniform is None else gq.masked_fill(uniform, 0.0)
        if grad_k is not None:
            grad_k += gk
        if grad_v is not None:
            grad_v += gv
    return [None if g is None else g.to(x.dtype) for g, x in ((grad_q, q), (grad_k, k), (grad_v, v))] + [None]


def blockwise_attention(q, k, v, bias, call: BlockCall) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output (B, H, T, d), dropped, droppable) of a regularized call, block by block."""
    return BlockwiseAttention.apply(q, k, v, bias, call)


def call_seed() -> int:
    """The seed of one blockwise call: one draw from torch's global generator."""
    return int(torch.randint(0, 2**62, (1,)).item())


def rule_of(drop) -> Optional[BlockRule]:
    """The :class:`BlockRule` of an ``EditScores.drop``: a rule, a dense bool mask, or None."""
    if drop is None or isinstance(drop, BlockRule):
        return drop
    if isinstance(drop, torch.Tensor):
        return DenseRule(drop)
    return None  # a plain callable: evaluated whole (one block)


def blockwise_rows(q: torch.Tensor, k: torch.Tensor, drop) -> Optional[int]:
    """Rows per block when this regularized call should run blockwise, else None (one block)."""
    if torch.compiler.is_compiling():
        return None  # a compiled region takes the one-block path (no generator objects in a graph)
    if drop is not None and not isinstance(drop, (BlockRule, torch.Tensor)):
        return None
    b, h, t, d = q.shape
    rows = query_block_rows(b, h, t, k.shape[2], d)
    return rows if rows < t else None


__all__: Sequence[str] = (
    "AttentionScores",
    "BernoulliRule",
    "BlockRule",
    "DenseRule",
    "GradientScores",
    "RandomScores",
    "TopRegionRule",
    "blockwise_attention",
    "query_block_rows",
)
