"""What every attn_reg task adds to its fairseq base task, and the task-level regularizers' flags.

The registered tasks, one file each: ``attn_reg_translation`` and ``attn_reg_sentence_prediction``
are fairseq's ``translation`` and ``sentence_prediction`` tasks plus these duties: after the model is built, every
MultiheadAttention is routed through the core kernel (no new parameters); ``begin_epoch``
records the 1-based epoch that cross-tuning reads; and the regularizers that need no special
criterion run in ``train_step``: AttendOut (``--attendout``) and every regularizer of the registry
(:mod:`..core.regularizers.registry`, the plugin's and any registered outside the package), each with its flags.
Validation and generation are untouched.
"""

import argparse
import dataclasses
import logging
import math
from dataclasses import field
from typing import Dict, Tuple

from fairseq import metrics, utils
from omegaconf import OmegaConf, open_dict

from ..core.kernel.controller import RegularizationController
from ..core.regularizers.ad_drop_config import ad_drop_epoch
from ..core.regularizers.attendout import AttendOutConfig
from ..core.regularizers.attendout.config import generator_positions
from ..core.regularizers.combinations import AD_DROP, ATTENDOUT, check_combination
from ..core.regularizers.options import attribute_prefix
from ..core.regularizers.registry import planned, planned_hooks, running
from .attendout import FairseqAttendOut, reduce_attendout_metrics
from .attendout_checkpoint import check_fairseq_supports_task_state
from .attention import install_attention_sites
from .criterion import RegularizingCriterion
from .options import fairseq_options
from .planned_run import warn_if_idle

logger = logging.getLogger(__name__)

# Flags of the task-level regularizers: the core configs' fields, defaults and help
# (core.options), after the switches and settings that exist only in fairseq.
AttnRegTaskOptions = fairseq_options(
    "AttnRegTaskOptions",
    [AttendOutConfig, *(regularizer.config for regularizer in planned())],
    extra=[
        (
            "attendout",
            bool,
            field(default=False, metadata={"help": "train with AttendOut (Defender/Attacker + learned score dropout)"}),
        ),
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
    ],
)


def task_regularizers_on(cfg) -> Dict[str, str]:
    """The task-level regularizers this run turns on (each validated first), each with its flag."""
    configs = [(regularizer, regularizer.config.from_namespace(cfg).validate()) for regularizer in planned()]
    on = {ATTENDOUT: "--attendout"} if getattr(cfg, "attendout", False) else {}
    for regularizer, config in configs:
        if config.enabled:
            on[regularizer.name_of(config)] = config.name(regularizer.switch)
    return on


def refuse_task_regularizers_beside(criterion_name: str, task, regularizers: Tuple[str, ...]) -> None:
    """A criterion's ``regularizers`` beside an attn_reg ``task``'s own: refused, both named, unless
    core.combinations says they combine."""
    criterion = dict.fromkeys(regularizers, f"--criterion {criterion_name}")
    check_combination({**criterion, **task_regularizers_on(task.cfg)})


def _switches():
    """Each task regularizer's switch: (its config, the field that turns it on; None: fairseq's --attendout)."""
    return ((AttendOutConfig, None), *((r.config, r.switch) for r in planned()))


_ATTENDOUT_EXTRAS = ("attendout_clip_norm", "attendout_valid_subset", "attendout_log_file")


