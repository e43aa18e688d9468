"""The AD-DROP criterion inside fairseq's own train_step, for every variant, in-process."""

import pytest
import torch

from attn_reg_plugin.core.kernel.attention_call import hook_in_progress

pytest.importorskip("fairseq")

from helpers import TINY_TRANSFORMER, fairseq_setup, record_results  # noqa: E402


def _batch(task, split="train"):
    task.load_dataset(split)
    itr = task.get_batch_iterator(task.dataset(split), max_tokens=600, seed=1).next_epoch_itr(shuffle=False)
    return next(iter(itr))


def _step(tiny_mt_data, *ad_drop_args, epoch=2, seed=0):
    from fairseq.optim.adam import FairseqAdam

    torch.manual_seed(123)  # model initialisation
    cfg, task, model, criterion = fairseq_setup(
        tiny_mt_data["bin"],
        [
            "--task",
            "attn_reg_translation",
            *TINY_TRANSFORMER,
            "--criterion",
            "ad_drop_label_smoothed_cross_entropy",
            "--label-smoothing",
            "0.1",
            "--optimizer",
            "adam",
            *ad_drop_args,
        ],
    )
    task.begin_epoch(epoch, model)
    sample = _batch(task)
    optimizer = FairseqAdam(cfg.optimizer, list(model.parameters()))
    torch.manual_seed(seed)  # fairseq-train reseeds like this before every update (seed + update number)
    loss, sample_size, log = task.train_step(sample, model, criterion, optimizer, update_num=0)
    return model, criterion, loss, log, task, sample


@pytest.mark.parametrize(
    "args",
    [
        ["--ad-drop-attribution", "ga"],
        ["--ad-drop-attribution", "iga", "--ad-drop-iga-steps", "3"],
        ["--ad-drop-attribution", "aa"],
        ["--ad-drop-attribution", "rd"],
        ["--ad-drop-labels", "gold"],
        ["--ad-drop-attention", "decoder-self,encoder-decoder", "--ad-drop-layers", "1"],
    ],
)
def test_every_variant_trains_one_step(tiny_mt_data, args):
    model, criterion, loss, log, _, _ = _step(tiny_mt_data, "--ad-drop-p", "0.5", "--ad-drop-q", "0.5", *args)
    assert torch.isfinite(loss)
    assert log["ad_drop_on"] == 1
    assert log["ad_drop_droppable"] > 0
    rate = log["ad_drop_dropped"] / log["ad_drop_droppable"]
    assert 0.1 < rate < 0.5, rate  # about p*q = 0.25
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert all(hook_in_progress(s) is None for s in criterion.ad_drop.controller.sites)  # hooks cleared after the pass


def test_plain_epoch_and_validation_are_the_base_criterion(tiny_mt_data):
    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

    model, criterion, loss, log, task, sample = _step(tiny_mt_data, epoch=1)
    assert task.attn_reg_epoch == 1
    assert log["ad_drop_on"] == 0 and "ad_drop_droppable" not in log
    # Validation (even in an AD-DROP epoch): identical to label_smoothed_cross_entropy.
    task.begin_epoch(2, model)
    plain = LabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1)
    ours_loss, _, _ = task.valid_step(sample, model, criterion)
    ref_loss, _, _ = task.valid_step(sample, model, plain)
    assert torch.equal(ours_loss, ref_loss)


def test_attribution_pass_touches_no_parameter_gradient(tiny_mt_data):
    """Pass 1 computes no parameter gradient: with pass 2's loss not back-propagated, .grad stays None."""
    cfg, task, model, criterion = fairseq_setup(
        tiny_mt_data["bin"],
        ["--task", "attn_reg_translation", *TINY_TRANSFORMER, "--criterion", "ad_drop_label_smoothed_cross_entropy"],
    )
    task.begin_epoch(2, model)
    model.train()
    sample = _batch(task)
    loss, _, log = criterion(model, sample)
    assert log["ad_drop_on"] == 1 and loss.requires_grad
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("method", ["ga", "rd"])
def test_same_seed_same_masks_and_loss(tiny_mt_data, monkeypatch, method):
    """CPU determinism: the same seed gives the same masks, loss and gradients; another seed other masks."""
    from attn_reg_plugin.core.kernel import blockwise

    masks = record_results(monkeypatch, blockwise, "rule_drops", lambda made: made[0])  # each call's drops
    runs = []
    for seed in (0, 0, 1):
        masks.append([])
        model, _, loss, log, _, _ = _step(
            tiny_mt_data, "--ad-drop-p", "0.5", "--ad-drop-q", "0.5", "--ad-drop-attribution", method, seed=seed
        )
        runs.append((loss.item(), log["ad_drop_dropped"].item(), [p.grad.clone() for p in model.parameters()]))
    assert len(masks[0]) == 2 and all(m.any() for m in masks[0])  # one mask per encoder layer
    assert all(torch.equal(a, b) for a, b in zip(masks[0], masks[1]))
    assert runs[0][:2] == runs[1][:2]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))
    assert not all(torch.equal(a, b) for a, b in zip(masks[0], masks[2]))
    assert runs[0][0] != runs[2][0]
