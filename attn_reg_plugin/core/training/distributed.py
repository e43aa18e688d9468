"""The few collective operations the regularizers need, in one place; no-ops in a single process.

AttendOut's Attacker is not wrapped in DDP, so its gradients are averaged here; the held-out
draw and the survivor are decided by rank 0 and broadcast; AD-DROP's logged counts are summed.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def is_distributed() -> bool:
    """True in a process group of more than one worker."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return torch.distributed.get_rank() if is_distributed() else 0


def all_reduce_mean_(tensors: Sequence[torch.Tensor]) -> None:
    """Average tensors (gradients) over the workers, in place."""
    if not is_distributed():
        return
    world = torch.distributed.get_world_size()
    for t in tensors:
        torch.distributed.all_reduce(t)
        t.div_(world)


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over the workers, in place; returns it."""
    if is_distributed():
        torch.distributed.all_reduce(tensor)
    return tensor


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every worker (any picklable object)."""
    if not is_distributed():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
