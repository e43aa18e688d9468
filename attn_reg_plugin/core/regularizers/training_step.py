"""One training step as a regularizer of its own passes sees it, in any framework.

R-Drop and HiddenCut run the model twice and add a consistency term between the passes. What they
do is science and lives once, here and in their modules (:func:`.rdrop.rdrop_step`,
:func:`.hiddencut.hiddencut_step`); what a pass *is* belongs to the framework: fairseq's criterion
sums a label-smoothed CE over the target's real tokens, transformers' Trainer computes the model's
own loss and divides it by the batch or by ``num_items_in_batch``. A framework hands the step a
:class:`TrainingStep`:

- ``forward(extra)``: one forward with the framework's loss, ``extra`` travelling as keywords of the
  model's call (HiddenCut's ranking and plan in transformers; fairseq's model takes none, its passes
  are steered by hooks);
- ``forward_doubled()``: one forward of the batch concatenated with itself (R-Drop's
  ``concat_batch``): the two halves' losses added, and each half as a pass;
- ``compared(first, second, term)``: the two passes' scores at the positions the loss covers;
- ``reduced(term_sum, positions, pair_loss, compared)``: a term summed over those positions, divided
  as the framework's loss is (fairseq's loss is a sum: unchanged).

A step returns a :class:`StepResult`: the loss to back-propagate, the pass whose output the
framework reports, and the sums it logs (tensors: no host read in the step), which the adapter
reduces by the regularizer's declared :class:`Logged` numbers, the same in both frameworks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Protocol, Tuple

import torch


@dataclass
class Pass:
    """One forward: the framework's loss of it (None for a half of a doubled batch, whose loss the two
    halves share), its output as the framework returns it, and its scores over classes (logits, or
    log-probabilities where the framework's loss takes them: ``TrainingStep.log_probs``)."""

    loss: Optional[torch.Tensor]
    output: Any
    scores: torch.Tensor
    extra: Dict[str, Any] = field(default_factory=dict)  # what the adapter logs of it (fairseq's nll)


@dataclass
class Compared:
    """Two passes' scores at the positions the loss covers; ``labels`` there (None when the batch has
    none) and ``keep``, which of them count (None: all)."""

    first: torch.Tensor
    second: torch.Tensor
    labels: Optional[torch.Tensor] = None
    keep: Optional[torch.Tensor] = None


class TrainingStep(Protocol):
    log_probs: bool

    def forward(self, extra: Optional[Mapping[str, Any]] = None) -> Pass: ...

    def forward_doubled(self) -> Tuple[torch.Tensor, Pass, Pass]: ...

    def compared(self, first: Pass, second: Pass, term: str) -> Compared: ...

    def reduced(
        self, term_sum: torch.Tensor, positions: torch.Tensor, pair_loss: torch.Tensor, compared: Compared
    ) -> torch.Tensor: ...


@dataclass
class StepResult:
    """What a step of its own passes returns: ``loss`` to back-propagate, ``reported`` the pass whose
    output the framework reports (the first), and ``sums``, the counts it logs (tensors or numbers)."""

    loss: torch.Tensor
    reported: Pass
    second: Pass
    sums: Dict[str, Any]


@dataclass(frozen=True)
class Logged:
    """A number a regularizer of its own passes logs, reduced from its steps' ``sums`` over a logging
    interval (and, in fairseq, over the workers): ``numerator / denominator``, a mean per position, or,
    without a denominator, ``numerator`` summed (an integer count). A mean of a ``divergence`` (nats) is
    logged in bits in fairseq, as fairseq logs its loss, and in nats in transformers."""

    name: str
    numerator: str
    denominator: Optional[str] = None
    divergence: bool = True

    def value(self, sums: Mapping[str, float], bits: bool) -> float:
        """The logged value from the interval's summed ``sums`` (``bits``: fairseq's unit)."""
        total = float(sums.get(self.numerator, 0))
        if self.denominator is None:
            return total
        count = float(sums.get(self.denominator, 0))
        if not count:
            return 0.0
        return total / count / (math.log(2) if bits and self.divergence else 1.0)


def sum_keys(logged: Tuple[Logged, ...]) -> Tuple[str, ...]:
    """The ``sums`` keys that ``logged`` reads, each once, in order."""
    keys: list = []
    for number in logged:
        for key in (number.numerator, number.denominator):
            if key is not None and key not in keys:
                keys.append(key)
    return tuple(keys)


def two_passes(step: TrainingStep, doubled: bool) -> Tuple[torch.Tensor, Pass, Pass]:
    """(the two passes' losses added, pass 1, pass 2): two forwards, or one of the batch concatenated
    with itself (its two halves)."""
    if doubled:
        return step.forward_doubled()
    first, second = step.forward(), step.forward()
    return first.loss + second.loss, first, second
