"""Gradient checkpointing through the Hugging Face trainers: exactly the loss and gradients of the
same step without checkpointing, for every regularizer, reentrant and not.

A checkpointed layer runs its forward again inside backward; the recompute must apply the masks
of the forward it replays (AD-DROP's pass 2, AttendOut's Gumbel masks, scheduled dropout's and
random-region AD-DROP's draws made inside the kernel, LayerDrop's uniform rows), although the
pass that set them has ended. Hidden and attention dropout are on, so the recompute's own
dropout draws (restored by torch's checkpoint) are exercised too.
"""

import pytest
import torch
import transformers

import helpers
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.core.regularizers.drophead import DropHeadConfig
from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig
from attn_reg_plugin.hf import (
    ADDropSeq2SeqTrainer,
    ADDropTrainer,
    AttendOutSeq2SeqTrainer,
    AttendOutTrainer,
    AttnRegSeq2SeqTrainer,
    AttnRegTrainer,
)
from helpers import tiny_bert_classifier

DROPOUT = 0.1


def tiny_bert():
    return tiny_bert_classifier(
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        hidden_dropout_prob=DROPOUT,
        attention_probs_dropout_prob=DROPOUT,
        attn_implementation="sdpa",
    )


def tiny_marian():
    return helpers.tiny_marian(dropout=DROPOUT, attention_dropout=DROPOUT, attn_implementation="sdpa")


def tiny_llama():
    return helpers.tiny_llama(attention_dropout=DROPOUT, attn_implementation="sdpa")


def _ids(generator, rows, length, pad_from):
    ids = torch.randint(3, 100, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    for row, start in enumerate(pad_from):
        mask[row, start:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def bert_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids, mask = _ids(g, 3, 9, [9, 6, 3])
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 1])}


def marian_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids, mask = _ids(g, 3, 8, [8, 5, 4])
    labels, _ = _ids(g, 3, 6, [6, 6, 3])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels.masked_fill(labels == 0, -100)}


def llama_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids, mask = _ids(g, 3, 8, [8, 6, 5])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


# family -> (model builder, batch, attention kinds regularized, plain / seq2seq trainers)
FAMILIES = {
    "bert": (tiny_bert, bert_batch, "encoder-self", False),
    "marian": (tiny_marian, marian_batch, "encoder-self,decoder-self,encoder-decoder", True),
    "llama": (tiny_llama, llama_batch, "decoder-self", False),
}
REGULARIZERS = [
    *("ad-drop-ga", "ad-drop-iga", "ad-drop-aa", "ad-drop-rd", "attendout", "scheduled-dropout", "layerdrop"),
    "drophead",
]


