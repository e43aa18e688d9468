"""``--task attn_reg_translation``: fairseq's translation task with its attention routed through the plugin."""

from dataclasses import dataclass, field

import numpy as np
from fairseq import metrics, utils
from fairseq.tasks import register_task
from fairseq.tasks.translation import EVAL_BLEU_ORDER, TranslationConfig, TranslationTask

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

    def reduce_metrics(self, logging_outputs, criterion):
        bleu_logs = [log for log in logging_outputs if "_bleu_sys_len" in log] if self.cfg.eval_bleu else []
        if bleu_logs:
            # Registered before fairseq's own, which it then leaves alone: fairseq registers "bleu"
            # only once some hypothesis has an n-gram, so a validation whose every hypothesis is
            # empty logged no bleu and --best-checkpoint-metric bleu stopped with KeyError: 'bleu'.
            metrics.log_derived("bleu", validation_bleu)
        super().reduce_metrics(logging_outputs, criterion)
        if bleu_logs and not any(
            utils.item(log[f"_bleu_totals_{i}"]) for log in bleu_logs for i in range(EVAL_BLEU_ORDER)
        ):
            # fairseq logs nothing for batches whose hypotheses are all empty: their references'
            # length would be missing from the brevity penalty of the corpus score.
            metrics.log_scalar("_bleu_counts", np.zeros(EVAL_BLEU_ORDER))
            metrics.log_scalar("_bleu_totals", np.zeros(EVAL_BLEU_ORDER))
            for key in ("_bleu_sys_len", "_bleu_ref_len"):
                metrics.log_scalar(key, utils.item(sum(log[key] for log in bleu_logs)))

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


def validation_bleu(meters) -> float:
    """fairseq's --eval-bleu score from the summed n-gram counts (sacrebleu's corpus BLEU of the
    validation set), and 0 when no hypothesis had any n-gram (all empty), as sacrebleu scores them."""
    if "_bleu_totals" not in meters or max(meters["_bleu_totals"].sum) == 0:
        return 0.0
    from sacrebleu.metrics import BLEU

    bleu = BLEU.compute_bleu(
        correct=meters["_bleu_counts"].sum,
        total=meters["_bleu_totals"].sum,
        sys_len=int(meters["_bleu_sys_len"].sum),
        ref_len=int(meters["_bleu_ref_len"].sum),
        smooth_method="exp",
    )
    return round(bleu.score, 2)
