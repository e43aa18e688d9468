"""``--criterion ad_drop_rdrop_label_smoothed_cross_entropy``: R-Drop's two forwards and objective as
AD-DROP's masked pass, inside fairseq's own train_step (in-process), its refusals, and a fairseq-train
run that logs both regularizers' keys. --checkpoint-activations: tests/fairseq/test_fairseq_checkpointing.py."""

import pytest
import torch

pytest.importorskip("fairseq")

from helpers import TINY_TRANSFORMER, fairseq_setup, fairseq_train, train_updates  # noqa: E402

BOTH = "ad_drop_rdrop_label_smoothed_cross_entropy"
AD_DROP = ["--ad-drop-p", "0.5", "--ad-drop-q", "0.5", "--ad-drop-schedule", "always"]


def _step(tiny_mt_data, criterion_name, *extra, dropout="0", ad_drop=AD_DROP):
    from fairseq.optim.adam import FairseqAdam

    torch.manual_seed(123)  # model initialisation: the same model for every criterion
    args = ["--task", "attn_reg_translation", *TINY_TRANSFORMER, "--dropout", dropout, "--optimizer", "adam"]
    cfg, task, model, criterion = fairseq_setup(
        tiny_mt_data["bin"], [*args, "--criterion", criterion_name, "--label-smoothing", "0.1", *ad_drop, *extra]
    )
    task.begin_epoch(1, model)
    task.load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_tokens=600, seed=1).next_epoch_itr(shuffle=False)
    sample = next(iter(itr))
    optimizer = FairseqAdam(cfg.optimizer, list(model.parameters()))
    torch.manual_seed(0)  # fairseq-train reseeds like this before every update
    loss, _, log = task.train_step(sample, model, criterion, optimizer, update_num=0)
    return loss.detach(), log


def test_both_passes_take_the_steps_ad_drop_drops(tiny_mt_data, caplog):
    """Without model dropout the two R-Drop passes differ only if their AD-DROP drops do: they do not
    (no KL), and the loss is twice AD-DROP's own step from the same seed, drop for drop. The warning
    that says so names the criterion the user gave."""
    with caplog.at_level("WARNING", logger="attn_reg_plugin.fairseq_plugin.rdrop_label_smoothed_cross_entropy"):
        loss, log = _step(tiny_mt_data, BOTH)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"--criterion {BOTH}"]
    alone, alone_log = _step(tiny_mt_data, "ad_drop_label_smoothed_cross_entropy")
    assert log["rdrop_kl_sum"] == 0 and log["rdrop_tokens"] > 0
    assert int(alone_log["ad_drop_dropped"]) > 0
    assert int(log["ad_drop_dropped"]) == 2 * int(alone_log["ad_drop_dropped"])  # counted in both passes
    assert int(log["ad_drop_droppable"]) == 2 * int(alone_log["ad_drop_droppable"])
    torch.testing.assert_close(loss, 2 * alone)


def test_model_dropout_separates_the_passes(tiny_mt_data):
    loss, log = _step(tiny_mt_data, BOTH, "--rdrop-alpha", "5", dropout="0.3")
    assert torch.isfinite(loss) and log["rdrop_kl_sum"] > 0 and int(log["ad_drop_dropped"]) > 0


def test_attention_dropout_alone_separates_the_passes_as_in_plain_rdrop(tiny_mt_data):
    """Attention dropout the only dropout, every attention edited: each forward of the masked pass draws
    its own, so the KL is of the order of plain R-Drop's, not 0 (one draw per site and pass made the
    passes bit-identical)."""
    attention_only = ("--attention-dropout", "0.3", "--rdrop-alpha", "5")
    _, plain = _step(tiny_mt_data, "rdrop_label_smoothed_cross_entropy", *attention_only, ad_drop=())
    every_kind = ("--ad-drop-attention", "encoder-self,decoder-self,encoder-decoder")
    _, both = _step(tiny_mt_data, BOTH, *attention_only, *every_kind)
    assert plain["rdrop_kl_sum"] > 0 and int(both["ad_drop_dropped"]) > 0
    assert both["rdrop_kl_sum"] > 0.2 * plain["rdrop_kl_sum"]


def test_the_concatenated_batch_is_refused(tiny_mt_data):
    with pytest.raises(ValueError, match=f"--criterion {BOTH} does not take --rdrop-concat-batch"):
        _step(tiny_mt_data, BOTH, "--rdrop-concat-batch")


def test_a_task_regularizer_beside_it_is_refused_naming_both(tiny_mt_data):
    with pytest.raises(ValueError) as e:
        _step(tiny_mt_data, BOTH, "--attendout")
    assert str(e.value).startswith(f"AD-DROP + R-Drop (--criterion {BOTH}) and AttendOut (--attendout) do not combine")


def test_fairseq_train_logs_both_regularizers_across_cross_tunings_epoch_boundary(tiny_mt_data):
    """The combination of core.combinations' table end to end: epoch 1 plain R-Drop, epoch 2 R-Drop over
    AD-DROP's masked pass (cross-tuning, the default schedule)."""
    train = [
        "--task", "attn_reg_translation", *TINY_TRANSFORMER, "--dropout", "0.1", "--optimizer", "adam", "--lr", "1e-3",
        "--max-tokens", "1000", "--cpu", "--seed", "3", "--no-progress-bar", "--log-format", "json",
        "--log-interval", "1", "--max-epoch", "2", "--no-save", "--criterion", BOTH, "--label-smoothing", "0.1",
        "--ad-drop-p", "0.5", "--ad-drop-q", "0.5",
    ]  # fmt: skip
    updates = train_updates(fairseq_train(tiny_mt_data["bin"], train).stdout)
    epochs = {epoch: [r for r in updates.values() if int(r["epoch"]) == epoch] for epoch in (1, 2)}
    assert epochs[1] and epochs[2] and len(epochs[1]) + len(epochs[2]) == len(updates)
    for record in updates.values():
        assert float(record["rdrop_kl"]) > 0 and int(float(record.get("ad_drop_skipped", 0))) == 0
    assert all(float(r["ad_drop_on"]) == 0 and float(r.get("ad_drop_rate", 0)) == 0 for r in epochs[1])
    assert all(float(r["ad_drop_on"]) == 1 and 0.1 < float(r["ad_drop_rate"]) < 0.4 for r in epochs[2])
