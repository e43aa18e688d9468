"""The fused edit kernel (core/kernel/fused_edit.py) on tiny shapes, in Triton's CPU interpreter, against the
portable PyTorch path: its drops (region, ties, coins, the rows a rule would empty), the model's
attention dropout inside the call, its output and its gradients (no padding, padding, a (B, 1, T, S)
mask whose rows differ, causal with T != S, GQA, emptied and keyless rows)."""

import dataclasses
import math

import pytest
import torch

from helpers import fused_kernel_device

DEVICE = fused_kernel_device()  # CUDA, compiled; else the CPU in Triton's interpreter
from attn_reg_plugin.core.kernel import fused_edit as fe  # noqa: E402

pytestmark = pytest.mark.gpu  # make gpu-check: compiled on CUDA; here in the interpreter

# The portable path, imported here only: its modules are being refactored (one place to re-point).
from attn_reg_plugin.core.kernel.blockwise import BlockCall, edit_attention
from attn_reg_plugin.core.kernel.masks import MASKED_BIAS
from attn_reg_plugin.core.kernel.rules import (
    Block,
    DenseRule,
    MapScores,
    SampledLogits,
    TopRegionRule,
    dense_gradient_attribution,
    keep_one_valid_key,
)


def qkv(b=1, h=2, h_kv=2, t=20, s=20, d=8, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn((b, h, t, d), generator=generator, dtype=dtype)
    k = torch.randn((b, h_kv, s, d), generator=generator, dtype=dtype)
    v = torch.randn((b, h_kv, s, d), generator=generator, dtype=dtype)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def padding_bias(lengths, s, left=False):
    """(B, 1, 1, S) additive bias, -inf at padding keys (right padding, or left with ``left``)."""
    keys = torch.arange(s)
    pad = [(keys < s - n) if left else (keys >= n) for n in lengths]
    return torch.zeros(len(lengths), 1, 1, s).masked_fill(torch.stack(pad).view(-1, 1, 1, s), -math.inf).to(DEVICE)


def mask_of_rows(lengths, t, s, seed=0, rate=0.3):
    """(B, 1, T, S) additive bias whose rows differ: -inf at padding keys and at random keys of each row."""
    taken = torch.rand((len(lengths), 1, t, s), generator=torch.Generator().manual_seed(seed)) < rate
    return padding_bias(lengths, s).expand(len(lengths), 1, t, s).masked_fill(taken.to(DEVICE), -math.inf)


def integer_attribution(q, v, seed=1, span=3):
    """An attribution gradient and values with small integer entries: the scores are exact integers
    whatever the order of summation (so the kernel's and torch's agree), with many ties."""
    generator = torch.Generator().manual_seed(seed)
    attribution = torch.randint(-span, span + 1, q.shape, generator=generator).float()
    values = torch.randint(-span, span + 1, v.shape, generator=generator).to(v.dtype)
    return attribution.to(DEVICE), values.to(DEVICE)


def validity(q, k, key_bias, causal):
    """(B, H, T, S) bool: the keys each query may attend (not padding; not in the future)."""
    t, s = q.shape[2], k.shape[2]
    valid = torch.ones((1, 1, t, s), dtype=torch.bool, device=q.device)
    if key_bias is not None:
        valid = valid & (key_bias > MASKED_BIAS)
    if causal:
        valid = valid & (torch.arange(s, device=q.device) <= torch.arange(t, device=q.device)[:, None] + s - t)
    return valid.expand(q.shape[0], q.shape[1], t, s)


def ad_drop_spec(q, k, values, attribution, p, rate, seed, key_bias=None, causal=False):
    """EditDrops for AD-DROP GA whose per-row state is the PyTorch path's own region
    (TopRegionRule.region) over torch's attribution scores dO V^T of the attribution pass (its
    ``attribution`` and ``values``); also (scores, valid, region). The kernel ranks its own product:
    equal to torch's for integer inputs (the region tests)."""
    scores, valid = dense_gradient_attribution(attribution, values), validity(q, k, key_bias, causal)
    shape = tuple(scores.shape)
    rule = TopRegionRule(MapScores(scores), p, 0.0)
    region, (threshold, k_rows, _), _ = rule.region(Block(slice(0, shape[2]), valid, shape, shape, 0))
    last_tie, lowest = fe.region_ties(scores, valid, threshold, k_rows)
    spec = fe.EditDrops(fe.AD_DROP, rate, seed, attribution, values, threshold.squeeze(-1), last_tie, lowest)
    return spec, scores, valid, region


def reference(q, k, v, seen: "fe.KernelDrops", key_bias, scale=None, dropout_p=0.0):
    """float64 attention by explicit softmax over the kernel's exported drops: q zeroed in uniform
    rows, every non-attended key excluded, a row attending nothing gives 0; under the model's attention
    dropout the weights times Z (0 where the kernel dropped the weight, 1 / (1 - p) elsewhere)."""
    q, k, v = (x.double() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    q = q.masked_fill(seen.uniform[..., None], 0.0)
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if key_bias is not None:
        scores = scores + key_bias.double().masked_fill(key_bias <= MASKED_BIAS, 0.0)
    attended = seen.valid & ~seen.drop
    some = attended.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~attended, -math.inf).masked_fill(~some, 0.0), -1) * some
    if dropout_p:
        probs = probs * torch.where(seen.weight_dropped, 0.0, 0.0 if dropout_p >= 1 else 1 / (1 - dropout_p))
    return probs @ v


