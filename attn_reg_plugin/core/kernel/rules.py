"""The drop rules: what a regularizer drops in one block of query rows, made again identically wherever it is needed.

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

import dataclasses
import fractions
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch

from .devices import on_host
from .masks import as_bytes, attention_weights, block_bias, causal_bias, may_hold_true

try:  # torch's CPU wheels come with numpy, but do not require it
    import numpy as _numpy
except ImportError:  # pragma: no cover
    _numpy = None


# Random numbers are drawn per chunk of query rows (blocks are whole chunks), tile by tile of keys.
CHUNK_ROWS = 64


KEY_TILE = 64


# The streams of a call's seed: the rules' coins, and the model's attention dropout in an edit
# (-2 is random scores', -4 the output edit's dropped heads).
COIN_STREAM = -1


WEIGHT_DROPOUT_STREAM = -3


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


def call_seed() -> torch.Tensor:
    """A seed drawn from torch's global generator, a 0-d int64 CPU tensor: a compiled region takes it
    as an input (no guard on its value), and an activation checkpoint, which restores that generator
    for its recompute, draws the same one again."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)


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
    invalid: Optional[torch.Tensor] = None  # ~valid, where the kernel made it for its masks

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
        return self._draws(stream, False) <= self._limit(probability)

    def kept(self, probability, stream: int = COIN_STREAM) -> torch.Tensor:
        """``~self.coins(probability, stream)``, as one comparison."""
        return self._draws(stream, False) > self._limit(probability)

    def _limit(self, probability):
        limit = coin_limit(probability)
        return limit.to(self.valid.device) if isinstance(limit, torch.Tensor) else limit

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


@dataclass(frozen=True, eq=False)
class LogitFactors:
    """Drop logits as factors, one map per sample: logit(b, i, j) = ``query[b, i] . key[b, j] + offset``,
    ``query`` (B, T, G), ``key`` (B, S, G), ``offset`` (0-d), float32; over its units: real queries and
    keys (``query_real`` (B, T), ``key_real`` (B, S), bool) and with ``causal`` no key after the query;
    with ``every_unit`` every pair (the real masks are then not read). AttendOut's Generator's policy
    (``attendout.policy.PolicyLogits``) and the fused kernel's :class:`SampledLogits` are such factors."""

    query: torch.Tensor
    key: torch.Tensor
    offset: torch.Tensor
    query_real: torch.Tensor
    key_real: torch.Tensor
    causal: bool
    every_unit: bool = False  # every (query, key) pair is a unit (no padding, not causal): no mask made

    def with_factors(self, query: torch.Tensor, key: torch.Tensor, offset: torch.Tensor):
        return dataclasses.replace(self, query=query, key=key, offset=offset)


@dataclass(frozen=True, eq=False)
class SampledLogits(LogitFactors):
    """A drop rule the fused Triton kernel draws itself (AttendOut's Generator): unit (b, i, j) of its
    :class:`LogitFactors` dropped with probability sigmoid(logit), one mask per sample shared by the heads,
    Gumbel-max over one Philox uniform per unit keyed by ``seed`` (an int, or a 0-d int64 CPU tensor: a
    compiled graph's, read only inside the operators), so that every kernel, and the log-probability of the
    actions, draws the very same."""

    seed: Union[int, torch.Tensor] = 0


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

    def sampled_logits(self) -> Optional[SampledLogits]:
        """The rule as the fused kernel draws it, for a rule whose draws are the kernel's own (its calls
        take the fused route wherever it covers them); None for the rules the route reads by their kind."""
        return None

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
                bias_rows = causal_bias(bias_rows, block.rows, keys, t, s, q_rows.device)
            part, _ = block_bias(bias_rows, torch.float32)
            if part is not None:
                logits = logits + part
            return attention_weights(logits, torch.float32)


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


# -- the region: each row's ceil(p n) largest valid scores, ties lowest key first ----------
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
        # (denominator - 1) + numerator * n as one op (a 0-d host addend: no launch of its own on a device)
        scaled = torch.add(torch.tensor(denominator - 1), n, alpha=numerator)
        return torch.div(scaled, denominator, rounding_mode="floor")
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


