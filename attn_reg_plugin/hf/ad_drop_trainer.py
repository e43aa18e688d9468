"""AD-DROP for transformers' Trainer / Seq2SeqTrainer: pass 1 + masks around the Trainer's own loss
(``ADDrop.around_loss``, in core).

The loss is computed exactly as the Trainer always computes it (``super().compute_loss``);
AD-DROP only wraps it in training steps of the epochs the schedule selects.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Tuple

import torch
import transformers

from ..core.kernel.controller import RegularizationController
from ..core.regularizers.ad_drop import ADDrop, AttributionPass
from ..core.regularizers.ad_drop_config import ADDropConfig
from ..core.regularizers.attribution import logit_target, multi_label_target, regression_target, token_loss_target
from ..core.regularizers.attribution_pass import bare_module
from ..core.regularizers.combinations import AD_DROP
from ..core.regularizers.options import named_by_field
from ..core.regularizers.planned_run import IdleRegularizerWarning
from ..core.training.distributed import all_reduce_sum_
from .attention import install_attention_sites
from .combinations import check_trainer_combination, turns_on
from .model_inputs import causal_lm, decoder_input_ids_from_labels
from .notices import SiteReport, warn_if_idle
from .trainer_arguments import model_argument, training_arguments
from .training_configurations import refuse_unsupported, refuse_unsupported_launch


class ADDropTrainerMixin:
    """Shared by :class:`ADDropTrainer` and :class:`ADDropSeq2SeqTrainer`."""

    attn_reg_regularizers = turns_on(AD_DROP, "ad_drop=ADDropConfig")

    def __init__(self, *args, ad_drop: ADDropConfig, **kwargs):
        if not isinstance(ad_drop, ADDropConfig):
            raise TypeError(f"ad_drop must be an ADDropConfig, got {type(ad_drop).__name__}")
        named_by_field(ad_drop).validate()
        check_trainer_combination(self, kwargs)
        model = model_argument("ADDropTrainer", args, kwargs)
        refuse_unsupported("ADDropTrainer", training_arguments(args, kwargs), model=model)
        # Before the Trainer's own setup, so bad layers / kinds fail before anything else happens.
        self.ad_drop_controller = RegularizationController()
        self.ad_drop_sites = install_attention_sites(model, self.ad_drop_controller)
        self.ad_drop = ADDrop(ad_drop, self.ad_drop_controller)
        self._ad_drop_reset()
        self._ad_drop_epoch_index = None  # 0-based epoch of the Trainer's running pass (_run_epoch)
        self._ad_drop_own_loop_epoch = None  # 1-based, from set_ad_drop_epoch (a user's own loop)
        self._ad_drop_own_loop_warned = False
        super().__init__(*args, **kwargs)
        refuse_unsupported_launch("ADDropTrainer", self)  # what accelerate's own config turned on, too
        warn_if_idle(self, ad_drop)  # cross-tuning over one planned epoch never acts
        self.attn_reg_site_report = SiteReport(self.ad_drop_sites, self.ad_drop.sites)

    # -- bookkeeping -----------------------------------------------------------------------
    def _ad_drop_reset(self) -> None:
        self._ad_drop_dropped = 0
        self._ad_drop_droppable = 0
        self._ad_drop_on_steps = 0
        self._ad_drop_steps = 0
        self._ad_drop_skipped = 0

    def ad_drop_current_epoch(self) -> int:
        """1-based epoch of the current step (cross-tuning: AD-DROP on even epochs): the Trainer's running
        pass, else what :meth:`set_ad_drop_epoch` said, else the Trainer's ``state.epoch``."""
        if self._ad_drop_epoch_index is not None:
            return self._ad_drop_epoch_index + 1
        if self._ad_drop_own_loop_epoch is not None:
            return self._ad_drop_own_loop_epoch
        if not self._ad_drop_own_loop_warned and self.ad_drop.config.schedule != "always":
            # Outside Trainer.train() nothing moves state.epoch: every step would count as epoch 1, plain.
            self._ad_drop_own_loop_warned = True
            warnings.warn(
                f'ADDropConfig(schedule="{self.ad_drop.config.schedule}") is plain in odd epochs, and compute_loss '
                "is called outside Trainer.train(), where the epoch stays at state.epoch "
                f"({self.state.epoch or 0:g}, epoch {int((self.state.epoch or 0) + 1e-9) + 1}): in your own loop, "
                "call trainer.set_ad_drop_epoch(epoch) (1-based) at the start of each epoch, or set "
                'ADDropConfig(schedule="always") to use AD-DROP at every step',
                IdleRegularizerWarning,
                stacklevel=3,
            )
        return int((self.state.epoch or 0) + 1e-9) + 1

    def set_ad_drop_epoch(self, epoch: int) -> None:
        """Say which 1-based epoch a loop of your own is in (cross-tuning runs AD-DROP on even epochs);
        ``Trainer.train()`` says it itself."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"set_ad_drop_epoch: epoch must be an integer >= 1 (1-based), got {epoch!r}")
        self._ad_drop_own_loop_epoch = epoch

    def _run_epoch(self, *args, **kwargs):
        # The Trainer's loop hands each pass its 0-based epoch here. state.epoch cannot stand in
        # for it: with an IterableDataset and max_steps it is still the previous pass's value at
        # the first step of a new pass, which would run that step in the previous phase.
        epoch = kwargs.get("epoch")
        self._ad_drop_epoch_index = int(epoch) if epoch is not None else None
        try:
            return super()._run_epoch(*args, **kwargs)
        finally:
            self._ad_drop_epoch_index = None

    # -- targets ---------------------------------------------------------------------------
    def ad_drop_target(self, model, inputs: Dict[str, Any]):
        """``(outputs, labels) -> (F, labels)`` for this batch, see core.attribution."""
        config = model.config
        labels = inputs.get("labels")
        gold_wanted = self.ad_drop.config.labels == "gold"
        regression = getattr(config, "problem_type", None) == "regression" or (
            getattr(config, "num_labels", None) == 1 and not getattr(config, "is_encoder_decoder", False)
        )
        if gold_wanted and labels is None:
            raise ValueError("ADDropConfig.labels='gold' needs `labels` in every training batch")

        def multi_label(logits):
            # As transformers decides it: the config says so, or float labels shaped like the logits.
            return getattr(config, "problem_type", None) == "multi_label_classification" or (
                labels is not None and labels.is_floating_point() and labels.shape == logits.shape
            )

        shifted = causal_lm(model)
        if shifted and labels is not None:
            labels = labels[:, 1:]  # a causal LM's logits at t score token t + 1, as its loss does

        def value(outputs, fixed):
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
            if shifted:
                logits = logits[:, :-1]
            if regression and logits.dim() == 2:
                if labels is None:
                    raise ValueError("AD-DROP on a regression model needs gold `labels` (no pseudo label exists)")
                return regression_target(logits.squeeze(-1), labels)
            gold = labels if gold_wanted else None
            use = fixed if fixed is not None else gold
            if logits.dim() == 2 and multi_label(logits):
                return multi_label_target(logits, use)
            if logits.dim() == 2:
                return logit_target(logits, use)
            if logits.dim() == 3:
                if labels is None:
                    raise ValueError("AD-DROP on a token-level model needs `labels` (-100 marks ignored tokens)")
                keep = labels.ne(-100)
                if use is not None and use is labels:
                    use = labels.masked_fill(~keep, 0)
                return token_loss_target(logits, keep, use)
            raise ValueError(f"AD-DROP: cannot build an attribution target from logits of shape {tuple(logits.shape)}")

        return value

    def ad_drop_gold_labels(self, model, inputs: Dict[str, Any]):
        """The batch's labels as :meth:`ad_drop_target`'s target takes them (a causal LM's shifted by
        one), for ``masked(labels=...)`` under ``labels="gold"``; None under pseudo labels."""
        labels = inputs.get("labels")  # (ad_drop_target refuses a gold batch without them)
        if self.ad_drop.config.labels != "gold" or labels is None:
            return None
        return labels[:, 1:] if causal_lm(model) else labels

    def ad_drop_forward_inputs(self, model, inputs: Dict[str, Any]) -> Dict[str, Any]:
        """The inputs of the attribution pass: no labels (no loss), decoder inputs built from them."""
        fwd = {k: v for k, v in inputs.items() if k not in ("labels", "num_items_in_batch")}
        labels = inputs.get("labels")
        if (
            labels is not None
            and getattr(model.config, "is_encoder_decoder", False)
            and fwd.get("decoder_input_ids") is None
            and fwd.get("decoder_inputs_embeds") is None
        ):
            fwd["decoder_input_ids"] = decoder_input_ids_from_labels(model, labels)
        return fwd

    # -- the step --------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (model.training and torch.is_grad_enabled()):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        self._ad_drop_steps += 1
        with self.ad_drop.around_loss(
            self.ad_drop_current_epoch(), lambda: self._attribution_pass(model, inputs)
        ) as counts:
            result = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if counts["ad_drop_on"]:  # summed over steps with no host sync per step
            self._ad_drop_on_steps += 1
            self._ad_drop_dropped = self._ad_drop_dropped + counts["ad_drop_dropped"].detach()
            self._ad_drop_droppable = self._ad_drop_droppable + counts["ad_drop_droppable"].detach()
            self._ad_drop_skipped = self._ad_drop_skipped + counts["ad_drop_skipped"]
        return result

    def _attribution_pass(self, model, inputs: Dict[str, Any]) -> AttributionPass:
        """Pass 1 of this step. It runs the eager model (torch.compile unwrapped too): it needs
        requires_grad on intermediate outputs, which would break a compiled graph at every layer; the
        masked pass and its backward run compiled."""
        accelerator = getattr(self, "accelerator", None)
        bare = bare_module(
            accelerator.unwrap_model(model, keep_torch_compile=False) if accelerator is not None else model
        )
        target = self.ad_drop_target(bare, inputs)
        fwd_inputs = self.ad_drop_forward_inputs(bare, inputs)
        return AttributionPass(
            lambda: self._attribution_forward(bare, fwd_inputs),
            target,
            bare,
            self.ad_drop_gold_labels(bare, inputs),
            fwd_inputs,  # a step compiled whole then attributes in its graph
        )

    def _attribution_forward(self, bare, inputs: Dict[str, Any]):
        """Pass 1's forward. With a mixed-precision Trainer, accelerate wraps the model's forward in
        the Trainer's autocast, which would override the attribution pass's own precision (fp32:
        autocast off); an explicit precision runs the forward accelerate wrapped (kept in
        ``_original_forward``), with the module's hooks still called."""
        original = bare.__dict__.get("_original_forward")
        if self.ad_drop.config.attribution_precision == "auto" or original is None:
            return bare(**inputs)
        wrapped = bare.__dict__["forward"]
        bare.forward = original
        try:
            return bare(**inputs)
        finally:
            bare.forward = wrapped

    def ad_drop_counts(self) -> Tuple[int, int, int]:
        """Dropped and valid attention positions, and skipped steps, since the last log, summed over all processes.

        The Trainer logs on every process at the same steps (it gathers the loss there too),
        so one all-reduce of two numbers per log keeps the rate that of the whole batch.
        """
        device = self.args.device
        counts = torch.stack(
            [
                torch.as_tensor(self._ad_drop_dropped, device=device),
                torch.as_tensor(self._ad_drop_droppable, device=device),
                torch.as_tensor(self._ad_drop_skipped, device=device),
            ]
        ).long()
        return tuple(all_reduce_sum_(counts).tolist())

    def log(self, logs: Dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._ad_drop_steps:  # a training log
            dropped, valid, skipped = self.ad_drop_counts()
            logs["ad_drop_on"] = round(self._ad_drop_on_steps / self._ad_drop_steps, 4)
            logs["ad_drop_rate"] = round(dropped / valid, 6) if valid else 0.0
            logs["ad_drop_skipped"] = skipped  # non-finite attribution target: trained with the plain loss
            self._ad_drop_reset()
        self.attn_reg_site_report.add_once(logs)
        return super().log(logs, *args, **kwargs)


class ADDropTrainer(ADDropTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with AD-DROP; extra keyword ``ad_drop: ADDropConfig``."""


class ADDropSeq2SeqTrainer(ADDropTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with AD-DROP; extra keyword ``ad_drop: ADDropConfig``."""
