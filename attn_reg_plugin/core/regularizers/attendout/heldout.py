"""Scoring the Defender and the Attacker on held-out samples: per-sample losses and the win rate."""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Tuple

import torch
import torch.nn.functional as F

from ...training.distributed import from_rank0

# (model, batch) -> (logits, target, keep): how an adapter scores one held-out batch
LogitsOf = Callable[[torch.nn.Module, object], Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]


def heldout_indices(n: int, count: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``count`` indices into a held-out set of ``n`` samples (distinct when ``n >= count``), drawn
    with ``generator`` (None: the global stream) and taken from rank 0, so every worker scores the
    same samples. The one way workers agree in the game: the survivor is rank 0's choice too."""
    if n >= count:
        idx = torch.randperm(n, generator=generator)[:count]
    else:
        idx = torch.randint(0, n, (count,), generator=generator)
    return from_rank0(idx)


def per_sample_loss(logits: torch.Tensor, target: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Held-out loss of each sample: cross-entropy (B, C), squared error (B,) / (B, 1) with a
    float target, or mean token cross-entropy (B, T, V) over ``keep`` (B, T)."""
    logits = logits.float()
    if logits.dim() == 3:
        keep = target.ne(-100) if keep is None else keep
        nll = F.cross_entropy(logits.transpose(1, 2), target.long().masked_fill(~keep, 0), reduction="none")
        return (nll * keep).sum(-1) / keep.sum(-1).clamp(min=1)
    if target.is_floating_point():
        return (logits.reshape(target.shape) - target.float()) ** 2
    return F.cross_entropy(logits, target.long(), reduction="none")


def win_probability(defender_losses: torch.Tensor, attacker_losses: torch.Tensor) -> torch.Tensor:
    """The Attacker's win rate on the held-out samples (ties count half; a NaN loss counts as infinite,
    so a network that diverged on a sample loses it)."""
    defender_losses, attacker_losses = (x.masked_fill(x.isnan(), math.inf) for x in (defender_losses, attacker_losses))
    wins = (attacker_losses < defender_losses).float() + 0.5 * (attacker_losses == defender_losses).float()
    return wins.mean()


@torch.no_grad()
def heldout_losses(model: torch.nn.Module, batches: Iterable, logits_of: LogitsOf) -> torch.Tensor:
    """Per-sample held-out losses of ``model`` in eval mode (its mode is restored)."""
    was_training = model.training
    model.eval()
    try:
        return torch.cat([per_sample_loss(*logits_of(model, batch)) for batch in batches])
    finally:
        model.train(was_training)
