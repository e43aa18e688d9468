"""What every AD-DROP criterion adds to its fairseq base criterion: pass 1 + masks, then the base
criterion's own forward as pass 2 (``ADDrop.around_loss``, in core), and the ``--ad-drop-*`` flags.

Registered criterions, one file each: ``ad_drop_label_smoothed_cross_entropy`` (translation)
and ``ad_drop_sentence_prediction`` (RoBERTa-style classifiers / regressors).

The base criterion (label-smoothed cross-entropy, ...) computes the loss exactly as it always
does; AD-DROP only wraps its forward in training epochs that the schedule selects. In
validation (``model.training`` False, no grad) nothing changes.
"""

import torch
from fairseq import metrics, utils

from ..core.regularizers.ad_drop import ADDrop, AttributionPass
from ..core.regularizers.ad_drop_config import ADDropConfig, ad_drop_epoch
from ..core.regularizers.attribution_pass import bare_module
from ..core.regularizers.combinations import AD_DROP
from .criterion import RegularizingCriterion
from .options import fairseq_options

# The --ad-drop-* flags: ADDropConfig's fields, defaults and help (core.options).
ADDropOptions = fairseq_options("ADDropOptions", [ADDropConfig])


class ADDropCriterionMixin(RegularizingCriterion):
    """Wraps a fairseq criterion's forward in AD-DROP; subclasses define the target."""

    regularizers = (AD_DROP,)
    edits_attention = True

    @classmethod
    def build_criterion(cls, cfg, task):
        """The base criterion, built as fairseq builds it, then AD-DROP from the same cfg's --ad-drop-* fields."""
        criterion = super().build_criterion(cfg, task)
        criterion.init_ad_drop(task, ADDropConfig.from_namespace(cfg))
        return criterion

    def init_ad_drop(self, task, config: ADDropConfig) -> None:
        self.ad_drop_config = config.validate()
        if not hasattr(task, "attn_reg_epoch"):  # fail while building, not at the first AD-DROP step
            raise ValueError(
                f"the ad_drop criterions need an attn_reg task, which routes attention through the plugin "
                f"(--task attn_reg_translation); got {type(task).__name__}"
            )
        self.ad_drop = None
        self.task = task

    def attach_attention_sites(self, controller) -> None:
        self.ad_drop = ADDrop(self.ad_drop_config, controller)

    def configs(self):
        return (self.ad_drop_config,)

    def begin_epoch(self, epoch: int) -> str:
        schedule = self.ad_drop_config.schedule
        phase = "AD-DROP" if ad_drop_epoch(schedule, epoch) else "plain"
        return f"epoch {epoch}: {phase} (--ad-drop-schedule {schedule})"

    def attribution_target(self, model, sample):
        """(net_output, labels) -> (F, labels), see core.attribution."""
        raise NotImplementedError

    def attribution_forward(self, bare_model, sample):
        """Pass 1: the bare model called exactly as the base criterion calls it."""
        return bare_model(**sample["net_input"])

    def gold_labels(self, model, sample):
        """The batch's gold labels as the target takes them (``--ad-drop-labels gold``)."""
        return sample["target"]

    def forward(self, model, sample, reduce=True):
        epoch = getattr(self.task, "attn_reg_epoch", None)
        if not model.training:
            return super().forward(model, sample, reduce)
        if self.ad_drop is None or epoch is None:
            raise RuntimeError(
                "the ad_drop criterions need an attn_reg task (--task attn_reg_translation or "
                "attn_reg_sentence_prediction) that routes attention through the plugin"
            )
        if not torch.is_grad_enabled():
            loss, sample_size, log = super().forward(model, sample, reduce)
            log.update(ad_drop_on=0, ad_drop_steps=1)
            return loss, sample_size, log
        # Counts stay tensors: no host-device sync inside the step (fairseq reduces them later).
        with self.ad_drop.around_loss(epoch, lambda: self.attribution_pass(model, sample)) as counts:
            loss, sample_size, log = super().forward(model, sample, reduce)
        log.update(counts)
        return loss, sample_size, log

    def attribution_pass(self, model, sample) -> AttributionPass:
        """Pass 1 of this step: the bare model called as the base criterion calls it, this criterion's target."""
        bare = bare_module(model)
        gold = self.gold_labels(model, sample) if self.ad_drop_config.labels == "gold" else None
        return AttributionPass(
            lambda: self.attribution_forward(bare, sample), self.attribution_target(model, sample), bare, gold
        )

    @classmethod
    def reduce_ad_drop_metrics(cls, logging_outputs) -> None:
        steps = [log for log in logging_outputs if "ad_drop_on" in log]
        if not steps:
            return  # validation
        # Counts, not per-step flags: in distributed training fairseq sums the workers' logs
        # key by key into one, so ad_drop_on alone would read 2 with two workers.
        n = utils.item(sum(log.get("ad_drop_steps", 1) for log in steps))
        if n == 0:
            return  # only dummy batches (fairseq zeroes their logs)
        on = utils.item(sum(log["ad_drop_on"] for log in steps))
        metrics.log_scalar("ad_drop_on", on / n, n, round=2)
        droppable = utils.item(sum(log.get("ad_drop_droppable", 0) for log in steps))
        dropped = utils.item(sum(log.get("ad_drop_dropped", 0) for log in steps))
        # Weighted by the AD-DROP steps' real positions, so an interval's or an epoch's value is the
        # exact dropped fraction of its AD-DROP steps; a plain step adds no weight (a span with
        # no AD-DROP step logs 0).
        metrics.log_scalar("ad_drop_rate", dropped / droppable if droppable else 0.0, droppable, round=4)
        # Steps of AD-DROP epochs whose attribution target was not finite (half-precision
        # overflow): they trained with the plain loss. A sum over the interval, not a mean.
        skipped = utils.item(sum(log.get("ad_drop_skipped", 0) for log in steps))
        metrics.log_scalar_sum("ad_drop_skipped", skipped)
