"""Properties of the masks and the kernel over random shapes (hypothesis), and exact gradients in
every mask shape (rows with no valid key included) on the fused and the math sdpa backends.

`make test` runs a few hundred examples in all; `make test-all` (HYPOTHESIS_PROFILE=thorough) more.
"""

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import EditScores
from attn_reg_plugin.core.kernel.rules import candidate_region
from helpers import HandPass, ad_drop_masks

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@st.composite
def attention_case(draw):
    """(valid (B, 1, T, S) bool, kind): 1-3 real keys per sequence, either padding side, every kind."""
    kind = draw(st.sampled_from(["encoder-self", "decoder-self", "encoder-decoder"]))
    batch = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 3), min_size=batch, max_size=batch))
    pad = draw(st.integers(0, 2))
    S = max(lengths) + pad
    T = S if kind != "encoder-decoder" else draw(st.integers(1, 4))
    left = draw(st.booleans())
    keys = torch.zeros(batch, S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        if left:
            keys[b, S - n :] = True
        else:
            keys[b, :n] = True
    valid = keys[:, None, None, :].expand(batch, 1, T, S)
    if kind == "decoder-self":  # causal: a query sees itself and earlier positions
        valid = valid & torch.ones(T, S, dtype=torch.bool).tril()
    return valid.contiguous(), kind


probabilities = st.one_of(st.sampled_from([0.01, 0.5, 0.99]), st.floats(0.01, 0.99))


@given(case=attention_case(), p=probabilities, q=probabilities, heads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_masks_drop_only_valid_keys_and_never_empty_a_row(case, p, q, heads, seed):
    valid, _ = case
    g = torch.Generator().manual_seed(seed)
    attribution = torch.randn(valid.shape[0], heads, *valid.shape[2:], generator=g)
    region = candidate_region(attribution, valid, p)
    n = valid.sum(-1, keepdim=True).expand(region.shape[:-1] + (1,))
    exact = Fraction(repr(p))  # the decimal p, in integers: ceil(p n) = -(-n num // den)
    expected = n.clone().apply_(lambda m: -(-m * exact.numerator // exact.denominator))
    assert torch.equal(region.sum(-1, keepdim=True), expected)
    drop = ad_drop_masks(attribution, valid, p, q, generator=g)
    assert not (drop & ~valid).any()  # padding and future keys are never dropped
    has_key = valid.any(-1, keepdim=True).expand_as(drop[..., :1])
    kept = (valid & ~drop).any(-1, keepdim=True)
    assert torch.equal(kept, has_key)  # a row with a real key keeps one


@given(case=attention_case(), p=probabilities, q=probabilities)
def test_realized_rate_is_the_documented_formula_in_expectation(case, p, q):
    """Per row with n real keys: k = ceil(p n) candidates, each dropped with probability q, except that
    a row whose every key was drawn (k = n, probability q^n) keeps one: E = q k - [k = n] q^n."""
    valid, _ = case
    draws = 400
    tiled = valid.repeat(draws, 1, 1, 1)
    attribution = torch.rand(tiled.shape, generator=torch.Generator().manual_seed(0))
    drop = ad_drop_masks(attribution, tiled, p, q, generator=torch.Generator().manual_seed(1))
    n = valid.sum(-1).double()
    k = torch.ceil(n * p - 1e-9)
    expected = torch.where(k == n, q * k - q**n, q * k) * (n > 0)
    realized = drop.sum(-1).double().view(draws, *n.shape).mean(0)
    # per-row count <= 3 Bernoullis: variance <= 3/4; 5 sigma over `draws` samples
    assert (realized - expected).abs().max() <= 5 * math.sqrt(0.75 / draws)


@given(case=attention_case(), dtype=st.sampled_from(DTYPES), q=probabilities, seed=st.integers(0, 2**16))
def test_kernel_weights_respect_every_mask_and_idle_equals_sdpa(case, dtype, q, seed):
    valid, kind = case
    B, _, T, S = valid.shape
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(B, 2, L, 4, generator=g).to(dtype) for L in (T, S, S)]
    # Idle: the kernel is sdpa with the boolean mask (a row with no valid key: 0, as sdpa gives it).
    idle, _ = attend(*qkv, bias=valid)
    stock = F.scaled_dot_product_attention(*qkv, attn_mask=valid)
    torch.testing.assert_close(idle.float(), stock.float().nan_to_num(0.0), atol=TOL[dtype], rtol=TOL[dtype])
    # Any drop mask, even one that empties rows (AttendOut): weights only on kept real keys, rows sum
    # to 1, an emptied row is uniform over its real keys, a row with no real key is 0; never NaN.
    drop = torch.rand(B, 2, T, S, generator=g) < q
    out, weights = attend(*qkv, bias=valid, **HandPass(EditScores(drop=drop)).call, need_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    has_key = valid.any(-1, keepdim=True).expand(B, 2, T, 1)
    emptied = (drop | ~valid).all(-1, keepdim=True) & has_key
    allowed = valid & (~drop | emptied)
    assert (weights.float()[~allowed.expand_as(weights)] == 0).all()
    sums = weights.float().sum(-1, keepdim=True)
    torch.testing.assert_close(sums, has_key.to(sums.dtype), atol=TOL[dtype] * 4, rtol=0)
    uniform = (valid / valid.sum(-1, keepdim=True).clamp(min=1)).expand_as(weights)
    rows = emptied.expand_as(weights)
    torch.testing.assert_close(weights.float()[rows], uniform[rows].float(), atol=TOL[dtype] * 4, rtol=0)


# -- gradients, exact, in every mask shape --------------------------------------------------------
def _left_padded_causal():
    """Batch of 2, 5 positions; sample 1 is left-padded by 2, so its rows 0 and 1 have no valid key."""
    keys = torch.tensor([[True] * 5, [False, False, True, True, True]])
    return keys[:, None, None, :] & torch.ones(5, 5, dtype=torch.bool).tril()


def _explicit(q, k, v, allowed):
    """The reference: softmax over allowed keys in float64; a row with none attends to nothing (0)."""
    scores = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs @ v.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["fused", "math"])
@pytest.mark.parametrize("edit", ["none", "drop", "capture"])
def test_kernel_gradients_equal_the_explicit_softmax_path(dtype, backend, edit):
    """Rows with no valid key (left-padded causal batches) send back no gradient with a regularizer
    active, on the fused and the math backends: the finite fill would spread them over padding keys,
    where torch's fused CPU backward is wrong by O(1)."""
    from attn_reg_plugin.core.kernel.attention_call import CaptureOutput

    valid = _left_padded_causal()
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(3))
    drop = (torch.rand(2, 2, 5, 5, generator=g) < 0.3) & valid
    drop[..., 0] = False  # keep every row's first valid key: no emptied row here (that is Eq. 4's case)
    drop = drop & ~(valid & ~drop).logical_not().all(-1, keepdim=True)
    hook = {"none": None, "drop": EditScores(drop=drop), "capture": CaptureOutput()}[edit]
    allowed = valid & ~drop if edit == "drop" else valid
    upstream = torch.randn(2, 2, 5, 8, generator=g)

    q, k, v = (t.to(dtype).clone().requires_grad_() for t in (q0, k0, v0))
    choice = SDPBackend.MATH if backend == "math" else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel([choice]), torch.enable_grad():
        out, _ = attend(q, k, v, bias=valid, **(HandPass(hook).call if hook is not None else {}))
    (out.float() * upstream).sum().backward()

    ref_q, ref_k, ref_v = (t.double().clone().requires_grad_() for t in (q0.to(dtype), k0.to(dtype), v0.to(dtype)))
    ref = _explicit(ref_q, ref_k, ref_v, allowed)
    (ref * upstream.double()).sum().backward()
    tol = dict(atol=TOL[dtype] * 8, rtol=TOL[dtype] * 8)
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    for mine, want in ((q, ref_q), (k, ref_k), (v, ref_v)):
        torch.testing.assert_close(mine.grad.double(), want.grad, **tol)
    assert (out[1, :, :2] == 0).all()  # the keyless rows attend to nothing
