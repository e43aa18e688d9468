"""What a Trainer user must see at the Trainer's default log level: a regularizer that will not act in
the planned run (an :class:`~attn_reg_plugin.core.regularizers.planned_run.IdleRegularizerWarning` when training
begins, before the progress bar is drawn) and what it regularizes (the first training log record).

transformers' Trainer shows neither the plugin's INFO lines nor its own by default; its log records
are printed, kept in ``state.log_history`` and sent to every reporting integration.
"""

from __future__ import annotations

import sys
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

from transformers import TrainerCallback

from ..core.kernel.attention_call import AttentionSite
from ..core.regularizers.planned_run import IdleRegularizerWarning, idle_run_warning


def planned_run(args, state) -> Tuple[Optional[int], Optional[int], str]:
    """(planned epochs, planned updates, how the run's length was set) as the Trainer planned them
    at train start; epochs is None for a dataset without a length (the Trainer plans sys.maxsize)."""
    epochs = state.num_train_epochs if 0 < state.num_train_epochs < sys.maxsize else None
    updates = state.max_steps if state.max_steps > 0 else None
    length = f"max_steps={args.max_steps}" if args.max_steps > 0 else f"num_train_epochs={args.num_train_epochs:g}"
    return epochs, updates, f"TrainingArguments.{length}"


class IdleRunWarning(TrainerCallback):
    """Warns once, when training begins, if the run as planned never lets ``config``'s regularizer act."""

    def __init__(self, config):
        self.config = config

    def on_train_begin(self, args, state, control, **kwargs):
        message = idle_run_warning(self.config, *planned_run(args, state))
        if message and state.is_world_process_zero:
            warnings.warn(message, IdleRegularizerWarning, stacklevel=2)


def warn_if_idle(trainer, config) -> None:
    """Add :class:`IdleRunWarning` for ``config`` to ``trainer`` ahead of its other callbacks, so that the
    warning is printed before the progress callback draws its bar, not into it."""
    trainer.add_callback(IdleRunWarning(config))
    callbacks = trainer.callback_handler.callbacks
    callbacks.insert(0, callbacks.pop())


class SiteReport:
    """The first training log record's ``attn_reg_*`` keys: how many attention sites the probe found
    in the model, which kinds the regularizer acts on (``attention="auto"`` resolved) and how many
    sites it acts on."""

    def __init__(self, found: Sequence[Tuple[str, AttentionSite]], regularized: Sequence[AttentionSite]):
        kinds: List[str] = list(dict.fromkeys(s.kind for s in regularized))
        self.entries: Optional[Dict[str, object]] = {
            "attn_reg_sites_found": len(found),
            "attn_reg_attention": ",".join(kinds),
            "attn_reg_sites": len(regularized),
        }

    def add_once(self, logs: Dict[str, object]) -> None:
        if "loss" in logs and self.entries is not None:  # a training log
            logs.update(self.entries)
            self.entries = None
