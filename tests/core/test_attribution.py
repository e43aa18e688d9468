"""AD-DROP attribution (GA / IGA / AA) and targets against explicit autograd references.

A tiny 2-layer multi-head attention classifier is built here. In "kernel" mode every layer
calls ``attend`` with its own registered AttentionSite (what ADDrop drives); in "explicit"
mode the same weights compute softmax maps A_l by hand, optionally edited (perturbed or
scaled), so dF/dA_l can be taken directly by autograd or by finite differences.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import active_plan, hook_in_progress
from attn_reg_plugin.core.kernel.controller import RegularizationController
from attn_reg_plugin.core.kernel.rules import Block, IntegratedGradientScores, MapScores, ScoreSource, TopRegionRule
from attn_reg_plugin.core.regularizers import attribution
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig

B, T, D, HEADS, LAYERS, CLASSES = 3, 5, 8, 2, 2, 3
LENGTHS = [5, 3, 1]  # batch row 2 has a single real token


class TinyAttnClassifier(torch.nn.Module):
    def __init__(self, controller, kinds=("encoder-self",) * LAYERS, reverse_registration=False, dropout=0.0):
        super().__init__()
        self.dropout = dropout  # hidden dropout after every layer (training mode)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(D, 3 * D) for _ in range(LAYERS))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(LAYERS))
        self.readout = torch.nn.Linear(D, CLASSES)
        # Model layer i uses a site of kind kinds[i]; its layer index counts that kind only.
        specs = [(kind, kinds[:i].count(kind)) for i, kind in enumerate(kinds)]
        order = range(LAYERS)[::-1] if reverse_registration else range(LAYERS)
        registered = {i: controller.register(*specs[i]) for i in order}
        self.sites = [registered[i] for i in range(LAYERS)]  # call order

    def forward(self, x, key_pad, mode="kernel", maps=None, edit=None):
        """x: (B, T, D); key_pad: (B, T) True at padding. edit(layer, A) -> A' (explicit mode)."""
        b, t, _ = x.shape
        dh = D // HEADS
        bias = torch.zeros(b, 1, 1, t, dtype=x.dtype).masked_fill(key_pad[:, None, None, :], float("-inf"))
        h = x
        for layer in range(LAYERS):
            q, k, v = self.qkv[layer](h).view(b, t, 3, HEADS, dh).permute(2, 0, 3, 1, 4)
            if mode == "kernel":
                o, _ = attend(q, k, v, bias, site=self.sites[layer])
            else:
                a = torch.softmax(q @ k.transpose(-2, -1) * dh**-0.5 + bias, dim=-1)
                if edit is not None:
                    a = edit(layer, a)
                if maps is not None:
                    maps.append(a)
                o = a @ v
            h = h + F.dropout(
                torch.tanh(self.proj[layer](o.transpose(1, 2).reshape(b, t, D))), self.dropout, self.training
            )
        keep = (~key_pad).to(h.dtype).unsqueeze(-1)
        return self.readout((h * keep).sum(1) / keep.sum(1))


def _setup(dtype=torch.float64, seed=0, model_kw=None, **cfg):
    torch.manual_seed(seed)
    controller = RegularizationController()
    model = TinyAttnClassifier(controller, **(model_kw or {})).to(dtype)
    x = torch.randn(B, T, D, dtype=dtype)
    key_pad = torch.arange(T)[None, :] >= torch.tensor(LENGTHS)[:, None]
    config = ADDropConfig(**{"attention": "encoder-self", "attribution": "ga", "layers": "all", **cfg})
    return model, x, key_pad, ADDrop(config, controller)


def target(out, labels):
    return attribution.logit_target(out, labels)


def _explicit_F(model, x, key_pad, labels=None, edit=None):
    maps = []
    logits = model(x, key_pad, mode="explicit", maps=maps, edit=edit)
    if labels is None:
        labels = logits.detach().argmax(-1)
    return logits.gather(-1, labels[:, None]).sum(), maps, labels


