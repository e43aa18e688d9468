"""core.hiddencut: the span on hand-built tensors (contiguous, floor(ratio * n) long, started among the
top-40% most-attended real tokens, never on padding), its rates over many draws, determinism, the JS
term against a hand computation, the attention statistic, the forward-hook cut and its counts, and the
config's refusals."""

import math

import pytest
import torch
import torch.nn.functional as F

from attn_reg_plugin.core.regularizers.hiddencut import (
    CutPlan,
    HiddenCutConfig,
    SpanCut,
    attention_received,
    attention_received_by_blocks,
    hiddencut_objective,
    hiddencut_spans,
    js_consistency,
    js_divergence,
)

pytestmark = pytest.mark.host_only  # no device branch: the portable run skips it

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_one_row_by_hand():
    """20 real tokens of 24: span floor(0.1 * 20) = 2 long; top floor(0.4 * 20) = 8 tokens by attention."""
    valid = torch.zeros(1, 24, dtype=torch.bool)
    valid[0, :20] = True
    received = torch.zeros(1, 24)
    top = [3, 7, 11, 12, 15, 18, 19, 0]
    for rank, pos in enumerate(top):
        received[0, pos] = 10.0 - rank
    received[0, 22] = 100.0  # padding, however attended, is never a start
    starts = set()
    for seed in range(400):
        cut = hiddencut_spans(valid, received, 0.1, 0.4, generator=_gen(seed))[0]
        where = cut.nonzero().flatten().tolist()
        start = where[0]
        starts.add(start)
        # contiguous, 2 long, stops at the last real token (19)
        assert where == list(range(start, min(start + 2, 20)))
    assert starts == set(top)


def test_ties_rank_the_lower_position_first():
    valid = torch.ones(1, 10, dtype=torch.bool)
    received = torch.ones(1, 10)  # all equal: the top floor(0.4 * 10) = 4 are positions 0..3
    starts = {int(hiddencut_spans(valid, received, 0.1, 0.4, _gen(s))[0].nonzero()[0]) for s in range(200)}
    assert starts == {0, 1, 2, 3}


def test_left_padding_short_rows_and_empty_rows():
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    received = torch.rand(3, 5, generator=_gen(0))
    for seed in range(50):
        cut = hiddencut_spans(valid, received, 0.1, 0.4, _gen(seed))
        assert not (cut & ~valid).any()
        assert cut.sum(1).tolist() == [1, 1, 0]  # at least one token; none without real tokens
        assert cut[1, 0]
    for shape in ((2, 0), (0, 5)):  # no positions, no rows: an empty cut
        empty = torch.zeros(shape, dtype=torch.bool)
        assert hiddencut_spans(empty, torch.zeros(shape), 0.1, 0.4, _gen(0)).shape == shape


@pytest.mark.parametrize("n, ratio, top, span, k", [(30, 0.1, 0.4, 3, 12), (5, 0.1, 0.4, 1, 2), (70, 0.1, 0.4, 7, 28)])
def test_lengths_are_floor_of_the_fractions_at_least_one(n, ratio, top, span, k):
    valid = torch.ones(1, n, dtype=torch.bool)
    received = torch.arange(n, 0, -1, dtype=torch.float32)[None]  # position i ranks i-th
    starts = set()
    for seed in range(300):
        cut = hiddencut_spans(valid, received, ratio, top, _gen(seed))[0]
        starts.add(int(cut.nonzero()[0]))
        assert int(cut.sum()) == min(span, n - int(cut.nonzero()[0]))
    assert starts == set(range(k))


def test_start_is_uniform_over_the_top_tokens():
    valid = torch.ones(4000, 10, dtype=torch.bool)
    received = torch.arange(10, 0, -1, dtype=torch.float32).expand(4000, 10)
    cut = hiddencut_spans(valid, received, 0.1, 0.4, _gen(3))
    starts = cut.float().argmax(1)
    counts = torch.bincount(starts, minlength=10).float() / 4000
    assert counts[4:].sum() == 0
    torch.testing.assert_close(counts[:4], torch.full((4,), 0.25), atol=0.03, rtol=0)  # 5 sigma ~ 0.034


