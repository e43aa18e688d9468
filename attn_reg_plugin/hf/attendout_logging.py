"""What AttendOut adds to the Trainer's logs.

* every training log (the one that carries the Trainer's ``"loss"``) gains
  ``attendout_attacker_loss``, the Attacker's loss in the same units, and with fp16
  ``attendout_attacker_overflows``, the Attacker's steps its own loss scaler skipped;
* every dropout step logs the generator's drop probabilities and the game's statistics
  (``attendout_p_*``, ``attendout_dropout_step``, ``attendout_win_rate``, ...) and appends one line
  to the JSONL log (``attendout_log_file``).

The Trainer's own counts stay the Defender's (:func:`trainer_counts_kept`).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, Optional

import torch

from ..core.regularizers.attendout import DropProbabilityLog
from ..core.training.distributed import all_reduce_mean_

# What a Trainer subclass counts in its compute_loss: TRL's SFTTrainer logs them as num_tokens,
# entropy and mean_token_accuracy.
TRAINER_COUNTS = ("_total_train_tokens", "_metrics")


@contextlib.contextmanager
def trainer_counts_kept(trainer):
    """Around the Attacker's step, which runs the Trainer's own ``compute_loss``: a subclass's counts
    (:data:`TRAINER_COUNTS`) are put back afterwards, so they do not count the Attacker's forward as a
    second batch and stay what the Trainer logs without AttendOut."""
    saved = {name: copy.deepcopy(trainer.__dict__[name]) for name in TRAINER_COUNTS if name in trainer.__dict__}
    try:
        yield
    finally:
        trainer.__dict__.update(saved)


def dropout_step_logs(stats: Dict[str, object], dropout_steps_done: int) -> Dict[str, object]:
    """The Trainer log of one dropout step, from the game's statistics."""
    logs = {f"attendout_p_{name}": p for name, p in stats["drop_prob"].items()}
    logs.update(
        attendout_dropout_step=dropout_steps_done,
        attendout_win_rate=stats["win_rate"],
        attendout_drop_rate=stats["drop_rate"],  # what the kernel applied to the Attacker
        attendout_kept_attacker=float(stats["keep_attacker"]),
        attendout_reward=stats["reward"],
        attendout_baseline=stats["baseline"],
    )
    return logs


class AttendOutLogs:
    """The Attacker's training loss and overflows since the last training log, and the JSONL log."""

    def __init__(self, log_file: Optional[str]):
        self.drop_probabilities = DropProbabilityLog(log_file)
        self.attacker_loss_sum: Any = 0.0
        self.attacker_updates = 0
        self.attacker_overflows = 0  # A's steps skipped since the last log

    def add_attacker_loss(self, loss) -> None:
        self.attacker_loss_sum = self.attacker_loss_sum + loss

    def count_update(self, attacker_overflowed: bool) -> None:
        self.attacker_updates += 1
        self.attacker_overflows += int(attacker_overflowed)

    def add_to_training_log(self, logs: Dict[str, float], own_scaler: bool) -> None:
        """Adds the Attacker's loss (and, with its own fp16 scaler, its overflows) to a training log."""
        if "loss" not in logs or not self.attacker_updates:
            return
        total = torch.as_tensor(self.attacker_loss_sum).detach().clone()
        all_reduce_mean_([total])  # like the Trainer's "loss": averaged over workers
        logs["attendout_attacker_loss"] = float(total) / self.attacker_updates
        self.attacker_loss_sum, self.attacker_updates = 0.0, 0
        if own_scaler:
            logs["attendout_attacker_overflows"] = self.attacker_overflows
            self.attacker_overflows = 0

    def log_dropout_step(self, trainer, stats: Dict[str, object], dropout_steps_done: int) -> None:
        """The dropout step's Trainer log and JSONL line."""
        # Trainer.log clears control.should_log; keep it so this update's training log still happens.
        should_log = trainer.control.should_log
        trainer.log(dropout_step_logs(stats, dropout_steps_done))
        trainer.control.should_log = should_log
        if trainer.is_world_process_zero():
            self.drop_probabilities.write(trainer.state.global_step, stats)
