"""fairseq-train saving ``checkpoint_last.pt`` on a job's time-limit signal, then exiting for the requeue.

Only when the environment names the signal (``ATTN_REG_SAVE_ON_SIGNAL=USR2``, which the sweep's
Slurm jobs set for their fairseq-train children): Slurm sends it ``--signal``'s delay before the
job's limit. fairseq has no such save of its own; here, at the first update boundary after the
signal (every rank at the same one: the flag is all-reduced when there are several), each rank does
what fairseq does at a checkpoint (rank 0 writes ``checkpoint_last.pt``, the epoch's position in
it), logs :data:`SAVED` and exits with :data:`EXIT_CODE`. The requeued job's fairseq-train resumes
there. An epoch's last update validates and saves as always first.
"""

import logging
import os
import signal
import sys

ENV = "ATTN_REG_SAVE_ON_SIGNAL"
EXIT_CODE = 75  # EX_TEMPFAIL: stopped to be requeued, not failed
SAVED = "attn_reg: saved checkpoint_last.pt on the job's time-limit signal"

logger = logging.getLogger(__name__)
_signalled = []


def _flag(trainer) -> bool:
    """Whether any rank got the signal (the same answer on every rank)."""
    if trainer.data_parallel_world_size == 1:
        return bool(_signalled)
    import torch
    from fairseq.distributed import utils as distributed_utils

    flag = torch.tensor([float(bool(_signalled))], device=trainer.device)
    distributed_utils.all_reduce(flag, group=trainer.data_parallel_process_group)
    return bool(flag.item() > 0)


def install() -> None:
    """Wrap fairseq-train's ``validate_and_save`` (called after every update) when asked to."""
    name = os.environ.get(ENV)
    train = sys.modules.get("fairseq_cli.train")
    if not name or train is None or getattr(train.validate_and_save, "attn_reg_time_limit", False):
        return
    signal.signal(getattr(signal, f"SIG{name}"), lambda signum, frame: _signalled.append(signum))
    original = train.validate_and_save

    def validate_and_save(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch):
        result = original(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch)
        if not _flag(trainer):
            return result
        from fairseq import checkpoint_utils

        saved = end_of_epoch and epoch_itr.epoch % cfg.checkpoint.save_interval == 0  # the epoch's save just ran
        if not saved:
            checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, None)
        logger.info(f"{SAVED} (epoch {epoch_itr.epoch}, {trainer.get_num_updates()} updates); exiting for the requeue")
        logging.shutdown()
        sys.exit(EXIT_CODE)

    validate_and_save.attn_reg_time_limit = True
    train.validate_and_save = validate_and_save
