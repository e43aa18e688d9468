"""Re-syncing Defender and Attacker: the survivor's weights and optimizer state overwrite the other's."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ...training.sharding import reshard


@torch.no_grad()
def copy_model_state(source: nn.Module, destination: nn.Module) -> None:
    """Overwrite ``destination``'s parameters and buffers in place (optimizers keep their references).

    FSDP2 models are resharded first, so both list their sharded parameters (the ones optimizers
    hold) and each rank copies its own shard."""
    reshard(source)
    reshard(destination)
    for s, d in zip(source.parameters(), destination.parameters()):
        d.copy_(s)
    for s, d in zip(source.buffers(), destination.buffers()):
        d.copy_(s)


def copy_optimizer_state(
    source: torch.optim.Optimizer,
    source_params: Sequence[torch.Tensor],
    destination: torch.optim.Optimizer,
    destination_params: Sequence[torch.Tensor],
) -> None:
    """Give ``destination`` a copy of ``source``'s per-parameter state (Adam moments, step).

    The parameter lists are the sharded ones for FSDP2 models (read after :func:`copy_model_state`)."""
    for s, d in zip(source_params, destination_params):
        state = source.state.get(s)
        if state:
            destination.state[d] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        else:
            destination.state.pop(d, None)