def make_trainer(family, regularizer, checkpointing, tmp_path):
    build, batch, kinds, seq2seq = FAMILIES[family]
    model = build()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
        )
    args_cls = transformers.Seq2SeqTrainingArguments if seq2seq else transformers.TrainingArguments
    args = args_cls(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        remove_unused_columns=False,
        per_device_eval_batch_size=2,
    )
    if regularizer.startswith("ad-drop"):
        cls = ADDropSeq2SeqTrainer if seq2seq else ADDropTrainer
        config = ADDropConfig(
            p=0.5, q=0.5, attention=kinds, schedule="always", attribution=regularizer[-2:], iga_steps=3
        )
        return cls(model=model, args=args, ad_drop=config)
    if regularizer == "attendout":
        cls = AttendOutSeq2SeqTrainer if seq2seq else AttendOutTrainer
        heldout = [{k: v[i] for k, v in batch(seed=9).items()} for i in range(3)]
        trainer = cls(
            model=model,
            args=args,
            eval_dataset=heldout,
            data_collator=torch.utils.data.default_collate,
            attendout=AttendOutConfig(dropout_step=2, attention=kinds, init_drop=0.4),
        )
        trainer.create_optimizer()  # the Attacker's optimizer mirrors it
        return trainer
    cls = AttnRegSeq2SeqTrainer if seq2seq else AttnRegTrainer
    if regularizer == "drophead":
        return cls(model=model, args=args, drophead=DropHeadConfig(schedule="0:0.5", attention=kinds))
    if regularizer == "scheduled-dropout":
        return cls(model=model, args=args, scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.3", attention=kinds))
    return cls(model=model, args=args, layerdrop=AttentionLayerDropConfig(p=0.5, attention=kinds))


def one_step(family, regularizer, checkpointing, tmp_path):
    """Loss and every gradient (Defender, and Attacker for AttendOut) of one training step; what it dropped."""
    trainer = make_trainer(family, regularizer, checkpointing, tmp_path)
    batch = FAMILIES[family][1]()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); one step is taken here by hand
    torch.manual_seed(5)
    loss = trainer.training_step(trainer.model, batch)
    models = [trainer.model] + ([trainer.attendout_attacker] if regularizer == "attendout" else [])
    grads = [p.grad.clone() for m in models for p in m.parameters() if p.grad is not None]
    if regularizer.startswith("ad-drop"):
        acted = int(trainer._ad_drop_dropped)
    elif regularizer == "attendout":
        acted = sum(
            int(h.drop.dense().sum())
            for h in trainer.attendout_game.attacker_hooks(
                trainer.attendout_streams(trainer._prepare_inputs(batch))
            ).values()
        )
    else:
        (counts,) = trainer._attn_reg_counts.values()  # the one regularizer's [done, of]
        acted = int(counts[0])
    return loss.detach(), grads, acted


CASES = [(f, r) for f in FAMILIES for r in REGULARIZERS if not (f == "llama" and r == "attendout")]


@pytest.mark.parametrize("family,regularizer", CASES, ids=[f"{f}-{r}" for f, r in CASES])
def test_checkpointed_step_equals_plain_step(family, regularizer, tmp_path):
    loss, grads, acted = one_step(family, regularizer, None, tmp_path)
    assert acted > 0, "the regularizer must have edited some attention for this test to mean anything"
    for mode in ("reentrant", "non-reentrant"):
        loss_ck, grads_ck, _ = one_step(family, regularizer, mode, tmp_path)
        torch.testing.assert_close(loss_ck, loss, rtol=1e-5, atol=0, msg=f"{mode} loss")
        assert len(grads_ck) == len(grads)
        for a, b in zip(grads_ck, grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"{mode} gradient")


def test_checkpointing_without_the_pass_carried_is_refused_and_would_differ(tmp_path, monkeypatch):
    """The test above can fail: when the model's call does not carry the pass (the model kwarg
    ``attn_reg_plan``), the reentrant forward reads it from the sites with autograd off and is refused;
    without that refusal, the recompute in the backward, after the pass ended, would run ordinary
    attention and the gradients would differ."""
    from attn_reg_plugin.core.kernel import attention_call
    from attn_reg_plugin.hf import sites

    loss, grads, _ = one_step("bert", "ad-drop-ga", None, tmp_path)
    monkeypatch.setattr(sites, "_carry_the_pass", lambda model, args, kwargs: None)
    with pytest.raises(RuntimeError, match="ran a regularized pass with autograd off"):
        one_step("bert", "ad-drop-ga", "reentrant", tmp_path)
    monkeypatch.setattr(attention_call, "_refuse_uncarried_edit", lambda site, hook: None)
    _, grads_ck, _ = one_step("bert", "ad-drop-ga", "reentrant", tmp_path)
    distance = sum(float((a - b).pow(2).sum()) for a, b in zip(grads_ck, grads)) ** 0.5
    assert distance / sum(float(g.pow(2).sum()) for g in grads) ** 0.5 > 1e-3


