"""AttendOut's Defender/Attacker game inside fairseq's training loop.

The trainer's model is the Defender D (regular dropout); this module keeps the Attacker A (a
copy of D, same architecture and dropout, plus the generator's masks), its optimizer and the
core :class:`~attn_reg_plugin.core.regularizers.attendout.AttendOut`. The task calls

* :meth:`FairseqAttendOut.train_attacker` after D's forward/backward on the same batch,
* :meth:`FairseqAttendOut.after_optimizer_step` after D's optimizer step: A's step, and every
  T updates the held-out evaluation, the generator update and the re-sync.

A's gradients are normalised exactly as the trainer normalises D's (summed loss, all-reduced
over workers, divided by the total sample size). fairseq does not hand ``--clip-norm`` to
tasks, so A is clipped with ``--attendout-clip-norm`` (set it to the same value).

Half precision (``--fp16`` / ``--bf16``, with or without ``--memory-efficient-fp16``): A's
optimizer is the same wrapper as D's with a loss scaler of its own. When fairseq skips D's step
for an overflow, ``after_optimizer_step`` is not called, so A's gradients of that update are
kept and A steps once over both updates; when A's own gradients overflow, A skips its step and
the update still counts. Plain ``--fp16`` / ``--bf16`` (FP16Optimizer) step fp32 master copies
of the weights: the re-sync copies the survivor's masters and their optimizer state too.

Resuming (docs/CHECKPOINTS.md has a table of fairseq's ``--reset-*`` flags): the game's state
travels in the checkpoint's task state, and a resume never silently starts a new game
(:mod:`.attendout_checkpoint`). ``--reset-optimizer`` resets A's optimizer as it resets D's. A's
param-group settings (lr, betas, weight decay, ...) are D's after a resume, before every step of
A, after every re-sync and when saved: "its own optimizer of the same type" has D's settings,
whatever the resumed command changed.

``--amp``: A's forward runs under the same autocast as D's, and A's AMPOptimizer has its own
GradScaler. fairseq's AMP still calls ``optimizer_step`` when D's gradients overflow (its scaler
skips the step) and then trains the same batch again (``--amp-batch-retries``); so when D's
scale drops, A drops that update's gradients and cached masks too, and the update does not count
towards T (A and D see the retried batch once each). A's own overflow skips A's step, as above.
"""

import contextlib
import dataclasses
import logging
import math
from dataclasses import field
from typing import Callable, Dict, Iterator, Optional

import torch
from fairseq import metrics, optim, utils

from ..core.kernel.controller import RegularizationController
from ..core.regularizers.attendout.config import AttendOutConfig, generator_positions
from ..core.regularizers.attendout.duel import build_attacker, end_dropout_step, scaler_skipped_step
from ..core.regularizers.attendout.game import AttendOut
from ..core.regularizers.attendout.generator import Generator
from ..core.regularizers.attendout.heldout import heldout_indices
from ..core.regularizers.attendout.log import DropProbabilityLog
from ..core.regularizers.attendout.sync import copy_model_state, copy_optimizer_state
from ..core.regularizers.attribution_pass import bare_module
from ..core.training.distributed import all_reduce_sum_, from_rank0, is_distributed, rank
from .attendout_checkpoint import (
    check_fairseq_supports_task_state,
    loaded_checkpoint_path,
    read_attendout_state,
    restored_message,
)
from .attention import install_attention_sites
from .task_regularizers import TaskBinding, TaskRunner, bind_to_task, whole_config

logger = logging.getLogger(__name__)


