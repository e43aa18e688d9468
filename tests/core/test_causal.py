"""attend(is_causal=True): the same outputs, gradients, drops and counts as the causal mask given as a
bias, on every path of the kernel, without a (T, S) mask where sdpa or a block of queries can do
without one."""

import pytest
import torch

from attn_reg_plugin.core.kernel import blockwise, masks, rules
from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import CaptureOutput, EditScores
from attn_reg_plugin.core.kernel.controller import RegularizationController
from attn_reg_plugin.core.kernel.rules import BernoulliRule, RandomScores, TopRegionRule
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attribution import logit_target
from helpers import HandPass


def _small_blocks(monkeypatch):
    monkeypatch.setattr(rules, "CHUNK_ROWS", 2)
    monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(blockwise, "LINEAR_FACTOR", 0)
    monkeypatch.setattr(blockwise, "ONE_BLOCK_KEYS", 0)


def _explicit(bias, t, s):
    """The causal mask as a bias (queries aligned to the last keys), combined with ``bias``."""
    device = None if bias is None else bias.device
    allowed = torch.arange(t, device=device)[:, None] + (s - t) >= torch.arange(s, device=device)[None, :]
    if bias is None:
        return allowed.view(1, 1, t, s)
    if bias.dtype == torch.bool:
        return bias & allowed
    return bias.masked_fill(~allowed, float("-inf"))


def _padding(kind, b, s):
    if kind is None:
        return None
    allowed = (torch.arange(s)[None, :] < torch.tensor([s, s - 2])[:, None]).view(b, 1, 1, s)
    if kind == "bool":
        return allowed
    return torch.zeros(b, 1, 1, s).masked_fill(~allowed, -1e9)  # fairseq's finite fill


HOOKS = {
    "none": lambda b, h, t, s: None,
    "dense drop": lambda b, h, t, s: EditScores(
        drop=torch.rand(b, h, t, s, generator=torch.Generator().manual_seed(3)) < 0.4, counted=True
    ),
    "coins, blocks": lambda b, h, t, s: EditScores(drop=BernoulliRule(torch.tensor(0.4)), counted=True),
    "random region, blocks": lambda b, h, t, s: EditScores(drop=TopRegionRule(RandomScores(), 0.5, 0.5), counted=True),
}