def _explicit_grads(model, x, key_pad, layers=range(LAYERS)):
    value, maps, labels = _explicit_F(model, x, key_pad)
    grads = torch.autograd.grad(value, [maps[i] for i in layers])
    return [g.detach() for g in grads], [m.detach() for m in maps], labels


def _attributions(adrop, model, x, key_pad, tgt=target, frozen="model", dense=True):
    """ADDrop.attributions on the kernel-mode model; checks the sites come back in call order.
    ``dense=False``: training's attributions (score sources, linear in length), evaluated whole."""
    frozen = model if frozen == "model" else frozen
    sites, attrs, valids = adrop.attributions(lambda: model(x, key_pad), tgt, frozen=frozen, dense=dense)
    assert list(sites) == [s for s in model.sites if s in adrop.sites]
    assert len(attrs) == len(valids) == len(sites)
    if not dense:
        assert all(isinstance(a, IntegratedGradientScores) for a in attrs) or adrop.config.attribution != "iga"
        attrs = [_whole_map(a, x) if isinstance(a, ScoreSource) else a for a in attrs]
    return attrs, valids


def _whole_map(source, x):
    """A score source's (B, H, T, T) map, evaluated as one block."""
    shape = (B, HEADS, T, T)
    return source.scores(Block(slice(0, T), torch.ones(1, 1, 1, T, dtype=torch.bool), shape, shape, None))


# IGA's dense maps (what the lab reads) in float64, and training's factored scores, A ⊙ (Σ dF/dO) Vᵀ / m
# formed in float32 (as GA's per-block scores are).
IGA_FORMS = pytest.mark.parametrize(
    "dense, tol", [(True, dict(atol=1e-6, rtol=1e-5)), (False, dict(atol=1e-5, rtol=1e-4))], ids=["dense", "factored"]
)


# ---------------------------------------------------------------- GA


@pytest.mark.parametrize("layers, idx", [("all", [0, 1]), ("0", [0]), ("1", [1])])
def test_ga_equals_explicit_dF_dA_float64(layers, idx):
    model, x, key_pad, adrop = _setup(layers=layers)
    attrs, valids = _attributions(adrop, model, x, key_pad, frozen=model)
    ref, _, _ = _explicit_grads(model, x, key_pad, idx)
    assert len(attrs) == len(idx)
    for a, r in zip(attrs, ref):
        assert a.shape == (B, HEADS, T, T)
        assert r.abs().max() > 1e-3  # a non-trivial gradient is being compared
        # Targets and attributions are float32 by design (attribution.py), hence not 1e-12.
        assert a.dtype == torch.float32
        assert torch.allclose(a.double(), r, atol=1e-7, rtol=1e-5), (a.double() - r).abs().max()
    for v in valids:
        want = ~key_pad[:, None, None, :]
        assert torch.equal(v.expand(B, HEADS, T, T), want.expand(B, HEADS, T, T))


def test_ga_float32_model_matches_float64_reference():
    model, x, key_pad, adrop = _setup(dtype=torch.float32, seed=1)
    attrs, _ = _attributions(adrop, model, x, key_pad, frozen=model)
    ref_model = copy.deepcopy(model).double()
    ref, _, _ = _explicit_grads(ref_model, x.double(), key_pad)
    for a, r in zip(attrs, ref):
        assert a.dtype == torch.float32
        assert torch.allclose(a.double(), r, atol=1e-5, rtol=1e-4), (a.double() - r).abs().max()