def kth_largest(scores: torch.Tensor, k: torch.Tensor, bound: Optional[int] = None) -> torch.Tensor:
    """Each row's k-th largest score, (..., 1); ``k`` (..., 1) per row, at least 1 where it matters
    (a row with k = 0 gets its largest). On a CPU, numpy's selection on the values alone, one
    partition per group of rows sharing k: for 128 rows of 4,096 keys and one k, 0.65 ms against
    torch.topk's 4.4 ms; for a causal block (20 values of k over 256 rows) 0.70 ms against 5.0 ms
    for one partition at every k. Elsewhere (another device, bfloat16, which numpy lacks) torch.topk,
    sized by ``bound``, a bound on k known on the host (ceil(p x keys) for the region): no read of k,
    so no device sync and no graph break. Without a bound, a top-k sized by k read on the host, or
    while torch.compile traces, a sort."""
    rows = scores.shape[:-1] + (1,)
    on_numpy = on_host(scores) and scores.dtype in (torch.float32, torch.float64, torch.float16)
    if bound is not None and not (_numpy is not None and on_numpy):
        # The `bound` largest of each row, sorted: the k-th is at k - 1, clamped to [0, bound - 1] in one
        # op (as k clamped to [1, keys] first: bound <= keys).
        top = scores.topk(max(1, min(bound, scores.shape[-1])), dim=-1, sorted=True).values
        return top.gather(-1, (k - 1).clamp(0, top.shape[-1] - 1).expand(rows))
    k = k.clamp(min=1, max=scores.shape[-1]).expand(rows)
    if _numpy is not None and on_numpy:
        return _kth_largest_numpy(scores, k)
    if torch.compiler.is_compiling():  # no host read of k: a sorted row, traced whatever k holds
        return scores.sort(dim=-1, descending=True).values.gather(-1, k - 1)
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