@pytest.mark.parametrize("hook_name", list(HOOKS))
@pytest.mark.parametrize("bias_kind", [None, "bool", "float"])
@pytest.mark.parametrize("t,s", [(6, 6), (4, 6), (6, 4)], ids=["T=S", "cache", "more-queries"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_the_causal_flag_equals_the_causal_mask_as_a_bias(hook_name, bias_kind, t, s, need_weights, monkeypatch):
    """Queries aligned to the last keys (a cache: T < S) and rows without a valid key (T > S: they
    give 0), with a padding bias of either convention, on the ordinary, dense and blockwise paths."""
    _flag_against_mask(hook_name, bias_kind, t, s, need_weights, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hook_name", list(HOOKS))
@pytest.mark.parametrize("bias_kind", [None, "bool"])
@pytest.mark.parametrize("t,s", [(6, 6), (4, 6), (6, 4)], ids=["T=S", "cache", "more-queries"])
def test_the_causal_flag_on_cuda_equals_the_causal_mask(dtype, hook_name, bias_kind, t, s, monkeypatch):
    """On CUDA: sdpa's is_causal, blocks whose key span is arithmetic (no host read), integer coins
    from a CUDA generator, rows without a valid key; in half precision too."""
    _flag_against_mask(hook_name, bias_kind, t, s, False, monkeypatch, device="cuda", dtype=dtype)


TOLERANCE = {
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=5e-2),
}


def _flag_against_mask(hook_name, bias_kind, t, s, need_weights, monkeypatch, device="cpu", dtype=torch.float32):
    if "blocks" in hook_name:
        _small_blocks(monkeypatch)
    g = torch.Generator().manual_seed(1)
    b, h, d = 2, 2, 4
    q = torch.randn(b, h, t, d, generator=g).to(device, dtype)
    k, v = (torch.randn(b, h, s, d, generator=g).to(device, dtype) for _ in range(2))
    bias = _padding(bias_kind, b, s)
    bias = None if bias is None else bias.to(device)
    results = []
    for causal in (True, False):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        hook = HOOKS[hook_name](b, h, t, s)
        if hook is not None and isinstance(hook.drop, torch.Tensor):
            hook = EditScores(drop=hook.drop.to(device), counted=True)
        torch.manual_seed(7)  # a hand-set drawing hook takes its seed from the global stream
        site = HandPass(hook)
        out, weights = attend(
            *leaves,
            bias if causal else _explicit(bias, t, s).to(device),
            **site.call,
            need_weights=need_weights,
            is_causal=causal,
        )
        (out.float() * torch.linspace(-1, 1, out.numel(), device=device).view(out.shape)).sum().backward()
        counts = None if hook is None else [int(c) for c in site.record.counts()]
        results.append((out, weights, [x.grad for x in leaves], counts))
    (out, weights, grads, counts), (out_, weights_, grads_, counts_) = results
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, out_, **TOLERANCE[dtype])
    for a, e in zip(grads, grads_):
        torch.testing.assert_close(a, e, **TOLERANCE[dtype])
    if need_weights:
        torch.testing.assert_close(weights, weights_)
    assert counts == counts_
    if t > s:  # the first T - S queries see no key: output 0
        assert not out[:, :, : t - s].any()


@pytest.mark.parametrize("t", [6, 4])
def test_ga_capture_of_a_causal_call_keeps_the_same_output_and_validity(t):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, t, 4, generator=g)
    k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(2))
    captured = []
    for causal in (True, False):
        site = HandPass(CaptureOutput())
        out, _ = attend(q, k, v, None if causal else _explicit(None, t, 6), **site.call, is_causal=causal)
        captured.append((out, site.record.outputs[0], site.record.valid[0]))
    (out, kept, valid), (out_, kept_, valid_) = captured
    torch.testing.assert_close(out, out_)
    assert kept is out and kept.requires_grad
    assert torch.equal(valid.expand(1, 1, t, 6), valid_.expand(1, 1, t, 6))


class _CausalLM(torch.nn.Module):
    """Two causal self-attention layers over a right-padded batch; the causal part is given as
    ``is_causal`` or folded into the bias."""

    def __init__(self, flag: bool, checkpointed=False, need_weights=False, width=8, heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.flag, self.checkpointed, self.need_weights, self.heads = flag, checkpointed, need_weights, heads
        self.controller = RegularizationController()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, 3 * width) for _ in range(2))
        self.projections = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))
        self.sites = [self.controller.register("decoder-self", i) for i in range(2)]
        self.out = torch.nn.Linear(width, 3)

    def _layer(self, i, x, bias):
        b, t, w = x.shape
        q, k, v = self.layers[i](x).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        o, _ = attend(q, k, v, bias, site=self.sites[i], is_causal=self.flag, need_weights=self.need_weights)
        return x + self.projections[i](o.transpose(1, 2).reshape(b, t, w))

    def forward(self, x, padding):
        bias = padding if self.flag else _explicit(padding, x.shape[1], x.shape[1])
        for i in range(2):
            if self.checkpointed:  # the recompute must save what the forward saved (a projection follows)
                x = self.controller.checkpoint(self._layer, i, x, bias)
            else:
                x = self._layer(i, x, bias)
        return self.out(x.mean(1))


def _step(model, x, padding, attribution):
    torch.manual_seed(0)
    ad_drop = ADDrop(ADDropConfig(p=0.3, q=0.5, schedule="always", attribution=attribution), model.controller)
    with ad_drop.masked(lambda: model(x, padding), logit_target, frozen=model) as stats:
        loss = model(x, padding).logsumexp(-1).sum()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    return loss.detach(), grads, int(stats["dropped"]), int(stats["droppable"])


