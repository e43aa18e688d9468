"""Query rows with no valid key: a causal LM's left-padding positions (issue 31, item 5).

The logits at the last padding position predict the first real token, so the loss reads a row
that attends to nothing. Eager attention spreads such a row uniformly over every key (masked and
future ones too); transformers' sdpa, and so the plugin, give it 0. The equivalence check compares
a model whose own attention is not sdpa on a left-padded row as well, and refuses when that row
differs, saying how to get exact equivalence: switch the model to sdpa first. Switched, the model
installs and the plugin reproduces it exactly, loss and gradients.
"""

import copy

import pytest
import torch
import transformers
from families import FAMILIES, build
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from attn_reg_plugin.core.kernel.attention_call import EditScores
from attn_reg_plugin.core.kernel.controller import RegularizationController
from attn_reg_plugin.hf import install_attention_sites

CAUSAL = [f for f in FAMILIES if f.name in ("Llama", "Mistral", "GPT-2")]  # GPT-2: no pad token


def _eager(family, dtype=torch.float32):
    model = build(family).to(dtype)  # hidden 32, 2 layers, sdpa
    model.set_attn_implementation("eager")
    return model


def _sdpa_under_another_name(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _left_padded_batch():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 12, 13, 14, 15]])
    mask = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _loss_and_grads(model, batch, hooks=None):
    model.zero_grad()
    if hooks is None:
        loss = model(**batch).loss
    else:
        with hooks:
            loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", CAUSAL, ids=lambda f: f.name)
def test_eager_causal_lm_is_refused_naming_the_keyless_rows_and_left_as_it_was(family, dtype):
    model = _eager(family, dtype).eval()
    batch = _left_padded_batch()
    with torch.no_grad():
        before = model(**batch).logits
    with pytest.raises(ValueError) as refused:
        install_attention_sites(model, RegularizationController())
    message = str(refused.value)
    assert "left-padded" in message and "no valid key" in message, message
    assert 'attn_implementation="sdpa"' in message and "set_attn_implementation" in message, message
    assert model.config._attn_implementation == "eager"
    assert not any("attn_reg_sites" in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)


@pytest.mark.parametrize("family", CAUSAL, ids=lambda f: f.name)
def test_switched_to_sdpa_it_installs_and_the_plugin_is_exact_on_left_padding(family):
    stock = _eager(family)
    stock.set_attn_implementation("sdpa")  # what the refusal tells the user to do
    stock.eval()  # no dropout (GPT-2 has some): deterministic; gradients still flow
    ours = copy.deepcopy(stock)
    controller = RegularizationController()
    install_attention_sites(ours, controller)
    assert ours.config._attn_implementation == "attn_reg"
    batch = _left_padded_batch()

    loss, grads = _loss_and_grads(stock, batch)
    # Idle: transformers' own sdpa, bit for bit.
    idle_loss, idle_grads = _loss_and_grads(ours, batch)
    assert torch.equal(idle_loss, loss)
    assert grads.keys() == idle_grads.keys() and all(torch.equal(idle_grads[n], g) for n, g in grads.items())
    # The kernel with nothing dropped: the same loss and gradients (keyless rows 0 with no gradient), no NaN.
    hooks = controller.hooks({s: EditScores() for s in controller.sites})
    kernel_loss, kernel_grads = _loss_and_grads(ours, batch, hooks)
    torch.testing.assert_close(kernel_loss, loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == kernel_grads.keys()
    for n, g in grads.items():
        assert torch.isfinite(kernel_grads[n]).all(), n
        torch.testing.assert_close(kernel_grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_the_refused_difference_is_real_eager_reads_future_tokens_at_the_last_padding_position():
    """Why the keyless rows matter: eager's last padding position (which predicts the first real token)
    depends on a later token; sdpa's does not."""
    family = next(f for f in CAUSAL if f.name == "Mistral")
    eager = _eager(family).eval()
    sdpa = copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    batch = _left_padded_batch()
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][1, 5] = 50  # a real token after the last padding position
    with torch.no_grad():
        for model, reads_the_future in ((eager, True), (sdpa, False)):
            a, b = model(**batch).logits[1, 2], model(**changed).logits[1, 2]
            assert (not torch.equal(a, b)) == reads_the_future


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", CAUSAL, ids=lambda f: f.name)
def test_an_implementation_giving_keyless_rows_0_passes_the_left_padded_check(family, dtype):
    """Not named "sdpa", so the left-padded row is compared; it gives those rows 0 like sdpa: accepted,
    in half precision too (the padding positions are compared at float32's tolerance)."""
    transformers.AttentionInterface.register("sdpa_for_test", _sdpa_under_another_name)
    AttentionMaskInterface.register("sdpa_for_test", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model = build(family).to(dtype)
    model.set_attn_implementation("sdpa_for_test")
    controller = RegularizationController()
    install_attention_sites(model, controller)
    assert model.config._attn_implementation == "attn_reg" and len(controller.sites) == 2
