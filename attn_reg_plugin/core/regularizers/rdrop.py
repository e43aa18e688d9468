"""R-Drop (Liang, Wu et al. 2021, dropreg/R-Drop): two forward passes of the same batch, each with its own
dropout draws, trained to agree.

The objective, exactly as R-Drop's official fairseq code (and fairseq's later
``label_smoothed_cross_entropy_with_rdrop``) computes it::

    loss = CE(pass 1) + CE(pass 2) + alpha * sum over real tokens t of (KL(p1_t || p2_t) + KL(p2_t || p1_t)) / 2

with each CE summed over the same real (non-pad, not ignored) tokens, and the whole divided by
the number of real tokens of *one* copy of the batch (fairseq's ``sample_size``). So, per token:
the two passes' CE *added* (not averaged) plus alpha times the mean symmetric KL (the two
directions averaged). The paper's MT alpha is 5 (its IWSLT'14 De-En script). Both the KL and its
gradient flow through both passes (no stop-gradient), as in the official code.

A framework adapter supplies the two passes' scores and the CE it already computes;
this module states the formula once: :func:`symmetric_kl`, :func:`rdrop_kl`,
:func:`rdrop_objective`, and the concatenated batch (:func:`concat_with_itself`,
:func:`split_in_two`), which is a copy: the caller's batch is never changed (fairseq#5410).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .combinations import RDROP
from .options import RegularizerOptions, option
from .registry import OWN_PASSES, Method, Regularizer, register
from .training_step import Logged, StepResult, TrainingStep, two_passes


@dataclass
class RDropConfig(RegularizerOptions):
    """R-Drop's options; the fairseq flags are these names prefixed with ``--rdrop-``."""

    FLAG_PREFIX = "--rdrop-"

    alpha: float = option(
        5.0,
        "weight of the consistency term: loss per token = CE(pass 1) + CE(pass 2) + alpha * mean over real "
        "tokens of (KL(p1||p2) + KL(p2||p1)) / 2, as R-Drop's official fairseq code (the paper's MT alpha "
        "is 5; 0 = two passes, no KL)",
        "finite number >= 0",
    )
    concat_batch: bool = option(
        False,
        "one forward of the batch concatenated with itself (the official code's mode; a copy, the caller's "
        "batch is not changed) instead of two forwards",
        "flag (fairseq) / True or False (Python)",
    )

    def validate(self) -> RDropConfig:
        """Check every option; the error names the option as the user spelled it (core.options.option_name)."""
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < math.inf:
            raise ValueError(f"{self.name('alpha')} must be a finite number >= 0, got {alpha!r}")
        if not isinstance(self.concat_batch, bool):
            raise ValueError(f"{self.name('concat_batch')} must be True or False, got {self.concat_batch!r}")
        return self


REGULARIZER = register(
    Regularizer(
        "rdrop",
        RDROP,
        RDropConfig,
        "",
        None,
        "rdrop",
        passes=OWN_PASSES,
        step=lambda config, step, sites: rdrop_step(config, step),
        logged=(Logged("rdrop_kl", "rdrop_kl_sum", "rdrop_tokens"),),
        methods=(
            Method(
                "r-drop",
                "R-Drop (two passes + alpha * symmetric KL); classifiers alpha 1, translation alpha 5 (its MT alpha)",
                {"alpha": 1.0},
                mt_defaults=(("--rdrop-alpha", "5"),),
                fairseq_criterion="rdrop_label_smoothed_cross_entropy",
                trainer="RDropTrainer",
            ),
        ),
    )
)


def model_dropout(model: torch.nn.Module) -> dict:
    """Where ``model`` drops something at random in training, {where: probability > 0}: modules named
    for a drop with a probability ``p`` (torch's Dropout, fairseq's FairseqDropout and
    LayerDropModuleList) and float attributes named for one (transformers' ``attention_dropout``,
    BART's ``self.dropout``, BERT's ``dropout_prob``, ``layerdrop``, ConvNeXt's ``drop_prob``). A
    drop stored under another name is not seen: the warning this feeds may then be wrong."""
    found = {}
    for name, module in model.named_modules():
        p = getattr(module, "p", None)
        if "drop" in type(module).__name__.lower() and isinstance(p, float) and p > 0:
            found[name or type(module).__name__] = p
        for attribute, value in vars(module).items():
            if "drop" in attribute.lower() and isinstance(value, float) and value > 0:
                found[f"{name}.{attribute}" if name else attribute] = value
    return found


