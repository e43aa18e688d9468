"""The blockwise kernel (core.kernel): a regularized call split into blocks of query rows gives the
dense path's output and gradients for the same drop decisions, the decisions do not depend on the
split, and AD-DROP's region is each row's exact top ceil(p n) by attribution.

Blocks are forced at tiny sizes by shrinking the budget (``small_blocks``)."""

import functools
import math

import pytest
import torch

from attn_reg_plugin.core.kernel import blockwise, devices, rules
from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import CaptureProbs, EditScores, hook_in_progress
from attn_reg_plugin.core.kernel.controller import RegularizationController
from attn_reg_plugin.core.kernel.rules import (
    BernoulliRule,
    Block,
    DenseRule,
    GradientScores,
    MapScores,
    RandomScores,
    TopRegionRule,
    candidate_region,
    chunk_draws,
    dense_gradient_attribution,
)
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attribution import logit_target
from helpers import HandPass


@pytest.fixture(autouse=True)
def block_calls(monkeypatch):
    """Rows per block of every call the kernel ran blockwise, so a test knows the path it took."""
    from attn_reg_plugin.core.kernel import attention

    seen = []

    def counted(q, k, v, bias, call):
        if call.rows_per_block < q.shape[2]:  # a short call is the same Function's one block
            seen.append(call.rows_per_block)
        return blockwise.edit_attention(q, k, v, bias, call)

    monkeypatch.setattr(attention, "edit_attention", counted)
    return seen


def _force_small_blocks(monkeypatch):
    monkeypatch.setattr(rules, "CHUNK_ROWS", 2)
    monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(blockwise, "LINEAR_FACTOR", 0)
    monkeypatch.setattr(blockwise, "ONE_BLOCK_KEYS", 0)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 2 query rows (chunks of 2) whatever the size: the multi-block path at test sizes."""
    _force_small_blocks(monkeypatch)


def _one_block(monkeypatch):
    monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", 1 << 40)


def _valid(kind, b=2, t=7):
    """Padding (sample 1 ends 2 early), or left-padded causal (sample 1's first rows see no key)."""
    if kind == "padding":
        keys = torch.arange(t)[None, :] < torch.tensor([t, t - 2])[:, None]
        return keys[:, None, None, :]
    keys = torch.arange(t)[None, :] >= torch.tensor([0, 3])[:, None]
    return keys[:, None, None, :] & torch.ones(t, t, dtype=torch.bool).tril()


def test_block_sizes_follow_the_budget():
    assert blockwise.query_block_rows(32, 12, 128, 128, 64) == 128  # BERT-base at 128: one block
    assert blockwise.query_block_rows(4, 12, 4096, 128, 64) == 4096  # cross-attention to 128 keys: one
    assert blockwise.query_block_rows(1, 2, 512, 512, 32) == 512  # under the fixed floor
    assert blockwise.query_block_rows(1, 2, 4096, 4096, 32) == 64  # 2**19 elements / (2 x 4096)
    rows = blockwise.query_block_rows(1, 12, 2048, 2048, 64)  # BERT-base width at 2k: H x T x d
    assert rows == 64 and rows % rules.CHUNK_ROWS == 0
    assert blockwise.query_block_rows(2, 12, 4096, 4096, 64) == 64  # a block holds as many as q


def test_draws_depend_on_the_row_and_key_not_on_the_split_or_the_keys_covered(monkeypatch):
    monkeypatch.setattr(rules, "CHUNK_ROWS", 4)
    monkeypatch.setattr(rules, "KEY_TILE", 2)
    shape = (2, 3, 11, 5)
    whole = chunk_draws(7, shape, slice(0, 11), 5, "cpu", True)
    assert whole.shape == (2, 3, 11, 5)
    for cuts in ([0, 4, 8, 11], [0, 8, 11], [0, 3, 6, 11]):  # on chunk boundaries or not
        parts = [chunk_draws(7, shape, slice(a, b), 5, "cpu", True) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts, dim=2), whole)
    for keys in (1, 2, 3, 4):  # a block covering fewer keys (causal) has the same numbers on them
        assert torch.equal(chunk_draws(7, shape, slice(4, 11), keys, "cpu", True), whole[:, :, 4:, :keys])
    assert len({float(x) for x in whole.flatten()}) == whole.numel()  # no two positions share a number
    assert not torch.equal(chunk_draws(8, shape, slice(0, 11), 5, "cpu", True), whole)
    assert 0.45 < chunk_draws(1, (4, 4, 64, 64), slice(0, 64), 64, "cpu", True).mean() < 0.55


@pytest.mark.parametrize("probability", [0.0, 0.3, 0.5, 1.0, torch.tensor(0.3), torch.tensor(1.0)], ids=str)
def test_integer_coins_drop_with_the_probability(probability):
    shape = (2, 4, 128, 1000)
    block = rules.Block(slice(0, 128), torch.ones(1, 1, 1, 1000, dtype=torch.bool), shape, shape, 11)
    drops = block.coins(probability)
    assert drops.dtype == torch.bool and drops.shape == shape
    p = float(probability)
    rate = drops.float().mean().item()
    assert abs(rate - p) < 4 * math.sqrt(max(p * (1 - p), 1e-12) / drops.numel()) + (0 if p in (0.0, 1.0) else 1e-9)
    assert torch.equal(block.coins(probability), drops)  # made again identically
    assert rules.coin_limit(0.3) == 644245093  # round(0.3 * 2**31) - 1: P = 0.29999999981
    assert rules.coin_limit(0.0) == -1 and rules.coin_limit(1.0) == 2**31 - 1


def _attend_pair(q, k, v, bias, hook_of, monkeypatch, block_calls, dropout_p=0.0):
    """Output and gradients of ``attend`` through blocks of 2 rows, then as one block, where
    ``hook_of()`` builds the (fresh) hook of each run."""
    results = []
    for split in (True, False):
        if split:
            _force_small_blocks(monkeypatch)
        else:
            _one_block(monkeypatch)
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        bias_leaf = bias.detach().clone().requires_grad_(bias.is_floating_point()) if bias is not None else None
        torch.manual_seed(5)
        out, _ = attend(*leaves, bias_leaf, dropout_p=dropout_p, **HandPass(hook_of()).call)
        assert (split and bool(block_calls)) or (not split and not block_calls), split
        block_calls.clear()
        (out.double() * torch.linspace(-1, 1, out.numel(), device=out.device).view(out.shape)).sum().backward()
        grads = [x.grad for x in leaves] + (
            [bias_leaf.grad] if bias_leaf is not None and bias_leaf.requires_grad else []
        )
        results.append((out, grads))
    return results


