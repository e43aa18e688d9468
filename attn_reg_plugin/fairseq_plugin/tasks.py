"""Old import path (until 0.2): each task is in the file named after its registry key."""
from .attn_reg_sentence_prediction import AttnRegSentencePredictionConfig, AttnRegSentencePredictionTask  # noqa: F401
from .attn_reg_task import AttnRegTaskMixin, AttnRegTaskOptions, refuse_unsupported_training  # noqa: F401
from .attn_reg_translation import AttnRegTranslationConfig, AttnRegTranslationTask  # noqa: F401
