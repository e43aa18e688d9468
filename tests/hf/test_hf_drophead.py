"""DropHead through AttnRegTrainer(drophead=DropHeadConfig(...)): the logged rate and probability."""

import pytest

from attn_reg_plugin.core.regularizers.drophead import DropHeadConfig
from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig
from attn_reg_plugin.hf import AttnRegTrainer
from helpers import hf_tensorboard_matches_the_log, pad_collate, small_bert, token_data, trainer_args


def test_hf_trainer_logs_the_rate_and_probability(tmp_path):
    trainer = AttnRegTrainer(
        model=small_bert(),
        args=trainer_args(tmp_path, max_steps=3, per_device_train_batch_size=16, report_to=["tensorboard"]),
        train_dataset=token_data(48, seed=4),
        data_collator=pad_collate,
        drophead=DropHeadConfig(schedule="0:0.4,2:0.2"),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["attn_drophead_p"] for h in logs] == pytest.approx([0.4, 0.3, 0.2])
    assert all(0.05 < h["attn_drophead_rate"] < 0.65 for h in logs), logs
    hf_tensorboard_matches_the_log(trainer, ["attn_drophead_p", "attn_drophead_rate"])
    with pytest.raises(ValueError, match="do not combine in one run: choose one attention regularizer per run"):
        AttnRegTrainer(
            model=small_bert(),
            args=trainer_args(tmp_path),
            drophead=DropHeadConfig(schedule="0:0.4"),
            scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.1"),
        )
