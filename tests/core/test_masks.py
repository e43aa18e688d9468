"""core.masks: the candidate region, the drops and the additive masks on hand-built tensors, and
a hypothesis property test of the whole AD-DROP mask path through the kernel (CPU only).

Tensors are (B, H, T, S) = batch, heads, queries, keys; ``valid`` is True where a query
may attend a key (real key, and not a future one in causal attention).
"""

import contextlib
import itertools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_reg_plugin.core.kernel import masks as masks_module
from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import EditScores
from attn_reg_plugin.core.kernel.masks import additive_mask, mask_fill_value, pack_bits, unpack_bits
from attn_reg_plugin.core.kernel.rules import candidate_region, ceil_of_product, keep_one_valid_key
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from helpers import FLOAT_DTYPES, HandPass, ad_drop_masks

# Row-sum tolerance of a softmax stored in the dtype (a few ulps of 1 times the row length).
SUM_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


# A 1x1x3x5 attribution map with distinct values per row.
ATTR = torch.tensor([[[[5.0, 1.0, 4.0, 2.0, 9.0], [0.0, 3.0, -1.0, 7.0, 8.0], [2.0, 2.5, 1.0, 0.5, 3.0]]]])
PAD_LAST = torch.tensor([True, True, True, True, False]).view(1, 1, 1, 5)
CAUSAL = torch.ones(3, 5, dtype=torch.bool).tril()  # row i sees keys 0..i


def _b(rows):
    return torch.tensor(rows, dtype=torch.bool).view(1, 1, len(rows), len(rows[0]))


# ---------------------------------------------------------------- candidate region


@pytest.mark.parametrize(
    "p, expected",
    [
        # n = 4 valid keys per row: ceil(p * 4) candidates; key 4 (padding) is never one,
        # even though it holds row 0's and row 1's and row 2's largest attribution.
        (0.5, [[1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [1, 1, 0, 0, 0]]),  # 2 each
        (0.25, [[1, 0, 0, 0, 0], [0, 0, 0, 1, 0], [0, 1, 0, 0, 0]]),  # exactly 1.0 -> 1
        (0.2, [[1, 0, 0, 0, 0], [0, 0, 0, 1, 0], [0, 1, 0, 0, 0]]),  # ceil(0.8) = 1
        (0.3, [[1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [1, 1, 0, 0, 0]]),  # ceil(1.2) = 2
        (0.75, [[1, 0, 1, 1, 0], [1, 1, 0, 1, 0], [1, 1, 1, 0, 0]]),  # 3
        (1.0, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]),  # all valid
    ],
)
def test_candidate_region_padding_exact(p, expected):
    assert torch.equal(candidate_region(ATTR, PAD_LAST, p), _b(expected))


@pytest.mark.parametrize(
    "p, expected",
    [
        # n = 1, 2, 3 valid keys in rows 0, 1, 2.
        (0.5, [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 1, 0, 0, 0]]),  # 1, 1, 2
        (0.1, [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]),  # 1, 1, 1
        (0.9, [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]),  # 1, 2, 3
    ],
)
def test_candidate_region_causal_exact(p, expected):
    assert torch.equal(candidate_region(ATTR, CAUSAL, p), _b(expected))


def test_candidate_region_ceil_is_not_fooled_by_rounding():
    # In float64 0.07 * 100 = 7.000000000000001, 0.28 * 25 = 7.000000000000001,
    # 0.55 * 100 = 55.00000000000001, 0.56 * 25 = 14.000000000000002: ceil(p * n) of the
    # decimal p is still 7, 7, 55, 14.
    torch.manual_seed(0)
    cases = [(0.07, 100, 7), (0.28, 25, 7), (0.55, 100, 55), (0.56, 25, 14), (0.3, 10, 3), (0.6, 5, 3), (0.2, 1, 1)]
    for p, n, want in cases:
        attr = torch.randn(2, 3, 4, n)
        region = candidate_region(attr, torch.ones(1, 1, 1, n, dtype=torch.bool), p)
        assert (region.sum(-1) == want).all(), (p, n, region.sum(-1))


