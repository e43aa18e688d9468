"""fairseq ``--checkpoint-activations``: one training step gives exactly the loss and gradients of the
same step without it, for every regularizer.

fairseq's checkpoint wrapper is reentrant (the layer's forward runs without autograd and is run
again inside backward), so AD-DROP's attribution pass runs with it paused and every masked
forward is replayed by the kernel in the recompute.
"""

import pytest
import torch

from helpers import TINY_TRANSFORMER, fairseq_in_process

KINDS = "encoder-self,decoder-self,encoder-decoder"
BASE = [
    "--task",
    "attn_reg_translation",
    *TINY_TRANSFORMER,
    "--dropout",
    "0.1",
    "--attention-dropout",
    "0.1",
    "--label-smoothing",
    "0.1",
    "--optimizer",
    "adam",
    "--lr",
    "1e-3",
    "--seed",
    "3",
]
AD_DROP = [
    "--criterion",
    "ad_drop_label_smoothed_cross_entropy",
    "--ad-drop-p",
    "0.5",
    "--ad-drop-q",
    "0.5",
    "--ad-drop-schedule",
    "always",
    "--ad-drop-attention",
    KINDS,
    "--ad-drop-iga-steps",
    "3",
]
PLAIN = ["--criterion", "label_smoothed_cross_entropy"]
REGULARIZERS = {
    "ad-drop-ga": AD_DROP + ["--ad-drop-attribution", "ga"],
    "ad-drop-iga": AD_DROP + ["--ad-drop-attribution", "iga"],
    "ad-drop-aa": AD_DROP + ["--ad-drop-attribution", "aa"],
    "ad-drop-rd": AD_DROP + ["--ad-drop-attribution", "rd"],
    # R-Drop as AD-DROP's masked pass: two masked forwards, both recomputed
    "ad-drop-rdrop": ["--criterion", "ad_drop_rdrop_label_smoothed_cross_entropy", *AD_DROP[2:]],
    "attendout": PLAIN + ["--attendout", "--attendout-attention", KINDS, "--attendout-init-drop", "0.4"],
    "scheduled-dropout": PLAIN + ["--attn-sched-dropout-schedule", "0:0.3", "--attn-sched-dropout-attention", KINDS],
    "layerdrop": PLAIN + ["--attn-layerdrop-p", "0.5", "--attn-layerdrop-attention", KINDS],
    "plain": PLAIN,
}


def one_step(data_bin, regularizer, checkpointing):
    from fairseq import optim

    extra = BASE + REGULARIZERS[regularizer] + (["--checkpoint-activations"] if checkpointing else [])
    # the same initial weights in every run (fairseq-train seeds before building)
    cfg, task, model, criterion, dataset = fairseq_in_process(data_bin, extra, seed=3)
    optimizer = optim.build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])
    sample = dataset.collater([dataset[i] for i in range(6)])
    model.train()
    torch.manual_seed(5)
    loss, _, log = task.train_step(sample, model, criterion, optimizer, update_num=0)
    models = [model] + ([task.attn_reg_attendout.attacker] if regularizer == "attendout" else [])
    grads = [p.grad.clone() for m in models for p in m.parameters() if p.grad is not None]
    return loss.detach(), grads, log


def _acted(regularizer, log):
    if regularizer.startswith("ad-drop"):
        return int(log["ad_drop_dropped"]) > 0
    if regularizer == "attendout":
        return any(float(v) > 0 for k, v in log.items() if k.startswith("attendout_p_"))
    return True  # plain, or see test_the_step_is_edited


@pytest.mark.parametrize("regularizer", list(REGULARIZERS))
def test_checkpoint_activations_step_equals_plain_step(tiny_mt_data, regularizer):
    loss, grads, log = one_step(tiny_mt_data["bin"], regularizer, checkpointing=False)
    assert _acted(regularizer, log)
    loss_ck, grads_ck, _ = one_step(tiny_mt_data["bin"], regularizer, checkpointing=True)
    torch.testing.assert_close(loss_ck, loss, rtol=1e-5, atol=0)
    assert len(grads_ck) == len(grads) > 0
    # 1e-5 relative to the step's largest gradient: the checkpointed backward sums parameter
    # gradients in another order (plain training shows the same last-bit differences, and the
    # key-projection bias, whose true gradient is 0, is pure rounding noise).
    scale = max(float(g.abs().max()) for g in grads)
    for a, b in zip(grads_ck, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("regularizer", ["scheduled-dropout", "layerdrop"])
def test_the_step_is_edited(tiny_mt_data, regularizer):
    """The equality above is about edited forwards: these two regularizers do edit this step."""
    plain, _, _ = one_step(tiny_mt_data["bin"], "plain", checkpointing=False)
    edited, _, _ = one_step(tiny_mt_data["bin"], regularizer, checkpointing=False)
    assert not torch.equal(edited, plain)


def test_without_the_pass_carried_the_checkpointed_step_is_refused_and_would_differ(tiny_mt_data, monkeypatch):
    """The equality above can fail: a layer of --checkpoint-activations whose call does not carry the
    pass reads it from its site in the reentrant forward, with autograd off, and is refused; without
    that refusal it would recompute ordinary attention in the backward (the pass has ended by then)."""
    from attn_reg_plugin.core.kernel import attention_call
    from attn_reg_plugin.fairseq_plugin import attention

    _, grads, _ = one_step(tiny_mt_data["bin"], "ad-drop-ga", checkpointing=False)
    monkeypatch.setattr(attention, "_carry_the_pass", lambda layer: None)
    with pytest.raises(RuntimeError, match="ran a regularized pass with autograd off"):
        one_step(tiny_mt_data["bin"], "ad-drop-ga", checkpointing=True)
    monkeypatch.setattr(attention_call, "_refuse_uncarried_edit", lambda site, hook: None)
    _, grads_ck, _ = one_step(tiny_mt_data["bin"], "ad-drop-ga", checkpointing=True)
    distance = sum(float((a - b).pow(2).sum()) for a, b in zip(grads_ck, grads)) ** 0.5
    assert distance / sum(float(g.pow(2).sum()) for g in grads) ** 0.5 > 1e-3
