"""``--task attn_reg_translation``: fairseq's translation task with its attention routed through the plugin."""

from dataclasses import dataclass, field

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from .attn_reg_task import AttnRegTaskMixin, AttnRegTaskOptions


@dataclass
class AttnRegTranslationConfig(TranslationConfig, AttnRegTaskOptions):
    # fairseq's own option name (its audio tasks have it); get_batch_iterator reads it.
    rebuild_batches: bool = field(
        default=False,
        metadata={
            "help": "rebuild the training batches every epoch (equal-length sentences grouped by seed + epoch) "
            "instead of once per process; a run resumed from a checkpoint then sees exactly the batches "
            "of an uninterrupted run"
        },
    )


@register_task("attn_reg_translation", dataclass=AttnRegTranslationConfig)
class AttnRegTranslationTask(AttnRegTaskMixin, TranslationTask):
    """fairseq's translation task with its attention routed through attn_reg_plugin."""

    def __init__(self, cfg, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self.attn_reg_setup()

    def attendout_streams(self, sample):
        net_input = sample["net_input"]
        return {"source": net_input["src_tokens"], "target": net_input["prev_output_tokens"]}

    def attendout_heldout_logits(self, model, sample, criterion):
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        target = sample["target"]
        return lprobs, target, target.ne(self.tgt_dict.pad())

    def attendout_generator_vocab(self):
        if self.src_dict is self.tgt_dict or self.src_dict.symbols == self.tgt_dict.symbols:
            return {"source": self.src_dict, "target": self.src_dict}
        return {"source": self.src_dict, "target": self.tgt_dict}
