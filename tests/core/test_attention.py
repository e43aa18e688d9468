"""core.attention: the ``attend`` kernel against a float64 reference, with and without a site's edits
(CPU only). Tensors are (B, H, T, S) = batch, heads, queries, keys."""

import pytest
import torch

from attn_reg_plugin.core.kernel import blockwise, rules
from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import CaptureOutput, EditScores
from attn_reg_plugin.core.kernel.rules import BernoulliRule
from helpers import FLOAT_DTYPES, HandPass, ad_drop_masks

# ---------------------------------------------------------------- the kernel


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("need_weights", [False, True])
def test_query_rows_without_any_valid_key_stay_finite(dtype, need_weights):
    # Left padding + causal mask: query row 0 of batch row 1 sees only key 0, which is padding,
    # so its whole row is -inf in the bias. Such rows must not produce NaN (the bias is clamped
    # to a finite value), and rows with valid keys are unaffected.
    torch.manual_seed(0)
    T = 4
    q, k, v = (torch.randn(2, 2, T, 8).to(dtype) for _ in range(3))
    real = torch.tensor([[True] * T, [False, False, True, True]]).view(2, 1, 1, T)
    valid = real & torch.ones(T, T, dtype=torch.bool).tril()
    bias = torch.zeros(2, 1, T, T, dtype=dtype).masked_fill(~valid, float("-inf"))
    drop = ad_drop_masks(torch.randn(2, 2, T, T), valid, 0.5, 0.5, generator=torch.Generator().manual_seed(0))
    for call in ({}, HandPass(EditScores(drop=drop)).call):
        out, _ = attend(q, k, v, bias, **call, need_weights=need_weights)
        assert torch.isfinite(out).all()
        has_valid = valid.expand(2, 2, T, T).any(-1)
        ref = _reference(q, k, v, valid & ~drop if call else valid)[0]
        tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}[dtype]
        assert torch.allclose(out.double()[has_valid], ref[has_valid], atol=tol)


