"""The AttendOut game's state in a Trainer checkpoint: the Attacker, its optimizer (and fp16 loss
scaler) and the game, saved beside each ``checkpoint-<step>`` folder and read back on resume.

``attendout.pt`` holds them all; a distributed run also writes ``attendout_game_rank<r>.pt`` per
worker, since each worker caches the masks of its own batches.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Optional, Protocol

import torch

from ..core.training.distributed import is_distributed, rank
from ..core.training.sharding import full_state_dicts, is_fully_sharded, load_full_state_dicts


class AttendOutDriver(Protocol):
    """What a checkpoint saves of ``attendout_driver.AttendOutDriver`` (declared here, so that the
    driver imports this module and not the other way round)."""

    attacker: torch.nn.Module
    optimizer: torch.optim.Optimizer
    game: object
    scaler: Optional[object]


# AttendOutTrainer's logger: its users filter its warnings by this name.
logger = logging.getLogger("attn_reg_plugin.hf.attendout_trainer")

ATTENDOUT_STATE = "attendout.pt"  # in each checkpoint folder: Attacker, its optimizer, the game
FULL_OPTIMIZER_STATE = "attacker_optimizer_by_name"  # a sharded Attacker's optimizer state, gathered


def _rank_game_file(folder: str) -> str:
    return os.path.join(folder, f"attendout_game_rank{rank()}.pt")


def attendout_state_dict(driver: AttendOutDriver) -> Dict[str, object]:
    """A, its optimizer, the game (and A's loss scaler). Under FSDP2, A and its optimizer state are
    gathered into full tensors on the CPU (a collective: every rank calls this), keyed by
    parameter name, so the file does not depend on the number of ranks."""
    if is_fully_sharded(driver.attacker):
        attacker, optimizer = full_state_dicts(driver.attacker, driver.optimizer)
        optimizer_key = FULL_OPTIMIZER_STATE
    else:
        attacker, optimizer = driver.attacker.state_dict(), driver.optimizer.state_dict()
        optimizer_key = "attacker_optimizer"
    return {
        "attacker": attacker,
        optimizer_key: optimizer,
        "game": driver.game.state_dict(),
        **({"attacker_scaler": driver.scaler.state_dict()} if driver.scaler is not None else {}),
    }


def save_attendout_state(driver: AttendOutDriver, folder: str, should_save: bool) -> None:
    """Writes the game's state into the checkpoint folder the Trainer just wrote. Every rank calls it."""
    state = attendout_state_dict(driver)  # on every rank: gathering a sharded A is a collective
    if should_save:
        torch.save(state, os.path.join(folder, ATTENDOUT_STATE))
    if is_distributed():  # each worker caches its own batches
        torch.save(driver.game.state_dict(), _rank_game_file(folder))


def load_attendout_state(driver: AttendOutDriver, folder: str) -> None:
    """Restores A, its optimizer, A's scaler and the game from a checkpoint folder; without
    ``attendout.pt`` the game starts anew from the loaded model."""
    path = os.path.join(folder, ATTENDOUT_STATE)
    if not os.path.isfile(path):
        logger.warning(
            f"{folder} has no {ATTENDOUT_STATE}: AttendOut starts a new game from the loaded model "
            "(Attacker = Defender, fresh generator)"
        )
        return
    state = torch.load(path, map_location="cpu", weights_only=True)
    if is_fully_sharded(driver.attacker) or FULL_OPTIMIZER_STATE in state:
        if FULL_OPTIMIZER_STATE not in state:
            raise ValueError(
                f"{path} was saved by an unsharded run: its Attacker optimizer state is indexed by position and "
                "cannot be sharded. Resume it without FSDP, or start a new AttendOut game from the model"
            )
        load_full_state_dicts(driver.attacker, driver.optimizer, state["attacker"], state[FULL_OPTIMIZER_STATE])
    else:
        driver.attacker.load_state_dict(state["attacker"])
        driver.optimizer.load_state_dict(state["attacker_optimizer"])
    if driver.scaler is not None and "attacker_scaler" in state:
        driver.scaler.load_state_dict(state["attacker_scaler"])
    game = state["game"]
    if is_distributed():
        mine = _rank_game_file(folder)
        if os.path.isfile(mine):
            game = torch.load(mine, map_location="cpu", weights_only=True)
    driver.game.load_state_dict(game)