def _refuse_options_of_what_is_off(cfg) -> None:
    """An option of a task regularizer that is off, given another value than its default, would do
    nothing, silently (a forgotten switch trained plain, its layers unchecked): on
    fairseq-train's command line it is refused. A hydra config (fairseq-hydra-train, a recipe) turns a
    regularizer off with one override: its other options there get one warning line naming them."""
    defaults = {f.name: f.default for f in dataclasses.fields(AttnRegTaskOptions)}
    command_line = _from_the_command_line(cfg)
    for config_cls, switch in _switches():
        config = config_cls.from_namespace(cfg)
        if getattr(cfg, "attendout", False) if switch is None else config.enabled:
            continue
        attributes = [attribute_prefix(config_cls) + f.name for f in dataclasses.fields(config_cls) if f.name != switch]
        given = [
            (attribute, getattr(cfg, attribute, defaults[attribute]))
            for attribute in attributes + list(_ATTENDOUT_EXTRAS if switch is None else ())
            if _normalized(getattr(cfg, attribute, defaults[attribute])) != _normalized(defaults[attribute])
        ]
        switch_attribute = "attendout" if switch is None else attribute_prefix(config_cls) + switch
        if given and command_line:
            (attribute, value), turn_on = given[0], "--attendout" if switch is None else config.name(switch)
            flag = "--" + attribute.replace("_", "-")
            raise ValueError(
                f"{flag} is {value!r}, but {turn_on} leaves its regularizer off, so it would have no effect: "
                f"turn it on with {turn_on}, or leave {flag} out"
            )
        if given:
            named = ", ".join(f"task.{attribute}={value!r}" for attribute, value in given)
            logger.warning(
                f"task.{switch_attribute}={getattr(cfg, switch_attribute)!r} leaves its regularizer off, so these "
                f"options of it have no effect: {named}"
            )


def _from_the_command_line(cfg) -> bool:
    """Whether the task's options are fairseq-train's flags (argparse), not a hydra config's keys.
    fairseq-train's config keeps the architecture's flags as an ``argparse.Namespace`` in its model
    node (every architecture of the attn_reg tasks is registered the legacy way, with flags), in the
    processes it spawns too; fairseq-hydra-train's model node is a config node. A task built from a
    plain namespace (no config around it) counts as the command line's."""
    root = _whole_config(cfg)
    return root is None or isinstance(root.get("model"), argparse.Namespace)


def _normalized(value):
    return value.strip().lower() if isinstance(value, str) else value


def _validate_task_options(cfg):
    """Value checks that need no model; run when the task is set up (before any data is read)."""
    AttendOutConfig.from_namespace(cfg).validate()
    if not 0 <= cfg.attendout_clip_norm < math.inf:  # also refuses nan
        raise ValueError(f"--attendout-clip-norm must be a finite number >= 0, got {cfg.attendout_clip_norm!r}")
    enabled = task_regularizers_on(cfg)
    _refuse_options_of_what_is_off(cfg)
    check_combination(enabled)
    if enabled:
        refuse_unsupported_training(cfg, next(iter(enabled.values())))
    if cfg.attendout:
        check_fairseq_supports_task_state()


def _whole_config(cfg):
    """fairseq-train's whole config, reached from the task's node (fairseq hands tasks ``cfg.task``
    only); None when the task is built from a plain namespace."""
    get_root = getattr(cfg, "_get_root", None)
    return get_root() if callable(get_root) else None


def store_model_args_as_config(cfg, model_args) -> None:
    """Make the checkpoints fairseq-train writes loadable by torch's safe unpickler, plugin or not.

    For an architecture registered the legacy way (``--arch transformer``, ``roberta``, ...)
    fairseq keeps the model's arguments as an ``argparse.Namespace`` in ``cfg.model`` and pickles
    it into every checkpoint, which torch >= 2.6's ``weights_only`` load refuses unless the
    plugin is imported (stock ``fairseq-generate --task translation``, fairseq's
    ``scripts/average_checkpoints.py``). The same arguments as a config node are saved as a
    plain dict, which fairseq reads back exactly as it reads a ``fairseq-hydra-train`` checkpoint.
    Only fairseq-train's own model node is replaced (not a checkpoint's, e.g. in fairseq-generate),
    after the model was built from it.
    """
    root = _whole_config(cfg)
    if root is None or not isinstance(model_args, argparse.Namespace) or root.get("model") is not model_args:
        return
    with open_dict(root):
        root.model = OmegaConf.create(vars(model_args))


