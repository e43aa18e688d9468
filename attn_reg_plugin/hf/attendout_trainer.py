"""AttendOut for transformers' Trainer: :class:`AttendOutTrainer`, :class:`AttendOutSeq2SeqTrainer`.

Same semantics as the fairseq task option ``--attendout``; the science is in
``attn_reg_plugin.core`` (the game and the duel's shared steps in ``core.attendout``).

* the Defender D is the Trainer's model, trained exactly as the Trainer trains it (regular
  dropout, the Trainer's loss, optimizer, scheduler and ``max_grad_norm`` clipping);
* the Attacker A is a copy of D whose attention takes the generator's score-dropout masks. It
  has its own optimizer, of the Trainer's optimizer class with the same parameter groups and
  hyperparameters; its learning rate is copied from the Trainer's optimizer at every step (so
  the Trainer's scheduler drives both) and its gradients are clipped to the same
  ``max_grad_norm``. A trains on D's batches: its forward/backward runs in the same training
  step, right after D's, through the Trainer's own ``training_step`` (same loss, same
  gradient-accumulation scaling);
* every T optimizer steps, T samples drawn at random (torch's global generator) from
  ``eval_dataset`` (or, with ``attendout_valid_subset="heldout"``, from ``eval_dataset["heldout"]``,
  the counterpart of fairseq's ``--attendout-valid-subset``) are scored by D and A in eval mode (per-sample cross-entropy, squared error
  for regression); the generator takes its REINFORCE step and the survivor's parameters *and*
  optimizer state overwrite the other's, so D and A start every dropout step identical and the
  model the Trainer saves is the survivor.

Gradient accumulation is supported (the masks of every micro-batch of an update are cached; an
update's log-probability is their mean). Mixed precision: A's forward runs under the Trainer's
autocast, as D's does. With fp16, A has a loss scaler of its own (a copy of the Trainer's
scaler's settings), so each network skips its own overflowing steps: when D's step is skipped,
the update still counts (the Trainer counts it too) and A steps unless its own gradients
overflowed; when A's step is skipped, D steps, and ``attendout_attacker_overflows`` is logged.

This module is the glue: the trainer's hooks into ``transformers.Trainer``. The game's steps are
:class:`~attn_reg_plugin.hf.attendout_driver.AttendOutDriver` (``trainer.attendout_driver``);
its checkpoint files are :mod:`.attendout_checkpoint`'s and its log entries :mod:`.attendout_logging`'s.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch
import transformers
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..core.regularizers.attendout import AttendOutConfig
from ..core.regularizers.combinations import ATTENDOUT
from ..core.regularizers.options import named_by_field
from ..core.training.sharding import is_fully_sharded
from .attendout_checkpoint import ATTENDOUT_STATE, attendout_state_dict, save_attendout_state
from .attendout_driver import AttendOutDriver, mirror_activation_checkpointing, optimizer_like
from .attendout_logging import trainer_counts_kept
from .combinations import check_trainer_combination, turns_on
from .notices import SiteReport, warn_if_idle
from .trainer_arguments import model_argument, training_arguments
from .training_configurations import refuse_unsupported, refuse_unsupported_launch

__all__ = [
    "ATTENDOUT_STATE",
    "AttendOutSeq2SeqTrainer",
    "AttendOutTrainer",
    "AttendOutTrainerMixin",
    "mirror_activation_checkpointing",
    "optimizer_like",
]

# Why AttendOut cannot run under a DeepSpeed engine at all (training_configurations).
NO_DEEPSPEED = (
    "the engine owns the Defender's backward and optimizer step, and the Attacker's backward would run "
    "through it. Use FSDP2 (fsdp_config={'version': 2}) or DDP (torchrun)"
)


class _AttendOutCallback(TrainerCallback):
    """A's step right after D's (before the scheduler moves the learning rate), the dropout step after the update."""

    def __init__(self, trainer: AttendOutTrainerMixin):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.attendout_driver.optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.attendout_driver.take_due_dropout_step():
            self.trainer._attendout_finish_dropout_step()


def _driver_attribute(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.attendout_driver, name), doc=doc)


class AttendOutTrainerMixin:
    """Shared by :class:`AttendOutTrainer` and :class:`AttendOutSeq2SeqTrainer`."""

    attn_reg_regularizers = turns_on(ATTENDOUT, "attendout=AttendOutConfig")

    attendout_config = _driver_attribute("config", "The run's AttendOutConfig.")
    attendout_defender_controller = _driver_attribute("defender_controller", "D's attention sites.")
    attendout_generator = _driver_attribute("generator", "The generator (G-Net) of the Attacker's masks.")
    attendout_attacker = _driver_attribute("attacker", "A; None until the first training step builds it.")
    attendout_optimizer = _driver_attribute("optimizer", "A's optimizer; None until the first training step.")
    attendout_scaler = _driver_attribute("scaler", "A's own fp16 loss scaler; None without fp16.")
    attendout_game = _driver_attribute("game", "The game (A's sites, masks, REINFORCE); None until the first step.")
    _attendout_start_id = _driver_attribute("start_id", "The id the generator reads at decoder position 0.")

    def __init__(
        self,
        *args,
        attendout: AttendOutConfig,
        attendout_log_file: Optional[str] = None,
        attendout_valid_subset: Optional[str] = None,
        **kwargs,
    ):
        if not isinstance(attendout, AttendOutConfig):
            raise TypeError(f"attendout must be an AttendOutConfig, got {type(attendout).__name__}")
        named_by_field(attendout).validate()
        check_trainer_combination(self, kwargs)
        model = model_argument("AttendOutTrainer", args, kwargs)
        refuse_unsupported("AttendOutTrainer", training_arguments(args, kwargs), model=model, no_deepspeed=NO_DEEPSPEED)
        if is_fully_sharded(model):
            raise ValueError(
                "AttendOutTrainer needs the unsharded model (it was sharded with FSDP2 before the Trainer was built): "
                "the Attacker is a copy of it, and a sharded module cannot be copied. Pass the unsharded model and "
                "let the Trainer shard it (fsdp_config={'version': 2})"
            )
        super().__init__(*args, **kwargs)
        refuse_unsupported_launch(
            "AttendOutTrainer", self, no_deepspeed=NO_DEEPSPEED
        )  # what accelerate's own config turned on, too
        self.attendout_driver = AttendOutDriver(self, model, attendout, attendout_log_file, attendout_valid_subset)
        self.add_callback(_AttendOutCallback(self))
        warn_if_idle(self, attendout)  # fewer planned updates than one dropout step never act
        self.attn_reg_site_report = SiteReport(self.attendout_driver.found_sites, self.attendout_driver.sites)

    # -- the game's state and steps, by the trainer's names -----------------------------------
    @property
    def _attendout_resume_from(self) -> Optional[str]:
        """The checkpoint folder the game is restored from at the first training step."""
        return self.attendout_driver.resume_from

    @_attendout_resume_from.setter
    def _attendout_resume_from(self, folder: Optional[str]) -> None:
        self.attendout_driver.resume_from = folder

    def _attendout_start(self) -> None:
        self.attendout_driver.start()

    def _attendout_finish_dropout_step(self) -> Dict[str, object]:
        """Ends a dropout step; the callback calls it through the trainer, so a wrapper set here takes effect."""
        return self.attendout_driver.finish_dropout_step()

    def _attendout_logits(self, model: torch.nn.Module, batch):
        return self.attendout_driver.heldout_logits(model, batch)

    def attendout_streams(self, inputs: Dict[str, Any]) -> Dict[str, torch.Tensor]:
        """The generator's token streams of a batch (see :meth:`AttendOutDriver.streams`)."""
        return self.attendout_driver.streams(inputs)

    def attendout_state_dict(self) -> Dict[str, object]:
        """A, its optimizer, the game (and A's loss scaler); under FSDP2 a collective (see :mod:`.attendout_checkpoint`)."""
        return attendout_state_dict(self.attendout_driver)

    # -- transformers.Trainer hooks -------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)  # None: the Trainer raises its own error
        # Any path the Trainer accepts (str or os.PathLike, e.g. pathlib.Path) resumes the game too.
        self.attendout_driver.resume_from = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        inputs = self._prepare_inputs(inputs)  # once: the steps below find it on the device already
        loss = super().training_step(model, dict(inputs), num_items_in_batch)
        self._attendout_start()  # through the trainer, as the step's other parts: overridable
        driver = self.attendout_driver
        # The Trainer's own step on A: same loss, same gradient-accumulation scaling.
        with driver.attacker_step(inputs), trainer_counts_kept(self):
            attacker_loss = super().training_step(driver.attacker, dict(inputs), num_items_in_batch)
        driver.logs.add_attacker_loss(attacker_loss)
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if model is self.attendout_driver.attacker:  # A's loss is made: its masks end here
            self.attendout_driver.end_attacker_pass()
        return result

    def log(self, logs: Dict[str, float], *args, **kwargs) -> None:
        driver = self.attendout_driver
        driver.logs.add_to_training_log(logs, own_scaler=driver.scaler is not None)
        self.attn_reg_site_report.add_once(logs)
        return super().log(logs, *args, **kwargs)

    # transformers 5.23.0 Trainer._save_checkpoint writes checkpoint-<global_step>/; this adds the game's state to it.
    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.attendout_driver.attacker is None or self.args.save_only_model:
            return
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        save_attendout_state(self.attendout_driver, folder, self.args.should_save)


class AttendOutTrainer(AttendOutTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with AttendOut; keywords ``attendout: AttendOutConfig``, ``attendout_log_file``,
    ``attendout_valid_subset`` (the key of a dict ``eval_dataset`` the held-out samples are drawn from)."""


class AttendOutSeq2SeqTrainer(AttendOutTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with AttendOut; the keywords of :class:`AttendOutTrainer`."""
