"""What a regularizer drops in one block of query rows, made again identically wherever it is needed.

A :class:`BlockRule` makes a block's drops (``forward_drops``, with a small per-row state) and makes
them again from that state (``backward_drops``: the backward, a checkpoint's recompute). Every random
number, one block or many, eager or compiled, comes from a generator seeded by (the call's seed, the
stream, the 64-row chunk), drawn in tiles of min(64, S) keys: the drops depend on the seed and the
indices, not on the split into blocks nor on when they are made (:func:`chunk_draws`). The seed is a
0-d int64 CPU tensor; the draws are the opaque operator ``attn_reg::keyed_draws``, which
torch.compile calls from its graph (it cannot trace a generator), so compiled drops are eager drops.

Rules: dense masks sliced per block (:class:`DenseRule`), Bernoulli coins (:class:`BernoulliRule`),
and AD-DROP's top-p region with Bernoulli(q) drops (:class:`TopRegionRule`), ranked by a
:class:`ScoreSource` (gradient attribution, attention weights from q and k, a map kept whole, random
scores); a row's region is its ceil(p n) largest valid scores, ties taken lowest key first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch

from . import masks

# Random numbers are drawn per chunk of query rows (blocks are whole chunks), tile by tile of keys.
CHUNK_ROWS = 64
KEY_TILE = 64
# The streams of a call's seed: the rules' coins, and the model's attention dropout in an edit
# (-2 is random scores', -4 DropHead's).
COIN_STREAM = -1
WEIGHT_DROPOUT_STREAM = -3


def block_bias(bias_rows: Optional[torch.Tensor], dtype: torch.dtype, valid: Optional[torch.Tensor] = None):
    """A block's additive bias (finite fill where disallowed) and validity, from its rows of the bias
    (``valid``: their validity, when already known)."""
    if bias_rows is None:
        return None, None
    if valid is None:
        valid = masks.valid_keys_from_bias(bias_rows)
    if bias_rows.dtype == torch.bool and not masks.may_hold_true(~bias_rows):
        return None, valid  # nothing to add (no padding in the block): the drops are the mask
    return masks.finite_bias(bias_rows, dtype), valid


def key_seed(seed: int, key: int) -> int:
    """A 63-bit seed for ``key`` under ``seed`` (splitmix64 of seed + key): a site of a pass, a
    stream of a call, a chunk of a stream; nearby keys get unrelated streams."""
    z = (seed + 0x9E3779B97F4A7C15 * (key + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def chunk_draws(
    seed: int, shape: Tuple[int, int, int, int], rows: slice, keys: int, device, uniform: bool
) -> torch.Tensor:
    """Random numbers for query rows ``rows`` and keys ``0 .. keys - 1`` of a call whose maps are
    ``shape`` (B, H, T, S): float32 uniforms in [0, 1) when ``uniform``, else int32 coins uniform over
    0 .. 2**31 - 1.

    Chunk c (rows 64c .. 64c+63) always draws from its own generator, seeded by (seed, c), one tile
    of ``min(KEY_TILE, S)`` keys after another (each tile: every sample, head and row of the chunk),
    so a number depends on the seed, its row and its key: not on how the rows are split into blocks
    nor on how many keys a block covers (a causal block draws for the keys it has, not for all S).
    """
    b, h, t, s = shape
    if rows.stop <= rows.start or keys == 0:  # no query rows or no keys (an empty call): nothing drawn
        dtype = torch.float32 if uniform else torch.int32
        return torch.empty((b, h, max(0, rows.stop - rows.start), keys), dtype=dtype, device=device)
    generator = torch.Generator(device=device)
    width = min(KEY_TILE, s)  # a call's tile width: a short call draws for its own keys only
    tiles = -(-keys // width)
    parts = []
    for chunk in range(rows.start // CHUNK_ROWS, -(-rows.stop // CHUNK_ROWS)):
        lo, hi = chunk * CHUNK_ROWS, min((chunk + 1) * CHUNK_ROWS, t)
        generator.manual_seed(key_seed(seed, chunk))
        size = (tiles, b, h, hi - lo, width)
        if uniform:
            drawn = torch.rand(size, generator=generator, device=device)
        else:
            drawn = torch.empty(size, dtype=torch.int32, device=device).random_(generator=generator)
        drawn = drawn.permute(1, 2, 3, 0, 4).reshape(b, h, hi - lo, tiles * width)
        parts.append(drawn[:, :, max(lo, rows.start) - lo : min(hi, rows.stop) - lo, :keys])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


@torch.library.custom_op("attn_reg::keyed_draws", mutates_args=())
def keyed_draws(
    seed: torch.Tensor,
    stream: int,
    call_shape: List[int],
    row_start: int,
    row_stop: int,
    keys: int,
    uniform: bool,
    device: torch.device,
) -> torch.Tensor:
    """Stream ``stream`` of ``seed`` (0-d int64, on the CPU) for rows ``row_start .. row_stop - 1`` and
    keys ``0 .. keys - 1`` of a call whose maps are ``call_shape``, on ``device``: float32 uniforms in
    [0, 1) when ``uniform``, else int32 coins uniform over 0 .. 2**31 - 1 (:func:`chunk_draws`)."""
    key = key_seed(int(seed), stream)
    return chunk_draws(key, tuple(call_shape), slice(row_start, row_stop), keys, device, uniform)


@keyed_draws.register_fake
def _keyed_draws_shape(seed, stream, call_shape, row_start, row_stop, keys, uniform, device):
    b, h = call_shape[0], call_shape[1]
    dtype = torch.float32 if uniform else torch.int32
    return torch.empty((b, h, row_stop - row_start, keys), dtype=dtype, device=device)


def coin_limit(probability):
    """The largest 31-bit coin that drops, for coins uniform over 0 .. 2**31 - 1: a coin drops with
    probability round(probability * 2**31) / 2**31 (float coins in [0, 1) are exact to 2**-24 only).
    ``probability``: a float, or a 0-d tensor (a scheduled rate) giving a 0-d int64 tensor."""
    if isinstance(probability, torch.Tensor):
        return (probability.double() * 2**31).round().long() - 1
    return round(probability * 2**31) - 1


@dataclass(frozen=True)
class Block:
    """One block of a call: query ``rows``, their validity (bool, broadcastable to ``shape``), the
    call's full map shape and its seed (a 0-d int64 CPU tensor). The block covers keys
    ``0 .. shape[-1] - 1``: fewer than the call's when no row of the block has a valid key beyond them
    (causal attention, padding)."""

    rows: slice
    valid: torch.Tensor
    shape: Tuple[int, int, int, int]  # (B, H, rows, keys of the block)
    call_shape: Tuple[int, int, int, int]  # (B, H, T, S)
    seed: Union[torch.Tensor, int]

    def __post_init__(self):
        # A validity that broadcasts over keys (from a bias shaped (..., 1)) holds for every key, and
        # rules count valid keys along the last dimension: it is widened to the block's keys (a view).
        if self.valid.shape[-1] != self.shape[-1]:
            object.__setattr__(self, "valid", self.valid.expand(*self.valid.shape[:-1], self.shape[-1]))
        if isinstance(self.seed, int):  # given by hand
            object.__setattr__(self, "seed", torch.tensor(self.seed))

    def coins(self, probability, stream: int = COIN_STREAM) -> torch.Tensor:
        """This block's Bernoulli(``probability``) drops (bool) from ``stream`` of the seed: 31-bit integer
        coins, which draw a third faster than float ones on a CPU (:func:`coin_limit`). The rules' coins
        come from :data:`COIN_STREAM`; the model's attention dropout inside a regularized call from
        :data:`WEIGHT_DROPOUT_STREAM`, made again from the seed in the backward, as FlashAttention
        regenerates its dropout."""
        limit = coin_limit(probability)
        if isinstance(limit, torch.Tensor):
            limit = limit.to(self.valid.device)
        return self._draws(stream, False) <= limit

    def uniform(self) -> torch.Tensor:
        """This block's uniform [0, 1) numbers (random scores), from their own stream."""
        return self._draws(-2, True)

    def _draws(self, stream: int, uniform: bool) -> torch.Tensor:
        rows, device = self.rows, self.valid.device
        return keyed_draws(
            self.seed, stream, list(self.call_shape), rows.start, rows.stop, self.shape[-1], uniform, device
        )


