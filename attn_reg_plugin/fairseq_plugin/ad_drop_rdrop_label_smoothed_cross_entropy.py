"""``--criterion ad_drop_rdrop_label_smoothed_cross_entropy``: R-Drop over AD-DROP's masked pass
(translation, ``--task attn_reg_translation``), with both criterions' flags.

Pass 1 ranks the keys once, as ``ad_drop_label_smoothed_cross_entropy``; the masked pass is then
R-Drop's two forwards, both under the step's AD-DROP drops (one seed per pass, so the same keys are
dropped in both), each with its own model dropout, and the loss is R-Drop's objective
(``--rdrop-alpha``). ``--rdrop-concat-batch`` is refused: pass 1 ranked one copy of the batch, so
the doubled batch has no attributions for its second half. Validation: one plain pass.
"""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterionConfig

from ..core.regularizers.combinations import AD_DROP, RDROP
from .ad_drop_criterion import ADDropCriterionMixin, ADDropOptions
from .ad_drop_label_smoothed_cross_entropy import ADDropLabelSmoothedCrossEntropyCriterion
from .rdrop_label_smoothed_cross_entropy import RDropLabelSmoothedCrossEntropyCriterion, RDropOptions

NAME = "ad_drop_rdrop_label_smoothed_cross_entropy"


@dataclass
class ADDropRDropLabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig, ADDropOptions, RDropOptions):
    pass


@register_criterion(NAME, dataclass=ADDropRDropLabelSmoothedCrossEntropyConfig)
class ADDropRDropLabelSmoothedCrossEntropyCriterion(ADDropCriterionMixin, RDropLabelSmoothedCrossEntropyCriterion):
    """AD-DROP's step whose masked pass is R-Drop's two forwards and objective."""

    regularizers = (AD_DROP, RDROP)
    attribution_target = ADDropLabelSmoothedCrossEntropyCriterion.attribution_target

    @classmethod
    def build_criterion(cls, cfg, task):
        criterion = super().build_criterion(cfg, task)
        if criterion.rdrop_config.concat_batch:
            raise ValueError(
                f"--criterion {NAME} does not take --rdrop-concat-batch: AD-DROP's attribution pass ranks one "
                "copy of the batch, so the doubled batch has no attributions for its second half. Leave it out "
                "(two forwards)"
            )
        return criterion

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)  # R-Drop's (and the base criterion's)
        cls.reduce_ad_drop_metrics(logging_outputs)
