"""A classifier run's resumable checkpoint (attn-reg-cls-compare): saved at each epoch's end (after its
dev scores), every ``--save-steps`` optimizer steps, and at the end of the step in which a stop signal
arrived; the next command for the run (or its requeued Slurm job) resumes it there
(``Trainer.train(resume_from_checkpoint=...)``).

The checkpoint is the Trainer's own ``trainer/checkpoint-<step>/`` in the run's folder (weights,
optimizer, scheduler, the RNG states, the Trainer's state and log; AttendOut adds its Attacker and game)
and :data:`STATE_FILE`, written last: the dev scores of the epochs so far, the best one, the loss summed
since the last epoch's log, the training seconds and the resumes. A folder without it (a save cut off
by a kill) is no checkpoint and is removed; the one before stays until a newer one is whole, and so does
the best dev epoch's weights file (``trainer/best-epoch<E>.pt``) that it names.

On the CPU a resumed run's weights are an uninterrupted run's bit for bit (the Trainer restores the RNG
states and skips the batches its epoch already trained; AD-DROP's cross-tuning takes its epoch from the
Trainer's loop, AttendOut restores its game), so are its dev and test scores and its per-epoch
training loss. A method's own logged numbers for the epoch it resumed in (AD-DROP's rate, R-Drop's KL,
...) cover the steps after the resume only: that epoch's record names the step (``resumed_at_step``);
so does its training loss with a transformers whose Trainer keeps no ``_tr_loss`` (5.23's does).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional, Tuple

from .report import write_json

STATE_FILE = "attn_reg_run.json"  # in checkpoint-<step>/: written last, so the checkpoint is whole
PREFIX = "checkpoint-"
SAVE_STEPS = 500  # --save-steps' default: a checkpoint every 500 optimizer steps besides each epoch's end


def best_file(folder: Path, epoch: int) -> Path:
    return folder / f"best-epoch{epoch}.pt"


def _step(path: Path) -> int:
    tail = path.name[len(PREFIX) :]
    return int(tail) if tail.isdigit() else -1


def last_checkpoint(folder: Path) -> Optional[Tuple[Path, dict]]:
    """The newest whole checkpoint under ``folder`` and its :data:`STATE_FILE`, or None; every other
    ``checkpoint-*`` folder (older, or cut off by a kill) is removed, and every best-epoch file it
    does not name (one saved after it, by the attempt that was stopped)."""
    found = None
    for path in sorted(folder.glob(f"{PREFIX}*"), key=_step, reverse=True):
        if _step(path) >= 0:
            try:
                found = (path, json.loads((path / STATE_FILE).read_text(encoding="utf-8")))
                break
            except (OSError, ValueError):
                pass
    if found is None:
        _keep_only(folder, None, None)
    else:
        _keep_only(folder, found[0], best_file(folder, found[1]["best_epoch"] or 0))
    return found


def _keep_only(folder: Path, checkpoint: Optional[Path], best: Optional[Path]) -> None:
    """Removes every checkpoint folder and best-epoch weights file in ``folder`` but ``checkpoint`` and
    ``best``: what no whole checkpoint needs any more."""
    for path in folder.iterdir():
        if path in (checkpoint, best) or not path.name.startswith((PREFIX, "best-epoch")):
            continue
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()


def load_best(folder: Path, state: dict) -> Optional[dict]:
    """The best dev epoch's weights that a checkpoint's state names (None before the first epoch's end)."""
    import torch

    epoch = state["best_epoch"]
    return None if epoch is None else torch.load(best_file(folder, epoch), weights_only=True)


def steps_per_epoch(state) -> int:
    return max(1, state.max_steps // max(1, round(state.num_train_epochs)))


def checkpoint_callback(folder: Path, save_steps: int, best, stop, log: Callable[[str], None], resumed: dict):
    """A ``TrainerCallback`` saving the run's checkpoints (``best``: the run's dev-epoch callback, its
    ``dev``, ``best_epoch`` and ``best_state``; ``stop``: :class:`processes.DeferredStop`); ``resumed``:
    the state of the checkpoint this attempt resumes from, or {}. Its ``trainer`` must be set to the
    trainer it is added to (the loss summed since the last log is the trainer's)."""
    import torch
    import transformers

    class RunCheckpoints(transformers.TrainerCallback):
        def __init__(self):
            self.trainer = None
            self.started = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.time()
            if resumed.get("loss_since_log") is not None:  # the loss summed since the last log, as it was
                self.trainer._tr_loss += resumed["loss_since_log"]
                self.trainer._globalstep_last_logged = resumed["last_logged_step"]

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % steps_per_epoch(state) == 0:
                return  # an epoch's last step: saved after the epoch's dev scores
            if stop.requested is not None or (save_steps and state.global_step % save_steps == 0):
                control.should_save = True

        def on_save(self, args, state, control, **kwargs):
            epoch = best.best_epoch
            if epoch is not None and not best_file(folder, epoch).exists():
                partial = folder / "best.pt.partial"
                torch.save(best.best_state, partial)
                os.replace(partial, best_file(folder, epoch))
            checkpoint = folder / f"{PREFIX}{state.global_step}"
            summed = getattr(self.trainer, "_tr_loss", None)  # the Trainer's (transformers 5.23) loss since its log
            record = {
                "step": state.global_step,
                "max_steps": state.max_steps,
                "dev": best.dev,
                "best_epoch": epoch,
                "loss_since_log": float(summed.item()) if summed is not None else None,
                "last_logged_step": self.trainer._globalstep_last_logged,
                "train_seconds": resumed.get("train_seconds", 0.0) + time.time() - self.started,
                "resumed_at_steps": resumed.get("resumed_at_steps", []),
            }
            write_json(checkpoint / STATE_FILE, record)
            _keep_only(folder, checkpoint, best_file(folder, epoch or 0))
            if stop.requested is not None:
                log(
                    f"{stop.name} during training: saved {checkpoint.name} (step {state.global_step} of "
                    f"{state.max_steps}, epoch {state.epoch:.2f}); the run resumes there (the same command again, or "
                    "the requeued job)"
                )
                stop.act()

    return RunCheckpoints()