def _reference(q, k, v, valid, scale=None, uniform_rows=None):
    """softmax(q k^T * scale + bias) v in float64; bias -inf where not valid."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if uniform_rows is not None:
        scores = scores.masked_fill(uniform_rows, 0.0)
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, -1)
    return probs @ v, probs


def _qkv(B=2, H=3, T=5, S=7, d=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, d, generator=g).to(dtype) for n in (T, S, S)]


def _pad_bias(lengths, S, dtype=torch.float32):
    valid = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).view(len(lengths), 1, 1, S)
    return torch.zeros(valid.shape, dtype=dtype).masked_fill(~valid, float("-inf")), valid


@pytest.mark.parametrize(
    "dtype, tol, need_weights",
    [
        (torch.float32, 1e-5, False),
        (torch.float32, 1e-5, True),
        (torch.float64, 1e-12, False),
        (torch.float64, 1e-12, True),
    ],
)
def test_attend_without_site_matches_reference(dtype, tol, need_weights):
    q, k, v = _qkv(dtype=dtype)
    bias, valid = _pad_bias([7, 4], 7, dtype)
    for scale in (None, 0.3):
        out, probs = attend(q, k, v, bias, scale=scale, need_weights=need_weights)
        ref_out, ref_probs = _reference(q, k, v, valid, scale=scale)
        assert torch.allclose(out.double(), ref_out, atol=tol, rtol=tol)
        if need_weights:
            assert torch.allclose(probs.double(), ref_probs, atol=tol)
        else:
            assert probs is None
    out, _ = attend(q, k, v)  # no bias at all
    assert torch.allclose(out.double(), _reference(q, k, v, torch.ones(1, dtype=torch.bool))[0], atol=tol)


def test_attend_need_weights_keeps_float64_precision():
    q, k, v = _qkv(dtype=torch.float64)
    bias, valid = _pad_bias([7, 4], 7, torch.float64)
    out, probs = attend(q, k, v, bias, need_weights=True)
    ref_out, ref_probs = _reference(q, k, v, valid)
    assert torch.allclose(probs, ref_probs, atol=1e-12, rtol=0)
    assert torch.allclose(out, ref_out, atol=1e-12, rtol=0)


@pytest.mark.parametrize("need_weights", [False, True])
def test_attend_with_drop_matches_reference_with_keys_removed(need_weights):
    q, k, v = _qkv(T=5, S=5)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    bias = torch.zeros(5, 5).masked_fill(~causal, float("-inf"))
    attr = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(9))
    drop = ad_drop_masks(attr, causal, 0.7, 0.7, generator=torch.Generator().manual_seed(3))
    assert drop.any()
    out, probs = attend(q, k, v, bias, **HandPass(EditScores(drop=drop)).call, need_weights=need_weights)
    ref_out, ref_probs = _reference(q, k, v, causal & ~drop)
    assert torch.allclose(out.double(), ref_out, atol=1e-5)
    if need_weights:
        assert torch.allclose(probs.double(), ref_probs, atol=1e-6)
    # Without any bias, a drop mask alone removes keys too.
    out, _ = attend(q, k, v, None, **HandPass(EditScores(drop=drop)).call)
    assert torch.allclose(out.double(), _reference(q, k, v, ~drop)[0], atol=1e-5)


def test_attend_drop_counts_dropped_and_valid_keys_and_refuses_what_is_no_mask_or_rule():
    q, k, v = _qkv()
    bias, valid = _pad_bias([7, 3], 7)
    drop = (torch.arange(7) == 0).view(1, 1, 1, 7)
    site = HandPass(EditScores(drop=drop, counted=True))
    out, _ = attend(q, k, v, bias, **site.call)
    stats = site.record.counts()
    with pytest.raises(TypeError, match="EditScores.drop must be a bool tensor or a BlockRule"):
        EditScores(drop=lambda valid: valid)
    assert torch.allclose(out.double(), _reference(q, k, v, valid & (torch.arange(7) != 0))[0], atol=1e-5)
    assert stats[0].item() == 2 * 3 * 5  # key 0 of every row
    assert stats[1].item() == 3 * 5 * (7 + 3)


@pytest.mark.parametrize("split", [False, True])
def test_a_row_the_drops_empty_attends_uniformly_and_counts_its_keys_dropped(split, monkeypatch):
    """AttendOut's Eq. 4: a row that would lose every valid key attends uniformly to them instead. The
    rule dropped those keys, so they count: a rate of 1 is logged as 1, not 0."""
    if split:
        monkeypatch.setattr(rules, "CHUNK_ROWS", 2)
        monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", 1)
        monkeypatch.setattr(blockwise, "LINEAR_FACTOR", 0)
        monkeypatch.setattr(blockwise, "ONE_BLOCK_KEYS", 0)
    q, k, v = _qkv()
    bias, valid = _pad_bias([7, 3], 7)
    drop = (torch.arange(7) < 3).view(1, 1, 1, 7)  # sample 1's three valid keys: its rows are emptied
    site = HandPass(EditScores(drop=drop, counted=True))
    out, _ = attend(q, k, v, bias, **site.call)
    dropped, droppable = site.record.counts()
    assert int(dropped) == 3 * 5 * 3 + 3 * 5 * 3 and int(droppable) == 3 * 5 * (7 + 3)
    torch.testing.assert_close(out[1], v[1, :, :3].mean(-2, keepdim=True).expand(3, 5, -1))


@pytest.mark.parametrize(
    "shape",
    [(0, 2, 4, 5), (2, 0, 4, 5), (2, 2, 0, 5), (2, 2, 3, 0)],
    ids=["no-batch", "no-heads", "no-rows", "no-keys"],
)
def test_an_edit_of_an_empty_call_gives_an_empty_output_and_no_counts(shape):
    """An empty batch reaches the kernel (a last, empty shard of data): its edit attends to nothing
    and counts 0 instead of failing in the look for the keys in use."""
    b, h, t, s = shape
    q, k, v = (torch.randn(b, h, n, 4) for n in (t, s, s))
    bias = torch.ones(b, 1, 1, s, dtype=torch.bool)
    site = HandPass(EditScores(drop=BernoulliRule(torch.tensor(0.5)), counted=True))
    out, _ = attend(q, k, v, bias, **site.call)
    assert out.shape == (b, h, t, 4) and not out.any()  # a row with no key attends to nothing: 0
    assert [int(x) for x in site.record.counts()[:2]] == [0, 0]


def test_uniform_rows_false_makes_no_row_uniform():
    q, k, v = _qkv(B=2, H=3, T=5, S=7)
    bias, _ = _pad_bias([7, 3], 7)
    plain, _ = attend(q, k, v, bias)
    out, _ = attend(q, k, v, bias, **HandPass(EditScores(uniform_rows=False)).call)
    assert torch.equal(out, plain)


def test_attend_uniform_rows_attend_uniformly_to_valid_keys():
    q, k, v = _qkv(B=2, H=3, T=5, S=7)
    bias, valid = _pad_bias([7, 3], 7)
    uniform = torch.zeros(2, 3, 5, 1, dtype=torch.bool)
    uniform[0, 1, 2] = uniform[1, 0, 0] = uniform[1, 2, 4] = True
    out, probs = attend(q, k, v, bias, **HandPass(EditScores(uniform_rows=uniform)).call, need_weights=True)
    n = valid.expand(2, 3, 5, 7).sum(-1, keepdim=True).float()
    u = uniform.squeeze(-1)
    want = (valid.expand(2, 3, 5, 7).float() / n)[u]
    assert torch.allclose(probs[u], want, atol=1e-7, rtol=0)
    assert (probs[u][~valid.expand(2, 3, 5, 7)[u]] == 0).all()
    # Output of a uniform row = mean of its valid value rows; other rows are unchanged.
    mean_v = (v.double() * valid.view(2, 1, 7, 1)).sum(-2, keepdim=True) / n.double()
    ref_out, _ = _reference(q, k, v, valid)
    ref_out = torch.where(uniform, mean_v.expand_as(ref_out), ref_out)
    assert torch.allclose(out.double(), ref_out, atol=1e-5)
    fused, _ = attend(q, k, v, bias, **HandPass(EditScores(uniform_rows=uniform)).call)
    assert torch.allclose(fused.double(), ref_out, atol=1e-5)


def test_attend_site_without_hook_is_plain_attention():
    q, k, v = _qkv()
    bias, valid = _pad_bias([5, 7], 7)
    out, _ = attend(q, k, v, bias, **HandPass(None).call)
    assert torch.allclose(out.double(), _reference(q, k, v, valid)[0], atol=1e-5)


def test_edit_stats_count_every_head_and_callable_sees_full_shape():
    """A mask shared by heads (B, 1, T, S) drops in every head."""
    q = k = v = torch.randn(2, 3, 4, 4)
    shared = torch.zeros(2, 1, 4, 4, dtype=torch.bool)
    shared[:, :, :, 1] = True
    site = HandPass(EditScores(drop=shared, counted=True))
    attend(q, k, v, **site.call)
    counts = site.record.counts()
    assert counts[0].item() == 2 * 3 * 4 and counts[1].item() == 2 * 3 * 4 * 4


# ---------------------------------------------------------------- the ordinary (idle) fast path


def _idle_cases(dtype):
    """Masks an idle call gets: none, bool, float -inf padding, and left-padded causal rows with no
    valid key, as bool, as -inf and as transformers' finite fill (the dtype's minimum)."""
    keys = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    valid = keys[:, None, None, :] & torch.ones(6, 6, dtype=torch.bool).tril()  # rows 0-1 of sample 1: no key
    padding = keys[:, None, None, :]
    return {
        "no bias": (None, torch.ones(1, 1, 1, 6, dtype=torch.bool)),
        "bool padding": (padding, padding),
        "-inf padding": (torch.zeros(padding.shape, dtype=dtype).masked_fill(~padding, float("-inf")), padding),
        "bool keyless rows": (valid, valid),
        "-inf keyless rows": (torch.zeros(valid.shape, dtype=dtype).masked_fill(~valid, float("-inf")), valid),
        "finite keyless rows": (
            torch.zeros(valid.shape, dtype=dtype).masked_fill(~valid, torch.finfo(dtype).min),
            valid,
        ),
    }


def _output_and_grads(q0, k0, v0, bias, upstream, **kwargs):
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    torch.manual_seed(7)  # the same dropout draws in every path
    out, _ = attend(q, k, v, bias, **kwargs)
    (out.float() * upstream).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(_idle_cases(torch.float32)))
def test_idle_call_equals_the_explicit_softmax_path(dtype, case):
    """Forward and gradient of an idle call (no site, or a site without hook) against softmax in
    float64 over the valid keys; a row with no valid key gives 0 and sends no gradient."""
    bias, valid = _idle_cases(dtype)[case]
    q0, k0, v0 = _qkv(B=2, H=2, T=6, S=6, d=8, dtype=dtype, seed=3)
    upstream = torch.randn(2, 2, 6, 8, generator=torch.Generator().manual_seed(4))
    ref_q, ref_k, ref_v = (t.double().clone().requires_grad_() for t in (q0, k0, v0))
    scores = (ref_q @ ref_k.transpose(-2, -1)) * 8**-0.5
    ref_out = torch.softmax(scores.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0) @ ref_v  # keyless: 0
    (ref_out * upstream.double()).sum().backward()
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}[dtype]
    for call in ({}, HandPass(None).call):
        got = _output_and_grads(q0, k0, v0, bias, upstream, **call)
        for mine, want in zip(got, [ref_out.detach(), ref_q.grad, ref_k.grad, ref_v.grad]):
            torch.testing.assert_close(mine.double(), want, atol=tol * 4, rtol=tol * 4)
        keyless = ~valid.expand(2, 2, 6, 6).any(-1)
        assert (got[0][keyless] == 0).all() and (got[1][keyless] == 0).all()


def _stock_sdpa_output_and_grads(q0, k0, v0, bias, upstream, dropout_p: float):
    """What stock sdpa gives the mask as a model hands it (disallowed scores at -inf), the same draws."""
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    if bias is not None and bias.dtype != torch.bool:
        bias = bias.masked_fill(bias <= -1e4, float("-inf"))
    torch.manual_seed(7)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p)
    (out.float() * upstream).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(_idle_cases(torch.float32)))
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_ordinary_call_is_stock_sdpa_bit_for_bit_on_the_cpu(dtype, case, dropout_p):
    """The one ordinary path (finite fill, keyless rows zeroed after, on every device) gives on a CPU
    the bits sdpa gives the mask as given, forward and backward, dropout draws included: the kernel
    changes nothing a model computes while idle."""
    bias, _ = _idle_cases(dtype)[case]
    q0, k0, v0 = _qkv(B=2, H=2, T=6, S=6, d=8, dtype=dtype, seed=5)
    upstream = torch.randn(2, 2, 6, 8, generator=torch.Generator().manual_seed(6))
    ours = _output_and_grads(q0, k0, v0, bias, upstream, dropout_p=dropout_p)
    stock = _stock_sdpa_output_and_grads(q0, k0, v0, bias, upstream, dropout_p)
    for a, b in zip(ours, stock):
        assert torch.equal(a, b)


def test_a_call_writes_nothing_on_its_site_or_plan_and_a_recompute_captures_nothing():
    """attend() reads the plan's hook and hands the counts to the pass: the site and the plan are as they were. The
    kernel given the same AttentionCall as a recompute, from the same point of torch's stream (where
    a checkpoint restores it), makes the same drops and captures and counts nothing."""
    from attn_reg_plugin.core.kernel.attention import attention_kernel
    from attn_reg_plugin.core.kernel.attention_call import AttentionCall
    from attn_reg_plugin.core.kernel.rules import BernoulliRule

    q, k, v = _qkv()
    hook = EditScores(drop=BernoulliRule(torch.tensor(0.5)), counted=True)
    one = HandPass(hook)
    site_before, plan_before = dict(vars(one.site)), dict(one.plan.calls)
    torch.manual_seed(0)
    out, _ = attend(q, k, v, **one.call)
    stats = one.record.counts()
    assert vars(one.site) == site_before == {"kind": "encoder-self", "layer": 0}
    assert dict(one.plan.calls) == plan_before and one.plan.of(one.site)[0] is hook
    assert 0 < int(stats[0]) < int(stats[1]) == q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    torch.manual_seed(0)
    again, _, recounted = attention_kernel(q, k, v, None, 0.0, None, False, AttentionCall(hook, recompute=True))
    assert torch.equal(again, out) and recounted is None and int(stats[0]) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(_idle_cases(torch.float32)))
def test_idle_call_on_cuda_equals_the_explicit_softmax_path(dtype, case):
    """On CUDA the ordinary path is the CPU's (finite fill, rows without keys zeroed by the kernel):
    it does not rely on sdpa's flash / memory-efficient / cuDNN kernels giving a fully masked row 0,
    which they do not for a bool mask in half precision (measured on an H200, torch 2.11: rows off by
    up to 2.1)."""
    bias, valid = _idle_cases(dtype)[case]
    q0, k0, v0 = (t.cuda() for t in _qkv(B=2, H=2, T=6, S=6, d=8, dtype=dtype, seed=3))
    bias, valid = (None if bias is None else bias.cuda()), valid.cuda()
    upstream = torch.randn(2, 2, 6, 8, generator=torch.Generator().manual_seed(4)).cuda()
    ref_q, ref_k, ref_v = (t.double().clone().requires_grad_() for t in (q0, k0, v0))
    scores = (ref_q @ ref_k.transpose(-2, -1)) * 8**-0.5
    ref_out = torch.softmax(scores.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0) @ ref_v
    (ref_out * upstream.double()).sum().backward()
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}[dtype]
    got = _output_and_grads(q0, k0, v0, bias, upstream)
    for mine, want in zip(got, [ref_out.detach(), ref_q.grad, ref_k.grad, ref_v.grad]):
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine.double(), want, atol=tol * 4, rtol=tol * 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_idle_call_on_cuda_at_a_real_size_with_dropout_stays_finite(dtype):
    """A left-padded causal batch at a model's size (S = 128, d = 64) with attention dropout:
    every output and gradient finite, padding queries 0."""
    B, H, S, d = 4, 8, 128, 64
    lengths = torch.tensor([128, 100, 37, 1])
    keys = torch.arange(S)[None, :] >= (S - lengths)[:, None]  # left padding
    valid = (keys[:, None, None, :] & torch.ones(S, S, dtype=torch.bool).tril()).cuda()
    q, k, v = (torch.randn(B, H, S, d, dtype=dtype, device="cuda", requires_grad=True) for _ in range(3))
    bias = torch.zeros(valid.shape, dtype=dtype, device="cuda").masked_fill(~valid, torch.finfo(dtype).min)
    out, _ = attend(q, k, v, bias, dropout_p=0.1)
    out.float().sum().backward()
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    keyless = ~valid.any(-1)  # (B, 1, S)
    assert (out.detach()[keyless.expand(B, H, S)] == 0).all()


@pytest.mark.parametrize("long", [False, True], ids=["one block", "blocks"])
def test_grouped_key_value_heads_equal_repeated_ones_and_ga_keeps_them_unrepeated(long, monkeypatch):
    """k, v with fewer heads (grouped-query attention): the same output, gradients and AD-DROP drops
    as the heads repeated by hand (transformers' repeat_kv order), and GA's capture keeps V unrepeated,
    its scores equal to the repeated ones'."""
    from attn_reg_plugin.core.kernel import blockwise
    from attn_reg_plugin.core.kernel.rules import BernoulliRule, Block, GradientScores, TopRegionRule

    if long:
        monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", 1)
        monkeypatch.setattr(blockwise, "LINEAR_FACTOR", 0)
        monkeypatch.setattr(blockwise, "ONE_BLOCK_KEYS", 0)
    g = torch.Generator().manual_seed(0)
    q0 = torch.randn(2, 4, 5, 8, generator=g)
    k0, v0 = torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g)
    bias = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    bias[1, ..., 5:] = False
    upstream = torch.randn(2, 4, 5, 8, generator=g)
    grad_out = torch.randn(2, 4, 5, 8, generator=g)

    def run(repeat, hook):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        kk, vv = (k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)) if repeat else (k, v)
        site = HandPass(hook)
        torch.manual_seed(3)
        out, _ = attend(q, kk, vv, bias, **site.call)
        (out * upstream).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad], site.record

    for hook in (None, EditScores(drop=BernoulliRule(torch.tensor(0.4)), counted=True)):
        (grouped, record), (repeated, record_by_hand) = run(False, hook), run(True, hook)
        for a, b in zip(grouped, repeated):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        if hook is not None:
            assert torch.equal(record.counts()[0], record_by_hand.counts()[0]) and int(record.counts()[0]) > 0
    (_, record), (_, record_by_hand) = run(False, CaptureOutput()), run(True, CaptureOutput())
    assert record.values[0].shape == (2, 2, 7, 8) and record_by_hand.values[0].shape == (2, 4, 7, 8)
    rule = TopRegionRule(GradientScores(grad_out, record.values[0]), 0.5, 0.5)
    by_hand = TopRegionRule(GradientScores(grad_out, record_by_hand.values[0]), 0.5, 0.5)
    valid = bias.expand(2, 4, 5, 7)
    block = Block(slice(0, 5), valid, (2, 4, 5, 7), (2, 4, 5, 7), torch.tensor(1))
    torch.testing.assert_close(rule.source.scores(block), by_hand.source.scores(block))
    drops = rule.whole(valid, torch.tensor(1))
    assert torch.equal(drops, by_hand.whole(valid, torch.tensor(1))) and drops.any()


def test_key_value_heads_that_do_not_divide_the_query_heads_are_refused():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 3, 3, 8)
    with pytest.raises(ValueError, match=r"^attend: 4 query heads need key/value heads dividing them, got 3$"):
        attend(q, k, k)


def test_attend_takes_a_plan_or_the_call_read_from_it_not_both():
    from types import MappingProxyType

    from attn_reg_plugin.core.kernel.attention_call import ORDINARY, Plan

    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="give the plan .* or the call read from it .*, not both"):
        attend(q, q, q, plan=Plan(MappingProxyType({})), call=ORDINARY)
    out, _ = attend(q, q, q, call=ORDINARY)  # the call alone: ordinary attention
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))
