"""Numerical faults: no NaN/Inf from any mask in fp32/fp16/bf16, forward and backward, and
fp16 attribution gradients that do not flush to zero.

The edge cases: sequences of length 1, a batch where one sentence is all padding but one
token, causal attention (row 0 has one key), rows with no valid key at all (left padding +
causal), p and q at 0.01 and 0.99, and every candidate of every row dropped (q = 1, and
p = q = 1: every key a candidate). The hypothesis property test in test_masks.py draws
shapes, padding patterns and p/q at random; this file pins the corners.
"""

import pytest
import torch

from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import EditScores
from attn_reg_plugin.core.kernel.controller import RegularizationController
from attn_reg_plugin.core.kernel.rules import candidate_region
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attribution import GradientScale, logit_target, token_loss_target
from helpers import FLOAT_DTYPES, HandPass, ad_drop_masks

# Absolute tolerance against a float64 reference (outputs; input gradients get 2.5x). The worst
# errors over all cases below are about a third of these (fp32 1e-6 / 3e-6, fp16 3e-3 / 7e-3, bf16 3e-2 / 6e-2).
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}

# name -> (B, T, S, key lengths, causal, left-padded)
CASES = {
    "length-1": (3, 1, 1, [1, 1, 1], False, False),
    "one-sentence-all-padding-but-one-token": (3, 6, 6, [6, 1, 4], False, False),
    "causal-row-0": (2, 5, 5, [5, 3], True, False),
    "causal-left-padded-rows-without-keys": (2, 4, 4, [4, 2], True, True),
}
PQ = [(0.01, 0.01), (0.01, 0.99), (0.99, 0.01), (0.99, 0.99), (0.5, 1.0), (1.0, 1.0)]


def _validity(B, T, S, lengths, causal, left):
    pos = torch.arange(S)[None, :]
    n = torch.tensor(lengths)[:, None]
    real = (pos >= S - n) if left else (pos < n)
    valid = real.view(B, 1, 1, S)
    if causal:
        valid = valid & torch.ones(T, S, dtype=torch.bool).tril()
    return valid


def _reference(q, k, v, allowed):
    """softmax(q k^T / sqrt(d), -inf where not allowed) v in float64."""
    q, k, v = q.double(), k.double(), v.double()
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "explicit"])
@pytest.mark.parametrize("p, q", PQ, ids=[f"p{p}-q{q}" for p, q in PQ])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_masked_attention_forward_and_backward_are_finite(dtype, case, p, q, need_weights):
    B, T, S, lengths, causal, left = CASES[case]
    H, d = 2, 8
    g = torch.Generator().manual_seed(100 * list(CASES).index(case) + PQ.index((p, q)))
    valid = _validity(B, T, S, lengths, causal, left).expand(B, H, T, S)
    bias = torch.zeros(valid[:, :1].shape, dtype=dtype).masked_fill(~valid[:, :1], float("-inf"))
    drop = ad_drop_masks(torch.randn(B, H, T, S, generator=g), valid, p, q, generator=g)
    has_key = valid.any(-1)
    assert ((valid & ~drop).sum(-1) >= 1)[has_key].all()  # never an emptied row
    if p == 1.0 and q == 1.0:
        assert torch.equal((valid & ~drop).sum(-1), has_key.long())  # all but the one kept key

    qkv = [(torch.randn(B, H, n, d, generator=g) * 2).to(dtype).requires_grad_() for n in (T, S, S)]
    out, probs = attend(*qkv, bias, **HandPass(EditScores(drop=drop)).call, need_weights=need_weights)
    weights = torch.randn(out.shape, generator=g)
    (out.float() * weights).sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(t.grad).all() for t in qkv)
    if need_weights:
        assert torch.isfinite(probs).all()
        assert (probs[(drop | ~valid) & has_key[..., None]] == 0).all()  # a row without keys is uniform

    # Rows with a key match float64 attention with the dropped keys removed, gradients too
    # (where no row lacks a key: the reference is NaN there, our kernel is finite).
    ref_qkv = [t.detach().double().requires_grad_() for t in qkv]
    ref = _reference(*ref_qkv, valid & ~drop)
    assert torch.allclose(out.double()[has_key], ref[has_key], atol=TOL[dtype])
    if has_key.all():
        (ref * weights.double()).sum().backward()
        for ours, theirs in zip(qkv, ref_qkv):
            assert torch.allclose(ours.grad.double(), theirs.grad, atol=TOL[dtype] * 2.5), (
                (ours.grad.double() - theirs.grad).abs().max()
            )