@pytest.mark.parametrize(
    "p, n, want",
    [
        (1e-9, 10, 1),  # any p > 0 makes one candidate of a non-empty row (a -1e-9 tolerance made 0)
        (1e-9, 1, 1),
        (0.2000000001, 10, 3),  # ceil(2.000000001) (the tolerance made 2)
        (0.2, 10, 2),  # the float 0.2 is 0.2000000000000000111: its exact ceil(10 p) would be 3
        (0.999999999999999999, 3, 3),
        (0.123456789012345678, 4096, 506),  # 18 decimals: the long-multiplication path
        (1 / 3, 100000, 33334),
    ],
)
def test_candidate_region_counts_ceil_of_the_decimal_p_exactly(p, n, want):
    region = candidate_region(torch.randn(2, 1, 3, n), torch.ones(1, 1, 1, n, dtype=torch.bool), p)
    assert (region.sum(-1) == want).all(), region.sum(-1)


def test_ceil_of_product_is_exact_on_both_paths():
    g = torch.Generator().manual_seed(0)
    for numerator, denominator, n_max in [(3, 10, 5000), (2000000001, 10**10, 2**20), (10**18 - 1, 10**18, 2**26)]:
        n = torch.cat([torch.randint(0, n_max + 1, (300,), generator=g), torch.tensor([0, 1, n_max])])
        want = torch.tensor([-(-int(m) * numerator // denominator) for m in n])
        assert torch.equal(ceil_of_product(n, numerator, denominator, n_max), want)


def test_p_with_more_decimal_places_than_the_exact_count_allows_is_refused():
    with pytest.raises(ValueError, match="more than 18 decimal places"):
        candidate_region(torch.randn(1, 1, 1, 4), torch.ones(1, 1, 1, 4, dtype=torch.bool), 1.5e-19)
    with pytest.raises(ValueError, match="--ad-drop-p: p = 1.5e-19 has more than 18 decimal places"):
        ADDropConfig(p=1.5e-19).validate()


def test_candidate_region_ignores_extreme_values_at_invalid_keys():
    # +inf / nan at padding must not make padding a candidate nor displace a valid key.
    attr = torch.tensor([[[[1.0, 3.0, 2.0, float("inf"), float("nan")]]]])
    valid = torch.tensor([True, True, True, False, False]).view(1, 1, 1, 5)
    assert torch.equal(candidate_region(attr, valid, 0.5), _b([[0, 1, 1, 0, 0]]))
    assert torch.equal(candidate_region(attr, valid, 1.0), _b([[1, 1, 1, 0, 0]]))


def test_candidate_region_valid_keys_with_minus_inf_attribution_still_count():
    # A valid key whose attribution is -inf (or nan) must not tie with the invalid keys:
    # with p = 1 both valid keys are candidates, never a padding key.
    valid = torch.tensor([False, False, True, True, False]).view(1, 1, 1, 5)
    for bad in (float("-inf"), float("nan")):
        attr = torch.tensor([[[[float("-inf"), float("-inf"), 1.0, bad, float("-inf")]]]])
        assert torch.equal(candidate_region(attr, valid, 1.0), _b([[0, 0, 1, 1, 0]])), bad
        drop = ad_drop_masks(attr, valid, 1.0, 1 - 1e-9, generator=torch.Generator().manual_seed(0))
        assert not (drop & ~valid).any() and drop.sum() == 1


def test_candidate_region_fully_padded_row_has_no_candidates():
    valid = torch.tensor([[True, True, False], [False, False, False]]).view(2, 1, 1, 3)
    region = candidate_region(torch.randn(2, 1, 1, 3), valid, 0.9)
    assert region[0].sum() == 2 and region[1].sum() == 0


@pytest.mark.parametrize("p", [0.0, -0.1, 1.5, float("nan")])
def test_candidate_region_rejects_bad_p(p):
    with pytest.raises(ValueError, match="p must be in"):
        candidate_region(ATTR, PAD_LAST, p)


# ---------------------------------------------------------------- drops


def _random_case(seed, B=3, H=2, T=6, S=9, causal=False):
    g = torch.Generator().manual_seed(seed)
    attr = torch.randn(B, H, T, S, generator=g)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    valid = (torch.arange(S)[None, :] < lengths[:, None]).view(B, 1, 1, S)
    if causal:
        valid = valid & torch.ones(T, S, dtype=torch.bool).tril()
    return attr, valid.expand(B, H, T, S)


@pytest.mark.parametrize("causal", [False, True])
def test_only_valid_candidates_are_dropped(causal):
    for seed in range(5):
        attr, valid = _random_case(seed, causal=causal)
        for p, q in [(0.3, 0.5), (0.6, 0.9), (0.9, 0.2)]:
            g = torch.Generator().manual_seed(seed + 100)
            drop = ad_drop_masks(attr, valid, p, q, generator=g)
            region = candidate_region(attr, valid, p)
            assert not (drop & ~region).any()
            assert not (drop & ~valid).any()


def test_tiny_q_drops_nothing():
    attr, valid = _random_case(1, B=4, H=4, T=16, S=32)
    drop = ad_drop_masks(attr, valid, 0.9, 1e-9, generator=torch.Generator().manual_seed(0))
    assert not drop.any()


def test_q_near_one_drops_every_candidate_when_candidates_are_not_the_whole_row():
    attr, valid = _random_case(2, B=4, H=2, T=8, S=16)
    p = 0.5
    drop = ad_drop_masks(attr, valid, p, 1 - 1e-9, generator=torch.Generator().manual_seed(0))
    region = candidate_region(attr, valid, p)
    n = valid.sum(-1)
    partial = torch.ceil(n * p) < n  # rows whose candidates leave >= 1 valid key
    assert torch.equal(drop[partial], region[partial])


@pytest.mark.parametrize("causal", [False, True])
def test_no_row_is_emptied_and_kept_key_is_lowest_attribution(causal):
    # p and q near 1: every valid key is a candidate and (almost surely) dropped.
    attr, valid = _random_case(3, B=4, H=3, T=7, S=7, causal=causal)
    for seed in range(10):
        drop = ad_drop_masks(attr, valid, 0.999, 1 - 1e-9, generator=torch.Generator().manual_seed(seed))
        kept = valid & ~drop
        has_valid = valid.any(-1)
        assert torch.equal(kept.sum(-1), has_valid.long())  # exactly one kept key per non-empty row
        lowest = attr.masked_fill(~valid, float("inf")).argmin(-1)
        kept_idx = kept.float().argmax(-1)
        assert torch.equal(kept_idx[has_valid], lowest[has_valid])


def test_kept_key_ignores_lower_attribution_at_padding():
    attr = torch.tensor([[[[3.0, 1.0, 2.0, -5.0]]]])  # padding key 3 has the lowest value
    valid = torch.tensor([True, True, True, False]).view(1, 1, 1, 4)
    drop = ad_drop_masks(attr, valid, 1.0, 1 - 1e-9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(drop, _b([[1, 0, 1, 0]]))


def test_causal_row_zero_and_length_one_sequences_keep_their_only_key():
    g = torch.Generator().manual_seed(0)
    attr = torch.randn(8, 4, 5, 5, generator=g)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    for _ in range(20):
        drop = ad_drop_masks(attr, causal, 0.99, 0.99, generator=g)
        assert not drop[..., 0, :].any()  # row 0 has exactly one valid key
        assert ((causal & ~drop).sum(-1) >= 1).all()
    one = torch.randn(3, 2, 1, 1, generator=g)
    for _ in range(5):
        assert not ad_drop_masks(one, torch.ones(1, 1, 1, 1, dtype=torch.bool), 0.99, 0.99, generator=g).any()


def test_keep_one_valid_key_without_attribution_keeps_first_valid_key():
    drop = _b([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 1, 0]])
    valid = _b([[1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 1, 0]])
    assert torch.equal(keep_one_valid_key(drop, valid), _b([[0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 1, 0]]))


def test_keep_one_valid_key_leaves_fully_padded_rows_alone():
    drop = _b([[0, 0, 0], [1, 1, 0]])
    valid = _b([[0, 0, 0], [1, 1, 0]])
    out = keep_one_valid_key(drop, valid, torch.tensor([[[[1.0, 2.0, 3.0], [5.0, 4.0, 0.0]]]]))
    assert torch.equal(out, _b([[0, 0, 0], [1, 0, 0]]))


def test_empirical_drop_rate_is_p_times_q():
    # Rows of 200 valid keys: ceil(0.5 * 200) = 100 candidates exactly, each dropped with
    # probability 0.3, no row can be emptied. 4*4*64 rows -> N = 102400 Bernoulli(0.3) draws;
    # the drop rate over valid keys is (dropped / N) * 0.5 with standard deviation
    # 0.5 * sqrt(0.3 * 0.7 / N) = 7.2e-4, so 0.004 is > 5 sigma.
    torch.manual_seed(0)
    attr = torch.randn(4, 4, 64, 200)
    valid = torch.ones(1, 1, 1, 200, dtype=torch.bool)
    drop = ad_drop_masks(attr, valid, 0.5, 0.3)
    rate = drop.sum().item() / drop.numel()
    assert abs(rate - 0.15) < 0.004, rate
    # With padding (n = 150 per row, 75 candidates) the rate over *valid* keys is still p*q.
    valid = (torch.arange(200) < 150).view(1, 1, 1, 200)
    drop = ad_drop_masks(attr, valid, 0.5, 0.3)
    assert not drop[..., 150:].any()
    rate = drop.sum().item() / (4 * 4 * 64 * 150)
    assert abs(rate - 0.15) < 0.005, rate


def test_seeded_generator_gives_identical_masks():
    attr, valid = _random_case(4, B=4, H=4, T=16, S=16)
    a = ad_drop_masks(attr, valid, 0.5, 0.5, generator=torch.Generator().manual_seed(123))
    b = ad_drop_masks(attr, valid, 0.5, 0.5, generator=torch.Generator().manual_seed(123))
    c = ad_drop_masks(attr, valid, 0.5, 0.5, generator=torch.Generator().manual_seed(124))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    torch.manual_seed(7)
    d = ad_drop_masks(attr, valid, 0.5, 0.5)
    torch.manual_seed(7)
    assert torch.equal(d, ad_drop_masks(attr, valid, 0.5, 0.5))


# ---------------------------------------------------------------- additive masks / dtypes


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_mask_fill_value_is_finite_even_when_added_twice(dtype):
    v = mask_fill_value(dtype)
    assert v == torch.finfo(dtype).min / 4
    t = torch.tensor(v, dtype=dtype)
    assert torch.isfinite(t + t) and (t + t) < -1e4


def test_mask_fill_value_rejects_integer_dtype():
    with pytest.raises(TypeError):
        mask_fill_value(torch.int64)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_additive_mask_values(dtype):
    drop = torch.tensor([[True, False], [False, True]])
    m = additive_mask(drop, dtype)
    assert m.dtype == dtype
    assert (m[~drop] == 0).all()
    assert (m[drop] == torch.tensor(mask_fill_value(dtype), dtype=dtype)).all()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bias_kind", ["neg-inf", "bool", "causal"])
def test_masked_softmax_in_low_precision_has_no_nan_and_zero_at_dropped(dtype, bias_kind):
    torch.manual_seed(0)
    B, H, T, S, d = 3, 2, 6, 6, 8
    q, k, v = (torch.randn(B, H, n, d).mul(3).to(dtype) for n in (T, S, S))
    lengths = torch.tensor([6, 3, 1])
    pad_valid = (torch.arange(S)[None, :] < lengths[:, None]).view(B, 1, 1, S)
    if bias_kind == "neg-inf":
        valid = pad_valid
        bias = torch.zeros(B, 1, 1, S, dtype=dtype).masked_fill(~pad_valid, float("-inf"))
    elif bias_kind == "bool":
        valid = pad_valid
        bias = pad_valid
    else:
        valid = pad_valid & torch.ones(T, S, dtype=torch.bool).tril()
        bias = torch.zeros(B, 1, T, S, dtype=dtype).masked_fill(~valid, float("-inf"))
    valid = valid.expand(B, H, T, S)
    attr = torch.randn(B, H, T, S)
    drop = ad_drop_masks(attr, valid, 0.9, 0.9, generator=torch.Generator().manual_seed(1))
    assert drop.any()
    out, probs = attend(q, k, v, bias, **HandPass(EditScores(drop=drop)).call, need_weights=True)
    assert probs.dtype == dtype
    assert torch.isfinite(probs).all() and torch.isfinite(out).all()
    assert (probs[drop] == 0).all()
    assert (probs[~valid] == 0).all()
    assert torch.allclose(probs.float().sum(-1), torch.ones(B, H, T), atol=SUM_TOL[dtype])
    # The fused path (no need_weights) agrees with the explicit one and is finite too.
    fused, _ = attend(q, k, v, bias, **HandPass(EditScores(drop=drop)).call)
    assert torch.isfinite(fused).all()
    ref = torch.matmul(probs.float(), v.float())
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    assert torch.allclose(fused.float(), ref, atol=tol), (fused.float() - ref).abs().max()


# ---------------------------------------------------------------- property-based


@st.composite
def _mask_cases(draw):
    B = draw(st.integers(1, 3))
    H = draw(st.integers(1, 3))
    T = draw(st.integers(1, 6))
    S = draw(st.integers(1, 9))
    causal = draw(st.booleans()) and T <= S
    lengths = draw(st.lists(st.integers(1, S), min_size=B, max_size=B))
    # Padding anywhere (not only at the end): each batch row keeps >= 1 real key.
    pad_rows = []
    for n_real in lengths:
        perm = draw(st.permutations(range(S)))
        pad_rows.append([i in perm[:n_real] for i in range(S)])
    if causal:  # keep key 0 real so every causal row has a valid key
        pad_rows = [[True] + r[1:] for r in pad_rows]
    p = draw(st.one_of(st.integers(1, 99).map(lambda i: i / 100), st.floats(0.01, 0.99)))
    q = draw(st.floats(0.01, 0.99))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    return B, H, T, S, causal, pad_rows, p, q, dtype, seed


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_mask_cases())
def test_property_ad_drop_masks(case):
    B, H, T, S, causal, pad_rows, p, q, dtype, seed = case
    g = torch.Generator().manual_seed(seed)
    key_real = torch.tensor(pad_rows, dtype=torch.bool).view(B, 1, 1, S)
    valid = key_real
    if causal:
        valid = valid & torch.ones(T, S, dtype=torch.bool).tril()
    valid = valid.expand(B, H, T, S)
    attr = torch.randn(B, H, T, S, generator=g).to(dtype)
    region = candidate_region(attr, valid, p)
    n = valid.sum(-1)
    # ceil(p * n) of the decimal p the user wrote (0.1 * 30 = 3, not binary 0.1's 4).
    want = [math.ceil(Fraction(repr(p)) * x) for x in n.flatten().tolist()]
    assert region.sum(-1).flatten().tolist() == want
    assert not (region & ~valid).any()
    drop = ad_drop_masks(attr, valid, p, q, generator=g)
    assert not (drop & ~valid).any()
    assert not (drop & ~region).any()
    assert ((valid & ~drop).sum(-1) >= 1)[n > 0].all()
    q_, k_, v_ = (torch.randn(B, H, m, 4, generator=g).to(dtype).requires_grad_() for m in (T, S, S))
    bias = torch.zeros(B, 1, T if causal else 1, S, dtype=dtype).masked_fill(~valid[:, :1], float("-inf"))
    out, probs = attend(q_, k_, v_, bias, **HandPass(EditScores(drop=drop)).call, need_weights=True)
    assert not torch.isnan(out).any() and not torch.isnan(probs).any()
    assert (probs[drop | ~valid] == 0).all()
    fused, _ = attend(q_, k_, v_, bias, **HandPass(EditScores(drop=drop)).call)
    assert torch.isfinite(fused).all()
    (out.float().sum() + fused.float().square().sum()).backward()  # both paths, backward too
    assert all(torch.isfinite(t.grad).all() for t in (q_, k_, v_))


@given(
    shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    n=st.integers(1, 70),
    density=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_packed_bits_unpack_to_the_mask_and_take_an_eighth(shape, n, density, seed):
    mask = torch.rand((*shape, n), generator=torch.Generator().manual_seed(seed)) < density
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape, -(-n // 8))
    assert torch.equal(unpack_bits(packed, n), mask)
    # The shifts (every device but a CPU) write the same bytes as numpy's packbits (a CPU), and
    # each unpacks the other's.
    with without_numpy():
        by_shifts = pack_bits(mask)
        assert torch.equal(unpack_bits(packed, n), mask)
    assert torch.equal(by_shifts, packed)
    assert torch.equal(unpack_bits(by_shifts, n), mask)


@contextlib.contextmanager
def without_numpy():
    saved, masks_module._numpy = masks_module._numpy, None
    try:
        yield
    finally:
        masks_module._numpy = saved


@pytest.mark.parametrize("numpy_path", [True, False])
def test_packed_bits_are_little_endian_per_byte(numpy_path):
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[0, 3] = mask[0, 9] = mask[1, 7] = mask[1, 8] = True
    with contextlib.nullcontext() if numpy_path else without_numpy():
        assert pack_bits(mask).tolist() == [[8, 2], [128, 1]]
        # A view that starts mid-word and a broadcast one (stride 0) pack as their values do.
        assert pack_bits(mask.view(-1)[3:19].view(1, 16)).tolist() == [[65, 0]]
        assert pack_bits(mask[:1].expand(3, 16)).tolist() == [[8, 2]] * 3


@pytest.mark.parametrize("layout", ["contiguous", "heads-innermost"])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("seed", range(4))
def test_dense_candidates_take_tied_keys_lowest_first_as_the_blockwise_rule_does(p, seed, layout):
    """Attributions with many exact ties (AA's weights of repeated tokens tie exactly): each row's
    region is its ceil(p n) valid keys by score, the lowest-indexed first among equal scores: the
    order a stable descending sort gives, and the rule of every block of the blockwise kernel."""
    g = torch.Generator().manual_seed(seed)
    b, h, t, s = 2, 3, 5, 40
    scores = torch.randint(0, 3, (b, h, t, s), generator=g).float()
    valid = (torch.arange(s)[None, :] < torch.tensor([s, s - 9])[:, None])[:, None, None, :]
    if layout == "heads-innermost":  # as T5's position-bias mask lays out its validity (B, H, T, S)
        valid = valid.expand(b, h, t, s).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    region = candidate_region(scores, valid, p)
    for i, j, r in itertools.product(range(b), range(h), range(t)):
        n = int(valid[i, 0, 0].sum())
        order = sorted(range(n), key=lambda key: (-float(scores[i, j, r, key]), key))
        expected = torch.zeros(s, dtype=torch.bool)
        expected[order[: math.ceil(Fraction(repr(p)) * n)]] = True
        assert torch.equal(region[i, j, r], expected), (i, j, r)