class FairseqAttendOut(TaskRunner):
    """The Attacker, its optimizer and the game, for one fairseq task."""

    def __init__(
        self,
        config: AttendOutConfig,
        clip_norm: float,
        valid_subset: str,
        log_file: str,
        heldout_logits: Callable,
        streams_of: Callable[[dict], Dict[str, torch.Tensor]],
        generator_vocab: Dict[str, object],
        whole_config=None,
    ):
        self.config = config
        self.clip_norm = clip_norm
        self.valid_subset = valid_subset
        self.drop_log = DropProbabilityLog(log_file or None)
        self.heldout_logits = heldout_logits  # (model, sample, criterion) -> (logits, target, keep)
        self.streams_of = streams_of  # sample -> {"source": tokens, "target": tokens}
        self.generator_vocab = generator_vocab  # stream -> fairseq Dictionary
        self.whole_config = whole_config  # fairseq-train's config: builds a half-precision optimizer like D's
        self.attacker_overflows = 0  # A's steps skipped for a gradient overflow, since the last log
        self.attacker = None
        self.attacker_optimizer = None
        self.game: Optional[AttendOut] = None
        self.pending_state = None
        self.sample_size = 0.0
        self.defender_optimizer = None  # D's (fairseq's) optimizer, whose param-group settings A follows
        self.defender_loaded = False  # set when fairseq loads D's weights from a checkpoint
        self.training_began = False
        self.criterion = None  # the step's criterion: the held-out evaluation after the optimizer step needs it

    # -- the task's calls (TaskRunner) ----------------------------------------------------
    def begin_epoch(self, task, epoch: int) -> None:
        # After fairseq's load_checkpoint: the game resumes from it, whatever the --reset-* flags.
        self.begin_training(type(task).__name__)
        self.heldout_dataset(task)

    def after_train_step(self, task, sample, model, criterion, optimizer, update_num, ignore_grad) -> dict:
        self.criterion = criterion
        return self.train_attacker(sample, model, criterion, optimizer, update_num, ignore_grad)

    @contextlib.contextmanager
    def around_optimizer_step(self, task, optimizer, model, update_num) -> Iterator[None]:
        scale_before = self.defender_scale(optimizer)
        yield
        self.after_optimizer_step(model, optimizer, self.criterion, task, update_num, scale_before)

    # -- set-up ---------------------------------------------------------------------------
    def validate_against(self, controller: RegularizationController) -> None:
        """Fail before training if the kinds / layers do not exist in the Defender (same as A's)."""
        with torch.random.fork_rng(devices=[]):
            AttendOut(self.config, controller, self._new_generator(torch.device("cpu")))

    def _new_generator(self, device) -> Generator:
        dicts = self.generator_vocab
        shared = len({id(d) for d in dicts.values()}) == 1
        return Generator(
            {s: len(d) for s, d in dicts.items()},
            {s: d.pad() for s, d in dicts.items()},
            self.config.generator_dim,
            self.config.max_positions,
            self.config.init_drop,
            self.config.temperature,
            share_streams=shared,
        ).to(device)

    def _ensure_attacker(self, defender: torch.nn.Module, optimizer) -> None:
        if self.attacker is not None:
            return
        kind = type(optimizer).__name__
        wrappers = ("FP16Optimizer", "MemoryEfficientFP16Optimizer", "AMPOptimizer")
        if kind in wrappers and self.whole_config is None:
            # A task built without fairseq-train's whole config cannot build the same wrapper for A.
            raise NotImplementedError(
                f"--attendout cannot mirror a {kind} without fairseq-train's config; train in fp32"
            )
        defender = bare_module(defender)
        self.attacker, controller = build_attacker(defender, install_attention_sites)
        device = next(defender.parameters()).device
        # The generator's random init must not consume the global stream: the Attacker is
        # built at the first update of a run, which after a resume is a different update.
        with torch.random.fork_rng(devices=[]):
            generator = self._new_generator(device)
        self.game = AttendOut(self.config, controller, generator)
        params = [p for p in self.attacker.parameters() if p.requires_grad]
        if kind in wrappers:
            # Same wrapper as D's with a loss scaler of its own: each network skips its own overflows.
            self.attacker_optimizer = getattr(optim, kind).build_optimizer(self.whole_config, params)
        else:
            # fairseq-train's optimizer config: legacy optimizers (sgd, adagrad) carry no .cfg
            cfg = self.whole_config.optimizer if self.whole_config is not None else optimizer.cfg
            self.attacker_optimizer = optim.build_optimizer(cfg, params)
        self.attacker_optimizer.zero_grad()  # a scaled optimizer sets its unscale factor here
        if self.pending_state is not None:
            self._load(self.pending_state)
            self.pending_state = None
        self.follow_defender(optimizer)  # also a resumed A: D's settings, not the saved ones

    # -- per batch ------------------------------------------------------------------------
    def train_attacker(self, sample, defender, criterion, optimizer, update_num, ignore_grad) -> Dict[str, object]:
        """A's forward/backward on D's batch with the generator's masks; returns logging entries."""
        self.defender_optimizer = optimizer
        self._ensure_attacker(defender, optimizer)
        self.attacker.train()
        self.attacker.set_num_updates(update_num)
        # The forward runs under the autocast fairseq's train_step gives D's forward (on with --amp only).
        with self.game.attacker_pass(self.streams_of(sample)):
            with torch.autocast("cuda", enabled=_amp(optimizer)):
                loss, sample_size, _ = criterion(self.attacker, sample)
        if ignore_grad:
            loss = loss * 0
        self.attacker_optimizer.backward(loss)  # scaled by A's own loss scaler in half precision
        self.sample_size += float(sample_size) if not ignore_grad else 0.0
        log = {
            "attendout_attacker_loss": loss.detach(),
            "attendout_sample_size": sample_size,
            "attendout_attacker_overflows": self.attacker_overflows,
        }
        self.attacker_overflows = 0
        for name, prob in zip(self.game.site_names(), self.game.last_drop_probabilities):
            log[f"attendout_p_{name}"] = prob
        return log

    def defender_scale(self, optimizer) -> Optional[float]:
        """D's AMP loss scale before its step (None without --amp), for ``scaler_skipped_step``."""
        return optimizer.scaler.get_scale() if self.attacker is not None and _amp(optimizer) else None

    def after_optimizer_step(
        self, defender, optimizer, criterion, task, update_num, scale_before: Optional[float] = None
    ) -> None:
        if self.attacker is None:
            return
        if scale_before is not None and scaler_skipped_step(optimizer.scaler, scale_before):
            # fairseq's AMP dropped D's step and will train this batch again (or skip it): A
            # forgets it too, so that both networks see each batch once and T counts D's steps.
            self.attacker_optimizer.zero_grad()
            self.sample_size = 0.0
            self.game.discard_update()
            return
        params = [p for p in self.attacker.parameters() if p.requires_grad]
        grads = [p.grad for p in params if p.grad is not None]
        sample_size = torch.tensor(self.sample_size, dtype=torch.float64)
        if is_distributed():
            for g in grads:
                all_reduce_sum_(g)
            sample_size = all_reduce_sum_(sample_size.to(grads[0].device if grads else "cpu"))
        # As the trainer does for D: sum of gradients over all workers / total sample size.
        self.attacker_optimizer.multiply_grads(1.0 / max(float(sample_size), 1.0))
        try:
            if self.clip_norm > 0 or getattr(self.attacker_optimizer, "scaler", None) is not None:
                self.attacker_optimizer.clip_grad_norm(self.clip_norm)  # also A's own overflow check
        except OverflowError:
            # A's gradients overflowed (its scaler has just lowered the scale): A skips this step,
            # as fairseq skips D's; the update still counts for the dropout step.
            self.attacker_overflows += 1
        else:
            self.follow_defender(optimizer)  # the lr D has just stepped with, and every other setting
            if _amp(self.attacker_optimizer):  # AMP's scaler skips an overflowing step itself
                scale = self.attacker_optimizer.scaler.get_scale()
                self.attacker_optimizer.step()
                self.attacker_overflows += int(scaler_skipped_step(self.attacker_optimizer.scaler, scale))
            else:
                self.attacker_optimizer.step()
        self.attacker_optimizer.zero_grad()
        self.sample_size = 0.0
        if self.game.end_update():
            self._finish_dropout_step(defender, optimizer, criterion, task, update_num)

    # -- every T updates ------------------------------------------------------------------
    @staticmethod
    def _shared_generator() -> torch.Generator:
        """The same on resume: fairseq seeds torch with seed + num_updates before each update, and
        torch.initial_seed() is that seed whatever dropout has drawn since."""
        return torch.Generator().manual_seed(torch.initial_seed() + 1)

    def heldout_dataset(self, task):
        """The split held-out samples come from; called when training begins, so a missing or
        empty split stops the run before its first update."""
        if self.valid_subset not in task.datasets:
            try:
                task.load_dataset(self.valid_subset, combine=False, epoch=1)
            except FileNotFoundError as e:
                raise ValueError(f"--attendout-valid-subset {self.valid_subset!r} cannot be loaded: {e}") from None
        dataset = task.datasets[self.valid_subset]
        if len(dataset) == 0:
            raise ValueError(
                f"--attendout-valid-subset {self.valid_subset!r} is empty: AttendOut needs held-out samples"
            )
        return dataset

    def _heldout_samples(self, task, device, generator):
        dataset = self.heldout_dataset(task)
        n, T = len(dataset), self.config.dropout_step
        idx = heldout_indices(n, T, generator)
        samples = []
        for start in range(0, len(idx), 64):
            batch = dataset.collater([dataset[int(i)] for i in idx[start : start + 64]])
            samples.append(utils.move_to_cuda(batch, device=device) if device.type == "cuda" else batch)
        return samples

    def _finish_dropout_step(self, defender, optimizer, criterion, task, update_num) -> None:
        bare = bare_module(defender)
        shared = self._shared_generator()
        samples = self._heldout_samples(task, next(bare.parameters()).device, shared)
        sides = {"defender": (bare, optimizer), "attacker": (self.attacker, self.attacker_optimizer)}
        stats = end_dropout_step(
            self.game,
            bare,
            self.attacker,
            samples,
            lambda model, sample: self.heldout_logits(model, sample, criterion),
            lambda source, destination: _copy_network(*sides[source], *sides[destination]),
            generator=shared,
        )
        self.follow_defender(optimizer)  # the copy moves per-parameter state only
        if rank() == 0:
            self.drop_log.write(update_num + 1, stats)
            probs = ", ".join(f"{k} {v:.4f}" for k, v in stats["drop_prob"].items())
            logger.info(
                f"AttendOut dropout step {self.game.dropout_steps_done} (update {update_num + 1}): attacker win rate "
                f"{stats['win_rate']:.3f}, kept {'attacker' if stats['keep_attacker'] else 'defender'}, mean reward "
                f"{stats['reward']:.4g}, baseline {stats['baseline']:.4g}, mean drop probability: {probs}, "
                f"dropped by the kernel: {stats['drop_rate']:.4f}"
            )

    def follow_defender(self, optimizer) -> None:
        """A's param-group settings become D's: every key but 'params' (lr, betas, weight decay, eps...)."""
        if self.attacker_optimizer is None or optimizer is None:
            return
        follow_param_groups(optimizer.param_groups, self.attacker_optimizer.param_groups)

    # -- checkpoints ----------------------------------------------------------------------
    def reset_optimizer(self) -> bool:
        """fairseq-train's ``--reset-optimizer``: D's optimizer state is not restored, so neither is A's."""
        checkpoint = self._checkpoint_config()
        return bool(checkpoint is not None and checkpoint.get("reset_optimizer", False))

    def _checkpoint_config(self):
        root = self.whole_config
        return root.checkpoint if root is not None and "checkpoint" in root else None

    def begin_training(self, task_state_key: str) -> None:
        """Called when training begins (the first ``begin_epoch``), after fairseq loaded its checkpoint.

        fairseq hands the task its checkpoint state only without ``--reset-dataloader``; when it
        loaded a checkpoint and handed none, read it from that file, so that the game goes on whatever
        the flags. Logs one line saying what was restored, or that a new game starts."""
        if self.training_began:
            return
        self.training_began = True
        if self.pending_state is not None or self.attacker is not None:
            source = "the checkpoint's task state"
        else:
            # Rank 0 finds and reads the file, as fairseq does, and every rank gets its state.
            path, why = (
                loaded_checkpoint_path(self._checkpoint_config(), self.defender_loaded) if rank() == 0 else (None, "")
            )
            state = from_rank0(read_attendout_state(path, task_state_key) if path is not None else None)
            if not state:
                if rank() == 0:
                    reason = why or (f"{path} holds no AttendOut state" if path else "no checkpoint was loaded")
                    logger.info(f"AttendOut: new game ({reason})")
                return
            self.load_state_dict(state)
            reset = self._checkpoint_config().get("reset_dataloader", False)
            source = f"{path}, read by AttendOut (fairseq hands the task no checkpoint state"
            source += " with --reset-dataloader)" if reset else ")"
        if rank() == 0:
            game = self.game.state_dict() if self.game is not None else self.pending_state["game"]
            logger.info(restored_message(game, self.config.dropout_step, source, self.reset_optimizer()))

    def state_dict(self) -> Dict[str, object]:
        if self.attacker is None:
            return self.pending_state or {}
        self.follow_defender(self.defender_optimizer)  # D's lr has moved on since A's last step
        return {
            "game": self.game.state_dict(),
            "attacker": self.attacker.state_dict(),
            "attacker_optimizer": self.attacker_optimizer.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, object]) -> None:
        if not state:
            return
        if self.attacker is None:
            self.pending_state = state  # applied when the Attacker is built at the first update
        else:
            self._load(state)

    def _load(self, state) -> None:
        self.attacker.load_state_dict(state["attacker"])
        if not self.reset_optimizer():  # fairseq did not restore D's optimizer either
            self.attacker_optimizer.load_state_dict(state["attacker_optimizer"])
        self.game.load_state_dict(state["game"])


