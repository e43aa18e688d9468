"""DropKey through fairseq (``--attn-sched-dropout-schedule dropkey:RATE``): the dropout moves from the
attention weights to the keys, so ``--attention-dropout`` does not reach the kernel at a DropKey site, in
every attention kind; a knot schedule (the AttendOut paper's scheduled dropout) acts on top of it."""

import pytest
import torch

pytest.importorskip("fairseq")

from helpers import TINY_TRANSFORMER, fairseq_setup, kernel_dropout_at_hooked_calls  # noqa: E402

KINDS = ["--attn-sched-dropout-attention", "encoder-self,decoder-self,encoder-decoder"]


def _dropout_at_hooked_calls(tiny_mt_data, monkeypatch, schedule):
    from fairseq.optim.adam import FairseqAdam

    torch.manual_seed(1)
    args = [
        "--task", "attn_reg_translation", *TINY_TRANSFORMER, "--criterion", "label_smoothed_cross_entropy",
        "--attention-dropout", "0.1", "--optimizer", "adam", "--attn-sched-dropout-schedule", schedule, *KINDS,
    ]  # fmt: skip
    cfg, task, model, criterion = fairseq_setup(tiny_mt_data["bin"], args)
    task.load_dataset("train")
    sample = next(iter(task.get_batch_iterator(task.dataset("train"), max_tokens=400, seed=1).next_epoch_itr()))
    seen = kernel_dropout_at_hooked_calls(monkeypatch)
    task.train_step(sample, model, criterion, FairseqAdam(cfg.optimizer, list(model.parameters())), update_num=0)
    return seen


@pytest.mark.parametrize("schedule,reaching", [("dropkey:0.2", 0.0), ("0:0.2", 0.1)])
def test_attention_dropout_is_off_at_dropkey_sites_of_every_kind(tiny_mt_data, monkeypatch, schedule, reaching):
    assert _dropout_at_hooked_calls(tiny_mt_data, monkeypatch, schedule) == [reaching] * 6  # 3 kinds x 2 layers


def test_the_start_up_log_says_so(tiny_mt_data, caplog):
    args = ["--task", "attn_reg_translation", *TINY_TRANSFORMER, "--attn-sched-dropout-schedule", "dropkey:0.1"]
    with caplog.at_level("INFO", logger="attn_reg_plugin.core.regularizers.scheduled_dropout"):
        fairseq_setup(tiny_mt_data["bin"], args)
    [said] = [r.getMessage() for r in caplog.records if "replaces the attention-weight dropout" in r.getMessage()]
    assert said.startswith("--attn-sched-dropout-schedule dropkey:0.1: DropKey replaces the attention-weight dropout")