@pytest.mark.parametrize("where", ["bare reentrant checkpoint", "no_grad"])
def test_a_pass_read_with_autograd_off_around_an_installed_model_is_refused(where):
    """A user's own bare reentrant torch checkpoint around an installed model's call, or a no-grad
    forward of it, inside a pass: the model's call reads the pass in progress with autograd off
    and is refused, naming controller.checkpoint (the recompute in the backward would come after
    the pass, ordinary attention: silently another function's gradients). The controller's
    checkpoint carries the pass: exact."""
    import torch.utils.checkpoint

    from attn_reg_plugin.core.kernel.attention_call import EditScores
    from attn_reg_plugin.core.kernel.controller import RegularizationController
    from attn_reg_plugin.core.kernel.rules import BernoulliRule
    from attn_reg_plugin.hf import install_attention_sites

    def step(checkpoint):
        torch.manual_seed(0)
        model = tiny_bert().train()
        controller = RegularizationController()
        install_attention_sites(model.bert, controller)
        embeds = model.bert.embeddings.word_embeddings(torch.arange(3, 15).view(2, 6)).detach().requires_grad_()
        torch.manual_seed(5)
        with controller.hooks({s: EditScores(drop=BernoulliRule(torch.tensor(0.4))) for s in controller.sites}):
            encode = lambda e: model.bert(inputs_embeds=e).last_hidden_state  # noqa: E731
            loss = (checkpoint(controller, encode, embeds) if checkpoint else encode(embeds)).pow(2).sum()
        loss.backward()
        return [p.grad for p in model.bert.encoder.parameters()]

    refusal = "encoder-self\\[0\\] ran a regularized pass with autograd off.*controller.checkpoint"
    if where == "no_grad":
        with pytest.raises(RuntimeError, match=refusal), torch.no_grad():
            step(None)
        return
    with pytest.raises(RuntimeError, match=refusal):
        step(lambda controller, f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True))
    plain = step(None)
    for reentrant in (True, False):
        checkpointed = step(lambda controller, f, x: controller.checkpoint(f, x, use_reentrant=reentrant))
        assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


def test_a_pass_reaches_an_installed_models_forward_in_another_thread():
    """transformers' DataParallel runs each replica's forward in a thread of its own, inside the
    caller's pass (a ContextVar or a thread-local set by the pass would not reach it): a forward run
    in a thread makes the pass's drops, the same as in the caller's thread (hidden dropout off)."""
    import threading

    from attn_reg_plugin.core.kernel.attention_call import EditScores
    from attn_reg_plugin.core.kernel.controller import RegularizationController
    from attn_reg_plugin.core.kernel.rules import BernoulliRule
    from attn_reg_plugin.hf import install_attention_sites

    model = tiny_bert().eval()
    controller = RegularizationController()
    install_attention_sites(model.bert, controller)
    ids = torch.arange(3, 15).view(2, 6)
    encode = lambda: model.bert(input_ids=ids).last_hidden_state  # noqa: E731
    edits = {s: EditScores(drop=BernoulliRule(torch.tensor(0.4)), counted=True) for s in controller.sites}
    with torch.no_grad():
        plain = encode()
    with controller.hooks(edits) as record:
        here = encode()
        there = []
        thread = threading.Thread(target=lambda: there.append(encode()))
        thread.start()
        thread.join()
    assert len(there) == 1 and torch.equal(there[0], here) and not torch.allclose(here, plain)
    assert len(record.sites) == 2 * len(controller.sites) and int(record.counts()[0]) > 0


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("regularizer", ["ad-drop-ga", "scheduled-dropout"])
def test_a_users_own_compute_loss_and_backward_equals_the_plain_step(regularizer, mode, tmp_path):
    """A user's own loop, no trainer step around it: ``loss = trainer.compute_loss(model, batch);
    loss.backward()`` on a tiny Llama with gradient checkpointing gives the gradients of the same
    step without checkpointing (it was refused once, as a forward outside a training step)."""

    def step(checkpointing):
        trainer = make_trainer("llama", regularizer, checkpointing, tmp_path)
        model = trainer.model.train()
        torch.manual_seed(5)
        loss = trainer.compute_loss(model, llama_batch())
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    loss, grads = step(None)
    loss_ck, grads_ck = step(mode)
    torch.testing.assert_close(loss_ck, loss, rtol=1e-6, atol=0)
    assert len(grads_ck) == len(grads) and all(g is not None for g in grads)
    for a, b in zip(grads_ck, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
