"""DropHead through the fairseq task: --attn-drophead-* flags, the kernel-counted rate in the log."""

import pytest
import torch

pytest.importorskip("fairseq")
from test_fairseq_attendout import BASE

from helpers import fairseq_setup


def test_fairseq_task_logs_the_rate_the_kernel_counted(tiny_mt_data):
    from fairseq.trainer import Trainer

    extra = ["--attn-drophead-schedule", "0:0.3", "--attn-drophead-attention", "encoder-self,decoder-self"]
    cfg, task, model, criterion = fairseq_setup(tiny_mt_data["bin"], [*BASE, *extra])
    task.load_dataset("train")
    trainer = Trainer(cfg, task, model, criterion)
    itr = trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)
    for batch, _ in zip(itr, range(2)):
        log = trainer.train_step([batch])
        assert torch.isfinite(torch.tensor(float(log["loss"])))
        assert log["attn_drophead_p"] == 0.3 and 0.1 < log["attn_drophead_rate"] < 0.5, log