def refuse_unsupported_training(cfg, regularizer_option: str) -> None:
    """Training set-ups the regularizers cannot honour, refused when the task is set up."""
    root = _whole_config(cfg)
    if root is None or "distributed_training" not in root:
        return
    if root.distributed_training.get("ddp_backend") == "fully_sharded":
        raise ValueError(
            f"{regularizer_option} does not support --ddp-backend fully_sharded: fairseq shards with fairscale's "
            "FSDP, which is not verified with the regularizers' extra forward passes (it does not run without CUDA, "
            "and fairscale is not a dependency). Use --ddp-backend pytorch_ddp (or legacy_ddp), with "
            "--checkpoint-activations to save memory; to shard parameters, use FSDP2 through the Hugging Face "
            "trainers or the core API (docs/DISTRIBUTED.md)"
        )


class AttnRegTaskMixin:
    """What every attn_reg task adds to its fairseq base task."""

    attn_reg_epoch: int = 1
    attn_reg_controller: RegularizationController = None
    attn_reg_active: Dict[str, object] = {}  # the registry's regularizers this run turns on, by key, running
    attn_reg_attendout: FairseqAttendOut = None
    attn_reg_ad_drop_config = None  # set by an ad_drop criterion: the epoch's phase is logged
    attn_reg_train_batches = None  # this worker's training batches per epoch, once fairseq-train batched them
    attn_reg_plan_checked = False

    def attn_reg_setup(self) -> None:
        """Call at the end of the task's __init__: validates the regularizer options."""
        _validate_task_options(self.cfg)

    # -- subclasses say how AttendOut reads a batch ---------------------------------------
    def attendout_streams(self, sample):
        """The generator's token streams of a batch: {"source": ..., "target": ...}."""
        raise NotImplementedError

    def attendout_heldout_logits(self, model, sample, criterion):
        """(logits or log-probs, target, keep) of a held-out batch for per-sample losses."""
        raise NotImplementedError

    def attendout_generator_vocab(self):
        raise NotImplementedError

    # -- model and criterion --------------------------------------------------------------
    def build_model(self, cfg, *args, **kwargs):  # from_checkpoint exists only in newer fairseq
        model = super().build_model(cfg, *args, **kwargs)
        # One controller per task: fairseq-train builds one model. (fairseq-generate with
        # several checkpoints builds more; they stay idle, so sharing the registry is harmless.)
        if self.attn_reg_controller is None:
            self.attn_reg_controller = RegularizationController()
            install_attention_sites(model, self.attn_reg_controller)
            self._build_task_regularizers(model)
        else:
            install_attention_sites(model, RegularizationController())
        store_model_args_as_config(self.cfg, cfg)
        return model

    def _build_task_regularizers(self, model) -> None:
        cfg = self.cfg
        # Selecting the sites here checks layers and kinds against the model, before training.
        self.attn_reg_active = {}
        for regularizer in planned():
            config = regularizer.config.from_namespace(cfg)
            if config.enabled:
                self.attn_reg_active[regularizer.key] = regularizer.build(config, self.attn_reg_controller)
        if cfg.attendout:
            config = AttendOutConfig.from_namespace(cfg)
            # Unset, the generator covers every sequence the model takes (source and target alike).
            lengths = [n for n in _flat(model.max_positions()) if isinstance(n, int) and n > 0]
            positions = generator_positions(config, max(lengths, default=None))
            self.attn_reg_attendout = FairseqAttendOut(
                dataclasses.replace(config, max_positions=positions),
                cfg.attendout_clip_norm,
                cfg.attendout_valid_subset,
                cfg.attendout_log_file,
                self.attendout_heldout_logits,
                self.attendout_streams,
                self.attendout_generator_vocab(),
                _whole_config(cfg),
            )
            self.attn_reg_attendout.validate_against(self.attn_reg_controller)
            # Tells AttendOut that fairseq loaded the Defender from a checkpoint (begin_training).
            model.register_load_state_dict_post_hook(_note_defender_loaded(self.attn_reg_attendout))

    def build_criterion(self, cfg, *args, **kwargs):
        criterion = super().build_criterion(cfg, *args, **kwargs)
        if not isinstance(criterion, RegularizingCriterion):
            return criterion
        criterion_name = str(getattr(cfg, "_name", None) or type(criterion).__name__)
        refuse_task_regularizers_beside(criterion_name, self, criterion.regularizers)
        if criterion.edits_attention:
            if self.attn_reg_controller is None:
                raise RuntimeError("attn_reg_plugin: the model must be built before the criterion")
            refuse_unsupported_training(self.cfg, f"--criterion {criterion_name}")
            criterion.attach_attention_sites(self.attn_reg_controller)  # validates layers / kinds against the model
        if AD_DROP in criterion.regularizers:
            self.attn_reg_ad_drop_config = criterion.ad_drop_config
        return criterion

    def begin_epoch(self, epoch, model):
        super().begin_epoch(epoch, model)
        self.attn_reg_epoch = epoch
        if not self.attn_reg_plan_checked:  # the first epoch of this process, before its first update
            self.attn_reg_plan_checked = True
            warn_if_idle(logger, self._attn_reg_configs(), _whole_config(self.cfg), self.attn_reg_train_batches)
        if self.attn_reg_ad_drop_config is not None:
            # The phase is in every metric line too (ad_drop_on), but only once an update is logged.
            schedule = self.attn_reg_ad_drop_config.schedule
            phase = "AD-DROP" if ad_drop_epoch(schedule, epoch) else "plain"
            logger.info(f"epoch {epoch}: {phase} (--ad-drop-schedule {schedule})")
        if self.attn_reg_attendout is not None:
            # After fairseq's load_checkpoint: the game resumes from it, whatever the --reset-* flags.
            self.attn_reg_attendout.begin_training(type(self).__name__)
            self.attn_reg_attendout.heldout_dataset(self)

    def _attn_reg_configs(self):
        """The configs of the run's regularizers (at most one; AD-DROP's from the criterion)."""
        regularizers = (self.attn_reg_attendout, *self.attn_reg_active.values())
        configs = [r.config for r in regularizers if r is not None]
        return configs + ([self.attn_reg_ad_drop_config] if self.attn_reg_ad_drop_config is not None else [])

    def get_batch_iterator(self, dataset, *args, **kwargs):
        itr = super().get_batch_iterator(dataset, *args, **kwargs)
        root = _whole_config(self.cfg)
        if root is not None and "dataset" in root and dataset is self.datasets.get(root.dataset.train_subset):
            self.attn_reg_train_batches = len(itr)  # the planned run's updates per epoch
        return itr

    # -- training -------------------------------------------------------------------------
    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        active = running(self.attn_reg_active)
        hooks = planned_hooks(active, update_num)
        # a checkpointed layer (--checkpoint-activations) carries these hooks (and AD-DROP's) to its recompute
        with self.attn_reg_controller.hooks(hooks) as record:
            loss, sample_size, log = super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)
        for regularizer, runner in active:
            # e.g. [dropped, real units] or [skipped, selected layer calls], counted by the kernel as it
            # applied them; tensors, so no host-device sync inside the step (reduce_metrics sums them).
            log.update(_step_log(regularizer, runner, regularizer.counts(record), update_num))
        if self.attn_reg_attendout is not None:
            self._attn_reg_criterion = criterion  # the held-out evaluation in optimizer_step needs it
            log.update(
                self.attn_reg_attendout.train_attacker(sample, model, criterion, optimizer, update_num, ignore_grad)
            )
        return loss, sample_size, log

    def optimizer_step(self, optimizer, model, update_num):
        attendout = self.attn_reg_attendout
        scale_before = attendout.defender_scale(optimizer) if attendout is not None else None
        super().optimizer_step(optimizer, model, update_num)
        if attendout is not None:
            attendout.after_optimizer_step(model, optimizer, self._attn_reg_criterion, self, update_num, scale_before)

    def reduce_metrics(self, logging_outputs, criterion):
        super().reduce_metrics(logging_outputs, criterion)
        reduce_attendout_metrics(logging_outputs)
        reduce_task_regularizer_metrics(logging_outputs)

    # -- checkpoints ----------------------------------------------------------------------
    def get_checkpoint_dict(self):
        state = self.attn_reg_attendout.state_dict() if self.attn_reg_attendout is not None else {}
        return {type(self).__name__: {"attendout": state}} if state else {}

    def set_checkpoint_dict(self, state):
        """fairseq calls it on load only without --reset-dataloader; AttendOut.begin_training covers the rest."""
        if self.attn_reg_attendout is not None and state.get("attendout"):
            self.attn_reg_attendout.load_state_dict(state["attendout"])