@pytest.mark.parametrize("attribution", ["ga", "aa", "rd", "iga"])
@pytest.mark.parametrize("blocks", ["one", "several"])
@pytest.mark.parametrize("padded", [False, True])
def test_ad_drop_on_a_causal_model_is_the_same_with_the_flag(attribution, blocks, padded, monkeypatch):
    """Pass 1, the region, the drops, the counts and the gradients of a whole AD-DROP step. Through
    blocks, no causal mask of more rows than a block is ever built."""
    built = []
    allowed = masks.causal_allowed

    def recorded(rows, *args):
        built.append(rows.stop - rows.start)
        return allowed(rows, *args)

    monkeypatch.setattr(masks, "causal_allowed", recorded)  # masks.causal_bias builds every causal mask
    if blocks == "several":
        _small_blocks(monkeypatch)
        monkeypatch.setattr(blockwise, "BACKWARD_ROWS_PER_DIM", 1)  # backward calls of 2 blocks (d = 4)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(4))
    padding = _padding("bool", 2, 6) if padded else None
    flagged = _step(_CausalLM(True), x, padding, attribution)
    if blocks == "several" and not padded:
        # Blocks of 2 rows, 4 in the backward's calls; pass 1 (and IGA's scaled passes) went to
        # sdpa's is_causal. (sdpa takes a padding mask or is_causal, not both: padded calls build it.)
        assert built and max(built) <= 4, built
    explicit = _step(_CausalLM(False), x, padding, attribution)
    torch.testing.assert_close(flagged[0], explicit[0])
    for a, e in zip(flagged[1], explicit[1]):
        torch.testing.assert_close(a, e)
    assert flagged[2:] == explicit[2:] and flagged[2] > 0


@pytest.mark.parametrize("attribution", ["ga", "aa", "rd", "iga"])
@pytest.mark.parametrize("blocks", ["one", "several"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_ad_drop_with_checkpointed_layers_is_the_same(attribution, blocks, need_weights, monkeypatch):
    """torch.utils.checkpoint (non-reentrant) around each layer, inside the training step: IGA's
    scaled captures (which a checkpoint may or may not recompute) and captures whose output is a
    fresh leaf (parameters frozen below) give the unchecked step's loss, counts and gradients, on the
    fast path and the explicit one (need_weights), with left padding."""
    if blocks == "several":
        _small_blocks(monkeypatch)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(4))
    left = (torch.arange(6)[None, :] >= torch.tensor([0, 3])[:, None]).view(2, 1, 1, 6)
    plain = _step(_CausalLM(True, need_weights=need_weights), x, left, attribution)
    checkpointed = _step(_CausalLM(True, checkpointed=True, need_weights=need_weights), x, left, attribution)
    torch.testing.assert_close(checkpointed[0], plain[0])
    for a, e in zip(checkpointed[1], plain[1]):
        torch.testing.assert_close(a, e)
    assert checkpointed[2:] == plain[2:] and plain[2] > 0


def test_dense_ga_attributions_of_a_long_causal_map_keep_its_validity(monkeypatch):
    """The lab's tools read attributions(dense=True) with each map's validity, also for a causal map
    longer than one block (training's per-block ranking does without it)."""
    _small_blocks(monkeypatch)
    model = _CausalLM(True)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(4))
    ad_drop = ADDrop(ADDropConfig(p=0.3, q=0.5, schedule="always"), model.controller)
    _, maps, valids = ad_drop.attributions(lambda: model(x, None), logit_target, frozen=model)
    assert all(m.shape == (2, 2, 6, 6) for m in maps)
    assert all(torch.equal(v.expand(1, 1, 6, 6), _explicit(None, 6, 6)) for v in valids)


def test_the_blockwise_causal_mask_is_built_per_block(monkeypatch):
    """causal_allowed gives a block's rows only, aligned to the last keys."""
    got = masks.causal_allowed(slice(2, 4), 5, 4, 6, "cpu")
    assert got.shape == (1, 1, 2, 5)
    assert got[0, 0].tolist() == [[True] * 5, [True] * 5]  # rows 2, 3 of 4 over 6 keys: keys <= 4, 5
    assert masks.causal_allowed(slice(0, 2), 3, 4, 2, "cpu")[0, 0].tolist() == [[False] * 3, [False] * 3]
    assert masks.causal_key_span(slice(0, 2), 4, 2) == 1  # no valid key at all: still one key
    assert masks.causal_key_span(slice(2, 4), 4, 6) == 6
    assert masks.causal_key_span(slice(0, 2), 6, 6) == 2
