"""Old import path (until 0.2): each AD-DROP criterion is in the file named after its registry key."""
from .ad_drop_criterion import ADDropCriterionMixin, ADDropOptions  # noqa: F401
from .ad_drop_label_smoothed_cross_entropy import (  # noqa: F401
    ADDropLabelSmoothedCrossEntropyConfig, ADDropLabelSmoothedCrossEntropyCriterion,
)
from .ad_drop_sentence_prediction import ADDropSentencePredictionConfig, ADDropSentencePredictionCriterion  # noqa: F401
