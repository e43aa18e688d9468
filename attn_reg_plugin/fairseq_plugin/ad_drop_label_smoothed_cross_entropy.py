"""``--criterion ad_drop_label_smoothed_cross_entropy``: label-smoothed cross-entropy with AD-DROP (translation)."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from ..core.regularizers.attribution import token_loss_target
from .ad_drop_criterion import ADDropCriterionMixin, ADDropOptions


@dataclass
class ADDropLabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig, ADDropOptions):
    pass


@register_criterion("ad_drop_label_smoothed_cross_entropy", dataclass=ADDropLabelSmoothedCrossEntropyConfig)
class ADDropLabelSmoothedCrossEntropyCriterion(ADDropCriterionMixin, LabelSmoothedCrossEntropyCriterion):
    """Label-smoothed cross-entropy trained with AD-DROP; target: negative pseudo-label token loss."""

    def attribution_target(self, model, sample):
        target = sample["target"]
        keep = target.ne(self.padding_idx)
        gold = target if self.ad_drop_config.labels == "gold" else None

        def value(net_output, labels):
            return token_loss_target(net_output[0], keep, labels if labels is not None else gold)

        return value

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        cls.reduce_ad_drop_metrics(logging_outputs)
