"""Run ``fairseq-train`` as one rank of a CPU (gloo) job, for tests/test_distributed.py.

    python tests/fairseq_rank.py DATA --distributed-rank R --distributed-world-size 2 \
        --distributed-init-method tcp://127.0.0.1:PORT --distributed-no-spawn --distributed-backend gloo ...

This is fairseq's own ``fairseq_cli.train.cli_main`` with two test-only additions:

* fairseq writes checkpoints from rank 0 only; here every rank also writes its model
  parameters to ``SAVE_DIR/params-rank{R}-update{U}.pt`` whenever fairseq saves, so the test
  can compare the ranks' parameters;
* fairseq builds ``--ddp-backend pytorch_ddp`` with ``device_ids=[device_id]``, which torch's
  DistributedDataParallel refuses for a CPU module; for CPU modules (only) those two arguments
  are dropped. Gradient bucketing, all-reduce and ``find_unused_parameters`` are torch's, unchanged.

(On CPU fairseq's own launcher cannot start the workers: it spawns ``torch.cuda.device_count()``
processes, and ``torchrun`` makes it divide by that count; one process per rank started by the
test with ``--distributed-no-spawn`` is what remains.)
"""

import os
import sys

# isort: off
from fairseq_cli.train import cli_main  # first: importing it sets up fairseq-train's log format

import torch
from fairseq import checkpoint_utils
from fairseq.models import distributed_fairseq_model
# isort: on


class _CpuDistributedDataParallel(distributed_fairseq_model.DistributedDataParallel):
    def __init__(self, module, device_ids=None, output_device=None, **kwargs):
        if next(module.parameters()).device.type == "cpu":
            device_ids = output_device = None
        super().__init__(module, device_ids=device_ids, output_device=output_device, **kwargs)


distributed_fairseq_model.DistributedDataParallel = _CpuDistributedDataParallel
_save_checkpoint = checkpoint_utils.save_checkpoint


def _save_checkpoint_and_rank_parameters(cfg, trainer, epoch_itr, val_loss):
    os.makedirs(cfg.save_dir, exist_ok=True)
    params = {k: v.detach().cpu().clone() for k, v in trainer.get_model().state_dict().items()}
    name = f"params-rank{trainer.data_parallel_rank}-update{trainer.get_num_updates()}.pt"
    torch.save(params, os.path.join(cfg.save_dir, name))
    return _save_checkpoint(cfg, trainer, epoch_itr, val_loss)


checkpoint_utils.save_checkpoint = _save_checkpoint_and_rank_parameters

if __name__ == "__main__":
    sys.argv[0] = "fairseq-train"
    cli_main()
