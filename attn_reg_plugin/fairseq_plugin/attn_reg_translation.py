"""``--task attn_reg_translation``: fairseq's translation task with its attention routed through the plugin."""

import os
from dataclasses import dataclass, field

import numpy as np
from fairseq import metrics, utils
from fairseq.data import data_utils
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

    def load_dataset(self, split, epoch=1, combine=False, task_cfg=None, **kwargs):
        # fairseq-generate and fairseq-validate pass the checkpoint's task config (after loading it)
        if task_cfg is not None:
            refuse_reversed_direction(task_cfg, self.cfg.source_lang, self.cfg.target_lang)
        super().load_dataset(split, epoch=epoch, combine=combine, task_cfg=task_cfg, **kwargs)

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


def trained_direction(task_cfg):
    """(source, target) a checkpoint was trained on: its -s/-t, or when it was trained without them
    the pair its task inferred from its data-bin, read there again if that folder still exists
    (fairseq saves the task options as given); (None, None) when neither can be known."""
    src, tgt = getattr(task_cfg, "source_lang", None), getattr(task_cfg, "target_lang", None)
    if src is None or tgt is None:
        paths = utils.split_paths(getattr(task_cfg, "data", None) or "")
        if paths and os.path.isdir(paths[0]):
            src, tgt = data_utils.infer_language_pair(paths[0])
    return src, tgt


def refuse_reversed_direction(task_cfg, src: str, tgt: str) -> None:
    """A joint data-bin serves both directions, so a checkpoint trained tgt->src decodes a
    src->tgt set up without an error: it translates the other side and is scored against the
    wrong references. Refused before decoding, naming both directions and the flags."""
    trained = trained_direction(task_cfg)
    if trained == (tgt, src) and src != tgt:
        raise ValueError(
            f"the checkpoint was trained {tgt}->{src} (-s {tgt} -t {src}), but this command reads the data "
            f"{src}->{tgt} (its -s/-t, or without them the data-bin's own pair): it would translate the {src} "
            f"side and score it against the {tgt} references. Pass -s {tgt} -t {src} "
            f"(--source-lang/--target-lang) to decode in the direction the model was trained"
        )


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
