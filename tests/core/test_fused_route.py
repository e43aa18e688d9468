"""The fused route (core/kernel/fused_route.py): with ATTN_REG_FUSED on, the regularized calls the fused
Triton kernel covers run there, and compute what the PyTorch path computes.

The two paths draw different coins (Philox in the kernel, keyed draws in PyTorch), so they are
compared where the drops take no coin: AD-DROP at q = 1 (every candidate dropped: the drops are the
region, exactly the PyTorch path's, ties and kept keys included) and Bernoulli at p = 1 (every row
attends uniformly). There they must give the same counts exactly and the same output and gradients
within rounding. Runs in Triton's interpreter without CUDA (tests/core/conftest.py), compiled with."""

import math

import pytest
import torch

from helpers import CORE_B, CORE_D, CORE_T, fused_kernel_device, tiny_bert_classifier, tiny_core_model, tiny_llama

DEVICE = fused_kernel_device()
pytestmark = pytest.mark.gpu  # make gpu-check: compiled on CUDA; here in the interpreter

from attn_reg_plugin.core.kernel import devices  # noqa: E402
from attn_reg_plugin.core.kernel.blockwise import BlockCall, edit_attention  # noqa: E402
from attn_reg_plugin.core.kernel.fused_route import fused_drops  # noqa: E402
from attn_reg_plugin.core.kernel.rules import BernoulliRule, DenseRule, GradientScores, RandomScores, TopRegionRule  # noqa: E402
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop  # noqa: E402
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig  # noqa: E402
from attn_reg_plugin.core.regularizers.attribution import logit_target  # noqa: E402