@pytest.mark.parametrize("method", ["ga", "iga", "aa"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_attribution_passes_are_finite_on_edge_batches(dtype, method):
    """GA (fused kernel + captured outputs), IGA and AA through a model whose batch has a
    one-token sentence and a fully padded query row, p = q = 0.99."""
    torch.manual_seed(0)
    controller = RegularizationController()
    model = TinyEncoder(controller, std=0.2).to(dtype)
    ids = torch.randint(0, 50, (3, 6))
    pad = torch.arange(6)[None, :] >= torch.tensor([6, 1, 4])[:, None]
    ad_drop = ADDrop(ADDropConfig(p=0.99, q=0.99, attribution=method, iga_steps=2), controller)
    with ad_drop.masked(lambda: model(ids, pad), lambda out, y: token_loss_target(out, ~pad, y), frozen=model) as stats:
        out = model(ids, pad)
        out.float().sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert stats["dropped"] > 0 and stats["dropped"] < stats["droppable"]


# -- fp16 attribution gradients ------------------------------------------------------------------
class TinyEncoder(torch.nn.Module):
    """Embeddings, post-LN attention blocks (``attend`` with one site per layer), token logits.

    ``std``: the N(0, std) initialisation of every weight; small values give the tiny
    attribution gradients that fp16 flushes to zero.
    """

    def __init__(self, controller, vocab=50, dim=32, heads=4, layers=4, classes=3, std=0.02):
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.norm = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(layers))
        self.out = torch.nn.Linear(dim, classes)
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, 0.0, std)
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.zeros_(m.bias)
        self.sites = [controller.register("encoder-self", i) for i in range(layers)]

    def forward(self, ids, pad):
        b, t = ids.shape
        h = self.emb(ids)
        dim = h.shape[-1]
        bias = torch.zeros(b, 1, 1, t, dtype=h.dtype).masked_fill(pad[:, None, None, :], float("-inf"))
        for layer, site in enumerate(self.sites):
            q, k, v = self.qkv[layer](h).view(b, t, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
            o, _ = attend(q, k, v, bias, site=site)
            h = self.norm[layer](h + self.proj[layer](o.transpose(1, 2).reshape(b, t, dim)))
        return self.out(h)


def _region_agreement(std, scaled, p=0.3):
    """Per layer: fraction of valid (query, key) pairs whose candidate membership is the same
    in the fp16 model as in the fp32 model with the same weights (GA, classification target)."""
    torch.manual_seed(0)
    regions = {}
    ids = torch.randint(0, 50, (4, 12))
    pad = torch.arange(12)[None, :] >= torch.tensor([12, 8, 3, 1])[:, None]
    state = None
    for dtype in (torch.float32, torch.float16):
        controller = RegularizationController()
        model = TinyEncoder(controller, std=std)
        if state is None:
            state = model.state_dict()
        model.load_state_dict(state)
        model.to(dtype)
        ad_drop = ADDrop(ADDropConfig(p=p, q=0.3), controller)
        if not scaled:
            ad_drop.gradient_scale = None
        _, attributions, valids = ad_drop.attributions(
            lambda: model(ids, pad), lambda out, y: logit_target(out[:, 0], y), frozen=model
        )
        assert all(torch.isfinite(a).all() for a in attributions)
        regions[dtype] = [(candidate_region(a, v, p), v.expand_as(a)) for a, v in zip(attributions, valids)]
    agreement = []
    for (r32, valid), (r16, _) in zip(regions[torch.float32], regions[torch.float16]):
        agreement.append(((r32 == r16) & valid).sum().item() / valid.sum().item())
    return agreement


def test_fp16_candidate_regions_match_fp32_for_tiny_gradients():
    # With weights ~ N(0, 0.002) the attributions are ~1e-12 (first-token classifier logit):
    # unscaled fp16 gradients flush to zero and about a third of the candidate memberships
    # change; with the gradient scale fp16 picks the fp32 candidates.
    unscaled = _region_agreement(std=0.002, scaled=False)
    assert min(unscaled[:3]) < 0.9, unscaled  # the case really underflows without scaling
    scaled = _region_agreement(std=0.002, scaled=True)
    assert min(scaled) >= 0.98, scaled


def test_fp16_candidate_regions_match_fp32_at_usual_scale():
    assert min(_region_agreement(std=0.02, scaled=True)) >= 0.98


def test_gradient_scale_recovers_values_fp16_flushes_to_zero():
    x = torch.ones(4, dtype=torch.float16, requires_grad=True)
    target = (x * torch.tensor([1e-9, 2e-9, 3e-9, -1e-9], dtype=torch.float16)).float().sum()
    plain = torch.autograd.grad(target, [x], retain_graph=True)[0]
    assert (plain == 0).all()  # below fp16's smallest subnormal
    (scaled,) = GradientScale().grad(target, [x])
    assert scaled.dtype == torch.float32
    want = torch.tensor([1e-9, 2e-9, 3e-9, -1e-9], dtype=torch.float16).float()
    assert torch.allclose(scaled, want, rtol=2e-3, atol=0)


def test_gradient_scale_backs_off_on_overflow_and_grows_again():
    scale = GradientScale(init_scale=2.0**16, growth_interval=2)
    x = torch.ones(3, dtype=torch.float16, requires_grad=True)
    target = (x * 1000).float().sum()  # 1000 * 2**16 overflows fp16; 1000 * 2**6 = 64000 does not
    (grad,) = scale.grad(target, [x])
    assert torch.equal(grad, torch.full((3,), 1000.0)) and scale.scale == 2.0**6
    scale.grad(target, [x])
    assert scale.scale == 2.0**7  # two clean calls: try a larger scale next time
    (grad,) = scale.grad(target, [x])  # overflows at 2**7, retried at 2**6
    assert torch.equal(grad, torch.full((3,), 1000.0)) and scale.scale == 2.0**6


def test_gradient_scale_leaves_fp32_and_bf16_alone():
    scale = GradientScale()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(2, dtype=dtype, requires_grad=True)
        (grad,) = scale.grad((x * 1e-30).float().sum(), [x])
        assert grad.dtype == torch.float32 and (grad > 0).all()
    assert scale.scale == 2.0**16 and scale.clean_calls == 0


def test_gradient_scale_gives_zeros_and_keeps_its_scale_when_the_forward_overflowed():
    scale = GradientScale()
    x = torch.tensor([1.0, 300.0], dtype=torch.float16, requires_grad=True)
    (grad,) = scale.grad((x * x * x).float().sum(), [x])  # 300**3 is inf in fp16
    assert torch.equal(grad, torch.zeros(2))
    assert scale.scale == 2.0**16