def follow_param_groups(source_groups, destination_groups) -> None:
    """Copy every param-group setting but 'params' (group by group, or the first group's to all
    when the counts differ)."""
    for i, destination in enumerate(destination_groups):
        source = source_groups[i] if len(source_groups) == len(destination_groups) else source_groups[0]
        for key, value in source.items():
            if key != "params":
                destination[key] = value


def _amp(optimizer) -> bool:
    return type(optimizer).__name__ == "AMPOptimizer"


def stepped_tensors(model: torch.nn.Module, optimizer) -> list:
    """The tensors ``optimizer``'s torch optimizer steps: the model's trainable parameters, or the
    fp32 master copies of FP16Optimizer (plain ``--fp16`` / ``--bf16``; flat or one per parameter)."""
    masters = getattr(optimizer, "fp32_params", None)
    if masters is None:
        return [p for p in model.parameters() if p.requires_grad]
    if isinstance(masters, dict):
        return list(masters.values())
    return [masters] if torch.is_tensor(masters) else list(masters)


@torch.no_grad()
def _copy_network(source, source_optimizer, destination, destination_optimizer) -> None:
    """The survivor's weights, fp32 masters (if any) and optimizer state overwrite the other's."""
    copy_model_state(source, destination)
    sources, destinations = (
        stepped_tensors(source, source_optimizer),
        stepped_tensors(destination, destination_optimizer),
    )
    if getattr(source_optimizer, "fp32_params", None) is not None:
        for s, d in zip(sources, destinations):
            d.copy_(s)
    copy_optimizer_state(source_optimizer.optimizer, sources, destination_optimizer.optimizer, destinations)


