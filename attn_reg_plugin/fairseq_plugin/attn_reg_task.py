"""What every attn_reg task adds to its fairseq base task, and the task-level regularizers' flags.

The registered tasks, one file each: ``attn_reg_translation`` and ``attn_reg_sentence_prediction``
are fairseq's ``translation`` and ``sentence_prediction`` tasks plus these duties: after the model is built, every
MultiheadAttention is routed through the core kernel (no new parameters); ``begin_epoch``
records the 1-based epoch that cross-tuning reads; and the regularizers that need no special
criterion run around ``train_step``, each with its flags: every plan regularizer of the registry
(:mod:`..core.regularizers.registry`, the plugin's and any registered outside the package) and every
regularizer of its own passes bound to the task (:mod:`.task_regularizers`: AttendOut's Attacker). The
task loops over them by key (``attn_reg_active``) and names none. Validation and generation are untouched.
"""

import argparse
import contextlib
import dataclasses
import logging
from typing import Dict, Tuple

from fairseq import metrics, utils
from omegaconf import OmegaConf, open_dict

from ..core.kernel.controller import RegularizationController
from ..core.regularizers.combinations import check_combination
from ..core.regularizers.options import attribute_prefix
from ..core.regularizers.registry import PLAN, planned, planned_hooks, running
from .attention import install_attention_sites
from .criterion import RegularizingCriterion
from .options import fairseq_options
from .planned_run import warn_if_idle
from .task_regularizers import TASK_BINDINGS, binding_of, task_regularizers, whole_config

logger = logging.getLogger(__name__)

# Flags of the task's regularizers: the core configs' fields, defaults and help (core.options), after the
# switches and settings that exist only in fairseq (a bound regularizer's, e.g. --attendout).
AttnRegTaskOptions = fairseq_options(
    "AttnRegTaskOptions",
    [regularizer.config for regularizer in task_regularizers()],
    extra=[
        option
        for binding in (binding_of(r) for r in task_regularizers())
        if binding is not None
        for option in (binding.switch, *binding.extra)
    ],
)


def task_regularizers_on(cfg) -> Dict[str, str]:
    """The task's regularizers this run turns on (each plan regularizer's options validated first), each
    with its flag."""
    on = {}
    for regularizer in task_regularizers():
        binding = binding_of(regularizer)
        if binding is not None:
            if binding.on(cfg):
                on[regularizer.name] = binding.flag
            continue
        config = regularizer.config.from_namespace(cfg).validate()
        if config.enabled:
            on[regularizer.name_of(config)] = config.name(regularizer.switch)
    return on


def refuse_task_regularizers_beside(criterion_name: str, task, regularizers: Tuple[str, ...]) -> None:
    """A criterion's ``regularizers`` beside an attn_reg ``task``'s own: refused, both named, unless
    core.combinations says they combine."""
    criterion = dict.fromkeys(regularizers, f"--criterion {criterion_name}")
    check_combination({**criterion, **task_regularizers_on(task.cfg)})


def _refuse_options_of_what_is_off(cfg) -> None:
    """An option of a task regularizer that is off, given another value than its default, would do
    nothing, silently (a forgotten switch trained plain, its layers unchecked): on
    fairseq-train's command line it is refused. A hydra config (fairseq-hydra-train, a recipe) turns a
    regularizer off with one override: its other options there get one warning line naming them."""
    defaults = {f.name: f.default for f in dataclasses.fields(AttnRegTaskOptions)}
    command_line = _from_the_command_line(cfg)
    for regularizer in task_regularizers():
        config_cls, switch, binding = regularizer.config, regularizer.switch, binding_of(regularizer)
        config = config_cls.from_namespace(cfg)
        if binding.on(cfg) if binding is not None else config.enabled:
            continue
        attributes = [attribute_prefix(config_cls) + f.name for f in dataclasses.fields(config_cls) if f.name != switch]
        extra = [option[0] for option in binding.extra] if binding is not None else []
        given = [
            (attribute, getattr(cfg, attribute, defaults[attribute]))
            for attribute in attributes + extra
            if _normalized(getattr(cfg, attribute, defaults[attribute])) != _normalized(defaults[attribute])
        ]
        switch_attribute = binding.switch[0] if binding is not None else attribute_prefix(config_cls) + switch
        if given and command_line:
            (attribute, value), turn_on = given[0], binding.flag if binding is not None else config.name(switch)
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
    root = whole_config(cfg)
    return root is None or isinstance(root.get("model"), argparse.Namespace)


def _normalized(value):
    return value.strip().lower() if isinstance(value, str) else value


def _validate_task_options(cfg):
    """Value checks that need no model; run when the task is set up (before any data is read)."""
    for binding in (binding_of(r) for r in task_regularizers()):
        if binding is not None:
            binding.validate(cfg)
    enabled = task_regularizers_on(cfg)
    _refuse_options_of_what_is_off(cfg)
    check_combination(enabled)
    if enabled:
        refuse_unsupported_training(cfg, next(iter(enabled.values())))


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
    root = whole_config(cfg)
    if root is None or not isinstance(model_args, argparse.Namespace) or root.get("model") is not model_args:
        return
    with open_dict(root):
        root.model = OmegaConf.create(vars(model_args))


