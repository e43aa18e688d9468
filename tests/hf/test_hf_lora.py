"""LoRA adapters (peft) on a tiny Llama and a tiny T5: the sites are found through the PeftModel,
AD-DROP trains the adapters only, and its attribution pass gives no parameter a gradient."""

import pytest
import torch
from families import FAMILIES, build

from attn_reg_plugin.core.kernel.controller import RegularizationController
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attribution import token_loss_target
from attn_reg_plugin.hf import install_attention_sites

peft = pytest.importorskip("peft")

FAMILY = {f.model_type: f for f in FAMILIES}


@pytest.mark.parametrize("model_type,targets", [("llama", ["q_proj", "v_proj"]), ("t5", ["q", "v"])])
def test_lora_adapters_train_and_frozen_base_weights_get_no_gradient(model_type, targets):
    family = FAMILY[model_type]
    model = peft.get_peft_model(
        build(family), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    )
    controller = RegularizationController()
    sites = install_attention_sites(model, controller)
    assert {s.kind for _, s in sites} == set(family.kinds)
    lora = {n for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)

    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(3, 99, (2, 8), generator=g)}
    if family.head == "Seq2SeqLM":
        inputs["decoder_input_ids"] = torch.randint(3, 99, (2, 5), generator=g)
    model.train()
    ad = ADDrop(ADDropConfig(p=0.5, q=0.5, schedule="always"), controller)  # attention="auto"
    expected_kind = "decoder-self" if model_type == "llama" else "encoder-self"
    assert {s.kind for s in ad.sites} == {expected_kind}

    def target(out, labels):
        return token_loss_target(out.logits, torch.ones(out.logits.shape[:2], dtype=torch.bool), labels)

    with ad.masked(lambda: model(**inputs), target, frozen=model) as stats:
        # pass 1 is over: it left no gradient anywhere, and frozen weights stayed frozen
        assert all(p.grad is None for p in model.parameters())
        logits = model(**inputs).logits
    assert {n for n, p in model.named_parameters() if p.requires_grad} == lora
    logits.float().logsumexp(-1).mean().backward()
    assert float(stats["dropped"]) > 0
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and with_grad <= lora  # only adapters learn; base weights have no .grad