def outputs_and_grads(function, q, k, v, grad):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = function(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach().double()] + [x.grad.double() for x in leaves]


# -- the drops -------------------------------------------------------------------------------------
def test_bernoulli_coins_rate_seed_and_counts():
    q, k, v = qkv(b=2, h=1, h_kv=1, t=32, s=40)
    bias = padding_bias([40, 30], 40)
    spec = fe.EditDrops(fe.BERNOULLI, 0.3, 1234)
    seen = fe.inspect(q, k, v, spec, bias)
    n = int(seen.valid.sum())
    assert n == 32 * 40 + 32 * 30
    assert not (seen.drop & ~seen.valid).any()
    rate = seen.drop.sum().item() / n
    assert abs(rate - 0.3) < 4 * math.sqrt(0.3 * 0.7 / n)  # 4 sigma of a binomial
    assert torch.equal(fe.inspect(q, k, v, spec, bias).drop, seen.drop)  # the seed alone decides
    other = fe.inspect(q, k, v, fe.EditDrops(fe.BERNOULLI, 0.3, 1235), bias).drop
    assert (other != seen.drop).float().mean() > 0.3
    _, dropped, droppable = fe.fused_edit_attention(q, k, v, spec, bias)
    assert (int(dropped), int(droppable)) == (int(seen.drop.sum()), n)


def test_bernoulli_row_its_coins_would_empty_attends_uniformly():
    q, k, v = qkv(t=24, s=24)
    spec = fe.EditDrops(fe.BERNOULLI, 0.8, 7)
    seen = fe.inspect(q, k, v, spec, causal=True)
    assert seen.uniform.any() and not seen.uniform.all()  # the first rows have few keys
    assert not (seen.drop & seen.uniform[..., None]).any()  # a uniform row's drops are cleared
    assert ((seen.valid & ~seen.drop).any(-1) | seen.uniform).all()
    _, dropped, _ = fe.fused_edit_attention(q, k, v, spec, causal=True)
    assert int(dropped) == int(seen.drop.sum() + (seen.valid & seen.uniform[..., None]).sum())