TOL = {
    torch.float32: dict(atol=2e-6, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=5e-2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["padding", "causal"])
@pytest.mark.parametrize("uniform", [False, True])
def test_blocks_equal_one_block_for_the_same_dense_drops(dtype, kind, uniform, monkeypatch, block_calls):
    """Rows without a valid key (left-padded causal), rows whose every key is dropped (made
    uniform), and LayerDrop's uniform flag, with a bool bias."""
    g = torch.Generator().manual_seed(0)
    b, h, t, d = 2, 3, 7, 4
    q, k, v = (torch.randn(b, h, t, d, generator=g).to(dtype) for _ in range(3))
    valid = _valid(kind, b, t)
    drop = torch.rand(b, h, t, t, generator=g) < 0.4
    drop[0, 0, 3] = True  # a row losing every key: attends uniformly to them
    flag = torch.ones(1, 1, 1, 1, dtype=torch.bool) if uniform else None
    (split, whole) = _attend_pair(
        q, k, v, valid, lambda: EditScores(drop=drop, uniform_rows=flag), monkeypatch, block_calls
    )
    torch.testing.assert_close(split[0], whole[0], **TOL[dtype])
    for a, w in zip(split[1], whole[1]):
        torch.testing.assert_close(a, w, **TOL[dtype])
    assert torch.isfinite(split[0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["padding", "causal"])
def test_attention_dropout_in_an_edit_is_the_same_one_block_or_many(dtype, kind, monkeypatch, block_calls):
    """The model's attention dropout inside a regularized call is keyed by the call's seed, as its drops
    are: one block and many drop the same weights (the same output and gradients), and the backward
    regenerates them, keeping no generator state."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=g).to(dtype) for _ in range(3))
    hook_of = lambda: EditScores(drop=BernoulliRule(torch.tensor(0.2)))  # noqa: E731
    split, whole = _attend_pair(q, k, v, _valid(kind), hook_of, monkeypatch, block_calls, dropout_p=0.3)
    torch.testing.assert_close(split[0], whole[0], **TOL[dtype])
    for a, w in zip(split[1], whole[1]):
        torch.testing.assert_close(a, w, **TOL[dtype])
    _force_small_blocks(monkeypatch)
    torch.manual_seed(5)
    undropped = attend(q, k, v, _valid(kind), **HandPass(hook_of()).call)[0]
    assert not torch.allclose(undropped, split[0])


def test_attention_dropout_in_an_edit_drops_the_keyed_weights_and_rescales_the_rest():
    """On hand-built tensors: the weights the call's keyed coins drop are 0, the rest scaled by 1 / (1 - p),
    about p of them dropped; the seed is drawn from torch's stream at the call when the edit draws
    nothing else (a dense mask)."""
    g = torch.Generator().manual_seed(1)
    b, h, t, d, p = 2, 4, 64, 8, 0.25
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    no_drop = torch.zeros(1, 1, 1, 1, dtype=torch.bool)
    torch.manual_seed(3)
    out, _ = attend(q, k, v, dropout_p=p, **HandPass(EditScores(drop=no_drop)).call)
    torch.manual_seed(3)
    shape = (b, h, t, t)
    dropped = rules.Block(slice(0, t), torch.ones(1, 1, 1, t, dtype=torch.bool), shape, shape, rules.call_seed())
    dropped = dropped.coins(p, rules.WEIGHT_DROPOUT_STREAM)
    assert abs(dropped.float().mean().item() - p) < 0.01
    weights = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, -1)
    torch.testing.assert_close(out, (weights.masked_fill(dropped, 0.0) / (1 - p)) @ v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["padding", "causal"])
def test_blocks_on_cuda_equal_one_block(dtype, kind, monkeypatch, block_calls):
    """The same kernel on CUDA (its backward recomputes each block through sdpa): several blocks
    equal one for the same drops, in half precision, with fully masked rows (left-padded causal)
    and a row that loses every key; the output stays finite."""
    g = torch.Generator().manual_seed(0)
    b, h, t, d = 2, 3, 7, 8
    q, k, v = (torch.randn(b, h, t, d, generator=g).to("cuda", dtype) for _ in range(3))
    valid = _valid(kind, b, t).cuda()
    drop = torch.rand(b, h, t, t, generator=g) < 0.4
    drop[0, 0, 3] = True
    drop = drop.cuda()
    split, whole = _attend_pair(q, k, v, valid, lambda: EditScores(drop=drop), monkeypatch, block_calls)
    assert torch.isfinite(split[0]).all()
    torch.testing.assert_close(split[0], whole[0], **TOL[dtype])
    for a, w in zip(split[1], whole[1]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, w, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_ad_drop_ga_region_on_cuda_is_the_exact_top_p(dtype, monkeypatch):
    """GA's per-block region on CUDA (sorted top-k, ties by key index) is each row's dense top ceil(p n)."""
    monkeypatch.setattr(rules, "CHUNK_ROWS", 2)
    g = torch.Generator().manual_seed(3)
    b, h, t, d = 2, 2, 7, 4
    grad_out, values = torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g).to(dtype)
    valid = _valid("causal", b, t)
    rule = TopRegionRule(GradientScores(grad_out.cuda(), values.cuda()), 0.5, 1.0)
    dense = candidate_region(dense_gradient_attribution(grad_out, values.float()), valid, 0.5)
    n = valid.expand(b, h, t, t).sum(-1, keepdim=True)
    drops = _rule_drops(rule, valid.cuda(), (b, h, t, t), 11, 2).cpu()
    everything = dense.sum(-1, keepdim=True) == n
    assert torch.equal(drops | everything & dense, dense)


def test_blocks_back_propagate_into_a_float_bias(monkeypatch, block_calls):
    """T5's relative position bias is a learned float bias: its gradient comes back per block."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    bias = torch.randn(1, 2, 6, 6, generator=g).masked_fill(~_valid("padding", 1, 6)[0, :, :, :], float("-inf"))
    drop = torch.rand(2, 2, 6, 6, generator=g) < 0.3
    split, whole = _attend_pair(q, k, v, bias, lambda: EditScores(drop=drop), monkeypatch, block_calls)
    torch.testing.assert_close(split[0], whole[0])
    assert len(split[1]) == 4
    for a, w in zip(split[1], whole[1]):
        torch.testing.assert_close(a, w)


def test_blocks_replay_attention_dropout_in_the_backward(small_blocks, block_calls):
    """The model's attention dropout inside a block (keyed by the call's seed) is made again
    identically in the backward: the analytical gradient equals the numerical one (gradcheck,
    float64, the same seed at every evaluation)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    drop = torch.rand(1, 2, 5, 5, generator=g) < 0.3

    def f(q, k, v):
        torch.manual_seed(0)
        return attend(q, k, v, dropout_p=0.3, **HandPass(EditScores(drop=drop)).call)[0]

    assert torch.autograd.gradcheck(f, (q, k, v))
    assert block_calls and set(block_calls) == {2}


def _rule_drops(rule, valid, shape, seed, rows_per_block):
    out = []
    for start in range(0, shape[2], rows_per_block):
        rows = slice(start, min(shape[2], start + rows_per_block))
        part = valid[..., rows, :] if valid.shape[-2] > 1 else valid
        block = Block(rows, part, (shape[0], shape[1], rows.stop - rows.start, shape[3]), shape, seed)
        drop, state = rule.forward_drops(block)
        assert torch.equal(rule.backward_drops(block, state), drop)  # the backward regenerates the forward's drops
        out.append(drop.expand(block.shape))
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("kind", ["padding", "causal"])
@pytest.mark.parametrize("p", [0.2, 0.5, 0.99])
def test_gradient_region_is_the_dense_top_p_in_every_block(kind, p, monkeypatch):
    monkeypatch.setattr(rules, "CHUNK_ROWS", 2)
    g = torch.Generator().manual_seed(3)
    b, h, t, d = 2, 2, 7, 4
    grad_out, values = torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)
    valid = _valid(kind, b, t)
    shape = (b, h, t, t)
    # q = 1: every candidate dropped (bar the never-empty rule), so the drops show the region.
    rule = TopRegionRule(GradientScores(grad_out, values), p, 1.0)
    dense = candidate_region(dense_gradient_attribution(grad_out, values), valid, p)
    n = valid.expand(shape).sum(-1, keepdim=True)
    for rows_per_block in (2, 4, 7):
        drops = _rule_drops(rule, valid, shape, 11, rows_per_block)
        assert not (drops & ~valid).any()
        everything = dense.sum(-1, keepdim=True) == n  # rows whose region is all their keys keep one
        assert torch.equal(drops | everything & dense, dense), rows_per_block
        assert torch.equal((dense & ~drops).sum(-1, keepdim=True), everything.long() * (n > 0))


def test_ties_at_the_threshold_are_taken_lowest_key_first():
    scores = torch.tensor([[[[1.0, 3.0, 2.0, 2.0, 2.0, 0.0]]]])

    class Fixed(RandomScores):
        def scores(self, block):
            return scores

    valid = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    rule = TopRegionRule(Fixed(), 0.5, 1.0)  # 3 candidates: key 1, then two of the three 2.0s
    drops = _rule_drops(rule, valid, (1, 1, 1, 6), 0, 1)
    assert drops.squeeze().tolist() == [False, True, True, True, False, False]


def test_a_validity_broadcast_over_keys_counts_every_key(monkeypatch):
    """A mask shaped (..., 1) (every key alike for a row) leaves each row all S keys to rank: the
    region is ceil(p S), one block or many, as with the mask expanded."""
    monkeypatch.setattr(rules, "CHUNK_ROWS", 2)
    shape = (2, 2, 4, 8)
    scores = torch.arange(8, dtype=torch.float32).expand(shape)
    valid = torch.ones(2, 1, 4, 1, dtype=torch.bool)
    rule = TopRegionRule(MapScores(scores), 0.5, 1.0)  # every candidate dropped: 4 of 8 keys
    expanded = rule.whole(valid.expand(shape), torch.tensor(5))
    assert expanded.sum(-1).eq(4).all()
    assert torch.equal(rule.whole(valid, torch.tensor(5), shape), expanded)
    assert torch.equal(_rule_drops(rule, valid, shape, torch.tensor(5), 2), expanded)


def test_rules_regenerate_the_same_drops_for_any_split(monkeypatch):
    monkeypatch.setattr(rules, "CHUNK_ROWS", 2)
    valid = _valid("causal", 2, 8)
    shape = (2, 3, 8, 8)
    for rule in (BernoulliRule(torch.tensor(0.4)), TopRegionRule(RandomScores(), 0.3, 0.5), DenseRule(valid)):
        first = _rule_drops(rule, valid, shape, 3, 2)
        assert torch.equal(first, _rule_drops(rule, valid, shape, 3, 4)), rule
        assert torch.equal(first, _rule_drops(rule, valid, shape, 3, 8)), rule


# -- AD-DROP through a model, split into blocks ------------------------------------------------------
class _Encoder(torch.nn.Module):
    """Two self-attention layers over a padded batch, optionally activation-checkpointed."""

    def __init__(self, width=8, heads=2, checkpointed=False):
        super().__init__()
        torch.manual_seed(0)
        self.controller = RegularizationController()
        self.heads, self.checkpointed = heads, checkpointed
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, 3 * width) for _ in range(2))
        self.sites = [self.controller.register("encoder-self", i) for i in range(2)]
        self.out = torch.nn.Linear(width, 3)

    def _layer(self, i, x, bias):
        b, t, w = x.shape
        q, k, v = self.layers[i](x).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        o, _ = attend(q, k, v, bias, dropout_p=0.1 if self.training else 0.0, site=self.sites[i])
        return x + o.transpose(1, 2).reshape(b, t, w)

    def forward(self, x, bias):

        for i in range(2):
            layer = functools.partial(self._layer, i)
            x = self.controller.checkpoint(layer, x, bias) if self.checkpointed else layer(x, bias)
        return self.out(x.mean(1))


def _ad_drop_step(model, x, bias, attribution="ga", seed=0):
    torch.manual_seed(seed)
    ad_drop = ADDrop(ADDropConfig(p=0.3, q=0.5, schedule="always", attribution=attribution), model.controller)
    with ad_drop.masked(lambda: model(x, bias), logit_target, frozen=model) as stats:
        loss = model(x, bias).logsumexp(-1).sum()
    loss.backward()  # after the pass: a checkpointed layer's recompute gets it from its call
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return loss.detach(), grads, stats


@pytest.mark.parametrize("attribution", ["ga", "rd"])
def test_ad_drop_split_into_blocks_keeps_no_map_and_checkpointing_changes_nothing(
    attribution, small_blocks, block_calls
):
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(4))
    bias = _valid("padding", 2, 6)
    plain = _Encoder()
    loss, grads, stats = _ad_drop_step(plain, x, bias, attribution)
    assert len(block_calls) == 2  # pass 2's two layers ran blockwise
    # GA's pass 2 ranks by (dF/dO, V) rules, never a dense attribution map
    rate = float(stats["dropped"]) / float(stats["droppable"])
    assert 0.02 < rate < 0.4 and torch.isfinite(loss)
    again, grads_again, _ = _ad_drop_step(_Encoder(), x, bias, attribution)
    assert torch.equal(loss, again) and all(torch.equal(a, b) for a, b in zip(grads, grads_again))
    checkpointed, grads_ckpt, _ = _ad_drop_step(_Encoder(checkpointed=True), x, bias, attribution)
    torch.testing.assert_close(checkpointed, loss)
    for a, b in zip(grads_ckpt, grads):
        torch.testing.assert_close(a, b)


def test_ad_drop_ga_hooks_hold_rules_not_maps(small_blocks):
    model = _Encoder()
    x = torch.randn(2, 6, 8)
    ad_drop = ADDrop(ADDropConfig(p=0.3, q=0.5, schedule="always"), model.controller)
    with ad_drop.masked(lambda: model(x, None), logit_target, frozen=model):
        rules = [hook_in_progress(site).drop for site in model.sites]
        model(x, None)  # the masked forward (a block that runs none is refused)
    assert all(isinstance(r, TopRegionRule) and isinstance(r.source, GradientScores) for r in rules)
    assert all(r.source.grad_output.shape == (2, 2, 6, 4) for r in rules)  # (B, H, T, d): linear in T


def test_blockwise_counts_match_the_drops(small_blocks, block_calls):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    valid = _valid("padding", 2, 6)
    drop = torch.rand(2, 2, 6, 6, generator=g) < 0.3
    site = HandPass(EditScores(drop=drop, counted=True))
    attend(q, k, v, valid, **site.call)
    counts = site.record.counts()
    assert block_calls == [2]
    applied = drop & valid
    emptied = ((applied | ~valid).all(-1, keepdim=True)) & valid.any(-1, keepdim=True)
    assert int(counts[0]) == int((applied & ~emptied).sum())
    assert int(counts[1]) == int(valid.expand(2, 2, 6, 6).sum())


@pytest.mark.parametrize("blocks", ["one", "several"])
def test_without_a_bias_every_key_counts_towards_ceil_p_n(blocks, monkeypatch, block_calls):
    """A call with no mask has S valid keys per row, so GA's region is ceil(p S) keys per row. (The
    capture's validity once held a single key, which made the region 1 key per row.)"""
    if blocks == "several":
        _force_small_blocks(monkeypatch)
    model = _Encoder()
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(1)
    ad_drop = ADDrop(ADDropConfig(p=0.5, q=0.5, schedule="always"), model.controller)
    with ad_drop.masked(lambda: model(x, None), logit_target, frozen=model) as stats:
        model(x, None)
    assert len(block_calls) == (2 if blocks == "several" else 0)
    assert int(stats["droppable"]) == 2 * 2 * 2 * 6 * 6  # 2 layers x 2 samples x 2 heads x 6 rows x 6 keys
    # 144 candidates (3 of 6 keys in each of 48 rows), each dropped with q = 0.5: 72 expected, sd 6
    # (a region of one key per row would drop about 24)
    assert 50 < int(stats["dropped"]) < 95, int(stats["dropped"])


@pytest.mark.parametrize("kind", ["padding", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_weight_region_is_the_dense_top_p_in_every_block(kind, dtype, monkeypatch):
    """AA on a long map keeps q, k and the bias; each block's weights, recomputed, rank the keys as
    the dense weights do: the region is each row's top ceil(p n) by the dense path's weights."""
    from attn_reg_plugin.core.kernel.rules import AttentionScores

    monkeypatch.setattr(rules, "CHUNK_ROWS", 2)
    g = torch.Generator().manual_seed(4)
    b, h, t, d = 2, 2, 7, 4
    q, k, v = (torch.randn(b, h, t, d, generator=g).to(dtype) for _ in range(3))
    valid = _valid(kind, b, t)
    weights = attend(q, k, v, valid, need_weights=True)[1].float()  # the kernel's dense weights
    dense = candidate_region(weights, valid, 0.5)
    n = valid.expand(b, h, t, t).sum(-1, keepdim=True)
    rule = TopRegionRule(AttentionScores(q, k, valid, d**-0.5), 0.5, 1.0)
    for rows_per_block in (2, 4, 7):
        drops = _rule_drops(rule, valid, (b, h, t, t), 5, rows_per_block)
        everything = dense.sum(-1, keepdim=True) == n
        assert torch.equal(drops | everything & dense, dense), rows_per_block


def test_ad_drop_aa_split_into_blocks_keeps_q_and_k_not_weights(small_blocks, block_calls):
    model = _Encoder()
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(7))
    bias = _valid("padding", 2, 6)
    ad_drop = ADDrop(ADDropConfig(p=0.3, q=0.5, schedule="always", attribution="aa"), model.controller)
    with ad_drop.masked(lambda: model(x, bias), logit_target, frozen=model) as stats:
        rules = [hook_in_progress(site).drop for site in model.sites]
        model(x, bias).sum().backward()
    from attn_reg_plugin.core.kernel.rules import AttentionScores

    assert all(isinstance(r, TopRegionRule) and isinstance(r.source, AttentionScores) for r in rules)
    assert len(block_calls) == 2
    rate = float(stats["dropped"]) / float(stats["droppable"])
    assert 0.05 < rate < 0.3, rate
    # the dense attributions (dense=True, what the lab's tools read) are still weight maps
    sites, maps, _ = ad_drop.attributions(lambda: model(x, bias), logit_target, frozen=model)
    assert all(isinstance(m, torch.Tensor) and m.shape == (2, 2, 6, 6) for m in maps)


def test_ad_drop_iga_split_into_blocks_keeps_summed_gradients_not_maps(small_blocks, block_calls):
    """IGA's pass 2 ranks A ⊙ (Σ_k dF/dO_k) Vᵀ / m per block: the hooks hold dF/dO sums (B, H, T, d),
    V, q and k, and each block's region is the top-p of the dense integrated-gradient map."""
    from attn_reg_plugin.core.kernel.rules import AttentionScores, IntegratedGradientScores

    model = _Encoder()
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(7))
    bias = _valid("padding", 2, 6)
    ad_drop = ADDrop(ADDropConfig(p=0.5, q=0.5, schedule="always", attribution="iga", iga_steps=3), model.controller)
    torch.manual_seed(3)
    with ad_drop.masked(lambda: model(x, bias), logit_target, frozen=model) as stats:
        rules = [hook_in_progress(site).drop for site in model.sites]
        model(x, bias).sum().backward()
    sources = [r.source for r in rules]
    assert all(isinstance(s, IntegratedGradientScores) and isinstance(s.weights, AttentionScores) for s in sources)
    assert all(s.gradient.grad_output.shape == (2, 2, 6, 4) for s in sources)  # (B, H, T, d): linear in T
    assert len(block_calls) == 2 and 0.05 < float(stats["dropped"]) / float(stats["droppable"]) < 0.45
    torch.manual_seed(3)
    _, maps, valids = ad_drop.attributions(lambda: model(x, bias), logit_target, frozen=model)  # dense, Eq. 3
    for source, dense, valid in zip(sources, maps, valids):
        rule = TopRegionRule(source, 0.5, 1.0)
        region = candidate_region(dense, valid, 0.5)
        n = valid.expand(2, 2, 6, 6).sum(-1, keepdim=True)
        everything = region.sum(-1, keepdim=True) == n
        for rows_per_block in (2, 4):
            drops = _rule_drops(rule, valid, (2, 2, 6, 6), 5, rows_per_block)
            assert torch.equal(drops | everything & region, region), rows_per_block


def test_ties_straddling_the_threshold_in_many_rows_take_the_lowest_keys():
    """Scores with few distinct values (a causal LM's first layer: repeated tokens share V, so their
    scores tie) in rows of different lengths: each row's region is its keys above the threshold,
    then the lowest-indexed keys at it, ceil(p n) in all."""
    g = torch.Generator().manual_seed(8)
    b, h, t = 2, 3, 9
    scores = torch.randint(0, 3, (b, h, t, t), generator=g).float()
    valid = _valid("causal", b, t)

    class Fixed(RandomScores):
        def scores(self, block):
            return scores[:, :, block.rows].clone()

    drops = _rule_drops(TopRegionRule(Fixed(), 0.5, 1.0), valid, (b, h, t, t), 0, 3)
    full = valid.expand(b, h, t, t)
    for i, j, r in ((i, j, r) for i in range(b) for j in range(h) for r in range(t)):
        keys = [c for c in range(t) if full[i, j, r, c]]
        got = {c for c in range(t) if drops[i, j, r, c]}
        k = -(-len(keys) // 2)
        if k == len(keys):  # every key a candidate (or none): all but one are dropped
            assert got <= set(keys) and len(got) == max(0, len(keys) - 1), (i, j, r)
            continue
        assert got == set(sorted(keys, key=lambda c: (-scores[i, j, r, c].item(), c))[:k]), (i, j, r)


@pytest.mark.parametrize("tied_rows", [0.3, 0.9])  # the CPU ranks the straddling rows gathered, or all rows
@pytest.mark.parametrize("distinct", [2, 40])  # many keys at the threshold (a scan) or few (positions)
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "k per sample"])
def test_lowest_keys_first_equals_a_row_by_row_reading(tied_rows, distinct, layout):
    """Each row: the keys above its threshold, then of the keys at it the lowest-indexed ones, k in
    all, whichever way the CPU ranks them, and as the scan that other devices run gives it."""
    g = torch.Generator().manual_seed(int(tied_rows * 10) + distinct)
    b, h, t, s = 2, 3, 16, 48
    tied = torch.rand(b, h, t, 1, generator=g) < tied_rows
    scores = torch.where(
        tied, torch.randint(0, distinct, (b, h, t, s), generator=g).float(), torch.rand(b, h, t, s, generator=g)
    )
    scores[..., -3:] = -math.inf  # invalid keys, never above a threshold
    k = torch.randint(
        1, s - 3, (b, 1, 1, 1) if layout == "k per sample" else (b, h, t, 1), generator=g, dtype=torch.int32
    )
    if layout == "permuted":  # T5's scores come permuted
        scores = scores.transpose(1, 2).contiguous().transpose(1, 2)
    threshold = rules.kth_largest(scores, k)
    region = scores >= threshold
    at_least = region.sum(-1, keepdim=True, dtype=torch.int32)
    full_k = k.expand(b, h, t, 1)
    expected = torch.zeros(b, h, t, s, dtype=torch.bool)
    for i, j, r in ((i, j, r) for i in range(b) for j in range(h) for r in range(t)):
        row, th, n = scores[i, j, r].tolist(), threshold[i, j, r, 0].item(), int(full_k[i, j, r, 0])
        keys = [c for c in range(s) if row[c] > th] + [c for c in range(s) if row[c] == th]
        expected[i, j, r, keys[:n]] = True
    assert (at_least > full_k).float().mean() > 0.1  # ties straddle in many rows
    given = region.clone()
    for counted in (at_least, None):  # the forward's count, or none (the backward's)
        assert torch.equal(rules.lowest_keys_first(scores, threshold, k, region, counted), expected)
        assert torch.equal(region, given)  # the caller's region is left as it was
    assert torch.equal(rules._ranked_by_scan(scores == threshold, region, k, at_least), expected)


def test_a_given_mask_through_blocks_leaves_the_random_stream_alone(small_blocks, block_calls):
    """AttendOut's Generator masks draw nothing in the kernel, so a blockwise call takes no seed: the
    global stream is where the one-block path leaves it, and what follows trains identically."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    drop = torch.rand(2, 1, 6, 6, generator=g) < 0.3
    torch.manual_seed(3)
    before = torch.get_rng_state()
    attend(q, k, v, _valid("padding", 2, 6), **HandPass(EditScores(drop=drop)).call)
    assert block_calls == [2]
    assert torch.equal(torch.get_rng_state(), before)


def test_a_blockwise_call_makes_its_drops_from_the_sites_seed_alone(small_blocks):
    """Split into blocks, a drawing rule's drops depend on the seed its pass gave the site, not on
    torch's stream: the forward, a recompute and another point of the stream agree; another seed
    drops otherwise."""
    from attn_reg_plugin.core.kernel.attention import attention_kernel
    from attn_reg_plugin.core.kernel.attention_call import AttentionCall

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    hook = EditScores(drop=BernoulliRule(torch.tensor(0.5)), counted=True)
    outs = []
    for stream, recompute, seed in ((0, False, 11), (1, True, 11), (2, False, 12)):
        torch.manual_seed(stream)
        out, _, _ = attention_kernel(q, k, v, None, 0.0, None, False, AttentionCall(hook, recompute, seed))
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def _kept_against_made_again(rule, dropout_p, monkeypatch, device="cpu", dtype=torch.float32):
    from attn_reg_plugin.core.kernel.attention import attention_kernel
    from attn_reg_plugin.core.kernel.attention_call import AttentionCall

    # One backward call per block either way, so the bits compare (groups sum in another order).
    monkeypatch.setattr(blockwise, "BACKWARD_ROWS_PER_DIM", 0)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g).to(device, dtype) for _ in range(3))
    if rule == "coins":
        drop = BernoulliRule(torch.tensor(0.4, device=device))
    else:
        scores = GradientScores(torch.randn(2, 2, 6, 4, generator=g).to(device), v.detach())
        drop = TopRegionRule(scores, 0.5, 0.5)
    call = AttentionCall(EditScores(drop=drop), False, 21)
    again_calls = []  # the backward's evaluations of the rule
    rule_drops = blockwise.rule_drops

    def counted(*args):
        again_calls.extend([] if args[-1] else [1])  # args[-1]: fresh_state, the forward's evaluation
        return rule_drops(*args)

    monkeypatch.setattr(blockwise, "rule_drops", counted)

    def step():
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        torch.manual_seed(0)
        bias = _valid("padding", 2, 6).to(device)
        out, _, _ = attention_kernel(*leaves, bias, dropout_p, None, False, call)
        return [out, *torch.autograd.grad(out.float().square().sum(), leaves)]

    kept = step()
    assert again_calls == []
    monkeypatch.setattr(blockwise, "KEPT_DROPS_FACTOR", 0)
    made_again = step()
    assert len(again_calls) == 3  # one per block of 2 rows
    for a, b in zip(kept, made_again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rule", ["coins", "gradient-region"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["lse-backward", "recompute-backward"])
def test_drops_kept_as_bits_give_the_backward_the_same_drops(rule, dropout_p, small_blocks, monkeypatch):
    """Kept as bits (the default at these sizes) or made again by the rule (past the budget), a
    blockwise call's output and every gradient are the same bits; kept, the backward never
    evaluates the rule."""
    _kept_against_made_again(rule, dropout_p, monkeypatch)


def test_kept_bits_are_saved_tensors_so_a_checkpoint_drops_them_until_its_recompute(small_blocks):
    """A blockwise call's kept drops go through save_for_backward: torch's saved-tensor hooks see them
    (a non-reentrant activation checkpoint discards what they see until the recompute makes it again;
    held on the autograd node instead, every checkpointed layer's bits stayed in memory), and a
    checkpointed call's gradients equal the plain call's."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    rule = BernoulliRule(torch.tensor(0.4))
    bias = _valid("padding", 2, 6)

    def run(checkpointed: bool):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        torch.manual_seed(0)
        site = HandPass(EditScores(drop=rule))

        def call(*qkv):
            return attend(*qkv, bias, **site.call)[0]

        if checkpointed:
            out = torch.utils.checkpoint.checkpoint(call, *leaves, use_reentrant=False)
        else:
            out = call(*leaves)
        return [out, *torch.autograd.grad(out.square().sum(), leaves)]

    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(checkpointed=False)
    packed_bits = [shape for dtype, shape in saved if dtype == torch.uint8]
    assert packed_bits == [(2, 2, 2, 1)] * 3  # one per block of 2 rows: 6 keys in one byte
    for a, b in zip(run(checkpointed=True), run(checkpointed=False)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rule", ["coins", "gradient-region"])
def test_drops_kept_as_bits_on_cuda_give_the_backward_the_same_drops(rule, dtype, small_blocks, monkeypatch):
    _kept_against_made_again(rule, 0.0, monkeypatch, device="cuda", dtype=dtype)


@pytest.mark.parametrize("seed", range(6))
def test_each_rows_kth_largest_is_the_same_from_numpy_and_from_topk(seed, monkeypatch):
    """The CPU's numpy selection and torch.topk (CUDA, torch.compile) give each row's k-th largest
    score, ties and invalid (-inf) keys included, with one k for the block or one per row."""
    g = torch.Generator().manual_seed(seed)
    rows, keys = 2 + seed, 5 + 7 * seed
    scores = torch.randint(0, 4, (2, rows, keys), generator=g).float()  # many ties
    scores[torch.rand(scores.shape, generator=g) < 0.3] = -math.inf
    per_row = torch.randint(1, keys + 1, (2, rows, 1), generator=g)
    for k in (per_row, per_row[:1, :1]):
        from_numpy = rules.kth_largest(scores, k)
        want = torch.stack([
            torch.sort(row, descending=True).values[int(kk) - 1]
            for row, kk in zip(scores.reshape(-1, keys), k.expand(2, rows, 1).reshape(-1))
        ]).view(2, rows, 1)  # fmt: skip
        with monkeypatch.context() as patched:
            patched.setattr(rules, "_numpy", None)
            from_topk = rules.kth_largest(scores, k)
            bounded = [rules.kth_largest(scores, k, bound) for bound in (int(k.max()), keys, keys + 3)]
        assert torch.equal(from_numpy, want) and torch.equal(from_topk, want)
        assert all(torch.equal(b, want) for b in bounded)  # a top-k sized on the host, k never read
    in_bf16 = rules.kth_largest(scores.bfloat16(), per_row)  # numpy has no bfloat16: topk's path
    assert torch.equal(in_bf16, rules.kth_largest(scores, per_row).bfloat16())


@pytest.mark.cpu_branch
@pytest.mark.parametrize("kind", ["padding", "causal"])
@pytest.mark.parametrize("layerdrop", [False, True])
def test_backward_groups_of_blocks_equal_one_backward_call_per_block(kind, layerdrop, small_blocks, monkeypatch):
    """sdpa's CPU backward over groups of kept blocks (of different key spans in causal attention,
    with rows without a valid key and rows made uniform) gives the gradients of one call per block."""
    g = torch.Generator().manual_seed(8)
    b, h, t, d = 2, 2, 9, 4
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    bias = _valid(kind, b, t)
    flag = torch.tensor([True, False]).view(2, 1, 1, 1) if layerdrop else None
    groups = []
    results = []
    backward_group = blockwise._backward_group

    def recorded(*args):
        groups.append(backward_group(*args))
        return groups[-1]

    monkeypatch.setattr(blockwise, "_backward_group", recorded)
    for per_dim in (4, 0):  # groups of 8 blocks of 2 rows (4 x d / 2), then one block per call
        monkeypatch.setattr(blockwise, "BACKWARD_ROWS_PER_DIM", per_dim)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        torch.manual_seed(2)
        hook = EditScores(drop=TopRegionRule(RandomScores(), 0.5, 0.9), uniform_rows=flag)
        out, _ = attend(*leaves, bias, **HandPass(hook).call)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        results.append((out, [x.grad for x in leaves]))
    assert groups == [8, 1]
    (out, grads), (out_, grads_) = results
    assert torch.equal(out, out_)
    for a, e in zip(grads, grads_):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("learned_bias", [False, True], ids=["lse-backward", "recompute-backward"])
def test_float64_blocks_keep_float64(learned_bias, monkeypatch):
    """float64 through blocks: the row log-sum-exp and the sums over blocks stay float64 (sdpa's CPU
    backward takes a float64 log-sum-exp for float64 inputs), equal to one block to float64 rounding;
    a bias that needs a gradient takes the backward that recomputes each block."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.zeros(2, 1, 7, 7, dtype=torch.float64).masked_fill(~_valid("causal", 2, 7), -1e9)
    bias = bias + 0.1 * torch.randn(bias.shape, generator=g, dtype=torch.float64)
    results = []
    for split in (True, False):
        with monkeypatch.context() as patched:
            if split:
                patched.setattr(rules, "CHUNK_ROWS", 2)
                patched.setattr(blockwise, "BLOCK_ELEMENTS", 1)
                patched.setattr(blockwise, "LINEAR_FACTOR", 0)
                patched.setattr(blockwise, "ONE_BLOCK_KEYS", 0)
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v, bias)]
            leaves[3].requires_grad_(learned_bias)
            drop = torch.rand(2, 2, 7, 7, generator=torch.Generator().manual_seed(1)) < 0.3
            out, _ = attend(*leaves, **HandPass(EditScores(drop=drop)).call)
            out.sum().backward()
            results.append([out, *(x.grad for x in leaves if x.requires_grad)])
    for a, e in zip(*results):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-10)


# -- one seed, the same drops at any split ------------------------------------------------------------
def _edit_step(model, x, bias, edit_of, seed=0):
    """One forward/backward of ``model`` with ``edit_of(site)`` set on every site by one pass: the loss,
    every gradient, and the pass's [dropped, droppable] counts."""
    torch.manual_seed(seed)
    with model.controller.hooks({s: edit_of(s) for s in model.sites}) as record:
        loss = model(x, bias).logsumexp(-1).sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    dropped, droppable = record.counts()
    return loss.detach(), grads, {"dropped": dropped, "droppable": droppable}


EDITS = {
    "scheduled-dropout": lambda site: EditScores(drop=BernoulliRule(torch.tensor(0.3)), counted=True),
    "layerdrop": lambda site: EditScores(uniform_rows=True if site.layer == 1 else None),
    "attendout-mask": lambda site: EditScores(
        drop=torch.rand((2, 1, 6, 6), generator=torch.Generator().manual_seed(site.layer)) < 0.4, counted=True
    ),
}


@pytest.mark.parametrize("regularizer", ["ga", "iga", "aa", "aa-ties", "rd", *EDITS])
def test_a_calls_drops_are_the_same_as_one_block_or_many(regularizer, monkeypatch, block_calls):
    """One tie rule and one random regime at every length: for the same seed a call makes the same
    drops whether it runs as one block or block by block, so a whole step (its dropped count, loss
    and every gradient) does not change when a call's length crosses the block size. Attention
    dropout is off (eval): sdpa's own draws differ with the split, as they would with the length."""
    monkeypatch.setattr(rules, "CHUNK_ROWS", 2)  # blocks are whole chunks: both runs draw per 2 rows
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(4))
    if regularizer == "aa-ties":
        x[:, 3] = x[:, 1]  # equal keys: every row's attention weights tie at keys 1 and 3
    bias = _valid("padding", 2, 6)

    def step():
        model = _Encoder().eval()
        if regularizer in EDITS:
            return _edit_step(model, x, bias, EDITS[regularizer])
        return _ad_drop_step(model, x, bias, regularizer.split("-")[0])

    loss, grads, stats = step()
    assert block_calls == []  # one block: the one-block path
    _force_small_blocks(monkeypatch)
    loss_blocks, grads_blocks, stats_blocks = step()
    assert block_calls and all(rows == 2 for rows in block_calls)  # every edited call split in blocks of 2 rows
    if regularizer != "layerdrop":
        assert int(stats["dropped"]) > 0 and int(stats["dropped"]) == int(stats_blocks["dropped"])
        assert int(stats["droppable"]) == int(stats_blocks["droppable"])
    torch.testing.assert_close(loss_blocks, loss, rtol=1e-6, atol=0)
    for a, b in zip(grads_blocks, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_aa_pass_one_outputs_are_sdpas_at_every_length_in_bfloat16(monkeypatch):
    """AA's capture hands the model sdpa's output as a long call's capture does: an explicit A V of a
    short map rounds otherwise in half precision, and the layers above (and the weights they rank)
    would change when a call's length crosses the block size."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    bias = _valid("padding", 2, 9)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    for split in (False, True):
        if split:
            _force_small_blocks(monkeypatch)
        out, _ = attend(q, k, v, bias, **HandPass(CaptureProbs(requires_grad=False, keeps_inputs=True)).call)
        assert torch.equal(out, expected)


def test_aa_keeps_the_models_own_mask_not_a_copy():
    """What AA keeps between its passes is q, k and the mask the model gave (shared by the layers):
    no float (B, 1, T, S) copy."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))
    bias = _valid("padding", 2, 9)
    site = HandPass(CaptureProbs(requires_grad=False, keeps_inputs=True))
    out, _ = attend(q, k, v, bias, **site.call)
    (kept,) = site.record.probs
    assert kept.bias is bias and kept.query.data_ptr() == q.data_ptr() and kept.key.data_ptr() == k.data_ptr()
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias))


@pytest.mark.parametrize("blocks", ["one", "many"])
def test_each_call_of_a_site_in_a_pass_draws_its_own_attention_dropout(blocks, monkeypatch):
    """A site called twice in one pass (R-Drop's two forwards over AD-DROP) applies the pass's drops in
    both calls but the model's attention dropout anew in each, as stock sdpa draws it: with v the
    identity, the output is the dropped weights, so their zeros show the dropout."""
    (_force_small_blocks if blocks == "many" else _one_block)(monkeypatch)
    controller = RegularizationController()
    site = controller.register("encoder-self", 0)
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 2, 12, 12, generator=g), torch.randn(2, 2, 12, 12, generator=g)
    v = torch.eye(12).expand(2, 2, 12, 12)
    rule = BernoulliRule(torch.tensor(0.3))
    with controller.hooks({site: EditScores(drop=rule, counted=True)}) as record:
        first = attend(q, k, v, dropout_p=0.5, site=site)[0]
        second = attend(q, k, v, dropout_p=0.5, site=site)[0]
    dropped_1, dropped_2 = first == 0, second == 0
    # The rule's drops are zero in both calls (the pass's); the dropout's differ between the calls.
    assert record.entries[0][1].dropped == record.entries[1][1].dropped
    both = dropped_1 & dropped_2
    assert both.float().mean() > 0.25  # the rule's 0.3 at least, shared
    agree = (dropped_1 == dropped_2).float().mean()
    assert agree < 0.85, f"two calls agree on {agree:.3f} of the weights: one dropout drawn twice"


