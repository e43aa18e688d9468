"""``--criterion rdrop_label_smoothed_cross_entropy``: label-smoothed cross-entropy with R-Drop
(``--rdrop-alpha``, ``--rdrop-concat-batch``), with ``--task translation`` or ``attn_reg_translation``.

Training: two passes (two forwards, or one of a concatenated *copy* of ``net_input``); the loss is
the sum over real target tokens of both passes' label-smoothed CE plus alpha times the symmetric KL
(``core.rdrop``), divided by one copy's ``ntokens``: R-Drop's official fairseq code. Validation: one
pass, the stock loss, so valid loss is comparable with a plain run's.

Why not fairseq's own ``label_smoothed_cross_entropy_with_rdrop``: fairseq 0.12.2 does not have it
(added after it, in 0.12.3); it concatenates ``sample['net_input']`` in place (fairseq#5410) and
runs the doubled batch in validation too, so its valid loss is two passes' CE, twice a plain run's.
"""

import logging
import math
from dataclasses import dataclass

import torch
from fairseq import metrics, utils
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
    label_smoothed_nll_loss,
)

from ..core.regularizers.combinations import RDROP
from ..core.regularizers.rdrop import (
    RDropConfig,
    concat_with_itself,
    no_dropout_warning,
    rdrop_kl,
    rdrop_objective,
    split_in_two,
)
from .criterion import RegularizingCriterion
from .options import fairseq_options

NAME = "rdrop_label_smoothed_cross_entropy"
FAIRSEQ_DROPOUT = "set --dropout (and --attention-dropout, --activation-dropout) above 0"

logger = logging.getLogger(__name__)

# The --rdrop-* flags: RDropConfig's fields, defaults and help (core.options).
RDropOptions = fairseq_options("RDropOptions", [RDropConfig])


@dataclass
class RDropLabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig, RDropOptions):
    pass


@register_criterion(NAME, dataclass=RDropLabelSmoothedCrossEntropyConfig)
class RDropLabelSmoothedCrossEntropyCriterion(RegularizingCriterion, LabelSmoothedCrossEntropyCriterion):
    """Label-smoothed cross-entropy trained with R-Drop; validation is the base criterion unchanged."""

    regularizers = (RDROP,)

    @classmethod
    def build_criterion(cls, cfg, task):
        """The base criterion, built as fairseq builds it, then R-Drop's options from the same cfg (checked here)."""
        criterion = super().build_criterion(cfg, task)
        criterion.rdrop_config = RDropConfig.from_namespace(cfg).validate()
        criterion.criterion_name = str(getattr(cfg, "_name", NAME))  # as the user named it (a subclass's too)
        return criterion

    def forward(self, model, sample, reduce=True):
        if not (model.training and torch.is_grad_enabled()):
            return super().forward(model, sample, reduce)  # validation: one pass, the stock loss
        if not reduce:
            raise ValueError(f"--criterion {NAME} trains with a summed loss (reduce=True)")
        if not getattr(self, "dropout_checked", False):  # once, at the first training step
            self.dropout_checked = True
            message = no_dropout_warning(model, f"--criterion {self.criterion_name}", FAIRSEQ_DROPOUT)
            if message:
                logger.warning(message)
        out_1, out_2 = self.two_passes(model, sample["net_input"])
        lprobs_1, target = self.get_lprobs_and_target(model, out_1, sample)
        lprobs_2, _ = self.get_lprobs_and_target(model, out_2, sample)
        ce_1, nll_1 = label_smoothed_nll_loss(lprobs_1, target, self.eps, ignore_index=self.padding_idx)
        ce_2, nll_2 = label_smoothed_nll_loss(lprobs_2, target, self.eps, ignore_index=self.padding_idx)
        kl, tokens = rdrop_kl(lprobs_1, lprobs_2, target.ne(self.padding_idx), log_probs=True)
        loss = rdrop_objective(ce_1 + ce_2, kl, self.rdrop_config.alpha)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        log = {
            "loss": loss.data,
            "nll_loss": (nll_1.data + nll_2.data) / 2,  # per pass: ppl stays comparable with a plain run
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
            "rdrop_kl_sum": kl.data,
            "rdrop_tokens": tokens,
        }
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, out_1, sample)
            log.update(n_correct=utils.item(n_correct.data), total=utils.item(total.data))
        return loss, sample_size, log

    def two_passes(self, model, net_input):
        """The two passes' net outputs: two forwards, or one of a concatenated copy of ``net_input`` split in halves."""
        if not self.rdrop_config.concat_batch:
            return model(**net_input), model(**net_input)
        out = model(**concat_with_itself(net_input))
        first, second = split_in_two(out[0])  # the decoder's scores; the rest is per-layer extras
        return (first, *out[1:]), (second, *out[1:])

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        tokens = utils.item(sum(log.get("rdrop_tokens", 0) for log in logging_outputs))
        if tokens:  # training only: validation runs one pass
            kl = utils.item(sum(log.get("rdrop_kl_sum", 0) for log in logging_outputs))
            # in bits, as fairseq logs loss: the training loss is (CE1 + CE2) + alpha * rdrop_kl per token
            metrics.log_scalar("rdrop_kl", kl / tokens / math.log(2), tokens, round=5)