@pytest.mark.parametrize("causal", [False, True])
def test_ad_drop_region_is_the_pytorch_paths_region_ties_included(causal):
    q, k, v = qkv(b=2, h=2, h_kv=1, t=20, s=27, d=4)
    # The attribution pass's values, not this call's v (hidden dropout makes them differ).
    attribution, values = integer_attribution(q, v)
    bias = padding_bias([27, 18], 27, left=True)
    spec, scores, valid, region = ad_drop_spec(q, k, values, attribution, 0.3, 1.0, 11, bias, causal)
    tied = (scores.unsqueeze(-1) == scores.unsqueeze(-2)) & valid.unsqueeze(-1) & valid.unsqueeze(-2)
    assert (tied.sum((-1, -2)) > valid.sum(-1)).any()  # ties straddle thresholds
    seen = fe.inspect(q, k, v, spec, bias, causal)
    assert torch.equal(seen.scores, scores) and torch.equal(seen.valid, valid)  # exact: integer products
    assert torch.equal(seen.region, region)
    # q = 1: every candidate dropped but a row's lowest-scored key where all its keys are candidates.
    assert torch.equal(seen.drop, keep_one_valid_key(region, valid, scores))
    half = fe.inspect(q, k, v, with_rate(spec, 0.5), bias, causal)
    assert not (half.drop & ~region).any()
    n = int(region.sum())
    assert abs(half.drop.sum().item() / n - 0.5) < 4 * math.sqrt(0.25 / n)


def with_rate(spec, rate):
    return dataclasses.replace(spec, rate=rate)


def test_ad_drop_ties_are_taken_lowest_key_first():
    """One row, scores 5 5 3 3 3 3 1 1 over 8 keys, p = 0.5: k = 4, the region is the two 5s and
    the first two 3s (keys 2, 3), not keys 4, 5."""
    q, k, v = qkv(b=1, h=1, h_kv=1, t=1, s=8, d=4)
    first = torch.tensor([1.0, 0.0, 0.0, 0.0], device=DEVICE)
    values = torch.tensor([5.0, 5, 3, 3, 3, 3, 1, 1], device=DEVICE).view(1, 1, 8, 1) * first
    attribution = first.view(1, 1, 1, 4)
    spec, _, _, region = ad_drop_spec(q, k, values, attribution, 0.5, 1.0, 3)
    assert region[0, 0, 0].tolist() == [True] * 4 + [False] * 4
    assert fe.inspect(q, k, v, spec).region[0, 0, 0].tolist() == [True] * 4 + [False] * 4


# -- output and gradients --------------------------------------------------------------------------
CASES = {
    "plain": dict(),
    "padding": dict(lengths=[20, 13], b=2),
    "causal, T < S": dict(t=13, s=29, causal=True),
    "gqa": dict(h=4, h_kv=2),
    "gqa, causal, padding": dict(h=2, h_kv=1, lengths=[20, 9], b=2, causal=True),
    "keyless rows": dict(t=22, s=14, causal=True),  # rows 0 .. 7 have no key at or before them
    "keyless, left padding": dict(lengths=[20, 6], b=2, causal=True, left=True),
    "mask of rows, causal, T < S": dict(t=19, s=23, lengths=[23, 10], b=2, causal=True, rows=True),
    "mask of rows, gqa": dict(h=4, h_kv=2, lengths=[20, 17], b=2, rows=True),
}


def case_inputs(case, dtype=torch.float32):
    options = dict(CASES[case])
    lengths, causal, left = options.pop("lengths", None), options.pop("causal", False), options.pop("left", False)
    rows = options.pop("rows", False)
    q, k, v = qkv(dtype=dtype, **options)
    bias = None if lengths is None else padding_bias(lengths, k.shape[2], left)
    if rows:
        bias = mask_of_rows(lengths, q.shape[2], k.shape[2])
    return q, k, v, bias, causal