def test_same_generator_seed_same_spans():
    valid = torch.ones(8, 16, dtype=torch.bool)
    received = torch.rand(8, 16, generator=_gen(1))
    a = hiddencut_spans(valid, received, 0.2, 0.5, _gen(7))
    assert torch.equal(a, hiddencut_spans(valid, received, 0.2, 0.5, _gen(7)))
    assert not all(torch.equal(a, hiddencut_spans(valid, received, 0.2, 0.5, _gen(s))) for s in range(8, 12))


def test_attention_received_averages_heads_and_real_queries():
    weights = torch.softmax(torch.randn(2, 3, 4, 4, generator=_gen(0)), -1)
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    got = attention_received(weights, valid)
    expected_0 = weights[0, :, :3, :].mean(0).mean(0)  # heads, then the 3 real queries
    torch.testing.assert_close(got[0, :3], expected_0[:3])
    assert got[0, 3] == 0
    torch.testing.assert_close(got[1], weights[1].mean(0).mean(0))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "2-d float"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_received_by_blocks_is_the_dense_maps(monkeypatch, seed, mask_kind, causal):
    _received_by_blocks_against_dense(monkeypatch, seed, mask_kind, causal, "cpu")


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "bool", "2-d float"])
@pytest.mark.parametrize("seed", [0, 2])
def test_attention_received_by_blocks_on_cuda_is_the_dense_maps(monkeypatch, seed, mask_kind, causal):
    _received_by_blocks_against_dense(monkeypatch, seed, mask_kind, causal, "cuda")


def _received_by_blocks_against_dense(monkeypatch, seed, mask_kind, causal, device):
    """Random shapes, grouped keys, padding (a row with one real token included), masks of each kind and
    causality, soft-capping: block by block (blocks of 1 to 7 rows) equals attention_received of the whole
    softmax."""
    g = torch.Generator().manual_seed(seed)
    b, kv_heads, t, d = 3, 2, int(torch.randint(5, 40, (1,), generator=g)), 8
    heads = kv_heads * int(torch.randint(1, 4, (1,), generator=g))
    q, k = torch.randn(b, heads, t, d, generator=g), torch.randn(b, kv_heads, t, d, generator=g)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, t // 2 :] = False
    valid[2, 1:] = False
    scores = q @ k.repeat_interleave(heads // kv_heads, dim=1).transpose(-2, -1) * 0.3
    softcap = 2.0 if seed == 2 else None  # Gemma-2's logit soft-capping, before the mask
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, t, t, generator=g) > 0.3
        scores = scores.masked_fill(~mask, -math.inf)
    elif mask_kind is not None:
        mask = torch.randn(b, 1, t, t, generator=g) if mask_kind == "float" else torch.randn(t, t, generator=g)
        scores = scores + mask
    if causal:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    weights = torch.softmax(scores.masked_fill(~valid[:, None, None, :], -math.inf), dim=-1).nan_to_num(0.0)
    rows = int(torch.randint(1, 8, (1,), generator=g))
    monkeypatch.setattr("attn_reg_plugin.core.regularizers.hiddencut.RECEIVED_BLOCK_ELEMENTS", b * heads * t * rows)
    q, k, valid, mask = (x if x is None else x.to(device) for x in (q, k, valid, mask))
    got = attention_received_by_blocks(q, k, valid, 0.3, mask, causal, softcap)
    assert got.device.type == device
    got = got.cpu()
    torch.testing.assert_close(got, attention_received(weights, valid.cpu()), rtol=1e-5, atol=1e-6)
    assert torch.all(got[~valid.cpu()] == 0) and got.dtype == torch.float32