def tensors(b=2, h=2, h_kv=2, t=20, s=27, d=4, seed=0):
    """q, k and v (k and v repeated to q's heads, as attend hands them over) and, for AD-DROP, an
    attribution pass's output gradient and its values (unrepeated) with small integer entries: their
    products are exact in any order of summation, with many ties."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn((b, n, x, d), generator=g) for n, x in ((h, t), (h_kv, s), (h_kv, s)))
    attribution = torch.randint(-3, 4, (b, h, t, d), generator=g).float()
    values = torch.randint(-3, 4, (b, h_kv, s, d), generator=g).float()
    k, v = (x.repeat_interleave(h // h_kv, 1) for x in (k, v))
    return [x.to(DEVICE) for x in (q, k, v, attribution, values)]


def padding(lengths, s):
    keys = torch.arange(s)
    return torch.stack([torch.where(keys < n, 0.0, -math.inf) for n in lengths]).view(len(lengths), 1, 1, s).to(DEVICE)


def random_rows(b, t, s, seed=0, rate=0.3):
    """(B, 1, T, S) bool, True at the keys a random mask takes from each query row (rows differ)."""
    return (torch.rand((b, 1, t, s), generator=torch.Generator().manual_seed(seed)) < rate).to(DEVICE)


def materialised_mask(kind, lengths, t, s):
    """A (B, 1, T, S) mask as transformers hands it to attention: "padding and causal" (float32, its
    least value at padding and the future; "bool": True = may attend), or padding and random rows."""
    pad = padding(lengths, s).expand(len(lengths), 1, t, s) == 0
    if kind == "random rows":
        return torch.where(pad & ~random_rows(len(lengths), t, s), 0.0, -math.inf)
    allowed = pad & (torch.arange(s, device=DEVICE) <= torch.arange(t, device=DEVICE)[:, None] + s - t)
    if kind.endswith("bool"):
        return allowed
    return torch.zeros(allowed.shape, device=DEVICE).masked_fill(~allowed, torch.finfo(torch.float32).min)


def block_call(rule, t, rows=None, causal=False, **options):
    return BlockCall(rule, None, None, rows or t, torch.tensor(17), 0.0, None, True, causal=causal, **options)


def run(q, k, v, bias, call, fused, monkeypatch):
    """(output, dq, dk, dv, dropped, droppable) of edit_attention with the route on or off."""
    monkeypatch.setattr(devices, "FUSED", fused)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, _, dropped, droppable = edit_attention(*leaves, bias, call)
    out.backward(torch.linspace(-1, 1, out.numel(), device=out.device).view(out.shape))
    return [out.detach()] + [x.grad for x in leaves] + [int(dropped), int(droppable)]


CASES = {
    "plain": dict(),
    "padding": dict(lengths=[27, 15]),
    "causal, T < S, blocks": dict(t=13, causal=True, rows=4),
    "gqa, padding, blocks": dict(h=4, h_kv=2, lengths=[27, 9], rows=8),
    "keyless rows": dict(t=30, s=12, causal=True),  # rows 0 .. 17 have no key at or before them
}


@pytest.mark.parametrize("negate", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_ad_drop_at_q_1_equals_the_pytorch_path(case, negate, monkeypatch):
    options = dict(CASES[case])
    lengths, causal, rows = options.pop("lengths", None), options.pop("causal", False), options.pop("rows", None)
    q, k, v, attribution, values = tensors(**options)
    bias = None if lengths is None else padding(lengths, k.shape[2])
    rule = TopRegionRule(GradientScores(attribution, values, negate), 0.3, 1.0)
    call = block_call(rule, q.shape[2], rows, causal)
    assert fused_drops(q, k, v, bias, call) is not None  # the route covers it
    fused, portable = (run(q, k, v, bias, call, on, monkeypatch) for on in (True, False))
    assert fused[4:] == portable[4:] and fused[4] > 0  # the same drops, counted alike
    for name, a, b in zip(("out", "dq", "dk", "dv"), fused[:4], portable[:4]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_ad_drop_samples_limit_the_drops_to_their_samples(monkeypatch):
    q, k, v, attribution, values = tensors()
    samples = torch.tensor([False, True], device=DEVICE)
    call = block_call(TopRegionRule(GradientScores(attribution, values), 0.5, 1.0, samples), q.shape[2])
    fused, portable = (run(q, k, v, None, call, on, monkeypatch) for on in (True, False))
    assert fused[4:] == portable[4:] and fused[4] > 0
    torch.testing.assert_close(fused[0], portable[0], rtol=1e-5, atol=1e-5)
    plain = run(q, k, v, None, block_call(None, q.shape[2]), False, monkeypatch)[0]
    torch.testing.assert_close(fused[0][0], plain[0], rtol=1e-5, atol=1e-6)  # sample 0 loses nothing
    assert not torch.allclose(fused[0][1], plain[1], atol=1e-3)


def test_bernoulli_at_p_1_makes_every_row_uniform_as_the_pytorch_path(monkeypatch):
    q, k, v, _, _ = tensors(t=9)
    bias = padding([27, 11], 27)
    call = block_call(BernoulliRule(torch.tensor(1.0)), q.shape[2], causal=True)
    assert fused_drops(q, k, v, bias, call) is not None
    fused, portable = (run(q, k, v, bias, call, on, monkeypatch) for on in (True, False))
    assert fused[4:] == portable[4:] and fused[4] == fused[5] > 0  # every valid key counted as dropped
    for name, a, b in zip(("out", "dq", "dk", "dv"), fused[:4], portable[:4]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["padding and causal", "padding and causal, bool", "random rows"])
@pytest.mark.parametrize("rule", ["ad_drop at q = 1", "bernoulli at p = 1"])
def test_a_materialised_mask_whose_rows_differ_equals_the_pytorch_path(kind, rule, monkeypatch):
    """A (B, 1, T, S) mask (padding with the future, or random rows) is read by the kernel row by row:
    the same counts exactly, output and gradients as the PyTorch path, in blocks of rows too."""
    q, k, v, attribution, values = tensors(t=21, s=27)
    bias = materialised_mask(kind, [27, 15], 21, 27)
    if rule.startswith("ad_drop"):
        call = block_call(TopRegionRule(GradientScores(attribution, values), 0.3, 1.0), 21, rows=8)
    else:
        call = block_call(BernoulliRule(torch.tensor(1.0)), 21)
    fused_call = fused_drops(q, k, v, bias, call)
    assert fused_call is not None and fused_call.key_bias.shape == (2, 1, 21, 27)  # covered, rows kept
    fused, portable = (run(q, k, v, bias, call, on, monkeypatch) for on in (True, False))
    assert fused[4:] == portable[4:] and fused[4] > 0
    for name, a, b in zip(("out", "dq", "dk", "dv"), fused[:4], portable[:4]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_a_call_with_the_models_attention_dropout_runs_on_the_kernel(monkeypatch):
    """An AD-DROP call with attention dropout (p = 0.1, as a BERT's in training) runs on the fused
    kernel, its dropout keyed by the call's dropout seed: finite, the same for the same seed, another
    for another seed, other than without dropout, and its gradients flow."""
    from attn_reg_plugin.core.kernel import fused_edit

    q, k, v, attribution, values = tensors()
    bias = padding([27, 15], 27)
    calls, original = [], fused_edit.fused_edit_attention
    monkeypatch.setattr(fused_edit, "fused_edit_attention", lambda *a, **o: calls.append(a[3]) or original(*a, **o))
    rule = TopRegionRule(GradientScores(attribution, values), 0.3, 0.5)

    def dropout_call(p, seed):
        return BlockCall(rule, None, None, 20, torch.tensor(17), p, None, True, dropout_seed=torch.tensor(seed))

    results = [
        run(q, k, v, bias, dropout_call(p, seed), True, monkeypatch)
        for p, seed in ((0.1, 5), (0.1, 5), (0.1, 6), (0.0, 5))
    ]
    assert [(d.dropout_p, d.dropout_seed) for d in calls] == [(0.1, 5), (0.1, 5), (0.1, 6), (0.0, 0)]
    same, again, other, plain = results
    for x in same[:4]:
        assert torch.isfinite(x).all() and x.abs().sum() > 0
    for a, b in zip(same, again):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert not torch.equal(same[0], other[0]) and not torch.equal(same[0], plain[0])
    assert same[4:] == other[4:] == plain[4:]  # the rule's drops do not depend on the dropout


def test_calls_the_kernel_does_not_cover_stay_on_the_pytorch_path(monkeypatch):
    q, k, v, attribution, values = tensors()
    t, s = q.shape[2], k.shape[2]
    ad_drop = TopRegionRule(GradientScores(attribution, values), 0.3, 0.5)
    uniform, seed = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=DEVICE), torch.tensor(1)
    coins = torch.rand((2, 2, t, s), generator=torch.Generator().manual_seed(3)) < 0.2
    per_head = torch.zeros((2, 2, t, s)).masked_fill(coins, -math.inf).to(DEVICE)
    uncovered = {
        "rows made uniform": (BlockCall(ad_drop, uniform, None, t, seed, 0.0, None, True), None),
        "the map returned": (block_call(ad_drop, t, need_weights=True), None),
        "a bias whose heads differ": (block_call(ad_drop, t), per_head),
        "a bias requiring grad": (block_call(ad_drop, t), per_head[:, :1].clone().requires_grad_()),
        "RD's random scores": (block_call(TopRegionRule(RandomScores(), 0.3, 0.5), t), None),
        "a dense rule": (block_call(DenseRule(torch.zeros(1, 1, t, s, dtype=torch.bool, device=DEVICE)), t), None),
    }  # fmt: skip
    for name, (call, bias) in uncovered.items():
        assert fused_drops(q, k, v, bias, call) is None, name
        out = run(q, k, v, bias, call, True, monkeypatch)[0]  # and it runs, on the PyTorch path
        assert torch.isfinite(out).all(), name


def test_a_call_the_kernel_does_not_cover_is_named_once_in_the_log(monkeypatch, caplog):
    """With the route on, nothing stays on the PyTorch path silently: each reason is one warning."""
    from attn_reg_plugin.core.kernel import fused_route

    monkeypatch.setattr(fused_route, "_NAMED", set())
    q, k, v, attribution, values = tensors()
    t, seed = q.shape[2], torch.tensor(1)
    ad_drop = TopRegionRule(GradientScores(attribution, values), 0.3, 0.5)
    uniform = BlockCall(
        ad_drop, torch.ones((1, 1, 1, 1), dtype=torch.bool, device=DEVICE), None, t, seed, 0.0, None, True
    )
    with caplog.at_level("WARNING", logger=fused_route.__name__):
        for call in (uniform, uniform, block_call(ad_drop, t, need_weights=True), block_call(ad_drop, t)):
            run(q, k, v, None, call, True, monkeypatch)
    named = [r.getMessage() for r in caplog.records if r.name == fused_route.__name__]
    assert named == [
        "the fused route: a regularized call runs on the PyTorch path, not the fused kernel: "
        "rows made uniform (attention LayerDrop's skipped calls) (ATTN_REG_FUSED=0 turns the route off)",
        "the fused route: a regularized call runs on the PyTorch path, not the fused kernel: "
        "the attention map returned (ATTN_REG_FUSED=0 turns the route off)",
    ]  # the covered call says nothing


def test_an_ad_drop_step_of_a_custom_model_equals_the_pytorch_paths(monkeypatch):
    """AD-DROP's two passes through a user's own loop (core ADDrop on a plain-PyTorch model): loss,
    counts and every gradient as on the PyTorch path. ADDropConfig takes q < 1; at 1 - 1e-7 a
    candidate survives a coin with probability 1e-7 on either path, so both drop the whole region
    (the seeds are fixed: a pass is a pass every run)."""

    def step(fused):
        monkeypatch.setattr(devices, "FUSED", fused)
        model = tiny_core_model().to(DEVICE)
        x = torch.randn(CORE_B, CORE_T, CORE_D, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        ad_drop = ADDrop(ADDropConfig(p=0.4, q=1 - 1e-7, schedule="always"), model.controller)
        torch.manual_seed(0)
        with ad_drop.masked(lambda: model(x), logit_target, frozen=model) as stats:
            loss = model(x).sum()
        loss.backward()
        return loss.detach(), int(stats["dropped"]), [p.grad for p in model.parameters()]

    fused, portable = step(True), step(False)
    assert fused[1] == portable[1] > 0
    torch.testing.assert_close(fused[0], portable[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(fused[2], portable[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def one_ad_drop_step(model, config, inputs, tmp_path, seed=None):
    """The loss of one ADDropTrainer training step of ``model`` on ``inputs`` (a batch of 2), taken by hand
    as train() would take it; ``seed``: torch's seed just before the step."""
    import transformers

    from attn_reg_plugin.hf import ADDropTrainer

    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=DEVICE == "cpu",
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = ADDropTrainer(model=model, args=args, ad_drop=config)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    trainer.current_gradient_accumulation_steps = 1  # set by train(); one step is taken here by hand
    trainer.state.epoch = 0.0
    model.train()
    batch = trainer._prepare_inputs(inputs)
    if seed is not None:
        torch.manual_seed(seed)
    return trainer.training_step(model, batch)


@pytest.mark.parametrize("padded", [False, True])
def test_an_hf_llama_step_with_gradient_checkpointing_on_the_route(padded, monkeypatch, tmp_path):
    """ADDropTrainer GA on a tiny Llama (GQA, causal) with non-reentrant gradient checkpointing, as
    the GPU bench's long rows run it, at q = 1 - 1e-7: loss and gradients equal the PyTorch path's.
    The fused kernel takes the masked pass's calls and their recomputes, a padded batch's too: there
    attention gets one materialised (B, 1, T, S) mask of padding and the future, which the kernel
    reads row by row."""
    pytest.importorskip("transformers")
    from attn_reg_plugin.core.kernel import fused_edit

    original = fused_edit.fused_edit_attention

    def step(fused):
        calls = []
        monkeypatch.setattr(devices, "FUSED", fused)

        def counted(q, k, v, drops, bias=None, *rest):  # each call's bias rows: 1 a key row, T a mask's
            calls.append(0 if bias is None else bias.shape[2])
            return original(q, k, v, drops, bias, *rest)

        monkeypatch.setattr(fused_edit, "fused_edit_attention", counted)
        model = tiny_llama().to(DEVICE)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(2))
        mask = torch.ones_like(ids)
        if padded:
            mask[1, -7:] = 0
        config = ADDropConfig(p=0.3, q=1 - 1e-7, attribution="ga", schedule="always")
        loss = one_ad_drop_step(model, config, {"input_ids": ids, "attention_mask": mask, "labels": ids}, tmp_path, 0)
        return loss.detach(), calls, [p.grad for p in model.parameters()]

    fused, portable = step(True), step(False)
    assert fused[1] and not portable[1]
    assert (max(fused[1]) == 16) == padded  # a padded batch's mask read row by row
    torch.testing.assert_close(fused[0], portable[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(fused[2], portable[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_an_hf_bert_training_step_with_padding_and_attention_dropout_runs_on_the_kernel(monkeypatch, tmp_path):
    """ADDropTrainer GA on a tiny BERT in training (attention dropout 0.1) with a padded batch: each
    layer's masked call reaches the fused kernel, the model's dropout and the padding mask with it, and
    the step's loss and gradients are finite."""
    pytest.importorskip("transformers")
    from attn_reg_plugin.core.kernel import fused_edit

    calls, original = [], fused_edit.fused_edit_attention

    def counted(q, k, v, drops, bias=None, *rest):
        calls.append((drops.dropout_p, bias is not None))
        return original(q, k, v, drops, bias, *rest)

    monkeypatch.setattr(devices, "FUSED", True)
    monkeypatch.setattr(fused_edit, "fused_edit_attention", counted)
    model = tiny_bert_classifier(attention_probs_dropout_prob=0.1).to(DEVICE)
    ids = torch.randint(3, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    config = ADDropConfig(p=0.3, q=0.5, attribution="ga", schedule="always")
    loss = one_ad_drop_step(
        model, config, {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1])}, tmp_path
    )
    assert calls == [(0.1, True)] * model.config.num_hidden_layers
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    query = model.bert.encoder.layer[0].attention.self.query.weight.grad
    assert query is not None and query.abs().sum() > 0


@pytest.mark.parametrize("shape", ["empty call", "head wider than a tile", "value head of its own size"])
def test_shapes_the_kernel_does_not_take_stay_on_the_pytorch_path(shape, monkeypatch):
    q, k, v, _, _ = tensors(d=136 if shape == "head wider than a tile" else 4)
    if shape == "empty call":  # a last shard with no query
        q = q[:, :, :0]
    if shape == "value head of its own size":
        v = torch.randn((*v.shape[:-1], 6), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    call = block_call(BernoulliRule(torch.tensor(0.3)), q.shape[2])
    assert fused_drops(q, k, v, None, call) is None
    out = run(q, k, v, None, call, True, monkeypatch)[0]
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and torch.isfinite(out).all()


def _padding_in(dtype, fill, lengths=(27, 15), s=27):
    """(B, 1, 1, S) bias made in ``dtype`` itself: 0 at real keys, ``fill`` after each length."""
    keys, zero, filled = torch.arange(s), torch.tensor(0.0, dtype=dtype), torch.tensor(fill, dtype=dtype)
    return torch.stack([torch.where(keys < n, zero, filled) for n in lengths]).view(len(lengths), 1, 1, s).to(DEVICE)


@pytest.mark.parametrize(
    "bias_case",
    ["bf16 fill of -1e4 (-9984 there: padding)", "float64 -9999.9999 (valid; -1e4 in float32)", "fp16 -inf"],
)
@pytest.mark.parametrize("rule", ["bernoulli", "ad-drop"])
def test_padding_is_decided_in_the_biass_own_dtype_as_on_the_pytorch_path(bias_case, rule, monkeypatch):
    """A key is padding where the bias, in its own dtype, is at or below -1e4 (masks.valid_keys_from_bias):
    a BERT-style (1 - mask) * -10000 in bf16 is padding, a float64 -9999.9999 is not, whatever the
    float32 the kernel reads."""
    q, k, v, attribution, values = tensors()
    dtype, fill = {
        "bf16": (torch.bfloat16, -1e4),
        "float64": (torch.float64, -9999.9999),
        "fp16": (torch.float16, -math.inf),
    }[bias_case.split()[0]]
    bias = _padding_in(dtype, fill)
    if rule == "bernoulli":
        call = block_call(BernoulliRule(torch.tensor(1.0)), q.shape[2])
    else:
        call = block_call(TopRegionRule(GradientScores(attribution, values), 0.3, 1.0), q.shape[2])
    assert fused_drops(q, k, v, bias, call) is not None
    fused, portable = (run(q, k, v, bias, call, on, monkeypatch) for on in (True, False))
    assert fused[4:] == portable[4:]
    for name, a, b in zip(("out", "dq", "dk", "dv"), fused[:4], portable[:4]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("negate", [False, True])
def test_infinite_attribution_scores_rank_as_the_largest_finite_ones(negate, monkeypatch):
    """An attribution product that overflows float32 ranks as float32's largest value, equal to one
    that reaches it (TopRegionRule's nan_to_num), so both paths take the same region."""
    q, k, v, attribution, values = tensors()
    attribution = torch.zeros_like(attribution)
    attribution[..., 0] = torch.finfo(torch.float32).max / 2
    values = torch.zeros_like(values)
    values[:, :, 3, 0], values[:, :, 7, 0] = 2.0, 4.0  # key 3 scores float32's max, key 7 overflows
    # k = 1 of 27 keys (p = 0.03): the threshold is the overflowing key's score itself.
    call = block_call(TopRegionRule(GradientScores(attribution, values, negate), 1.0 if negate else 0.03, 1.0), 20)
    fused, portable = (run(q, k, v, None, call, on, monkeypatch) for on in (True, False))
    assert fused[4:] == portable[4:] and fused[4] > 0
    for name, a, b in zip(("out", "dq", "dk", "dv"), fused[:4], portable[:4]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_bf16_stays_on_the_pytorch_path_in_the_interpreter():
    """Triton 3.7.1's interpreter gets a bf16 tl.dot wrong, so there a bf16 call is not the kernel's
    (compiled on a GPU, bf16 is covered: make gpu-check's autocast tests reach it)."""
    if DEVICE != "cpu":
        pytest.skip("compiled on CUDA: bf16 is covered there")
    q, k, v, _, _ = tensors()
    call = block_call(BernoulliRule(torch.tensor(0.3)), q.shape[2])
    assert fused_drops(*(x.bfloat16() for x in (q, k, v)), None, call) is None
    assert fused_drops(*(x.half() for x in (q, k, v)), None, call) is not None


@pytest.mark.parametrize("mask", ["key padding", "rows of their own"])
@pytest.mark.parametrize("p, seed", [(0.3, 0), (0.05, 1), (0.999, 2)])
def test_the_two_device_regions_give_the_same_state(p, seed, mask):
    """fused_edit.region_state (whole rows sorted in one program, up to 1,024 keys) and
    fused_select.region_state_streamed (a radix select over recomputed scores, any number of keys; it
    equals the PyTorch path's TopRegionRule.region: tests/core/test_fused_select.py) give the same state
    for a call, exactly: small integer scores (many ties at the threshold), padding or a (B, 1, T, S)
    mask of random rows, causal rows without keys, samples, k = 0."""
    from attn_reg_plugin.core.kernel import fused_edit, fused_route
    from attn_reg_plugin.core.kernel.fused_select import region_state_streamed

    g = torch.Generator().manual_seed(seed)
    t, s = int(torch.randint(5, 40, (), generator=g)), int(torch.randint(3, 70, (), generator=g))
    q, k, _, attribution, values = tensors(h=4, h_kv=2, t=t, s=s, seed=seed)
    bias = padding([s, int(torch.randint(1, s + 1, (), generator=g))], s)
    if mask == "rows of their own":
        bias = bias.expand(2, 1, t, s).masked_fill(random_rows(2, t, s, seed), -math.inf)
    samples = torch.tensor([True, bool(seed % 2)], device=DEVICE)
    rule = TopRegionRule(GradientScores(attribution, values), p, 0.5, samples)
    for causal in (False, True):
        call = block_call(rule, t, rows=7, causal=causal)
        key_bias = fused_route.kernel_bias(bias, 2, t)
        assert key_bias.shape[2] == (t if mask == "rows of their own" else 1)
        whole = fused_route.fused_drops(q, k, k, bias, call).drops
        streamed = region_state_streamed(attribution, values, key_bias, causal, *rule.fraction, samples)
        assert fused_edit.region_fits(s, *rule.fraction)
        for name, state in zip(("threshold", "last_tie", "lowest_key"), streamed):
            assert torch.equal(getattr(whole, name), state), (name, causal)


def test_a_recompute_of_the_same_call_reuses_its_region(monkeypatch):
    """The rule's region is ranked once for its call: a checkpoint's recompute (the same rule and the very
    same bias object) reuses it, with the same drops; another bias, or another rule, ranks again."""
    from attn_reg_plugin.core.kernel import fused_edit

    q, k, v, attribution, values = tensors()
    bias = padding([27, 15], 27)
    rule = TopRegionRule(GradientScores(attribution, values), 0.3, 1.0)
    call = block_call(rule, q.shape[2])
    ranked = []
    original = fused_edit.region_state
    monkeypatch.setattr(fused_edit, "region_state", lambda *a, **kw: ranked.append(1) or original(*a, **kw))
    first = fused_drops(q, k, v, bias, call)
    again = fused_drops(q, k, v, bias, call)
    assert len(ranked) == 1
    for name in ("threshold", "last_tie", "lowest_key"):
        assert getattr(again.drops, name) is getattr(first.drops, name)
    fused_drops(q, k, v, bias.clone(), call)  # a bias of its own: ranked again
    other = block_call(TopRegionRule(GradientScores(attribution, values), 0.3, 1.0), q.shape[2])
    fused_drops(q, k, v, bias, other)
    assert len(ranked) == 3
    fused, portable = (run(q, k, v, bias, call, on, monkeypatch) for on in (True, False))  # a step twice
    assert fused[4:] == portable[4:]
    torch.testing.assert_close(fused[0], portable[0], rtol=1e-5, atol=1e-5)


def test_a_recompute_of_the_same_call_reuses_its_row_counts(monkeypatch):
    """The same call again (a checkpoint's recompute: the same rule, seeds and bias object) is the very same
    FusedCall, and the kernel counts its rows once: one counting launch for both, the same counts, the same
    output and gradients. Another seed (R-Drop's second forward) keeps the region and counts again."""
    from attn_reg_plugin.core.kernel import fused_edit

    q, k, v, attribution, values = tensors()
    bias = padding([27, 15], 27)
    rule = TopRegionRule(GradientScores(attribution, values), 0.3, 0.5)
    counted = []
    original = fused_edit._row_counts_kernel
    monkeypatch.setattr(fused_edit, "_row_counts_kernel", CountedLaunches(original, counted))
    first, again = (run(q, k, v, bias, block_call(rule, q.shape[2]), True, monkeypatch) for _ in range(2))
    assert len(counted) == 1
    for a, b in zip(first, again):
        assert a == b if isinstance(a, int) else torch.equal(a, b)
    reseeded = BlockCall(rule, None, None, q.shape[2], torch.tensor(18), 0.0, None, True)
    assert (
        fused_drops(q, k, v, bias, reseeded).drops.threshold
        is fused_drops(q, k, v, bias, block_call(rule, 20)).drops.threshold
    )
    run(q, k, v, bias, reseeded, True, monkeypatch)
    assert len(counted) == 2


class CountedLaunches:
    """A Triton kernel whose launches (``kernel[grid](...)``) are recorded in ``launched``."""

    def __init__(self, kernel, launched):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        return self.kernel[grid]


# -- on by default on CUDA: the switch and the first-use check --------------------------------------
@pytest.mark.parametrize("value, switch", [("", None), ("1", True), ("0", False)])
def test_the_switch_reads_unset_one_or_zero(value, switch, monkeypatch):
    monkeypatch.setenv("ATTN_REG_FUSED", value)
    assert devices.fused_switch() is switch


def test_another_value_of_the_switch_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("ATTN_REG_FUSED", "yes")
    with pytest.raises(ValueError, match=r"ATTN_REG_FUSED: 1 .*, 0 \(never\) or unset .*got 'yes'"):
        devices.fused_switch()


def test_unset_the_route_is_asked_on_cuda_only(monkeypatch):
    monkeypatch.setattr(devices, "FUSED", None)
    assert not devices.fused_route_asked(torch.zeros(1))
    assert devices.fused_route_asked(torch.zeros(1, device="meta")) is False
    monkeypatch.setattr(devices, "FUSED", True)
    assert devices.fused_route_asked(torch.zeros(1))


def test_the_first_use_check_passes_the_kernel_and_catches_a_backward_that_disagrees(monkeypatch):
    """fused_route.check_against_pytorch on this device: None for the kernel as it is (fp32 and fp16);
    a dk 1 % off (a backward kernel that disagrees with the forward) is caught and named."""
    from attn_reg_plugin.core.kernel import fused_edit, fused_route

    assert fused_route.check_against_pytorch(torch.device(DEVICE), torch.float32, 16) is None
    assert fused_route.check_against_pytorch(torch.device(DEVICE), torch.float16, 8) is None
    if fused_edit.available(torch.zeros(1, dtype=torch.bfloat16, device=DEVICE)):  # compiled Triton (a GPU)
        assert fused_route.check_against_pytorch(torch.device(DEVICE), torch.bfloat16, 64) is None
    original = fused_edit._backward

    def dk_off(*args):
        dq, dk, dv = original(*args)
        return dq, dk * 1.01, dv

    monkeypatch.setattr(fused_edit, "_backward", dk_off)
    failed = fused_route.check_against_pytorch(torch.device(DEVICE), torch.float32, 16)
    assert failed is not None and failed.startswith("AD-DROP: dk off by")


def default_route(monkeypatch, verdict):
    """The route as a CUDA device takes it by default (ATTN_REG_FUSED unset), here in the interpreter, with
    the first-use check's verdict ``verdict`` (counted calls: the check's, the kernel's)."""
    from attn_reg_plugin.core.kernel import fused_edit, fused_route

    calls = {"check": 0, "kernel": 0}
    original = fused_edit.fused_edit_attention

    def check(*args):
        calls["check"] += 1
        return verdict

    def kernel(*args, **kwargs):
        calls["kernel"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(devices, "FUSED", None)
    monkeypatch.setattr(devices, "fused_route_asked", lambda q: True)
    monkeypatch.setattr(fused_route, "_CHECKED", {})
    monkeypatch.setattr(fused_route, "_NAMED", set())
    monkeypatch.setattr(fused_route, "check_against_pytorch", check)
    monkeypatch.setattr(fused_edit, "fused_edit_attention", kernel)
    return calls


def test_on_by_default_the_kernel_is_checked_once_then_takes_the_calls(monkeypatch):
    calls = default_route(monkeypatch, None)
    q, k, v, attribution, values = tensors()
    rule = TopRegionRule(GradientScores(attribution, values), 0.3, 1.0)
    for _ in range(2):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        edit_attention(*leaves, None, block_call(rule, q.shape[2]))
    assert calls == {"check": 1, "kernel": 2}


def test_a_failed_first_use_check_sends_the_calls_to_the_pytorch_path_and_says_so(monkeypatch, caplog):
    from attn_reg_plugin.core.kernel import fused_route

    calls = default_route(monkeypatch, "dk off by 0.02")
    q, k, v, attribution, values = tensors()
    rule = TopRegionRule(GradientScores(attribution, values), 0.3, 1.0)
    with caplog.at_level("WARNING", logger=fused_route.__name__):
        for _ in range(2):
            fused = run(q, k, v, None, block_call(rule, q.shape[2]), None, monkeypatch)
    assert calls == {"check": 1, "kernel": 0}
    monkeypatch.setattr(devices, "fused_route_asked", lambda q: False)
    pytorch = run(q, k, v, None, block_call(rule, q.shape[2]), False, monkeypatch)
    for a, b in zip(fused, pytorch):
        assert a == b if isinstance(a, int) else torch.equal(a, b)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(errors) == 1 and "disagrees with the PyTorch path" in errors[0] and "dk off by 0.02" in errors[0]
    assert len(warnings) == 1 and "its first-use check on" in warnings[0] and "failed (dk off by 0.02)" in warnings[0]


def test_a_first_use_check_that_raises_is_a_failure_not_a_crash(monkeypatch, caplog):
    """A kernel that does not compile or launch on the device (the check raises): the calls take the PyTorch
    path, the error named once; training goes on."""
    from attn_reg_plugin.core.kernel import fused_route

    calls = default_route(monkeypatch, None)

    def raising(*args):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_50")

    monkeypatch.setattr(fused_route, "check_against_pytorch", raising)
    q, k, v, attribution, values = tensors()
    rule = TopRegionRule(GradientScores(attribution, values), 0.3, 1.0)
    with caplog.at_level("WARNING", logger=fused_route.__name__):
        out = run(q, k, v, None, block_call(rule, q.shape[2]), None, monkeypatch)
    assert calls["kernel"] == 0 and torch.isfinite(out[0]).all()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "the check raised RuntimeError: PTX .version 8.7" in errors[0]
    assert "the fused Triton kernel does not run on" in errors[0]  # not "disagrees": it never ran
