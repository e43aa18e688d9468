"""``--criterion ad_drop_sentence_prediction``: fairseq's sentence_prediction (classifiers, regressors) with AD-DROP."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.sentence_prediction import SentencePredictionConfig, SentencePredictionCriterion

from ..core.regularizers.attribution import logit_target, regression_target
from .ad_drop_criterion import ADDropCriterionMixin, ADDropOptions


@dataclass
class ADDropSentencePredictionConfig(SentencePredictionConfig, ADDropOptions):
    pass


@register_criterion("ad_drop_sentence_prediction", dataclass=ADDropSentencePredictionConfig)
class ADDropSentencePredictionCriterion(ADDropCriterionMixin, SentencePredictionCriterion):
    """sentence_prediction trained with AD-DROP.

    Target: the logit of the pass-1 pseudo label (gold label with ``--ad-drop-labels gold``)
    for classification; minus the squared-error loss against the gold values with
    ``--regression-target`` (a regressor has no pseudo label).
    """

    def attribution_forward(self, bare_model, sample):
        # The same call as SentencePredictionCriterion.forward: encoder features through the
        # classification head, not the LM head.
        return bare_model(
            **sample["net_input"], features_only=True, classification_head_name=self.classification_head_name
        )

    def gold_labels(self, model, sample):
        return model.get_targets(sample, None).view(-1)

    def attribution_target(self, model, sample):
        # Targets as the base criterion reads them (model.get_targets is sample["target"]).
        gold = model.get_targets(sample, None).view(-1)
        if self.regression_target:
            return lambda net_output, labels: regression_target(net_output[0].view(-1), gold.float())
        fixed = gold if self.ad_drop_config.labels == "gold" else None

        def value(net_output, labels):
            return logit_target(net_output[0], labels if labels is not None else fixed)

        return value

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        cls.reduce_ad_drop_metrics(logging_outputs)