def test_js_by_hand():
    logits_1, logits_2 = torch.randn(5, 7, generator=_gen(0)), torch.randn(5, 7, generator=_gen(1))
    p, q = logits_1.softmax(-1), logits_2.softmax(-1)
    m = (p + q) / 2
    by_hand = 0.5 * ((p * (p / m).log()).sum(-1) + (q * (q / m).log()).sum(-1))
    torch.testing.assert_close(js_divergence(logits_1, logits_2), by_hand)
    torch.testing.assert_close(js_divergence(p.log(), q.log(), log_probs=True), by_hand)
    # the official code's F.kl_div(p.log(), m) is KL(m || p): a different number, not used here
    official = 0.5 * (F.kl_div(p.log(), m, reduction="none").sum(-1) + F.kl_div(q.log(), m, reduction="none").sum(-1))
    assert not torch.allclose(official, by_hand)
    assert (by_hand >= 0).all() and (by_hand <= math.log(2)).all()
    keep = torch.tensor([True, False, True, True, False])
    total, count = js_consistency(logits_1, logits_2, keep)
    torch.testing.assert_close(total, by_hand[keep].sum())
    assert int(count) == 3
    total, count = js_consistency(logits_1, logits_2)
    torch.testing.assert_close(total, by_hand.sum())
    assert int(count) == 5
    assert hiddencut_objective(torch.tensor(1.0), torch.tensor(2.0), torch.tensor(0.5), 4.0) == 5.0


def test_js_gradient_reaches_both_passes():
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    js_divergence(a, b).sum().backward()
    assert a.grad.abs().sum() > 0 and b.grad.abs().sum() > 0


def _js_by_autograd(lp, lq):
    """The JS written out for autograd (the form before the fused backward), impossible classes included."""
    both = (lp == -math.inf) & (lq == -math.inf)
    lm = torch.logaddexp(lp.masked_fill(both, 0.0), lq.masked_fill(both, 0.0)) - math.log(2.0)
    kl = [(x.exp() * torch.where(x == -math.inf, 0.0, x - lm)).sum(-1) for x in (lp, lq)]
    return 0.5 * (kl[0] + kl[1])


@pytest.mark.parametrize("rows_a_block", [None, 1, 4])
@pytest.mark.parametrize("log_probs", [False, True])
def test_js_gradient_is_autograds_of_the_written_out_form(monkeypatch, log_probs, rows_a_block):
    _js_against_autograd(monkeypatch, log_probs, rows_a_block, "cpu")


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("rows_a_block", [None, 1])
@pytest.mark.parametrize("log_probs", [False, True])
def test_js_gradient_on_cuda_is_autograds_of_the_written_out_form(monkeypatch, log_probs, rows_a_block):
    _js_against_autograd(monkeypatch, log_probs, rows_a_block, "cuda")


def _js_against_autograd(monkeypatch, log_probs, rows_a_block, device):
    """Values and gradients of the fused JS, in one block of positions or several, against autograd of
    the formula, with classes impossible in one pass, in both, and a whole row of one class; and torch's
    gradcheck in float64."""
    if rows_a_block is not None:
        monkeypatch.setattr("attn_reg_plugin.core.regularizers.hiddencut.JS_BLOCK_ELEMENTS", rows_a_block * 9)
    g = _gen(3)
    a, b = (
        torch.randn(2, 3, 9, generator=g, dtype=torch.float64),
        torch.randn(2, 3, 9, generator=g, dtype=torch.float64),
    )
    a, b = a.view(6, 9), b.view(6, 9)
    a[0, :3] = -math.inf  # impossible in the first pass only
    a[1, 4], b[1, 4] = -math.inf, -math.inf  # impossible in both
    a[2, 1:], b[2, 1:] = -math.inf, -math.inf  # one possible class in both: JS 0
    if log_probs:
        a, b = a.log_softmax(-1), b.log_softmax(-1)
    weights = torch.randn(6, generator=g, dtype=torch.float64)
    a, b, weights = a.to(device), b.to(device), weights.to(device)
    x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
    got = js_divergence(x.view(2, 3, 9), y.view(2, 3, 9), log_probs=log_probs).view(6)
    got_grads = torch.autograd.grad(got @ weights, (x, y))
    x2, y2 = a.clone().requires_grad_(), b.clone().requires_grad_()
    lp, lq = (x2, y2) if log_probs else (x2.log_softmax(-1), y2.log_softmax(-1))
    want = _js_by_autograd(lp, lq)
    want_grads = torch.autograd.grad(want @ weights, (x2, y2))
    torch.testing.assert_close(got, want)
    assert got[2] == 0 and torch.isfinite(got).all()
    for g1, g2 in zip(got_grads, want_grads):
        assert torch.isfinite(g1).all()
        torch.testing.assert_close(g1, g2)
    finite = (
        torch.randn(4, 5, dtype=torch.float64, device=device, requires_grad=True),
        torch.randn(4, 5, dtype=torch.float64, device=device),
    )
    assert torch.autograd.gradcheck(lambda u, v: js_divergence(u, v), (finite[0], finite[1].requires_grad_()))


