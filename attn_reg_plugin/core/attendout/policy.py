"""The Generator's policy: Gumbel-max sampling of drop actions and the REINFORCE loss (Eq. 5)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def gumbel_drops(logits: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Gumbel-max over {keep: 0, drop: logit}: True (drop) with probability sigmoid(logit)."""
    u = torch.rand((2,) + tuple(logits.shape), generator=generator, device=logits.device, dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    exponential = (-torch.log(u.clamp(min=tiny))).clamp(min=tiny)  # -log u > 0, kept off 0
    gumbel = -torch.log(exponential)
    return logits.float() + gumbel[0] > gumbel[1]


def drop_log_prob(logits: torch.Tensor, drops: torch.Tensor) -> torch.Tensor:
    """log P(action) per unit: log sigmoid(l) where dropped, log sigmoid(-l) where kept."""
    logits = logits.float()
    return torch.where(drops, F.logsigmoid(logits), F.logsigmoid(-logits))


def reinforce_loss(log_probs: torch.Tensor, rewards: torch.Tensor, baseline: float) -> torch.Tensor:
    """Minus Eq. 5's objective: its gradient is -(1/T) sum_t (r_t - b) grad log P(a_t)."""
    advantage = (rewards.float() - baseline).to(log_probs.device)
    return -(advantage * log_probs).mean()