def test_ga_entry_matches_central_finite_difference():
    model, x, key_pad, adrop = _setup(seed=2)
    attrs, _ = _attributions(adrop, model, x, key_pad, frozen=model)
    _, _, labels = _explicit_F(model, x, key_pad)
    eps = 1e-6
    # (layer, b, head, query, key): a first-layer entry (acts through layer 2 too), a
    # second-layer entry, and an entry at a padded key (dF/dA there is (dF/dO) v, not 0).
    for layer, b, h, i, j in [(0, 0, 1, 2, 3), (1, 1, 0, 0, 2), (0, 1, 1, 1, 4)]:

        def bump(delta):
            def edit(l, a):
                if l != layer:
                    return a
                a = a.clone()
                a[b, h, i, j] += delta
                return a

            with torch.no_grad():
                return _explicit_F(model, x, key_pad, labels=labels, edit=edit)[0]

        fd = (bump(eps) - bump(-eps)) / (2 * eps)
        got = attrs[layer][b, h, i, j].item()
        assert abs(fd.item()) > 1e-4
        assert abs(got - fd.item()) < 1e-6 * max(1.0, abs(fd.item())), (layer, got, fd.item())


@pytest.mark.parametrize("frozen", [True, False])
def test_ga_populates_no_parameter_grad_and_restores_requires_grad(frozen):
    model, x, key_pad, adrop = _setup()
    attrs, _ = _attributions(adrop, model, x, key_pad, frozen=model if frozen else None)
    assert all(a.abs().sum() > 0 for a in attrs)
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())
    assert all(hook_in_progress(site) is None for site in model.sites)  # hooks removed after the pass


def test_ga_does_not_disturb_a_later_training_backward():
    model, x, key_pad, adrop = _setup()
    _attributions(adrop, model, x, key_pad)
    model(x, key_pad).sum().backward()
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.grad = None
    ref(x, key_pad).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, r.grad, atol=1e-12)


def test_attribution_pass_must_go_through_the_kernel():
    model, x, key_pad, adrop = _setup()
    with pytest.raises(RuntimeError, match="not routed through"):
        adrop.attributions(lambda: model(x, key_pad, mode="explicit"), target, frozen=model)


def test_a_site_called_twice_in_the_attribution_pass_is_named_as_such():
    """The calls do reach the kernel, twice: the refusal names the sites called more than once and the
    attribution that takes any number of calls, not the routing."""
    model, x, key_pad, adrop = _setup()
    with pytest.raises(RuntimeError, match=r"encoder-self\[0\], encoder-self\[1\] called more than once") as e:
        adrop.attributions(lambda: (model(x, key_pad), model(x, key_pad))[1], target, frozen=model)
    assert "not routed" not in str(e.value) and "attribution='rd'" in str(e.value)


# ---------------------------------------------------------------- AA and IGA


def test_aa_equals_attention_maps():
    model, x, key_pad, adrop = _setup(attribution="aa")
    attrs, valids = _attributions(adrop, model, x, key_pad, frozen=model)
    _, maps, _ = _explicit_F(model, x, key_pad)
    assert len(attrs) == LAYERS and len(valids) == LAYERS
    for a, m in zip(attrs, maps):
        assert a.dtype == torch.float32
        assert torch.allclose(a.double(), m.detach(), atol=1e-6)
    assert all(p.grad is None for p in model.parameters())


def _iga_reference(model, x, key_pad, m, scaled_layers, wrt):
    """A_wrt / m * sum_k dF/dA_wrt, evaluated with the maps of ``scaled_layers`` scaled by k/m."""
    _, maps, labels = _explicit_F(model, x, key_pad)
    total = 0
    for k in range(1, m + 1):

        def edit(l, a, alpha=k / m):
            return a * alpha if l in scaled_layers else a

        value, maps_k, _ = _explicit_F(model, x, key_pad, labels=labels, edit=edit)
        total = total + torch.autograd.grad(value, maps_k[wrt])[0]
    return maps[wrt].detach() / m * total


@IGA_FORMS
@pytest.mark.parametrize("layer", [0, 1])
def test_iga_single_layer_equals_explicit_integrated_gradients(layer, dense, tol):
    m = 4
    model, x, key_pad, adrop = _setup(attribution="iga", iga_steps=m, layers=str(layer), seed=3)
    attrs, _ = _attributions(adrop, model, x, key_pad, frozen=model, dense=dense)
    ref = _iga_reference(model, x, key_pad, m, {layer}, layer)
    assert len(attrs) == 1
    assert ref.abs().max() > 1e-3
    # Explicit kernel path computes softmax in float32 (see test_attention.py), hence 1e-6.
    assert torch.allclose(attrs[0].double(), ref, **tol), (attrs[0].double() - ref).abs().max()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())