# Each case under two or three of the rules ("emptying": rates at which rows lose every key, so that they
# keep one, AD-DROP, or attend uniformly, Bernoulli and the Generator): the interpreter takes seconds a case.
RULES = {
    "plain": ["bernoulli", "ad_drop"],
    "padding": ["bernoulli", "emptying ad_drop", "generator"],
    "causal, T < S": ["ad_drop", "emptying bernoulli", "emptying generator"],
    "gqa": ["ad_drop"],
    "gqa, causal, padding": ["ad_drop", "generator"],  # and Bernoulli against the portable edit, below
    "keyless rows": ["emptying bernoulli", "ad_drop"],
    "keyless, left padding": ["emptying ad_drop"],
    "mask of rows, causal, T < S": ["bernoulli", "emptying ad_drop"],
    "mask of rows, gqa": ["emptying bernoulli", "ad_drop", "emptying generator"],
}


def generator_policy(b, t, s, causal, offset, g=12, seed=6):
    """AttendOut's Generator as the kernel draws it (rules.SampledLogits): factors of width ``g``, the last
    sample's last 3 queries and 4 keys not real, mean drop probability about sigmoid(offset)."""
    generator = torch.Generator().manual_seed(seed)
    query, key = torch.randn(b, t, g, generator=generator) / 2, torch.randn(b, s, g, generator=generator) / 2
    query_real, key_real = torch.ones(b, t, dtype=torch.bool), torch.ones(b, s, dtype=torch.bool)
    query_real[-1, -3:], key_real[-1, -4:] = False, False
    factors = [x.to(DEVICE) for x in (query, key, torch.tensor(float(offset)), query_real, key_real)]
    return SampledLogits(*factors, causal, False, 1000 + seed)


def rule_spec(rule, q, k, v, bias, causal, **dropout):
    """EditDrops of a test's rule ("emptying": at rates where rows lose every key), with ``dropout``."""
    p = 0.9 if rule.startswith("emptying") else 0.3
    if rule.endswith("bernoulli"):
        return fe.EditDrops(fe.BERNOULLI, p, 5, **dropout)
    if rule.endswith("generator"):
        policy = generator_policy(q.shape[0], q.shape[2], k.shape[2], causal, math.log(p / (1 - p)))
        return fe.EditDrops(fe.GENERATOR, 0.0, policy.seed, policy=policy, **dropout)
    attribution = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    values = torch.randn(v.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    spec = ad_drop_spec(q, k, values, attribution, 1.0 if p > 0.5 else p, p, 5, bias, causal)[0]
    return dataclasses.replace(spec, **dropout)


def assert_matches_the_reference(q, k, v, bias, causal, spec, tolerance):
    """The kernel's output and gradients (fp32) are the float64 reference's over its own inspected drops."""
    seen = fe.inspect(q, k, v, spec, bias, causal)
    assert torch.equal(seen.valid, validity(q, k, bias, causal))
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    fused = outputs_and_grads(lambda *x: fe.fused_edit_attention(*x, spec, bias, causal)[0], q, k, v, grad)
    expected = outputs_and_grads(
        lambda *x: reference(*x, seen, bias, dropout_p=spec.dropout_p), q.double(), k.double(), v.double(), grad
    )
    for name, got, want in zip(("out", "dq", "dk", "dv"), fused, expected):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance, msg=name)
    keyless = ~seen.valid.any(-1)
    assert (fused[0][keyless] == 0).all() and (fused[1][keyless] == 0).all()
    return seen


@pytest.mark.parametrize("case, rule", [(case, rule) for case, rules in RULES.items() for rule in rules])
def test_output_and_gradients_match_float64_softmax(case, rule):
    q, k, v, bias, causal = case_inputs(case)
    spec = rule_spec(rule, q, k, v, bias, causal)
    assert_matches_the_reference(q, k, v, bias, causal, spec, 2e-5)


# -- the model's attention dropout inside the call ---------------------------------------------------
DROPOUT_CASES = [
    ("plain", "bernoulli"),
    ("padding", "ad_drop"),
    ("causal, T < S", "emptying bernoulli"),  # rows attending uniformly, their weights dropped too
    ("gqa, causal, padding", "ad_drop"),
    ("keyless rows", "emptying ad_drop"),  # rows keeping one key, and rows with none
    ("mask of rows, causal, T < S", "ad_drop"),
    ("gqa, causal, padding", "emptying generator"),
]