def no_dropout_warning(model: torch.nn.Module, method: str, how_to_add: str) -> Optional[str]:
    """The warning for a two-pass method (R-Drop) on a model without any dropout, else None: its
    passes are then identical, so the consistency term is 0 at every step, at twice the cost."""
    if model_dropout(model):
        return None
    return (
        f"{method}: {type(model).__name__} has no dropout anywhere (every dropout, LayerDrop or drop-path "
        "probability is 0), so the two "
        f"passes are identical: the KL is 0 at every step and each step costs two passes. R-Drop needs the "
        f"model's dropout: {how_to_add}"
    )


def symmetric_kl(scores_1: torch.Tensor, scores_2: torch.Tensor, log_probs: bool = False) -> torch.Tensor:
    """(KL(p1 || p2) + KL(p2 || p1)) / 2 per position, over the last dimension (nats).

    ``scores``: logits (softmax taken here, in float32 at least), or, with ``log_probs``, the
    log-probabilities a model already normalized (fairseq's ``get_normalized_probs``).
    ``KL(p1||p2) + KL(p2||p1) = sum (p1 - p2)(log p1 - log p2)``: one product, and both directions'
    gradients reach both passes.
    """
    dtype = torch.promote_types(scores_1.dtype, torch.float32)
    lp1, lp2 = scores_1.to(dtype), scores_2.to(dtype)
    if not log_probs:
        lp1, lp2 = F.log_softmax(lp1, dim=-1), F.log_softmax(lp2, dim=-1)
    # A class impossible in both passes (-inf, e.g. a vocabulary entry masked out) adds 0, not
    # 0 * (-inf - -inf) = NaN; torch.where also keeps NaN out of the gradient.
    both_impossible = (lp1 == -math.inf) & (lp2 == -math.inf)
    log_ratio = torch.where(both_impossible, 0.0, lp1 - lp2)
    return 0.5 * ((lp1.exp() - lp2.exp()) * log_ratio).sum(-1)


def rdrop_kl(
    scores_1: torch.Tensor, scores_2: torch.Tensor, keep: Optional[torch.Tensor] = None, log_probs: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The symmetric KL summed over the positions ``keep`` marks (all when None), and their number.

    ``scores``: (..., classes), as :func:`symmetric_kl` takes them; ``keep``: bool, the scores' shape
    without the last dimension (a target that is not padding, a label that is not -100). Both stay
    tensors (no host sync).
    """
    kl = symmetric_kl(scores_1, scores_2, log_probs)
    if keep is None:
        return kl.sum(), torch.tensor(kl.numel(), device=kl.device)
    return kl.masked_fill(~keep, 0.0).sum(), keep.sum()


def rdrop_objective(ce_both: torch.Tensor, kl: torch.Tensor, alpha: float) -> torch.Tensor:
    """R-Drop's loss: ``ce_both`` (the two passes' CE *added*) plus alpha times the symmetric KL,
    both reduced alike (summed over the real tokens in fairseq, divided by what the model's own loss
    is divided by in the Hugging Face trainers)."""
    return ce_both + alpha * kl


def rdrop_step(config: RDropConfig, step: TrainingStep) -> StepResult:
    """R-Drop's training step over a framework's :class:`~.training_step.TrainingStep`: two passes (two
    forwards, or one of the doubled batch), their symmetric KL at the positions the loss covers, reduced
    as the loss is, and the objective. Logs the KL's sum and its positions."""
    pair_loss, first, second = two_passes(step, config.concat_batch)
    compared = step.compared(first, second, "R-Drop's KL")
    kl_sum, positions = rdrop_kl(compared.first, compared.second, compared.keep, log_probs=step.log_probs)
    loss = rdrop_objective(pair_loss, step.reduced(kl_sum, positions, pair_loss, compared), config.alpha)
    return StepResult(loss, first, second, {"rdrop_kl_sum": kl_sum.detach(), "rdrop_tokens": positions})


def concat_with_itself(batch: Any) -> Any:
    """A copy of ``batch`` (a tensor, or dicts / lists / tuples of them) with every tensor of at least
    one dimension concatenated with itself along dimension 0; other values are shared, not copied.
    Nothing of ``batch`` is changed (fairseq's criterion concatenated ``sample['net_input']`` in place,
    fairseq#5410)."""
    if isinstance(batch, torch.Tensor):
        return torch.cat([batch, batch]) if batch.dim() > 0 else batch
    if isinstance(batch, dict):
        return type(batch)({k: concat_with_itself(v) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(concat_with_itself(v) for v in batch)
    return batch


def split_in_two(tensor: torch.Tensor) -> Sequence[torch.Tensor]:
    """The two passes' halves of an output of :func:`concat_with_itself`'s batch (dimension 0)."""
    if tensor.size(0) % 2:
        raise ValueError(f"R-Drop: an output of the concatenated batch has {tensor.size(0)} rows, not an even number")
    return tensor.chunk(2, dim=0)
