"""The fairseq side of a regularizer of its own passes (R-Drop, HiddenCut): its step runs over
:class:`CriterionStep`, label-smoothed cross-entropy per pass, and :class:`OwnPassesCriterion` runs
whichever one a criterion names, logs its declared numbers and validates with the stock loss.

Training: the regularizer's step (``Regularizer.step``, in core); each pass's loss is the label-smoothed
CE summed over the target's real tokens, and a consistency term is summed over the same tokens, so the
whole is divided by one copy's ``ntokens`` (fairseq's ``sample_size``), as R-Drop's official fairseq
code divides it. Validation: one pass, the stock loss, so valid loss is comparable with a plain run's.
"""

from typing import Any, Mapping, Optional

import torch
from fairseq import metrics, utils
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    label_smoothed_nll_loss,
)

from ..core.regularizers.rdrop import concat_with_itself, split_in_two
from ..core.regularizers.registry import by_key
from ..core.regularizers.training_step import Compared, Pass, sum_keys
from .criterion import RegularizingCriterion


class CriterionStep:
    """One training step of a label-smoothed cross-entropy criterion as a regularizer of its own passes
    runs it (:class:`~..core.regularizers.training_step.TrainingStep`): scores are the model's
    log-probabilities, each pass's loss its summed label-smoothed CE (and its NLL, logged)."""

    log_probs = True

    def __init__(self, criterion, model, sample) -> None:
        self.criterion, self.model, self.sample = criterion, model, sample
        self.target = None

    def forward(self, extra: Optional[Mapping[str, Any]] = None) -> Pass:
        if extra:  # fairseq's model takes no such keywords: its passes are steered by hooks
            raise ValueError(f"fairseq's model call takes no keywords {sorted(extra)}")
        return self._pass(self.model(**self.sample["net_input"]))

    def forward_doubled(self):
        out = self.model(**concat_with_itself(self.sample["net_input"]))
        first, second = split_in_two(out[0])  # the decoder's scores; the rest is per-layer extras
        one, two = self._pass((first, *out[1:])), self._pass((second, *out[1:]))
        return one.loss + two.loss, one, two

    def _pass(self, output) -> Pass:
        criterion = self.criterion
        lprobs, self.target = criterion.get_lprobs_and_target(self.model, output, self.sample)
        ce, nll = label_smoothed_nll_loss(lprobs, self.target, criterion.eps, ignore_index=criterion.padding_idx)
        return Pass(ce, output, lprobs, {"nll": nll})

    def compared(self, first: Pass, second: Pass, term: str) -> Compared:
        return Compared(first.scores, second.scores, self.target, self.target.ne(self.criterion.padding_idx))

    def reduced(self, term_sum, positions, pair_loss, compared: Compared):
        return term_sum  # the loss is a sum over the same tokens


class OwnPassesCriterion(RegularizingCriterion, LabelSmoothedCrossEntropyCriterion):
    """Label-smoothed cross-entropy trained with the step of the regularizer ``own_passes`` names (its
    registry key; its config is the criterion's ``<key>_config``); validation is the base criterion
    unchanged. ``own_pass_sites(model)``: what the step needs of the model (HiddenCut's hooks), asked
    at every training step before the passes; ``training_step(model, sample)``: the step's passes (a
    :class:`CriterionStep`; a subclass for a model whose scores are not its output's first element)."""

    own_passes: str = ""
    name: str = ""  # as fairseq registers it, in messages

    def own_pass_sites(self, model):
        return None

    def training_step(self, model, sample) -> CriterionStep:
        return CriterionStep(self, model, sample)

    def forward(self, model, sample, reduce=True):
        if not (model.training and torch.is_grad_enabled()):
            return super().forward(model, sample, reduce)  # validation: one pass, the stock loss
        if not reduce:
            raise ValueError(f"--criterion {self.name} trains with a summed loss (reduce=True)")
        regularizer = by_key(self.own_passes)
        sites = self.own_pass_sites(model)
        config = getattr(self, f"{regularizer.key}_config")
        result = regularizer.step(config, self.training_step(model, sample), sites)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        first, second = result.reported, result.second
        log = {
            "loss": result.loss.data,
            "nll_loss": (first.extra["nll"].data + second.extra["nll"].data) / 2,  # per pass, as a plain run's
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
            **result.sums,
        }
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, first.output, sample)
            log.update(n_correct=utils.item(n_correct.data), total=utils.item(total.data))
        return result.loss, sample_size, log

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        logged = by_key(cls.own_passes).logged
        sums = {key: utils.item(sum(log.get(key, 0) for log in logging_outputs)) for key in sum_keys(logged)}
        means = [number for number in logged if number.denominator is not None]
        if not (all(sums[n.denominator] for n in means) if means else any(sums.values())):
            return  # validation runs one pass (and a dummy batch's log is zeroed)
        for number in logged:
            if number.denominator is None:
                metrics.log_scalar_sum(number.name, sums[number.numerator])
            else:  # a divergence in bits, as fairseq logs loss
                metrics.log_scalar(number.name, number.value(sums, bits=True), sums[number.denominator], round=5)