def keys_of(x: Optional[torch.Tensor], keys: int) -> Optional[torch.Tensor]:
    """``x[..., :keys]``, or ``x`` itself where its key dimension broadcasts or already has ``keys``."""
    if x is None or x.dim() < 1 or x.shape[-1] in (1, keys):
        return x
    return x[..., :keys]


def rows_of(x: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    """``x[..., rows, :]``, or ``x`` itself where its query dimension broadcasts (size 1)."""
    if x is None or x.dim() < 2 or x.shape[-2] == 1:
        return x
    return x[..., rows, :]


class BlockRule:
    """What a hook drops, regenerated per block. A stateless rule defines ``drops(block)``: the
    block alone (its rows, validity, shape and seed) determines them. A rule that ranks keys also
    finds a state in the forward (a threshold per row, say): ``forward_drops`` returns the drops and
    that state, ``backward_drops`` is handed it to make the same drops again. ``keeps_rows``: the
    drops never touch an invalid key and never empty a row by construction, so the kernel need not
    check (a full pass over the block each)."""

    keeps_rows = False
    # Whether the rule draws random numbers. A pass whose rules draw none takes no seed, so it
    # leaves torch's global random stream as it was.
    draws = True

    def drops(self, block: Block) -> torch.Tensor:
        raise NotImplementedError

    def forward_drops(self, block: Block) -> Tuple[torch.Tensor, object]:
        return self.drops(block), None

    def backward_drops(self, block: Block, state) -> torch.Tensor:
        return self.drops(block)

    def whole(self, valid: torch.Tensor, seed: torch.Tensor, shape: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
        """The drops of a call of ``shape`` (default: ``valid``'s) that is one block: the same draws
        from ``seed`` as any split of the call into blocks. ``valid`` may broadcast (a padding mask
        shared by heads and rows), as a block's does: the rules count and mask along it unexpanded."""
        shape = tuple(valid.shape if shape is None else shape)
        return self.forward_drops(Block(slice(0, shape[-2]), valid, shape, shape, seed))[0]


@dataclass(frozen=True, eq=False)
class DenseRule(BlockRule):
    """A mask given whole (bool, broadcastable to (B, H, T, S)): each block takes its rows."""

    mask: torch.Tensor
    draws = False

    def drops(self, block: Block) -> torch.Tensor:
        return keys_of(rows_of(self.mask, block.rows), block.shape[-1]).to(block.valid.device)


@dataclass(frozen=True, eq=False)
class BernoulliRule(BlockRule):
    """Each (sample, head, query, key) dropped with probability ``probability`` (a 0-d tensor)."""

    probability: torch.Tensor

    def drops(self, block: Block) -> torch.Tensor:
        return block.coins(self.probability)


class ScoreSource:
    """Scores that rank a block's keys per row (higher: more likely a candidate)."""

    def scores(self, block: Block) -> torch.Tensor:
        raise NotImplementedError


def dense_gradient_attribution(grad_output: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """dF/dA = (dF/dO) V^T, the whole (B, H, T, S) map. ``values`` (B, H_v, S, d) may have fewer heads
    (grouped-query attention: head h reads value head h // (H / H_v)), multiplied per group unrepeated."""
    b, h, t, d = grad_output.shape
    groups = h // values.shape[1]
    # In float32 even under a bf16 attribution pass: rounding the product to bf16's 8 bits
    # would tie keys of a row that the ranking has to tell apart.
    with torch.autocast(grad_output.device.type, enabled=False):
        if groups == 1:
            return torch.matmul(grad_output, values.float().transpose(-2, -1))
        grouped = grad_output.reshape(b, values.shape[1], groups * t, d)
        return torch.matmul(grouped, values.float().transpose(-2, -1)).view(b, h, t, -1)


@dataclass(frozen=True, eq=False)
class GradientScores(ScoreSource):
    """Gradient attribution dF/dA = (dF/dO) V^T (times -1 for the bottom region), per block of rows."""

    grad_output: torch.Tensor  # (B, H, T, d), float32
    values: torch.Tensor  # (B, H_v, S, d): H_v divides H (grouped-query attention's value heads, unrepeated)
    negate: bool = False

    def scores(self, block: Block) -> torch.Tensor:
        out = dense_gradient_attribution(self.grad_output[:, :, block.rows], self.values[:, :, : block.shape[-1]])
        return out.neg_() if self.negate else out


@dataclass(frozen=True, eq=False)
class AttentionScores(ScoreSource):
    """Attention weights softmax(q k^T scale + bias) of a block's rows, recomputed from q and k (AA,
    IGA), in float32: the same values whatever the blocks."""

    query: torch.Tensor  # (B, H, T, d)
    key: torch.Tensor  # (B, H, S, d)
    bias: Optional[torch.Tensor]  # as the model gave it (bool: True = may attend; or float)
    scale: float
    causal: bool = False  # future keys disallowed too (attend's is_causal)

    @property
    def device(self) -> torch.device:
        return self.query.device

    def scores(self, block: Block) -> torch.Tensor:
        # In float32 whatever the model's precision. The library may round a product of a block's
        # rows unlike the whole map's (its kernel depends on the shape): in bf16 by 2^-8, enough to
        # change a ranking at one seed in a few; in float32 by 2^-24, a near-tie.
        with torch.autocast(self.query.device.type, enabled=False):
            q_rows, keys = self.query[:, :, block.rows].float(), block.shape[-1]
            logits = torch.matmul(q_rows, self.key[:, :, :keys].float().transpose(-2, -1)) * self.scale
            bias_rows = keys_of(rows_of(self.bias, block.rows), keys)
            if self.causal:
                _, _, t, s = block.call_shape
                bias_rows = masks.causal_bias(bias_rows, block.rows, keys, t, s, q_rows.device)
            part, _ = block_bias(bias_rows, torch.float32)
            if part is not None:
                logits = logits + part
            return masks.attention_weights(logits, torch.float32)


@dataclass(frozen=True, eq=False)
class IntegratedGradientScores(ScoreSource):
    """Integrated gradients (AD-DROP's IGA, Eq. 3), A ⊙ (Σ_k dF/dO_k) Vᵀ / m per block of rows: the
    weights recomputed from q and k, times the gradient attribution of the summed output gradients
    of the layer's m scaled passes (``gradient``), over m."""

    weights: AttentionScores
    gradient: GradientScores
    steps: int
    negate: bool = False

    def scores(self, block: Block) -> torch.Tensor:
        out = self.weights.scores(block).mul_(self.gradient.scores(block)).div_(self.steps)
        return out.neg_() if self.negate else out


@dataclass(frozen=True, eq=False)
class MapScores(ScoreSource):
    """Scores given whole, (B, H, T, S) (a short map's gradient attribution, IGA's, or AA's weights
    from pass 1): each block takes its rows and keys, in float32."""

    map: torch.Tensor
    negate: bool = False

    def scores(self, block: Block) -> torch.Tensor:
        out = keys_of(rows_of(self.map, block.rows), block.shape[-1]).to(torch.float32, copy=True)
        return out.neg_() if self.negate else out


@dataclass(frozen=True, eq=False)
class RandomScores(ScoreSource):
    """Uniform random scores: a random candidate region (AD-DROP's RD control)."""

    def scores(self, block: Block) -> torch.Tensor:
        return block.uniform()


@dataclass(frozen=True, eq=False)
class TopRegionRule(BlockRule):
    """AD-DROP: each row's top ceil(p n) valid keys by ``source`` are candidates, each dropped with
    probability q; a row never loses its last valid key (the lowest-scored one is kept);
    ``samples`` (B,) bool, when given, limits drops to those samples."""

    source: ScoreSource
    p: float
    q: float
    samples: Optional[torch.Tensor] = None
    keeps_rows = True  # invalid keys score -inf; a row whose region is all its keys keeps one (_drop)

    def _scores(self, block: Block) -> torch.Tensor:
        """The block's scores, -inf at invalid keys (so they are never above a row's threshold)."""
        scores = self.source.scores(block).nan_to_num_(0.0)
        valid = block.valid
        if masks.may_hold_true(~valid):
            # An add of a (broadcast) -inf bias: several times faster than torch.where on a CPU.
            scores.add_(
                torch.zeros(valid.shape, dtype=scores.dtype, device=valid.device).masked_fill_(~valid, -math.inf)
            )
        return scores

    def __post_init__(self):  # p as an exact fraction once, outside any compiled region
        object.__setattr__(self, "fraction", masks.decimal_fraction(self.p))

    def region(self, block: Block, scores: Optional[torch.Tensor] = None):
        """(each row's candidates, (threshold, k, tied), n): the row's top k = ceil(p n) valid keys by
        score, ties at the threshold (the k-th largest valid score; +inf where k = 0) lowest key first."""
        scores = self._scores(block) if scores is None else scores
        n_valid = block.valid.sum(-1, keepdim=True)
        k = masks.ceil_of_product(n_valid, *self.fraction, block.shape[-1])  # exact for the decimal p
        threshold = masks.kth_largest(scores, k).masked_fill(k.expand(scores.shape[:-1] + (1,)) == 0, math.inf)
        region = scores >= threshold
        at_least = masks.as_bytes(region).sum(-1, keepdim=True, dtype=torch.int32)
        # Whether ties straddle the threshold in some row: kept, so the backward need not count.
        tied = masks.may_hold_true(at_least > k)
        if tied:
            region = masks.lowest_keys_first(scores, threshold, k.to(torch.int32), region, at_least)
        return region, (threshold, k, tied), n_valid

    def forward_drops(self, block: Block):
        scores = self._scores(block)
        region, state, n_valid = self.region(block, scores)
        return self._drop(block, scores, state, n_valid, region), state

    def backward_drops(self, block: Block, state) -> torch.Tensor:
        return self._drop(block, self._scores(block), state, None)

    def _drop(self, block: Block, scores, state, n_valid, region=None) -> torch.Tensor:
        threshold, k, tied = state
        if region is None:  # the backward: made again from the forward's thresholds
            region = scores >= threshold
            if tied:
                region = masks.lowest_keys_first(scores, threshold, k.to(torch.int32), region, None)
        drop = block.coins(self.q)
        drop &= region
        if self.samples is not None:
            drop &= self.samples.view(-1, 1, 1, 1)
        if n_valid is None:
            n_valid = block.valid.sum(-1, keepdim=True)
        if masks.may_hold_true(k >= n_valid):
            # A row whose every key is a candidate can lose them all: it keeps its lowest-scored one.
            drop = masks.keep_one_valid_key(drop, block.valid.expand(drop.shape), scores)
        return drop


def candidate_region(attribution: torch.Tensor, valid: torch.Tensor, p: float) -> torch.Tensor:
    """Boolean mask of each row's top ``ceil(p * n)`` valid keys by attribution, the whole map as one
    block of :meth:`~.block_rules.TopRegionRule.region` (its one home): ``n`` is the row's number of
    valid keys, ``ceil(p * n)`` exact for the decimal p, ties at the threshold lowest key first, invalid
    keys never candidates; so a call's region does not depend on its length."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"p must be in (0, 1], got {p}")
    shape = tuple(attribution.shape)
    return TopRegionRule(MapScores(attribution), p, 0.0).region(Block(slice(0, shape[-2]), valid, shape, shape, 0))[0]


def call_seed() -> torch.Tensor:
    """A seed drawn from torch's global generator, a 0-d int64 CPU tensor: a compiled region takes it
    as an input (no guard on its value), and an activation checkpoint, which restores that generator
    for its recompute, draws the same one again."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)