def test_span_cut_hook_zeroes_the_span_and_counts_once():
    layer = torch.nn.Linear(3, 3)
    x = torch.randn(2, 4, 3)
    cut = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    cutter = SpanCut()
    cutter.attach(layer, "L0")
    plain = layer(x)
    with cutter.cutting(CutPlan({"L0": (cut, valid)})) as plan:
        out = layer(x)
        layer(x)  # a second run of the same layer in the same pass (a recompute) is not counted again
    torch.testing.assert_close(out, plain.masked_fill(cut[..., None], 0.0))
    assert int(plan.cut) == 3 and int(plan.tokens) == 6
    torch.testing.assert_close(layer(x), plain)  # outside the pass: unchanged
    # time-first outputs (fairseq) and masks travelling as a call keyword (Hugging Face)
    tf = SpanCut()
    tf.attach(layer, 0, time_first=True)
    with tf.cutting(CutPlan({0: (cut, valid)})):
        out_tf = layer(x.transpose(0, 1))
    torch.testing.assert_close(out_tf.transpose(0, 1), out)


def test_plan_travels_as_a_keyword():
    class Layer(torch.nn.Module):
        def forward(self, x, **kwargs):
            return (x * 2, "extra")

    layer, cutter = Layer(), SpanCut()
    cutter.attach(layer, 1, kwarg="plan")
    x = torch.ones(1, 3, 2)
    cut = torch.tensor([[False, True, False]])
    assert torch.equal(layer(x)[0], x * 2)
    out, extra = layer(x, plan=CutPlan({1: (cut, torch.ones_like(cut))}))
    assert extra == "extra" and out[0, 1].abs().sum() == 0 and out[0, 0].sum() == 4
    assert torch.equal(layer(x, plan=CutPlan({0: (cut, cut)}))[0], x * 2)  # another layer's mask


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("ratio", 0.0, r"--hiddencut-ratio must be a fraction in \(0, 1\], got 0.0"),
        ("ratio", 1.5, r"--hiddencut-ratio must be a fraction in \(0, 1\], got 1.5"),
        ("top", True, r"--hiddencut-top must be a fraction in \(0, 1\], got True"),
        ("top", float("nan"), r"--hiddencut-top must be a fraction in \(0, 1\], got nan"),
        ("alpha", -1, r"--hiddencut-alpha must be a finite number >= 0, got -1"),
        ("alpha", math.inf, r"--hiddencut-alpha must be a finite number >= 0, got inf"),
        ("layers", "x", r"--hiddencut-layers must be 'all' or a comma-separated list"),
    ],
)
def test_config_refusals(field, value, message):
    with pytest.raises(ValueError, match=message):
        HiddenCutConfig(**{field: value}).validate()


def test_layers_past_the_model_are_refused():
    assert HiddenCutConfig().validate().selected_layers(3) == [0, 1, 2]
    assert HiddenCutConfig(layers="2,0").selected_layers(3) == [0, 2]
    with pytest.raises(ValueError, match=r"^--hiddencut-layers: the model has 2 layers \(0-1\), got 5$"):
        HiddenCutConfig(layers="1,5").selected_layers(2)
