"""The Trainer side of a regularizer of its own passes (R-Drop, HiddenCut): its step runs over
:class:`TrainerStep`, the Trainer's own loss per pass, and :class:`OwnPassesTrainerMixin` runs whichever
one a trainer class names, logs its declared numbers and leaves evaluation unchanged.

A pass's loss is what the Trainer computes for the model (its CE, label smoothing included); a
consistency term is summed over the positions the CE covers (every sample of a classifier; each label
that is not -100 of a token-level model, shifted for a causal LM) and divided by what the model's loss
is divided by (those positions in the batch, or, where the Trainer normalizes over the accumulated
batch, ``num_items_in_batch``): :func:`compared_positions`, :func:`loss_divisor`.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional

import torch
import torch.nn.functional as F

from ..core.regularizers.rdrop import concat_with_itself, split_in_two
from ..core.regularizers.registry import Regularizer, by_key
from ..core.regularizers.training_step import Compared, Pass, StepResult, sum_keys
from ..core.training.distributed import all_reduce_sum_
from .model_inputs import causal_lm


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


class TrainerStep:
    """One training step of a transformers Trainer as a regularizer of its own passes runs it
    (:class:`~..core.regularizers.training_step.TrainingStep`): each pass is the Trainer's own
    ``compute_loss`` (``compute_loss``: the one after the mixin in the trainer's bases) on a copy of the
    inputs, whose ``compute_loss`` may pop labels: the caller's inputs are never changed."""

    log_probs = False

    def __init__(self, trainer, model, inputs: Dict[str, Any], num_items_in_batch, compute_loss) -> None:
        self.trainer, self.model, self.inputs = trainer, model, inputs
        self.num_items_in_batch = num_items_in_batch
        self.compute_loss = compute_loss

    def forward(self, extra: Optional[Mapping[str, Any]] = None) -> Pass:
        loss, outputs = self.compute_loss(
            self.model,
            {**self.inputs, **(extra or {})},
            return_outputs=True,
            num_items_in_batch=self.num_items_in_batch,
        )
        return Pass(loss, outputs, _logits(outputs))

    def forward_doubled(self):
        # The doubled batch's loss is the mean of the two halves' (over twice the items): times 2.
        items = None if self.num_items_in_batch is None else 2 * self.num_items_in_batch
        loss, outputs = self.compute_loss(
            self.model, concat_with_itself(self.inputs), return_outputs=True, num_items_in_batch=items
        )
        first, second = split_in_two(_logits(outputs))
        return 2 * loss, Pass(None, outputs, first), Pass(None, outputs, second)

    def compared(self, first: Pass, second: Pass, term: str) -> Compared:
        return Compared(*compared_positions(self.trainer, self.model, self.inputs, first.scores, second.scores, term))

    def reduced(self, term_sum, positions, pair_loss, compared: Compared):
        pair = (compared.first, compared.second)
        divisor = loss_divisor(
            self.trainer, pair_loss, pair, compared.labels, compared.keep, positions, self.num_items_in_batch
        )
        return term_sum / divisor


class OwnPassesTrainerMixin:
    """Runs the step of the regularizer ``own_passes`` names (its registry key; its config is the trainer's
    attribute of that name) in training, the Trainer's loss unchanged in evaluation, and logs the
    regularizer's declared numbers (``Regularizer.logged``) at every training log, over all processes.
    ``own_pass_sites(model, inputs)``: what the framework built for the step (HiddenCut's cut sites);
    ``own_pass_step(model, inputs, num_items_in_batch)``: the step's passes (a :class:`TrainerStep`; a
    subclass for a model whose scores are not its output's ``logits``)."""

    own_passes: str = ""

    def __init__(self, *args, **kwargs):
        self._own_pass_reset()  # before the Trainer's own set-up, which may log
        super().__init__(*args, **kwargs)

    @property
    def own_regularizer(self) -> Regularizer:
        return by_key(self.own_passes)

    def own_pass_sites(self, model, inputs: Dict[str, Any]):
        return None

    def own_pass_step(self, model, inputs: Dict[str, Any], num_items_in_batch) -> TrainerStep:
        return TrainerStep(self, model, inputs, num_items_in_batch, super().compute_loss)

    def _own_pass_reset(self) -> None:
        # summed since the last log; tensors once a step ran, so no host sync per step
        self.own_pass_sums: Dict[str, Any] = dict.fromkeys(sum_keys(self.own_regularizer.logged), 0)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (model.training and torch.is_grad_enabled()):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        regularizer = self.own_regularizer
        step = self.own_pass_step(model, inputs, num_items_in_batch)
        result: StepResult = regularizer.step(getattr(self, regularizer.key), step, self.own_pass_sites(model, inputs))
        for key, value in result.sums.items():
            self.own_pass_sums[key] = self.own_pass_sums[key] + value
        return (result.loss, result.reported.output) if return_outputs else result.loss

    def own_pass_stats(self) -> Dict[str, float]:
        """The regularizer's logged numbers since the last log, over all processes (a divergence in nats)."""
        device = self.args.device
        keys = list(self.own_pass_sums)
        if not keys:
            return {}
        sums = torch.stack([torch.as_tensor(self.own_pass_sums[k], device=device) for k in keys]).double()
        totals = dict(zip(keys, all_reduce_sum_(sums).tolist()))
        return {number.name: number.value(totals, bits=False) for number in self.own_regularizer.logged}

    def log(self, logs: Dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:  # a training log; every process logs at the same steps
            stats = self.own_pass_stats()
            for number in self.own_regularizer.logged:
                value = stats[number.name]
                logs[number.name] = round(value, 6) if number.denominator else int(value)
            self._own_pass_reset()
        return super().log(logs, *args, **kwargs)