def reduce_attendout_metrics(logging_outputs) -> None:
    """AttendOut's training metrics: the Attacker's loss, its skipped steps, the per-layer drop probability."""
    steps = [log for log in logging_outputs if "attendout_attacker_loss" in log]
    if not steps:
        return
    loss = utils.item(sum(log["attendout_attacker_loss"] for log in steps))
    size = utils.item(sum(log["attendout_sample_size"] for log in steps))
    # Same units as fairseq's `loss` (base 2, per sample-size unit).
    metrics.log_scalar("attendout_attacker_loss", loss / max(size, 1) / math.log(2), size, round=3)
    overflows = utils.item(sum(log.get("attendout_attacker_overflows", 0) for log in steps))
    if overflows:
        metrics.log_scalar_sum("attendout_attacker_overflows", overflows)
    # The generator's mean drop probability per selected layer (paper Fig. 3), per batch.
    for key in sorted(k for k in steps[0] if k.startswith("attendout_p_")):
        metrics.log_scalar(key, utils.item(sum(log[key] for log in steps)) / len(steps), len(steps), round=4)


def _validate(cfg) -> None:
    """AttendOut's options, on or off (a bad value is refused either way), and what a run of it needs."""
    AttendOutConfig.from_namespace(cfg).validate()
    if not 0 <= cfg.attendout_clip_norm < math.inf:  # also refuses nan
        raise ValueError(f"--attendout-clip-norm must be a finite number >= 0, got {cfg.attendout_clip_norm!r}")
    if cfg.attendout:
        check_fairseq_supports_task_state()


