"""AttendOut's Defender/Attacker duel, the steps every framework runs the same way.

The game itself (masks, REINFORCE, the survivor rule) is :class:`~attn_reg_plugin.core.regularizers.attendout.game.AttendOut`.
Around it, an adapter (fairseq task, HF Trainer) owns the two networks, their optimizers and the
training loop, and calls these functions for the parts that do not depend on the framework:
building the Attacker, scoring both networks on the held-out samples, and ending a dropout step
(reward, survivor, re-sync). The adapter supplies only ``logits_of(model, batch) -> (logits,
target, keep)`` (how its models score a held-out batch) and ``copy_network(source, destination)``
(what a copy of one network over the other includes: weights, master weights, optimizer state).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

from ...kernel.controller import RegularizationController
from ...training.distributed import from_rank0
from ...training.module_copy import deepcopy_module
from ...training.sharding import is_fully_sharded
from .game import AttendOut
from .heldout import LogitsOf, heldout_losses


def build_attacker(
    defender: torch.nn.Module, install_sites: Callable
) -> Tuple[torch.nn.Module, RegularizationController]:
    """A: a copy of D as it is now, with attention sites of its own (the Generator's masks go there).

    Under FSDP2, build A from the unsharded D and shard both (:func:`~attn_reg_plugin.core.training.sharding.shard_like`):
    a sharded module cannot be copied."""
    if is_fully_sharded(defender):
        raise ValueError(
            "AttendOut: the Defender is already sharded with FSDP2 (fully_shard), which cannot be copied. Build the "
            "Attacker from the unsharded model first, then shard both, e.g. core.sharding.shard_like(defender, "
            "attacker) after sharding the Defender (docs/DISTRIBUTED.md)"
        )
    attacker = deepcopy_module(defender)  # a forward wrapped on the instance (TRL) runs the copy too
    controller = RegularizationController()
    install_sites(attacker, controller)
    return attacker, controller


def end_dropout_step(
    game: AttendOut,
    defender: torch.nn.Module,
    attacker: torch.nn.Module,
    batches: Iterable,
    logits_of: LogitsOf,
    copy_network: Callable[[str, str], None],
    generator: Optional[torch.Generator] = None,
) -> Dict[str, object]:
    """Score D and A on the same held-out batches, reward the Generator, pick the survivor (rank 0's
    choice on every worker) and copy it over the other: ``copy_network("attacker", "defender")``
    or the reverse. Returns the game's statistics."""
    batches = list(batches)
    d_losses = heldout_losses(defender, batches, logits_of)
    a_losses = heldout_losses(attacker, batches, logits_of)
    stats = game.finish_dropout_step(d_losses, a_losses, generator=generator)
    stats["keep_attacker"] = from_rank0(stats["keep_attacker"])
    if stats["keep_attacker"]:
        copy_network("attacker", "defender")
    else:
        copy_network("defender", "attacker")
    return stats


def scaler_skipped_step(scaler, scale_before: float) -> bool:
    """Whether a torch GradScaler (also the one inside fairseq's ``--amp`` optimizer) skipped the step
    it was just given: after ``update()`` its scale is lower exactly when the gradients were not
    finite. AttendOut asks it for D's step (skipped: A forgets the batch too) and for A's (skipped:
    counted as an Attacker overflow). fairseq's ``--fp16`` optimizers raise OverflowError instead."""
    return scaler.get_scale() < scale_before
