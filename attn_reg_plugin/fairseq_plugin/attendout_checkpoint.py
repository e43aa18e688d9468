"""Where AttendOut's game lives in a fairseq checkpoint, and how a resume finds it.

The game (Attacker, its optimizer, the Generator, its Adam state, the baseline, the dropout step)
travels in the checkpoint's task state. fairseq hands that to the task (``set_checkpoint_dict``)
except with ``--reset-dataloader``; then, and whenever fairseq loaded a checkpoint without handing
it, AttendOut reads its part from the file fairseq loaded (docs/CHECKPOINTS.md).
"""

import copy
import inspect
import os
from typing import Optional, Tuple

import torch
from fairseq import checkpoint_utils
from fairseq.file_io import PathManager


def _checkpoint_utils_source() -> str:
    # The module's file, not its (possibly wrapped or patched) functions.
    return inspect.getsource(checkpoint_utils)


def check_fairseq_supports_task_state() -> None:
    """AttendOut's state lives in the task's checkpoint dict, which fairseq 0.12.2 does not save."""
    source = _checkpoint_utils_source()
    if "get_checkpoint_dict" not in source or "set_checkpoint_dict" not in source:
        raise RuntimeError(
            "--attendout needs a fairseq whose checkpoints carry task state (task.get_checkpoint_dict, "
            "fairseq-fixed 0.12.3.1 / fairseq main after 0.12.2); this fairseq would lose the generator, "
            "baseline and Attacker on every checkpoint. Install fairseq-fixed (Python >= 3.11) or fairseq from main."
        )


def loaded_checkpoint_path(checkpoint, defender_loaded: bool) -> Tuple[Optional[str], str]:
    """The file fairseq's ``checkpoint_utils.load_checkpoint`` loaded D from (its own rules), or
    None and why AttendOut starts a new game. ``checkpoint``: fairseq's checkpoint config, or None."""
    if checkpoint is None or not defender_loaded:
        return None, ""
    suffix = checkpoint.get("checkpoint_suffix", "") or ""
    restore_file = checkpoint.get("restore_file", "checkpoint_last.pt")
    if restore_file == "checkpoint_last.pt":
        path = os.path.join(checkpoint.save_dir, f"checkpoint_last{suffix}.pt")
        if not PathManager.exists(path):
            if checkpoint.get("continue_once", None) is not None:
                path = checkpoint.continue_once
            elif checkpoint.get("finetune_from_model", None) is not None:
                return None, "--finetune-from-model takes the model's weights only"
    else:
        path = restore_file.replace(".pt", suffix + ".pt")
    return (path, "") if PathManager.isfile(path) else (None, "")


def restored_message(game, dropout_step: int, source: str, reset_optimizer: bool) -> str:
    optimizer = "" if reset_optimizer else "its optimizer, "
    message = (
        f"AttendOut: restored the Attacker, {optimizer}the Generator and its Adam state, the baseline and the "
        f"unfinished dropout step (update {game['update_in_step']} of {dropout_step} done, after "
        f"{game['dropout_steps_done']} finished dropout steps) from {source}"
    )
    if reset_optimizer:
        message += "; the Attacker's optimizer is reset (--reset-optimizer), as the Defender's is"
    return message


def read_attendout_state(path: str, task_state_key: str):
    """The AttendOut part of a checkpoint's task state, or None. Memory-mapped where the file allows,
    so that the rest of the checkpoint is not read again; the tensors kept are copied out."""
    local = PathManager.get_local_path(path)
    try:
        state = torch.load(local, map_location="cpu", mmap=True)
    except RuntimeError:  # a legacy (not zip) file cannot be memory-mapped
        with open(local, "rb") as f:
            state = torch.load(f, map_location="cpu")
    task_state = (state.get("extra_state") or {}).get(task_state_key) or {}
    # deepcopy gives the tensors storage of their own (a later save may rewrite the mapped file).
    return copy.deepcopy(task_state.get("attendout")) or None
