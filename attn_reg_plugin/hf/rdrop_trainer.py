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

from typing import Any, Dict, Optional

import torch
import transformers

from ..core.distributed import all_reduce_sum_
from ..core.options import named_by_field, one_regularizer
from ..core.rdrop import RDropConfig, concat_with_itself, rdrop_kl, rdrop_objective, split_in_two
from .model_inputs import causal_lm


def _other_regularizers(trainer) -> list:
    """The plugin's other regularizers mixed into the same trainer class, as their keyword names them."""
    from .ad_drop_trainer import ADDropTrainerMixin
    from .attendout_trainer import AttendOutTrainerMixin
    from .attn_reg_trainer import AttnRegTrainerMixin

    mixins = (
        (ADDropTrainerMixin, AD_DROP),
        (AttendOutTrainerMixin, "attendout=AttendOutConfig"),
        (AttnRegTrainerMixin, "scheduled_dropout= / layerdrop="),
    )
    return [name for mixin, name in mixins if isinstance(trainer, mixin)]


AD_DROP = "ad_drop=ADDropConfig"


def _over_ad_drops_masked_pass(trainer) -> bool:
    """ADDropTrainerMixin's compute_loss runs first and calls this mixin's inside its masked pass."""
    from .ad_drop_trainer import ADDropTrainerMixin

    mro = type(trainer).__mro__
    return mro.index(ADDropTrainerMixin) < mro.index(RDropTrainerMixin)


def _logits(outputs) -> torch.Tensor:
    if isinstance(outputs, dict) and outputs.get("logits") is not None:
        return outputs["logits"]
    raise ValueError("R-Drop needs the model's output `logits` (a ModelOutput with logits)")


class RDropTrainerMixin:
    """Shared by :class:`RDropTrainer` and :class:`RDropSeq2SeqTrainer`."""

    def __init__(self, *args, rdrop: RDropConfig, **kwargs):
        if not isinstance(rdrop, RDropConfig):
            raise TypeError(f"rdrop must be an RDropConfig, got {type(rdrop).__name__}")
        self.rdrop = named_by_field(rdrop).validate()
        others = _other_regularizers(self)
        if AD_DROP in others and _over_ad_drops_masked_pass(self):
            others.remove(AD_DROP)  # the one combination allowed: R-Drop as AD-DROP's masked pass
            if self.rdrop.concat_batch:
                raise ValueError(
                    "R-Drop over AD-DROP does not take rdrop=RDropConfig(concat_batch=True): AD-DROP's attribution "
                    "pass ranks one copy of the batch, so the doubled batch has no attributions for its second half"
                )
        elif AD_DROP in others:
            raise ValueError(
                "R-Drop over AD-DROP needs ADDropTrainerMixin before RDropTrainerMixin in the class's bases, so that "
                "R-Drop's two passes are AD-DROP's masked pass (class T(ADDropTrainerMixin, RDropTrainerMixin, Trainer))"
            )
        one_regularizer(["rdrop=RDropConfig", *others])
        self._rdrop_reset()
        super().__init__(*args, **kwargs)

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
        first, second, keep = self._rdrop_positions_of(model, inputs, *scores)
        kl_sum, positions = rdrop_kl(first, second, keep)
        loss = rdrop_objective(ce_both, kl_sum / self._rdrop_divisor(positions, num_items_in_batch), self.rdrop.alpha)
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

    def _rdrop_positions_of(self, model, inputs: Dict[str, Any], first, second):
        """The two passes' scores at the positions the CE covers, and which of them count (None: all)."""
        labels = inputs.get("labels")
        if first.size(-1) < 2:
            raise ValueError(
                "R-Drop compares the two passes' class distributions, but this model's logits have one "
                "output (a regression head): there is no distribution to compare"
            )
        if first.dim() == 2:
            if labels is not None and labels.is_floating_point() and labels.shape == first.shape:
                raise ValueError(
                    "R-Drop's KL compares softmax distributions; a multi-label model's outputs are "
                    "independent sigmoids: not supported"
                )
            return first, second, None
        if labels is None:
            raise ValueError("R-Drop on a token-level model needs `labels` (-100 marks ignored tokens)")
        if causal_lm(self.accelerator.unwrap_model(model)):
            # a causal LM's logits at t score token t + 1, as its loss does
            first, second, labels = first[:, :-1], second[:, :-1], labels[:, 1:]
        return first, second, labels.ne(-100)

    def _rdrop_divisor(self, positions: torch.Tensor, num_items_in_batch: Optional[Any]):
        """What the Trainer's loss of this model is divided by, so the KL is reduced as the CE is.

        As ``Trainer.compute_loss`` (transformers 5.x): a model that takes ``num_items_in_batch``
        divides its summed loss by it (the accumulated batch's items, all processes' when
        ``average_tokens_across_devices``, which then multiplies the loss by the processes);
        otherwise the loss is this batch's mean."""
        if num_items_in_batch is None or not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            return positions.clamp(min=1)
        scale = 1
        if self.args.average_tokens_across_devices:
            scale = self.accelerator.num_processes // getattr(self, "get_tp_size", lambda: 1)()
        return num_items_in_batch / scale

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