def keep_one_valid_key(
    drop: torch.Tensor, valid: torch.Tensor, attribution: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Un-drop one key in every row that would otherwise lose all its valid keys.

    The key kept is the valid key of lowest attribution (the least important one, so the
    regularizer's intent is kept as far as possible); without attribution, the first valid key.
    Rows with no valid key at all (fully padded queries) are left alone.
    """
    drop = drop & valid
    n_valid = valid.sum(-1, keepdim=True)  # before broadcasting (see candidate_region)
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
        invalid = ~valid if block.invalid is None else block.invalid
        if not on_host(valid):  # one fill, not the add's three ops (a launch each on a device)
            return scores.masked_fill_(invalid, -math.inf)
        if may_hold_true(invalid):
            # An add of a (broadcast) -inf bias: several times faster than torch.where on a CPU.
            scores.add_(
                torch.zeros(valid.shape, dtype=scores.dtype, device=valid.device).masked_fill_(invalid, -math.inf)
            )
        return scores

    def __post_init__(self):  # p as an exact fraction once, outside any compiled region
        object.__setattr__(self, "fraction", decimal_fraction(self.p))

    def region(self, block: Block, scores: Optional[torch.Tensor] = None):
        """(each row's candidates, (threshold, k, tied), n): the row's top k = ceil(p n) valid keys by
        score, ties at the threshold (the k-th largest valid score; +inf where k = 0) lowest key first."""
        return self._region(block, scores, True)

    def _region(self, block: Block, scores: Optional[torch.Tensor], inf_where_none: bool):
        """:meth:`region`; on a device, the threshold of a row with k = 0 left as :func:`kth_largest`
        gives it unless ``inf_where_none``. The rule's own drops need no +inf there: k = 0 where a row
        has no valid key (p > 0), so all its scores are -inf (:meth:`_scores`), and whatever its
        threshold no key is above it and k - 0 = 0 of those equal to it are taken (as with p = 0,
        whose threshold is the row's largest): no candidate, nothing dropped or kept back."""
        scores = self._scores(block) if scores is None else scores
        n_valid = block.valid.sum(-1, keepdim=True)
        k = ceil_of_product(n_valid, *self.fraction, block.shape[-1])  # exact for the decimal p
        numerator, denominator = self.fraction
        bound = -(-block.shape[-1] * numerator // denominator)  # ceil(p x keys) >= every row's k, on the host
        threshold = kth_largest(scores, k, bound)
        device = not on_host(scores)
        if inf_where_none or not device:
            threshold = threshold.masked_fill(k.expand(scores.shape[:-1] + (1,)) == 0, math.inf)
        if device:  # every row ranked: a device cannot look for rows whose ties straddle
            return _top_lowest_keys_first(scores, threshold, k), (threshold, k, True), n_valid
        region = scores >= threshold
        at_least = as_bytes(region).sum(-1, keepdim=True, dtype=torch.int32)
        # Whether ties straddle the threshold in some row: kept, so the backward need not count.
        tied = may_hold_true(at_least > k)
        if tied:
            region = lowest_keys_first(scores, threshold, k.to(torch.int32), region, at_least)
        return region, (threshold, k, tied), n_valid

    def forward_drops(self, block: Block):
        scores = self._scores(block)
        region, state, n_valid = self._region(block, scores, False)
        return self._drop(block, scores, state, n_valid, region), state

    def backward_drops(self, block: Block, state) -> torch.Tensor:
        return self._drop(block, self._scores(block), state, None)

    def _drop(self, block: Block, scores, state, n_valid, region=None) -> torch.Tensor:
        threshold, k, tied = state
        device = not on_host(scores)
        if region is None and device and tied:  # the backward: made again from the forward's thresholds
            region = _top_lowest_keys_first(scores, threshold, k)
        elif region is None:
            region = scores >= threshold
            if tied:
                region = lowest_keys_first(scores, threshold, k.to(torch.int32), region, None)
        drop = block.coins(self.q)
        drop &= region
        if self.samples is not None:
            drop &= self.samples.view(-1, 1, 1, 1)
        if n_valid is None:
            n_valid = block.valid.sum(-1, keepdim=True)
        if device:  # no look at whether a row can be emptied: the fix runs, in a few ops
            return _keep_lowest_in_emptied_rows(drop, scores, threshold, n_valid)
        if may_hold_true(k >= n_valid):
            # A row whose every key is a candidate can lose them all: it keeps its lowest-scored one.
            drop = keep_one_valid_key(drop, block.valid.expand(drop.shape), scores)
        return drop


def _top_lowest_keys_first(scores, threshold, k) -> torch.Tensor:
    """Each row's keys above ``threshold`` and, of those equal to it, the first k minus those above:
    :func:`lowest_keys_first` of every row, in the fewest ops (a device's, where each is a launch).
    ``scores >= threshold`` without those equal is ``scores > threshold``, and its count is what
    :func:`_ranked_by_scan` takes from k."""
    above = scores > threshold
    equal = scores == threshold
    take = k - as_bytes(above).sum(-1, keepdim=True, dtype=torch.int32)
    return above | (equal & (equal.cumsum(-1, dtype=torch.int32) <= take))


def _keep_lowest_in_emptied_rows(drop, scores, threshold, n_valid) -> torch.Tensor:
    """:func:`keep_one_valid_key` of a region's drops, in six ops (a device's, where each is a launch).
    The region lies within the valid keys (their scores are finite, the others' -inf:
    :meth:`TopRegionRule._scores`), so the drops need no AND with them, and a row is emptied when it
    drops as many keys as it has valid ones (a row with none drops none: its fix changes nothing). Only
    a row whose region is every valid key (k = n) can be emptied, and its threshold is then its least
    valid score: the key kept, the valid key of lowest score and first among equals (argmin's), is its
    first key equal to the threshold."""
    emptied = drop.sum(-1, keepdim=True) == n_valid
    lowest = as_bytes(scores == threshold).argmax(-1, keepdim=True)  # the first one: argmax's tie rule
    return torch.where(emptied, drop.scatter(-1, lowest, False), drop)


def candidate_region(attribution: torch.Tensor, valid: torch.Tensor, p: float) -> torch.Tensor:
    """Boolean mask of each row's top ``ceil(p * n)`` valid keys by attribution, the whole map as one
    block of :meth:`TopRegionRule.region` (its one home): ``n`` is the row's number of
    valid keys, ``ceil(p * n)`` exact for the decimal p, ties at the threshold lowest key first, invalid
    keys never candidates; so a call's region does not depend on its length."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"p must be in (0, 1], got {p}")
    shape = tuple(attribution.shape)
    return TopRegionRule(MapScores(attribution), p, 0.0).region(Block(slice(0, shape[-2]), valid, shape, shape, 0))[0]