def _build(task, model, config: AttendOutConfig) -> FairseqAttendOut:
    """The task's AttendOut, once its model (the Defender) is built; the layers and kinds are checked."""
    cfg = task.cfg
    # Unset, the generator covers every sequence the model takes (source and target alike).
    lengths = [n for n in _flat(model.max_positions()) if isinstance(n, int) and n > 0]
    positions = generator_positions(config, max(lengths, default=None))
    attendout = FairseqAttendOut(
        dataclasses.replace(config, max_positions=positions),
        cfg.attendout_clip_norm,
        cfg.attendout_valid_subset,
        cfg.attendout_log_file,
        task.attendout_heldout_logits,
        task.attendout_streams,
        task.attendout_generator_vocab(),
        whole_config(cfg),
    )
    attendout.validate_against(task.attn_reg_controller)
    # Tells AttendOut that fairseq loaded the Defender from a checkpoint (begin_training).
    model.register_load_state_dict_post_hook(_note_defender_loaded(attendout))
    return attendout


def _flat(value):
    """The numbers of a model's max_positions(): an int, or a tuple of them (source, target)."""
    return [n for item in value for n in _flat(item)] if isinstance(value, (tuple, list)) else [value]


def _note_defender_loaded(attendout: FairseqAttendOut):
    def hook(module, incompatible_keys):
        if not attendout.training_began:  # not the Attacker (a copy of D, hooks included) loading its state
            attendout.defender_loaded = True

    return hook


bind_to_task(
    TaskBinding(
        "attendout",
        (
            "attendout",
            bool,
            field(default=False, metadata={"help": "train with AttendOut (Defender/Attacker + learned score dropout)"}),
        ),
        (
            (
                "attendout_clip_norm",
                float,
                field(
                    default=0.0,
                    metadata={
                        "help": "gradient clipping of the Attacker (fairseq does not pass --clip-norm to tasks: use the same value), >= 0"
                    },
                ),
            ),
            (
                "attendout_valid_subset",
                str,
                field(default="valid", metadata={"help": "dataset split the held-out samples are drawn from"}),
            ),
            (
                "attendout_log_file",
                str,
                field(
                    default="",
                    metadata={
                        "help": "append one JSON line per dropout step (per-layer mean drop probability, reward) to this file"
                    },
                ),
            ),
        ),
        _validate,
        _build,
        reduce_attendout_metrics,
    )
)