def refuse_unsupported_training(cfg, regularizer_option: str) -> None:
    """Training set-ups the regularizers cannot honour, refused when the task is set up."""
    root = whole_config(cfg)
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
    # the task's regularizers this run turns on, by registry key: a plan regularizer's running object, or a
    # bound regularizer's TaskRunner (at most one runs: core.combinations)
    attn_reg_active: Dict[str, object] = {}
    attn_reg_criterion: RegularizingCriterion = None  # the plugin's criterion, when the run trains with one
    attn_reg_train_batches = None  # this worker's training batches per epoch, once fairseq-train batched them
    attn_reg_plan_checked = False

    def attn_reg_setup(self) -> None:
        """Call at the end of the task's __init__: validates the regularizer options."""
        _validate_task_options(self.cfg)

    @property
    def attn_reg_attendout(self):
        """AttendOut's running object (None when off): ``attn_reg_active["attendout"]``."""
        return self.attn_reg_active.get("attendout")

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
        """Building each checks its layers and kinds against the model, before training."""
        self.attn_reg_active = {}
        for regularizer in task_regularizers():
            config, binding = regularizer.config.from_namespace(self.cfg), binding_of(regularizer)
            if binding is None and config.enabled:
                self.attn_reg_active[regularizer.key] = regularizer.build(config, self.attn_reg_controller)
            elif binding is not None and binding.on(self.cfg):
                self.attn_reg_active[regularizer.key] = binding.build(self, model, config)

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
        self.attn_reg_criterion = criterion
        return criterion

    def begin_epoch(self, epoch, model):
        super().begin_epoch(epoch, model)
        self.attn_reg_epoch = epoch
        if not self.attn_reg_plan_checked:  # the first epoch of this process, before its first update
            self.attn_reg_plan_checked = True
            warn_if_idle(logger, self._attn_reg_configs(), whole_config(self.cfg), self.attn_reg_train_batches)
        if self.attn_reg_criterion is not None:
            # e.g. AD-DROP's phase: in every metric line too (ad_drop_on), but only once an update is logged
            line = self.attn_reg_criterion.begin_epoch(epoch)
            if line:
                logger.info(line)
        for runner in self._bound_runners():
            runner.begin_epoch(self, epoch)

    def _bound_items(self):
        """(key, runner) of the running regularizers of their own passes (each a TaskRunner)."""
        return [(r.key, runner) for r, runner in running(self.attn_reg_active) if r.passes != PLAN]

    def _bound_runners(self):
        return [runner for _, runner in self._bound_items()]

    def _attn_reg_configs(self):
        """The configs of the run's regularizers (at most one; a criterion's from the criterion)."""
        configs = [runner.config for runner in self.attn_reg_active.values()]
        return configs + (list(self.attn_reg_criterion.configs()) if self.attn_reg_criterion is not None else [])

    def get_batch_iterator(self, dataset, *args, **kwargs):
        itr = super().get_batch_iterator(dataset, *args, **kwargs)
        root = whole_config(self.cfg)
        if root is not None and "dataset" in root and dataset is self.datasets.get(root.dataset.train_subset):
            self.attn_reg_train_batches = len(itr)  # the planned run's updates per epoch
        return itr

    # -- training -------------------------------------------------------------------------
    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        active = running(self.attn_reg_active)
        plans = [(regularizer, runner) for regularizer, runner in active if regularizer.passes == PLAN]
        hooks = planned_hooks(plans, update_num)
        # a checkpointed layer (--checkpoint-activations) carries these hooks (and AD-DROP's) to its recompute
        with self.attn_reg_controller.hooks(hooks) as record:
            loss, sample_size, log = super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)
        for regularizer, runner in active:
            if regularizer.passes == PLAN:
                # e.g. [dropped, real units] or [skipped, selected layer calls], counted by the kernel as it
                # applied them; tensors, so no host-device sync inside the step (reduce_metrics sums them).
                log.update(_step_log(regularizer, runner, regularizer.counts(record), update_num))
            else:  # its own passes on the same batch (AttendOut's Attacker)
                log.update(runner.after_train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad))
        return loss, sample_size, log

    def optimizer_step(self, optimizer, model, update_num):
        with contextlib.ExitStack() as around:
            for runner in self._bound_runners():
                around.enter_context(runner.around_optimizer_step(self, optimizer, model, update_num))
            super().optimizer_step(optimizer, model, update_num)

    def reduce_metrics(self, logging_outputs, criterion):
        super().reduce_metrics(logging_outputs, criterion)
        for binding in TASK_BINDINGS.values():
            binding.reduce_metrics(logging_outputs)
        reduce_task_regularizer_metrics(logging_outputs)

    # -- checkpoints ----------------------------------------------------------------------
    def get_checkpoint_dict(self):
        """Each bound runner's state under its key (``{"attendout": ...}``), in the task's entry."""
        states = {key: runner.state_dict() for key, runner in self._bound_items()}
        states = {key: state for key, state in states.items() if state}
        return {type(self).__name__: states} if states else {}

    def set_checkpoint_dict(self, state):
        """fairseq calls it on load only without --reset-dataloader; a runner's begin_epoch covers the rest
        (AttendOut.begin_training)."""
        for key, runner in self._bound_items():
            if state.get(key):
                runner.load_state_dict(state[key])


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