@IGA_FORMS
def test_iga_one_step_is_attention_times_gradient(dense, tol):
    model, x, key_pad, adrop = _setup(attribution="iga", iga_steps=1, seed=4)
    attrs, _ = _attributions(adrop, model, x, key_pad, frozen=model, dense=dense)
    grads, maps, _ = _explicit_grads(model, x, key_pad)
    for a, g, mp in zip(attrs, grads, maps):
        assert torch.allclose(a.double(), mp * g, **tol)


@IGA_FORMS
def test_iga_all_layers_equals_per_layer_integrated_gradients(dense, tol):
    # Paper Eq. 3 (Hao et al.): each layer's integral scales only that layer's map.
    m = 3
    model, x, key_pad, adrop = _setup(attribution="iga", iga_steps=m, layers="all", seed=5)
    attrs, _ = _attributions(adrop, model, x, key_pad, frozen=model, dense=dense)
    for layer in range(LAYERS):
        ref = _iga_reference(model, x, key_pad, m, {layer}, layer)
        assert torch.allclose(attrs[layer].double(), ref, **tol), (
            layer,
            (attrs[layer].double() - ref).abs().max(),
        )


@IGA_FORMS
def test_iga_under_hidden_dropout_integrates_one_function(dense, tol):
    """With dropout on, every forward of one IGA step sees the same dropout draw: the result is
    the explicit integrated gradients with that one draw, and the random stream ends where one
    forward leaves it (as after a GA pass). (The factored form rests on it: V is the same in every
    step of a layer's integral.)"""
    m = 3
    model, x, key_pad, adrop = _setup(attribution="iga", iga_steps=m, layers="all", seed=7, model_kw={"dropout": 0.3})
    model.train()
    torch.manual_seed(11)
    attrs, _ = _attributions(adrop, model, x, key_pad, frozen=model, dense=dense)
    after = torch.get_rng_state()

    class Reseeded(torch.nn.Module):  # every explicit forward starts from the same draw
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, *args, **kwargs):
            torch.manual_seed(11)
            return model(*args, **kwargs)

    for layer in range(LAYERS):
        ref = _iga_reference(Reseeded(), x, key_pad, m, {layer}, layer)
        assert torch.allclose(attrs[layer].double(), ref, **tol), (
            layer,
            (attrs[layer].double() - ref).abs().max(),
        )
    torch.manual_seed(11)
    model(x, key_pad)
    assert torch.equal(after, torch.get_rng_state())
    # and the draw matters: another draw gives other attributions
    torch.manual_seed(12)
    other, _ = _attributions(adrop, model, x, key_pad, frozen=model, dense=dense)
    assert not torch.allclose(other[0], attrs[0])


def test_iga_keeps_pass_one_pseudo_labels_fixed():
    # Scaling A by k/m can change the argmax; the target must use step m's (the model's own) labels.
    m = 2
    model, x, key_pad, adrop = _setup(attribution="iga", iga_steps=m, layers="0", seed=6)
    seen = []

    def recording_target(out, labels):
        value, used = attribution.logit_target(out, labels)
        seen.append(used.clone())
        return value, used

    _attributions(adrop, model, x, key_pad, tgt=recording_target)
    _, _, labels = _explicit_F(model, x, key_pad)
    assert len(seen) == m
    assert all(torch.equal(s, labels) for s in seen)


# ---------------------------------------------------------------- targets