@pytest.mark.parametrize("padded", [False, True])
def test_a_value_head_larger_than_the_query_head_runs_block_by_block(padded, block_calls, monkeypatch):
    """Multi-head latent attention (DeepSeek-V3) has value heads of another size than its query and key
    heads. sdpa's CPU flash op refuses them, so a blockwise call takes the recomputing backward: output and
    gradients equal the same drops applied in one block."""
    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(2, 2, 9, 4, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 2, 9, 6, generator=g, requires_grad=True)
    bias = None
    if padded:
        bias = (torch.arange(9)[None, :] < torch.tensor([9, 5])[:, None]).view(2, 1, 1, 9)
    drop = torch.rand(2, 2, 9, 9, generator=g) < 0.3

    def run():
        out = attend(q, k, v, bias, **HandPass(EditScores(drop=drop)).call)[0]
        return [out, *torch.autograd.grad(out.square().sum(), (q, k, v))]

    _force_small_blocks(monkeypatch)
    split = run()
    assert block_calls and split[0].shape == (2, 2, 9, 6)
    _one_block(monkeypatch)
    monkeypatch.setattr(blockwise, "ONE_BLOCK_KEYS", 128)
    whole = run()
    assert len(block_calls) == 1  # the second run was one block
    for a, b in zip(split, whole):
        torch.testing.assert_close(a, b)


def test_the_region_on_the_portable_path_reads_nothing_on_the_host(monkeypatch):
    """A device's route (the portable branches) sizes its top-k by ceil(p x keys), known on the host: the
    region costs no device sync (it read k.max() and k.min(), two syncs a block, issue 80)."""
    monkeypatch.setattr(devices, "PORTABLE", True)
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 16, 40, generator=g)
    valid = torch.rand(2, 1, 16, 40, generator=g) < 0.8
    rule = TopRegionRule(RandomScores(), 0.3, 0.5)
    block = Block(slice(0, 16), valid, (2, 3, 16, 40), (2, 3, 16, 40), 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        region, (threshold, k, _), _ = rule.region(block, scores.masked_fill(~valid, -math.inf))
    names = [e.name for e in prof.events()]
    assert "aten::_local_scalar_dense" not in names and "aten::topk" in names
    monkeypatch.setattr(devices, "PORTABLE", False)  # the CPU's numpy selection: the same region
    again, (threshold_cpu, _, _), _ = rule.region(block, scores.masked_fill(~valid, -math.inf))
    assert torch.equal(region, again) and torch.equal(threshold, threshold_cpu)
