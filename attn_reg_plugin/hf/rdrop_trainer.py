"""R-Drop for transformers' Trainer / Seq2SeqTrainer: the Trainer's own loss on two passes, plus
alpha times the symmetric KL of their output distributions (``core.rdrop``).

    loss = loss(pass 1) + loss(pass 2) + alpha * KL

``loss`` is what the Trainer computes for the model (its CE, label smoothing included), and KL is
the symmetric KL (``(KL(p1||p2) + KL(p2||p1)) / 2``, nats) summed over the same positions the CE
covers (every sample of a classifier; each label that is not -100 of a token-level model, shifted
for a causal LM) and divided by what the model's loss is divided by (those positions in the batch,
or, where the Trainer normalizes over the accumulated batch, ``num_items_in_batch``). Per token it
is R-Drop's official fairseq objective. Evaluation runs one pass, the loss unchanged.

No attention sites are installed: R-Drop works through the model's own dropout, so any model runs.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
import transformers

from ..core.regularizers.combinations import AD_DROP, RDROP, check_combination
from ..core.regularizers.options import named_by_field
from ..core.regularizers.planned_run import IdleRegularizerWarning
from ..core.regularizers.rdrop import (
    RDropConfig,
    concat_with_itself,
    no_dropout_warning,
    rdrop_kl,
    rdrop_objective,
    split_in_two,
)
from ..core.training.distributed import all_reduce_sum_
from .combinations import trainer_regularizers, turns_on
from .model_inputs import causal_lm


def _over_ad_drops_masked_pass(trainer) -> bool:
    """ADDropTrainerMixin's compute_loss runs first and calls this mixin's inside its masked pass."""
    from .ad_drop_trainer import ADDropTrainerMixin

    mro = type(trainer).__mro__
    return mro.index(ADDropTrainerMixin) < mro.index(RDropTrainerMixin)


def refuse_data_parallel(trainer, method: str) -> None:
    """Refuses torch's DataParallel (one process driving several GPUs): the Trainer then hands the loss
    one ``num_items_in_batch`` per GPU and averages per-GPU losses, which a consistency term between two
    passes of the whole batch is not divided like."""
    if trainer.args.n_gpu > 1:
        raise ValueError(
            f"{method} does not support DataParallel (one process with n_gpu={trainer.args.n_gpu} GPUs): launch one "
            "process per GPU (torchrun or accelerate launch), which the Trainer runs as DistributedDataParallel"
        )


def _logits(outputs) -> torch.Tensor:
    if isinstance(outputs, dict) and outputs.get("logits") is not None:
        return outputs["logits"]
    raise ValueError("R-Drop needs the model's output `logits` (a ModelOutput with logits)")


def compared_positions(trainer, model, inputs: Dict[str, Any], first, second, term: str):
    """(first, second, labels, keep): two passes' scores at the positions the CE covers, the labels
    there (None when the batch has none) and which of them count (None: all). ``term`` names the
    consistency term (R-Drop's KL, HiddenCut's JS) in errors."""
    labels = inputs.get("labels")
    if first.size(-1) < 2:
        raise ValueError(
            f"{term} compares the two passes' class distributions, but this model's logits have one "
            "output (a regression head): there is no distribution to compare"
        )
    if first.dim() == 2:
        if labels is not None and labels.is_floating_point() and labels.shape == first.shape:
            raise ValueError(
                f"{term} compares softmax distributions; a multi-label model's outputs are independent sigmoids: "
                "not supported"
            )
        return first, second, labels, None
    if labels is None:
        raise ValueError(f"{term} on a token-level model needs `labels` (-100 marks ignored tokens)")
    if causal_lm(trainer.accelerator.unwrap_model(model)):
        # a causal LM's logits at t score token t + 1, as its loss does
        first, second, labels = first[:, :-1], second[:, :-1], labels[:, 1:]
    return first, second, labels, labels.ne(-100)


def loss_divisor(trainer, pair_loss, pair_scores, labels, keep, positions, num_items_in_batch):
    """What the Trainer's loss of this model is divided by, so a consistency term is reduced as the
    CE is (``pair_loss``: the two passes' losses added; ``positions``: the positions the CE covers).

    As ``Trainer.compute_loss`` (transformers 5.x): without ``num_items_in_batch``, or for a model that
    takes no loss keywords, the loss is this batch's mean. Otherwise transformers hands the model
    ``num_items_in_batch`` (the accumulated batch's items, all processes' when
    ``average_tokens_across_devices``, which then multiplies the loss by the processes), but many
    heads ignore it (BERT's classifiers take their plain mean over the micro-batch): which one this
    model does is read once from its loss (:func:`_divides_by_items`). A ``compute_loss_func`` is
    taken to divide by ``num_items_in_batch``, as transformers takes it (its loss need not be a CE
    to read)."""
    if num_items_in_batch is None or not (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None):
        return positions.clamp(min=1)
    scale = 1
    if trainer.args.average_tokens_across_devices:
        scale = trainer.accelerator.num_processes // getattr(trainer, "get_tp_size", lambda: 1)()
    by_items = trainer.compute_loss_func is not None or _divides_by_items(
        trainer, pair_loss / scale, pair_scores, labels, keep, positions, num_items_in_batch
    )
    return (num_items_in_batch if by_items else positions.clamp(min=1)) / scale


def _divides_by_items(trainer, pair_loss, pair_scores, labels, keep, positions, num_items) -> bool:
    """Whether the model's loss is its summed CE over ``num_items`` rather than over this batch's
    ``positions``: the count nearer (in ratio) to the two passes' CE of their own logits (label
    smoothed as the Trainer's smoother does), summed, over ``pair_loss``. Decided at the first step
    where the counts differ (one host read), then kept; with one micro-batch per update, counted on
    this process alone, they are the same count, and nothing is read. Over several processes each votes and
    the majority decides, the same step everywhere (a tie: by items), so no two disagree."""
    decided = getattr(trainer, "_loss_divides_by_items", None)
    if decided is not None:
        return decided
    args = trainer.args
    # transformers divides the count by the ranks that share a batch (tensor, context, sequence parallel)
    shared = math.prod(getattr(trainer, f"get_{kind}_size", lambda: 1)() for kind in ("tp", "cp", "sp"))
    local = args.world_size == 1 or (not args.average_tokens_across_devices and shared == 1)
    if args.gradient_accumulation_steps == 1 and local:
        return True  # num_items_in_batch counts this very batch's positions (transformers counts them alike)
    vote = _divisor_vote(trainer, pair_loss, pair_scores, labels, keep, positions, num_items)
    votes = torch.tensor([vote is True, vote is False], dtype=torch.long, device=pair_loss.device)
    by_items, by_batch = all_reduce_sum_(votes).tolist()  # every process reaches this step's read
    if by_items == by_batch == 0:
        return True  # nothing to read this step: transformers' own assumption
    trainer._loss_divides_by_items = by_items >= by_batch
    return trainer._loss_divides_by_items


def _divisor_vote(trainer, pair_loss, pair_scores, labels, keep, positions, num_items) -> Optional[bool]:
    """This process's reading of :func:`_divides_by_items` from its batch; None where it cannot tell."""
    items, batch = float(num_items), float(positions.clamp(min=1))
    loss = float(pair_loss.detach())
    if labels is None or items == batch or not math.isfinite(loss) or loss <= 0:
        return None
    smoothing = trainer.args.label_smoothing_factor if trainer.label_smoother is not None else 0.0
    ce_sum = sum(
        F.cross_entropy(
            (s if keep is None else s[keep]).detach().float(),
            labels if keep is None else labels[keep],
            reduction="sum",
            label_smoothing=smoothing,
        )
        for s in pair_scores
    )
    implied = float(ce_sum) / loss
    if not math.isfinite(implied) or implied <= 0:
        return None
    return abs(math.log(implied / items)) <= abs(math.log(implied / batch))


class RDropTrainerMixin:
    """Shared by :class:`RDropTrainer` and :class:`RDropSeq2SeqTrainer`."""

    attn_reg_regularizers = turns_on(RDROP, "rdrop=RDropConfig")

    def __init__(self, *args, rdrop: RDropConfig, **kwargs):
        if not isinstance(rdrop, RDropConfig):
            raise TypeError(f"rdrop must be an RDropConfig, got {type(rdrop).__name__}")
        self.rdrop = named_by_field(rdrop).validate()
        others = trainer_regularizers(self, kwargs)
        if AD_DROP in others and _over_ad_drops_masked_pass(self):
            # R-Drop as AD-DROP's masked pass (core.combinations), in its one order of the bases
            if self.rdrop.concat_batch:
                raise ValueError(
                    "R-Drop over AD-DROP does not take rdrop=RDropConfig(concat_batch=True): AD-DROP's attribution "
                    "pass ranks one copy of the batch, so the doubled batch has no attributions for its second half"
                )
        elif AD_DROP in others and len(others) == 2:
            raise ValueError(
                "R-Drop over AD-DROP needs ADDropTrainerMixin before RDropTrainerMixin in the class's bases, so that "
                "R-Drop's two passes are AD-DROP's masked pass (class T(ADDropTrainerMixin, RDropTrainerMixin, Trainer))"
            )
        check_combination(others)
        self._rdrop_reset()
        super().__init__(*args, **kwargs)
        refuse_data_parallel(self, "R-Drop")
        message = no_dropout_warning(
            self.model, "rdrop=RDropConfig", "set the config's dropout probabilities (hidden, attention) above 0"
        )
        if message:
            warnings.warn(message, IdleRegularizerWarning, stacklevel=2)

    def _rdrop_reset(self) -> None:
        # summed symmetric KL and its positions since the last log; tensors, so no host sync per step
        self._rdrop_kl_sum: Any = 0.0
        self._rdrop_positions: Any = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (model.training and torch.is_grad_enabled()):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        ce_both, outputs, scores = self._rdrop_passes(model, inputs, num_items_in_batch)
        first, second, labels, keep = compared_positions(self, model, inputs, *scores, "R-Drop's KL")
        kl_sum, positions = rdrop_kl(first, second, keep)
        divisor = loss_divisor(self, ce_both, (first, second), labels, keep, positions, num_items_in_batch)
        loss = rdrop_objective(ce_both, kl_sum / divisor, self.rdrop.alpha)
        self._rdrop_kl_sum = self._rdrop_kl_sum + kl_sum.detach()
        self._rdrop_positions = self._rdrop_positions + positions
        return (loss, outputs) if return_outputs else loss

    def _rdrop_passes(self, model, inputs: Dict[str, Any], num_items_in_batch):
        """(loss(pass 1) + loss(pass 2), an output, (pass 1's logits, pass 2's logits)), each loss
        the Trainer's own. Its compute_loss may pop labels from the dict it is given (label smoothing),
        so it gets copies: the caller's inputs are never changed."""
        if self.rdrop.concat_batch:
            # The doubled batch's loss is the mean of the two passes' (over twice the items): times 2.
            doubled_items = None if num_items_in_batch is None else 2 * num_items_in_batch
            loss, outputs = super().compute_loss(
                model, concat_with_itself(inputs), return_outputs=True, num_items_in_batch=doubled_items
            )
            return 2 * loss, outputs, split_in_two(_logits(outputs))
        loss_1, out_1 = super().compute_loss(
            model, dict(inputs), return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        loss_2, out_2 = super().compute_loss(
            model, dict(inputs), return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        return loss_1 + loss_2, out_1, (_logits(out_1), _logits(out_2))

    def rdrop_kl(self) -> float:
        """The mean symmetric KL per position (nats) since the last log, over all processes."""
        device = self.args.device
        counts = torch.stack(
            [torch.as_tensor(self._rdrop_kl_sum, device=device), torch.as_tensor(self._rdrop_positions, device=device)]
        ).double()
        kl, positions = all_reduce_sum_(counts).tolist()
        return kl / positions if positions else 0.0

    def log(self, logs: Dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:  # a training log; every process logs at the same steps
            logs["rdrop_kl"] = round(self.rdrop_kl(), 6)
            self._rdrop_reset()
        return super().log(logs, *args, **kwargs)


class RDropTrainer(RDropTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with R-Drop; extra keyword ``rdrop: RDropConfig``."""


class RDropSeq2SeqTrainer(RDropTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with R-Drop; extra keyword ``rdrop: RDropConfig``."""