def test_logit_target_uses_argmax_pseudo_labels_or_given_labels():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 1.0]], requires_grad=True)
    value, labels = attribution.logit_target(logits)
    assert labels.tolist() == [1, 0]
    assert value.item() == pytest.approx(5.0)
    (g,) = torch.autograd.grad(value, logits)
    assert torch.equal(g, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    value, labels = attribution.logit_target(logits, torch.tensor([2, 2]))
    assert value.item() == pytest.approx(0.0) and labels.tolist() == [2, 2]
    value, _ = attribution.logit_target(logits.half())
    assert value.dtype == torch.float32


def test_token_loss_target_ignores_padding_and_defaults_to_argmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    keep = torch.tensor([[True, True, True, False], [True, False, False, False]])
    value, labels = attribution.token_loss_target(logits, keep)
    assert torch.equal(labels, logits.argmax(-1))
    ref = -sum(F.cross_entropy(logits[b, t], logits[b, t].argmax()) for b in range(2) for t in range(4) if keep[b, t])
    assert value.item() == pytest.approx(ref.item(), rel=1e-6)
    assert value.item() < 0
    # Changing logits (and labels, even to ignore_index -100) at keep=False positions changes nothing.
    changed = logits.clone()
    changed[~keep] = torch.randn(int((~keep).sum()), 5) * 10
    gold = logits.argmax(-1).masked_fill(~keep, -100)
    value2, _ = attribution.token_loss_target(changed, keep, gold)
    assert value2.item() == pytest.approx(value.item(), rel=1e-6)
    # ... and the gradient there is exactly zero.
    changed.requires_grad_(True)
    (g,) = torch.autograd.grad(attribution.token_loss_target(changed, keep, gold)[0], changed)
    assert (g[~keep] == 0).all() and (g[keep] != 0).any()
    # Given labels are used instead of the argmax.
    other = (logits.argmax(-1) + 1) % 5
    value3, used = attribution.token_loss_target(logits, keep, other)
    assert torch.equal(used, other) and value3.item() < value.item()


def test_regression_target_is_minus_squared_error():
    pred = torch.tensor([[1.0], [2.0], [-1.0]], requires_grad=True)
    gold = torch.tensor([1.5, 0.0, -1.0])
    value, used = attribution.regression_target(pred, gold)
    assert value.item() == pytest.approx(-(0.25 + 4.0))
    assert torch.equal(used, gold)
    (g,) = torch.autograd.grad(value, pred)
    # F increases as the prediction moves towards the gold value.
    assert torch.allclose(g, torch.tensor([[1.0], [-4.0], [0.0]]))


# ---------------------------------------------------------------- the two-pass step


@pytest.mark.parametrize(
    "model_kw, attention",
    [
        ({}, "encoder-self"),
        # Sites registered (and selected) in an order other than the call order, and kinds
        # listed in yet another order: each mask must still reach the layer it was made for.
        ({"kinds": ("encoder-self", "decoder-self"), "reverse_registration": True}, "decoder-self,encoder-self"),
    ],
)
def test_step_applies_ad_drop_masks_from_ga_in_pass_two(model_kw, attention):
    model, x, key_pad, adrop = _setup(p=0.5, q=0.5, model_kw=model_kw, attention=attention)
    torch.manual_seed(11)
    attrs, valids = _attributions(adrop, model, x, key_pad, frozen=model)
    sites, seeds = [s for s in model.sites if s in adrop.sites], {}

    def masked_forward():  # pass 2: each site's seed for the pass keys its drops
        seeds.update({s: active_plan(s).of(s)[1] for s in sites})
        return model(x, key_pad)

    torch.manual_seed(11)
    out, stats = adrop.step(lambda: model(x, key_pad), masked_forward, target, frozen=model)
    # The top half of each row's valid keys by attribution, each dropped with probability 0.5 by
    # coins keyed by the site's seed, as the kernel makes them for a call of one block.
    shape = (B, HEADS, T, T)
    drops = [
        TopRegionRule(MapScores(a), 0.5, 0.5).whole(v.expand(shape), seeds[s]) for s, a, v in zip(sites, attrs, valids)
    ]
    assert any(d.any() for d in drops) and len({int(seeds[s]) for s in sites}) == len(sites)

    def edit(layer, a):  # remove the dropped keys from the explicit softmax
        a = a.masked_fill(drops[layer], 0.0)
        return a / a.sum(-1, keepdim=True)

    ref = model(x, key_pad, mode="explicit", edit=edit)
    assert torch.allclose(out, ref, atol=1e-10)
    assert not torch.allclose(out, model(x, key_pad), atol=1e-6)  # the masks mattered
    n_valid = sum(v.expand(B, HEADS, T, T).sum() for v in valids)
    assert stats["dropped"] == sum(int(d.sum()) for d in drops)  # plain numbers (test_ad_drop_stats)
    assert stats["droppable"] == n_valid.item()
    assert all(hook_in_progress(site) is None for site in model.sites)
    out.sum().backward()  # pass 2's graph trains the parameters
    assert all(p.grad is not None for p in model.parameters())


# ---------------------------------------------------------------- attribution precision


def _autocast_seen(forward):
    """Wrap ``forward`` to record the CPU autocast state each call runs under."""
    seen = []

    def wrapped():
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return forward()

    return wrapped, seen


def test_bf16_attribution_runs_pass_one_under_bf16_autocast_and_pass_two_in_the_training_precision():
    model, x, key_pad, adrop = _setup(dtype=torch.float32, seed=1, p=0.5, q=0.5, attribution_precision="bf16")
    attribution_forward, seen_1 = _autocast_seen(lambda: model(x, key_pad))
    train_forward, seen_2 = _autocast_seen(lambda: model(x, key_pad))
    out, stats = adrop.step(attribution_forward, train_forward, target, frozen=model)
    assert seen_1 == [torch.bfloat16] and seen_2 == [None]
    assert out.dtype == torch.float32 and stats["dropped"] > 0


def test_bf16_attribution_is_the_gradient_to_bf16_precision_and_not_the_fp32_one():
    """bf16 GA is dF/dA within bf16's relative precision (2^-8, through a few ops), while the
    fp32 pass on the same model matches the float64 reference to 1e-4: bf16 really ran."""
    model, x, key_pad, adrop = _setup(dtype=torch.float32, seed=1, attribution_precision="bf16")
    attrs, _ = _attributions(adrop, model, x, key_pad)
    fp32 = ADDrop(ADDropConfig(attention="encoder-self", layers="all"), adrop.controller)
    exact, _ = _attributions(fp32, model, x, key_pad)
    ref, _, _ = _explicit_grads(copy.deepcopy(model).double(), x.double(), key_pad)
    for a, e, r in zip(attrs, exact, ref):
        scale = r.abs().max()
        assert a.dtype == torch.float32
        assert (e.double() - r).abs().max() < 1e-4 * scale
        assert 1e-4 * scale < (a.double() - r).abs().max() < 0.05 * scale


def test_fp32_attribution_turns_autocast_off_and_auto_keeps_it():
    """Under bf16 autocast training, fp32 attribution equals attribution without autocast;
    auto (the default) runs pass 1 in the training precision."""
    model, x, key_pad, adrop_fp32 = _setup(dtype=torch.float32, seed=1, attribution_precision="fp32")
    adrop_auto = ADDrop(ADDropConfig(attention="encoder-self", layers="all"), adrop_fp32.controller)
    plain, _ = _attributions(adrop_auto, model, x, key_pad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        forward, seen = _autocast_seen(lambda: model(x, key_pad))
        sites, fp32, _ = adrop_fp32.attributions(forward, target, frozen=model)
        auto, _ = _attributions(adrop_auto, model, x, key_pad)
    assert seen == [None]
    for f, p, a in zip(fp32, plain, auto):
        assert torch.equal(f, p)
        assert not torch.allclose(a, p, atol=1e-5)


def test_fp32_attribution_on_a_half_precision_model_is_refused():
    model, x, key_pad, adrop = _setup(dtype=torch.bfloat16, attribution_precision="fp32")
    with pytest.raises(
        ValueError,
        match=r"--ad-drop-attribution-precision fp32 needs fp32 weights, but the attribution "
        r"pass ran in torch.bfloat16: the model itself is in half precision. Use auto "
        r"or bf16",
    ):
        _attributions(adrop, model, x, key_pad)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_attribution_precision_with_the_random_region_is_refused(precision):
    with pytest.raises(
        ValueError,
        match=f"--ad-drop-attribution-precision {precision} sets the precision of the "
        "attribution pass, which --ad-drop-attribution rd does not run; leave it at auto",
    ):
        ADDropConfig(attribution="rd", attribution_precision=precision).validate()


@pytest.mark.cpu_branch  # the warning is about this CPU's bf16 matmuls
@pytest.mark.parametrize("native", [False, True])
def test_bf16_attribution_on_a_cpu_without_native_bf16_warns_once(monkeypatch, caplog, native):
    from attn_reg_plugin.core.regularizers import ad_drop as ad_drop_module

    monkeypatch.setattr(ad_drop_module, "cpu_has_native_bf16", lambda: native)
    model, x, key_pad, adrop = _setup(dtype=torch.float32, attribution_precision="bf16")
    with caplog.at_level("WARNING", logger="attn_reg_plugin.core.regularizers.ad_drop"):
        _attributions(adrop, model, x, key_pad)
        _attributions(adrop, model, x, key_pad)
    warned = [r.getMessage() for r in caplog.records if "no AVX-512" in r.getMessage()]
    assert warned == (
        []
        if native
        else [
            "--ad-drop-attribution-precision bf16: this CPU has no AVX-512, so torch multiplies bf16 matrices without "
            "oneDNN and the attribution pass is much slower than in fp32 (15 to 30 times a plain step on an AVX2 CPU, "
            "docs/PERFORMANCE.md); use auto"
        ]
    )


def test_a_compiled_model_takes_dO_through_kept_zero_probes_with_no_graph_break():
    """Issue 80: GA's first pass runs eagerly, makes each attention output its leaf and keeps a zero
    probe shaped as it; later passes through a compiled model add the probe to the output and take
    dF/dprobe = dF/dO (the same numbers), so the model compiles whole: no ``requires_grad_`` break
    at every layer. Eager calls keep making their outputs the leaves (no add)."""
    from torch._dynamo.utils import counters

    from helpers import CORE_B, CORE_D, CORE_T, tiny_core_model

    model = tiny_core_model().eval()
    x = torch.randn(CORE_B, CORE_T, CORE_D, generator=torch.Generator().manual_seed(1))
    ad_drop = ADDrop(ADDropConfig(p=0.5, q=0.5, schedule="always"), model.controller)
    torch._dynamo.reset()
    graphs = []

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(model, backend=counting)

    def grad_outputs(forward):
        record_sites, scores, _ = ad_drop.attributions(forward, attribution.logit_target, frozen=model, dense=False)
        return record_sites, [s.grad_output for s in scores]

    sites, first = grad_outputs(lambda: compiled(x))  # the first pass: eager, whatever the model
    assert not graphs
    probes = dict(ad_drop._probes)
    assert set(probes) == set(sites) and all(not p.any() and p.requires_grad for p in probes.values())
    counters.clear()
    _, through_probes = grad_outputs(lambda: compiled(x))
    assert len(graphs) == 1 and not counters["graph_break"], list(counters["graph_break"])
    assert ad_drop._probes == probes  # kept while the shapes hold: no new leaf
    assert all(not p.any() and p.grad is None for p in probes.values())  # still zero, nothing accumulated
    _, eager = grad_outputs(lambda: model(x))
    for a, b, c in zip(first, through_probes, eager):
        torch.testing.assert_close(b, a)
        torch.testing.assert_close(c, a, rtol=0, atol=0)
    torch._dynamo.reset()


def _ga_training_step(adrop, model):
    """One GA training step on a batch: pass 1, the masked pass 2 and its backward. The pass's inputs
    go to masked(): a step compiled whole then attributes in its graph."""

    def step(x, key_pad):
        with adrop.masked(lambda: model(x, key_pad), target, frozen=model, tensors=True, inputs=(x, key_pad)) as stats:
            loss = F.cross_entropy(model(x, key_pad), torch.arange(x.shape[0]) % CLASSES)
        loss.backward()
        return loss.detach(), stats["dropped"], stats["droppable"]

    return step


def _trained(step, model, batches):
    """Per batch, seeded by its index: the loss, the drops and droppable units, every parameter's
    gradient and the global generator's next draw (what the step left of the random stream)."""
    out = []
    for i, batch in enumerate(batches):
        torch.manual_seed(i)
        out.append([*step(*batch), *(p.grad for p in model.parameters()), torch.randint(1 << 30, ())])
        model.zero_grad(set_to_none=True)
    return out


def _ga_model(dropout=0.2):
    model, x, key_pad, adrop = _setup(torch.float32, model_kw=dict(dropout=dropout), p=0.5, q=0.5, schedule="always")
    return model.train(), (x, key_pad), adrop


def _compiled(function, backend="counting"):
    """``function`` under torch.compile, and the graphs dynamo made of it: the ``counting`` backend keeps
    each (and runs it as traced); another backend (``aot_eager``: AOTAutograd's graphs) keeps none."""
    graphs = []

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return torch.compile(function, backend=counting if backend == "counting" else backend), graphs


@pytest.mark.parametrize("backend", ["counting", "aot_eager"])
def test_a_ga_step_compiled_whole_makes_no_graph_of_its_own_and_trains_as_eager(backend):
    """Issue 80's target: the GA training step under one torch.compile makes at most 3 graph breaks.
    Pass 1 takes dF/dO in the step's graph (torch.func.vjp of the zero probes an earlier eager step
    kept, no parameter frozen) and pass 2's seeds come from an operator: the step makes as many
    graphs as plain training's (the backward's break), and computes what eager does."""
    from torch._dynamo.utils import counters

    model, batch, _ = _ga_model()

    def plain_step(x, key_pad):  # the GA step without AD-DROP
        loss = F.cross_entropy(model(x, key_pad), torch.arange(x.shape[0]) % CLASSES)
        loss.backward()
        return loss.detach()

    plain, plain_graphs = _compiled(plain_step)
    torch._dynamo.reset()
    plain(*batch)

    runs = []
    for compiled in (False, True):
        model, batch, adrop = _ga_model()
        step = _ga_training_step(adrop, model)
        _trained(step, model, [batch])  # eager: the first pass makes the probes
        torch._dynamo.reset()
        counters.clear()
        if compiled:
            step, graphs = _compiled(step, backend)
        runs.append(_trained(step, model, [batch] * 3))
    breaks = {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}
    if backend == "counting":
        assert len(graphs) == len(plain_graphs) and len(graphs) - 1 <= 3, (len(graphs), len(plain_graphs), breaks)
    for eager, compiled in zip(*runs):
        assert eager[1] > 0  # AD-DROP dropped something
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    torch._dynamo.reset()


def test_a_ga_step_compiled_whole_on_a_new_batch_shape_trains_as_eager():
    """A batch shaped otherwise than the one the probes were made for: the pass runs without them, as
    a pass without probes does (breaking the graph), and makes probes for the new shape. Every step
    computes what eager does."""
    short = torch.randn(B, T - 1, D, generator=torch.Generator().manual_seed(3))
    short_pad = torch.arange(T - 1)[None, :] >= torch.tensor([T - 1, 3, 1])[:, None]
    runs = []
    for compiled in (False, True):
        model, batch, adrop = _ga_model()
        step = _ga_training_step(adrop, model)
        _trained(step, model, [batch])
        torch._dynamo.reset()
        if compiled:
            step, _ = _compiled(step)
        runs.append(_trained(step, model, [batch, (short, short_pad), (short, short_pad)]))
    assert {tuple(p.shape) for p in adrop._probes.values()} == {(B, HEADS, T - 1, D // HEADS)}
    for eager, compiled in zip(*runs):
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    torch._dynamo.reset()
