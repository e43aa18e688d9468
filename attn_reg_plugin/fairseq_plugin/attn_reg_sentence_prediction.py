"""``--task attn_reg_sentence_prediction``: fairseq's sentence_prediction with its attention routed through the plugin."""

from dataclasses import dataclass

from fairseq.tasks import register_task
from fairseq.tasks.sentence_prediction import SentencePredictionConfig, SentencePredictionTask

from .attn_reg_task import AttnRegTaskMixin, AttnRegTaskOptions


@dataclass
class AttnRegSentencePredictionConfig(SentencePredictionConfig, AttnRegTaskOptions):
    pass


@register_task("attn_reg_sentence_prediction", dataclass=AttnRegSentencePredictionConfig)
class AttnRegSentencePredictionTask(AttnRegTaskMixin, SentencePredictionTask):
    """fairseq's sentence_prediction task (RoBERTa-style classifiers and regressors) with its
    attention routed through attn_reg_plugin (``encoder.sentence_encoder.layers.N.self_attn``
    become encoder-self sites N)."""

    def __init__(self, cfg, data_dictionary, label_dictionary):
        super().__init__(cfg, data_dictionary, label_dictionary)
        self.attn_reg_setup()

    def attendout_streams(self, sample):
        return {"source": sample["net_input"]["src_tokens"]}

    def attendout_heldout_logits(self, model, sample, criterion):
        logits, _ = model(
            **sample["net_input"], features_only=True, classification_head_name=criterion.classification_head_name
        )
        target = model.get_targets(sample, [logits]).view(-1)
        return logits, target, None  # float targets (--regression-target): squared error

    def attendout_generator_vocab(self):
        return {"source": self.source_dictionary}
