"""The registry's regularizers (:mod:`..core.regularizers.registry`) for transformers' Trainer.

:class:`AttnRegTrainer` / :class:`AttnRegSeq2SeqTrainer` take each registered regularizer's config by its
key: ``scheduled_dropout=ScheduledDropoutConfig``, ``layerdrop=AttentionLayerDropConfig``,
and every other regularizer registered, the plugin's or one outside the package. Its plan edits the training forward
at ``state.global_step``; evaluation and generation are untouched. Same semantics and log keys as the
fairseq task's flags.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List

import torch
import transformers

from ..core.kernel.attention_call import add_counts, zero_counts
from ..core.kernel.controller import RegularizationController
from ..core.regularizers.combinations import check_combination
from ..core.regularizers.options import named_by_field
from ..core.regularizers.registry import PLAN, planned, planned_hooks, registered, running
from .attention import install_attention_sites
from .combinations import trainer_regularizers
from .methods import trainer_path
from .notices import SiteReport, warn_if_idle
from .trainer_arguments import model_argument, training_arguments
from .training_configurations import refuse_unsupported, refuse_unsupported_launch

logger = logging.getLogger(__name__)


def _spelled(regularizer, config) -> str:
    """How the user turned ``regularizer`` on, for a refusal: its keyword and config, and the switch's value
    where that decides which regularizer it is (DropKey's ``dropkey:RATE`` schedule)."""
    switch = f"({regularizer.switch}={getattr(config, regularizer.switch)!r})" if regularizer.variants else ""
    return f"{regularizer.key}={type(config).__name__}{switch}"


def _refuse_own_passes_keywords(trainer, kwargs: Dict[str, object]) -> None:
    """A keyword of a regularizer of its own passes (``ad_drop=``) that no mixin of this class takes: its
    Trainer is named (it would reach transformers' Trainer as an unknown keyword, or read as none given)."""
    mixed = trainer_regularizers(trainer, kwargs)
    for regularizer in registered():
        if regularizer.passes != PLAN and regularizer.key in kwargs and regularizer.name not in mixed:
            trainers = ", ".join(".".join(trainer_path(m.trainer)) for m in regularizer.methods) or "its own Trainer"
            raise TypeError(
                f"AttnRegTrainer runs the plan regularizers only; {regularizer.key}={regularizer.config.__name__} "
                f"is {regularizer.name}, which runs passes of its own: train it with {trainers}"
            )


class AttnRegTrainerMixin:
    """The registry's regularizers around the training forward (one per run: core.combinations)."""

    @staticmethod
    def attn_reg_regularizers(trainer, kwargs: Dict[str, object]) -> Dict[str, str]:
        """What its regularizer keywords turn on: from the keywords while a mixin before it in the bases
        still holds them, else from what this mixin built of them."""
        given = {r.key: kwargs.get(r.key) for r in planned()}
        if all(config is None for config in given.values()):
            active = getattr(trainer, "attn_reg_active", {})  # empty before this mixin ran
            given = {key: runner.config for key, runner in active.items()}
        on = {}
        for regularizer in planned():
            config = given.get(regularizer.key)
            if config is not None:  # one that is off is refused by its regularizer, naming its switch
                on[regularizer.name_of(config)] = _spelled(regularizer, config)
        return on

    def __init__(self, *args, **kwargs):
        given = {r.key: kwargs.pop(r.key, None) for r in planned()}
        for regularizer in planned():
            config = given[regularizer.key]
            if config is not None and not isinstance(config, regularizer.config):
                raise TypeError(
                    f"{regularizer.key} must be a {regularizer.config.__name__}, got {type(config).__name__}"
                )
        _refuse_own_passes_keywords(self, kwargs)
        if all(config is None for config in given.values()):
            keywords = [f"{r.key}={r.config.__name__}(...)" for r in planned()]
            raise ValueError(f"AttnRegTrainer needs {', '.join(keywords[:-1])} or {keywords[-1]}")
        for config in given.values():
            if config is not None:
                named_by_field(config).validate()
        check_combination(trainer_regularizers(self, given))
        model = model_argument("AttnRegTrainer", args, kwargs)
        refuse_unsupported("AttnRegTrainer", training_arguments(args, kwargs), model=model)
        # Before the Trainer's own setup: bad layers / kinds fail first.
        self.attn_reg_controller = RegularizationController()
        found = install_attention_sites(model, self.attn_reg_controller)
        # A config that is off is refused by its regularizer, naming its switch: nothing given is ignored.
        self.attn_reg_active = {
            regularizer.key: regularizer.build(given[regularizer.key], self.attn_reg_controller)
            for regularizer in planned()
            if given[regularizer.key] is not None
        }
        self._attn_reg_reset()
        super().__init__(*args, **kwargs)
        refuse_unsupported_launch("AttnRegTrainer", self)  # what accelerate's own config turned on, too
        for runner in self.attn_reg_active.values():
            warn_if_idle(self, runner.config)  # a schedule at 0 over the whole run never acts
        sites = [site for runner in self.attn_reg_active.values() for site in runner.sites]
        self.attn_reg_site_report = SiteReport(found, sites)

    def _attn_reg_reset(self) -> None:
        # done / of units (or layer calls) per regularizer, counted by the kernel as it applies them;
        # tensors, so that a compiled model adds to them without a guard on their value
        self._attn_reg_counts: Dict[str, List[Any]] = {key: zero_counts() for key in self.attn_reg_active}
        self._attn_reg_hooked_steps = 0  # training forwards that had at least one hook set

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (model.training and torch.is_grad_enabled()):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        active = running(self.attn_reg_active)
        hooks = planned_hooks(active, self.state.global_step)  # every micro-batch of an update: its plan
        self._attn_reg_hooked_steps += bool(hooks)
        with self.attn_reg_controller.hooks(hooks) as record:
            result = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        for regularizer, _ in active:
            counts = regularizer.counts(record)
            self._attn_reg_counts[regularizer.key] = add_counts(self._attn_reg_counts[regularizer.key], counts)
        return result

    def log(self, logs: Dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:  # a training log
            last_update = max(self.state.global_step - 1, 0)  # the interval's last update
            for regularizer, runner in running(self.attn_reg_active):
                done, total = (int(c) for c in self._attn_reg_counts[regularizer.key])
                if self._attn_reg_hooked_steps and total == 0:
                    logger.warning(
                        "attn_reg: %d training forwards set regularizer hooks, but the attention kernel applied "
                        "none: the model's attention modules did not reach attn_reg_plugin's kernel",
                        self._attn_reg_hooked_steps,
                    )
                # measured over the interval's real units (or layer calls), then what it logs of the update
                logs[regularizer.rate_key()] = round(done / total if total else 0.0, 6)
                for name, value in runner.logged(last_update).items():
                    logs[f"{regularizer.log_prefix}_{name}"] = round(value, 6)
            self._attn_reg_reset()
        self.attn_reg_site_report.add_once(logs)
        return super().log(logs, *args, **kwargs)


class AttnRegTrainer(AttnRegTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with one of the registry's regularizers: ``scheduled_dropout=ScheduledDropoutConfig``,
    ``layerdrop=AttentionLayerDropConfig``, or any other registered one, by its key."""


class AttnRegSeq2SeqTrainer(AttnRegTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with one of the registry's regularizers."""