def _log_rate(logging_outputs, key: str, part: str, whole: str) -> None:
    """``key`` = sum of ``part`` / sum of ``whole`` over the logs that have them, weighted by ``whole``:
    averaged over an interval or an epoch it is that span's exact fraction (a step that counted
    nothing, e.g. one whose scheduled p is 0, adds no weight)."""
    logs = [log for log in logging_outputs if whole in log]
    if not logs:
        return  # validation, or another regularizer
    total = utils.item(sum(log[whole] for log in logs))
    done = utils.item(sum(log[part] for log in logs))
    metrics.log_scalar(key, done / total if total else 0.0, total, round=4)


def _step_log(regularizer, runner, counts, update: int) -> Dict[str, object]:
    """One step's logging output of a registry regularizer: its two counts (summed into its rate by
    :func:`reduce_task_regularizer_metrics`) and what it logs of the update, with a step count when it
    logs something (fairseq sums the workers' logs key by key)."""
    prefix = regularizer.log_prefix
    log = {f"{prefix}_{name}": count for name, count in zip(regularizer.counted, counts)}
    values = runner.logged(update)
    if values:
        log.update({f"{prefix}_{k}": v for k, v in values.items()})
        log[f"{prefix}_steps"] = 1
    return log


def reduce_task_regularizer_metrics(logging_outputs) -> None:
    """The task-level regularizers' training metrics, per update interval and per epoch as fairseq
    logs every metric (the same keys as the Hugging Face trainers log)."""
    for regularizer in planned():
        prefix, (part, whole) = regularizer.log_prefix, regularizer.counted
        _log_rate(logging_outputs, regularizer.rate_key(), f"{prefix}_{part}", f"{prefix}_{whole}")
        counts = {f"{prefix}_{part}", f"{prefix}_{whole}"}
        steps = [log for log in logging_outputs if f"{prefix}_steps" in log]
        # Divided by the summed step count, not averaged per log: fairseq sums the workers' logs key by key.
        n = utils.item(sum(log[f"{prefix}_steps"] for log in steps)) if steps else 0
        logged = (k for k in (steps[0] if n else ()) if k.startswith(prefix + "_") and k not in counts)
        for key in sorted(k for k in logged if k != f"{prefix}_steps"):
            metrics.log_scalar(key, utils.item(sum(log[key] for log in steps)) / n, n, round=4)


def _flat(value):
    """The numbers of a model's max_positions(): an int, or a tuple of them (source, target)."""
    return [n for item in value for n in _flat(item)] if isinstance(value, (tuple, list)) else [value]


def _note_defender_loaded(attendout: FairseqAttendOut):
    def hook(module, incompatible_keys):
        if not attendout.training_began:  # not the Attacker (a copy of D, hooks included) loading its state
            attendout.defender_loaded = True

    return hook
