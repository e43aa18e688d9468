"""Scheduled attention dropout, attention LayerDrop and DropHead for transformers' Trainer.

:class:`AttnRegTrainer` / :class:`AttnRegSeq2SeqTrainer` add scheduled Bernoulli attention
dropout (probability a piecewise-linear function of ``state.global_step``), attention
LayerDrop or DropHead to the training forward; evaluation and generation are untouched.

Same semantics as the fairseq task options ``--attn-sched-dropout-*``, ``--attn-layerdrop-*`` and
``--attn-drophead-*``.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import torch
import transformers

from ..core.attention_call import add_counts, zero_counts
from ..core.combinations import ATTENTION_LAYERDROP, DROPHEAD, check_combination
from ..core.controller import RegularizationController
from ..core.drophead import DropHead, DropHeadConfig
from ..core.layerdrop import AttentionLayerDrop, AttentionLayerDropConfig
from ..core.options import named_by_field
from ..core.scheduled_dropout import ScheduledAttentionDropout, ScheduledDropoutConfig
from .attention import install_attention_sites
from .combinations import trainer_regularizers
from .notices import SiteReport, warn_if_idle
from .trainer_arguments import model_argument, training_arguments
from .training_configurations import refuse_unsupported, refuse_unsupported_launch

logger = logging.getLogger(__name__)


class AttnRegTrainerMixin:
    """Scheduled Bernoulli attention dropout, attention LayerDrop or DropHead around the training forward."""

    @staticmethod
    def attn_reg_regularizers(trainer, kwargs: Dict[str, object]) -> Dict[str, str]:
        """What its ``scheduled_dropout`` / ``layerdrop`` / ``drophead`` turn on: from the keywords while a
        mixin before it in the bases still holds them, else from what this mixin built of them."""
        given = {k: kwargs.get(k) for k in ("scheduled_dropout", "layerdrop", "drophead")}
        if all(config is None for config in given.values()):
            built = (getattr(trainer, f"attn_reg_{k}", None) for k in given)  # None before this mixin ran
            given = dict(zip(given, (getattr(r, "config", None) for r in built)))
        scheduled, layerdrop, drophead = given.values()
        on = {}
        if scheduled is not None:
            on[scheduled.regularizer] = f"scheduled_dropout=ScheduledDropoutConfig(schedule={scheduled.schedule!r})"
        if layerdrop is not None and layerdrop.enabled:
            on[ATTENTION_LAYERDROP] = "layerdrop=AttentionLayerDropConfig"
        if drophead is not None:
            on[DROPHEAD] = "drophead=DropHeadConfig"
        return on

    def __init__(
        self,
        *args,
        scheduled_dropout: Optional[ScheduledDropoutConfig] = None,
        layerdrop: Optional[AttentionLayerDropConfig] = None,
        drophead: Optional[DropHeadConfig] = None,
        **kwargs,
    ):
        given = {"scheduled_dropout": scheduled_dropout, "layerdrop": layerdrop, "drophead": drophead}
        kinds = {
            "scheduled_dropout": ScheduledDropoutConfig,
            "layerdrop": AttentionLayerDropConfig,
            "drophead": DropHeadConfig,
        }
        for name, kind in kinds.items():
            if given[name] is not None and not isinstance(given[name], kind):
                raise TypeError(f"{name} must be a {kind.__name__}, got {type(given[name]).__name__}")
        if all(config is None for config in given.values()):
            raise ValueError(
                "AttnRegTrainer needs scheduled_dropout=ScheduledDropoutConfig(...), "
                "layerdrop=AttentionLayerDropConfig(...) or drophead=DropHeadConfig(...)"
            )
        for config in given.values():
            if config is not None:
                named_by_field(config).validate()
        check_combination(trainer_regularizers(self, given))
        model = model_argument("AttnRegTrainer", args, kwargs)
        refuse_unsupported("AttnRegTrainer", training_arguments(args, kwargs), model=model)
        # Before the Trainer's own setup: bad layers / kinds fail first.
        self.attn_reg_controller = RegularizationController()
        found = install_attention_sites(model, self.attn_reg_controller)
        self.attn_reg_scheduled_dropout = (
            ScheduledAttentionDropout(scheduled_dropout, self.attn_reg_controller)
            if scheduled_dropout is not None
            else None
        )
        self.attn_reg_drophead = DropHead(drophead, self.attn_reg_controller) if drophead is not None else None
        self.attn_reg_layerdrop = (
            AttentionLayerDrop(layerdrop, self.attn_reg_controller)
            if self.attn_reg_scheduled_dropout is None and self.attn_reg_drophead is None
            else None
        )
        self._attn_reg_reset()
        super().__init__(*args, **kwargs)
        refuse_unsupported_launch("AttnRegTrainer", self)  # what accelerate's own config turned on, too
        regularizer = self.attn_reg_scheduled_dropout or self.attn_reg_drophead or self.attn_reg_layerdrop
        warn_if_idle(self, regularizer.config)  # a schedule at 0 over the whole run never acts
        self.attn_reg_site_report = SiteReport(found, regularizer.sites)

    def _attn_reg_reset(self) -> None:
        # dropped / valid units, or skipped / selected layer calls, counted by the kernel as it
        # applies them; tensors, so that a compiled model adds to them without a guard on their value
        self._attn_reg_counts: List[Any] = zero_counts()
        self._attn_reg_hooked_steps = 0  # training forwards that had at least one hook set

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (model.training and torch.is_grad_enabled()):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if self.attn_reg_scheduled_dropout is not None:
            # Every micro-batch of an update uses that update's probability.
            hooks = self.attn_reg_scheduled_dropout.hooks(self.state.global_step)
        elif self.attn_reg_drophead is not None:
            hooks = self.attn_reg_drophead.hooks(self.state.global_step)
        else:
            hooks = self.attn_reg_layerdrop.hooks()
        self._attn_reg_hooked_steps += bool(hooks)
        with self.attn_reg_controller.hooks(hooks) as record:
            result = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        counts = record.calls() if self.attn_reg_layerdrop is not None else record.counts()
        self._attn_reg_counts = add_counts(self._attn_reg_counts, counts)
        return result

    def log(self, logs: Dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:  # a training log
            dropped, total = (int(c) for c in self._attn_reg_counts)
            if self._attn_reg_hooked_steps and total == 0:
                logger.warning(
                    "attn_reg: %d training forwards set regularizer hooks, but the attention kernel applied "
                    "none: the model's attention modules did not reach attn_reg_plugin's kernel",
                    self._attn_reg_hooked_steps,
                )
            rate = dropped / total if total else 0.0
            if self.attn_reg_scheduled_dropout is not None:
                logs["attn_sched_dropout_rate"] = round(rate, 6)  # measured over the interval's real units
                last_update = max(self.state.global_step - 1, 0)  # the interval's last update
                for layer, p in self.attn_reg_scheduled_dropout.probabilities(last_update).items():
                    logs[f"attn_sched_dropout_p_layer{layer}"] = round(p, 6)
            elif self.attn_reg_drophead is not None:
                logs["attn_drophead_rate"] = round(rate, 6)  # fraction of (sample, head) outputs dropped
                logs["attn_drophead_p"] = round(
                    self.attn_reg_drophead.probability(max(self.state.global_step - 1, 0)), 6
                )
            else:
                logs["attn_layerdrop_rate"] = round(rate, 6)  # fraction of selected layer passes skipped
            self._attn_reg_reset()
        self.attn_reg_site_report.add_once(logs)
        return super().log(logs, *args, **kwargs)


class AttnRegTrainer(AttnRegTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with ``scheduled_dropout=ScheduledDropoutConfig``,
    ``layerdrop=AttentionLayerDropConfig`` or ``drophead=DropHeadConfig``."""


class AttnRegSeq2SeqTrainer(AttnRegTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with ``scheduled_dropout``, ``layerdrop`` or ``drophead``."""