@pytest.mark.parametrize("case, rule", DROPOUT_CASES)
def test_dropout_output_and_gradients_match_float64_softmax_times_its_dropout(case, rule):
    """With the model's attention dropout (p = 0.3), the output and dq, dk, dv are the float64 reference's:
    softmax over the rule's drops (the normaliser sums the weights before dropout), times Z (0 at the
    weights inspect() says the kernel dropped, 1 / (1 - p) elsewhere), times v; gradients by autograd."""
    q, k, v, bias, causal = case_inputs(case)
    spec = rule_spec(rule, q, k, v, bias, causal, dropout_p=0.3, dropout_seed=99)
    seen = assert_matches_the_reference(q, k, v, bias, causal, spec, 1e-5)
    attended = seen.valid & ~seen.drop
    assert (attended & seen.weight_dropped).any() and (attended & ~seen.weight_dropped).any()


def test_dropout_rate_is_p_and_its_coins_are_their_own_stream():
    """The dropout's coins come from the dropout seed alone: the rate is p (a 4-sigma binomial bound), the
    same dropout seed repeats them under another rule seed, another changes them, and they are
    independent of the rule's coins (joint rate p_rule p_dropout)."""
    q, k, v = qkv(b=2, h=2, h_kv=2, t=40, s=56)
    spec = fe.EditDrops(fe.BERNOULLI, 0.5, 1234, dropout_p=0.2, dropout_seed=77)
    seen = fe.inspect(q, k, v, spec)
    n = seen.weight_dropped.numel()
    rate = seen.weight_dropped.float().mean().item()
    assert abs(rate - 0.2) < 4 * math.sqrt(0.2 * 0.8 / n)
    joint = (seen.weight_dropped & seen.drop).float().mean().item()
    assert abs(joint - 0.1) < 4 * math.sqrt(0.1 * 0.9 / n)
    other_rule = fe.inspect(q, k, v, dataclasses.replace(spec, seed=4321))
    assert torch.equal(other_rule.weight_dropped, seen.weight_dropped) and not torch.equal(other_rule.drop, seen.drop)
    other = fe.inspect(q, k, v, dataclasses.replace(spec, dropout_seed=78)).weight_dropped
    differ = (other != seen.weight_dropped).float().mean().item()
    assert abs(differ - 0.32) < 4 * math.sqrt(0.32 * 0.68 / n)  # 2 p (1 - p): independent draws
    out, dropped, droppable = fe.fused_edit_attention(q, k, v, spec)
    base = fe.fused_edit_attention(q, k, v, dataclasses.replace(spec, dropout_p=0.0))
    assert (int(dropped), int(droppable)) == (int(base[1]), int(base[2]))  # the rule's counts only
    assert not torch.equal(out, base[0])


def test_dropout_p_0_is_the_call_without_dropout_and_p_1_drops_every_weight():
    q, k, v = qkv(b=2, t=20, s=27)
    bias = padding_bias([27, 15], 27)
    spec = fe.EditDrops(fe.BERNOULLI, 0.3, 5)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    plain = outputs_and_grads(lambda *x: fe.fused_edit_attention(*x, spec, bias, True)[0], q, k, v, grad)
    zero = dataclasses.replace(spec, dropout_p=0.0, dropout_seed=123)
    assert not fe.inspect(q, k, v, zero, bias, True).weight_dropped.any()
    for got, want in zip(
        outputs_and_grads(lambda *x: fe.fused_edit_attention(*x, zero, bias, True)[0], q, k, v, grad), plain
    ):
        assert torch.equal(got, want)
    every = dataclasses.replace(spec, dropout_p=1.0, dropout_seed=123)
    assert fe.inspect(q, k, v, every, bias, True).weight_dropped.all()
    for got in outputs_and_grads(lambda *x: fe.fused_edit_attention(*x, every, bias, True)[0], q, k, v, grad):
        assert (got == 0).all()
    with pytest.raises(ValueError, match="a probability"):
        fe.fused_edit_attention(q, k, v, dataclasses.replace(spec, dropout_p=1.5))


@pytest.mark.parametrize("case", ["gqa, causal, padding", "keyless, left padding"])
def test_matches_the_portable_edit_with_the_kernels_drops(case):
    """blockwise.edit_attention with DenseRule(the kernel's coins) gives the kernel's output and
    gradients: its own uniform-instead-of-empty rows included (fed the coins before that rule)."""
    q, k, v, bias, causal = case_inputs(case)
    spec = fe.EditDrops(fe.BERNOULLI, 0.7, 9)
    seen = fe.inspect(q, k, v, spec, bias, causal)
    coins = seen.drop | (seen.uniform[..., None] & seen.valid)
    groups = q.shape[1] // k.shape[1]
    call = BlockCall(DenseRule(coins), None, None, q.shape[2], None, 0.0, None, True, causal=causal)

    def portable(q, k, v):
        return edit_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), bias, call)[0]

    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    fused = outputs_and_grads(lambda *x: fe.fused_edit_attention(*x, spec, bias, causal)[0], q, k, v, grad)
    expected = outputs_and_grads(portable, q, k, v, grad)
    for name, got, want in zip(("out", "dq", "dk", "dv"), fused, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


def test_gradcheck_float64():
    q, k, v = qkv(b=1, h=2, h_kv=1, t=4, s=5, d=2, dtype=torch.float64)
    bias = padding_bias([4], 5).double()
    spec = fe.EditDrops(fe.BERNOULLI, 0.4, 21)
    inputs = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *x: fe.fused_edit_attention(*x, spec, bias, True)[0], inputs, fast_mode=True)


@pytest.mark.parametrize("rows", [False, True])
def test_a_bool_mask_is_its_float_mask(rows):
    """A bool bias (True = may attend), a key row or a (B, 1, T, S) mask, read as it is: the kernel gives
    exactly what it gives for the additive 0 / -inf bias of the same keys."""
    q, k, v = qkv(b=2, t=19, s=23)
    bias = mask_of_rows([23, 10], 19, 23) if rows else padding_bias([23, 10], 23)
    spec = fe.EditDrops(fe.BERNOULLI, 0.4, 3, dropout_p=0.2, dropout_seed=1)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    results = []
    for mask in (bias, bias == 0):
        assert torch.equal(fe.inspect(q, k, v, spec, mask, True).valid, validity(q, k, bias, True))
        results.append(outputs_and_grads(lambda *x: fe.fused_edit_attention(*x, spec, mask, True)[0], q, k, v, grad))
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(got, want), name


def test_gradcheck_float64_with_dropout_and_a_mask_of_rows():
    q, k, v = qkv(b=2, h=2, h_kv=1, t=5, s=6, d=2, dtype=torch.float64)
    bias = mask_of_rows([6, 4], 5, 6, seed=1).double()
    spec = fe.EditDrops(fe.BERNOULLI, 0.3, 21, dropout_p=0.4, dropout_seed=8)
    assert fe.inspect(q, k, v, spec, bias, True).weight_dropped.any()
    inputs = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *x: fe.fused_edit_attention(*x, spec, bias, True)[0], inputs, fast_mode=True)


def test_ad_drop_without_the_attribution_values_is_refused():
    q, k, v = qkv(t=4, s=6)
    spec = fe.EditDrops(fe.AD_DROP, 0.5, 1, torch.zeros(q.shape, device=DEVICE), None, *(torch.zeros(1, 2, 4),) * 3)
    with pytest.raises(ValueError, match="attribution pass's values, of v's shape"):
        fe.fused_edit_attention(q, k, v, spec)


def test_available_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fe.available(torch.zeros(1))
    assert fe.available(torch.zeros(1, device="cuda")) if torch.cuda.is_available() else True
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fe.available(torch.zeros(1))
