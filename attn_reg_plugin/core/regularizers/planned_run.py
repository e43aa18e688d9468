"""Whether a regularizer acts at all in a run as planned, said before training.

A run can be set up so that its regularizer never changes anything: cross-tuning's first AD-DROP
epoch is epoch 2, so a one-epoch run (the usual fine-tuning set-up) trains a plain model;
AttendOut's first dropout step ends after ``dropout_step`` updates; a scheduled dropout
probability can be 0 at every planned update. The adapters call :func:`idle_run_warning` once
the trainer knows its planned epochs and updates (HF: at train start; fairseq: at the first
epoch) and log what it returns at WARNING level.

A warning, not an error: a run that stops before the regularizer acts is legitimate when a longer
one resumes it (``--max-epoch 1`` on a time-limited job, then ``--max-epoch 4``), and the
message names the option that makes it act in the run as planned.
"""

from __future__ import annotations

from typing import Optional

from .ad_drop_config import ADDropConfig, first_ad_drop_epoch
from .attendout.config import AttendOutConfig
from .registry import planned


class IdleRegularizerWarning(UserWarning):
    """A regularizer that will not act, or not change anything, in the run as set up."""


WHY_A_WARNING = " (a warning, not an error: a longer run may resume this one)"


def setting(config, field: str, value) -> str:
    """``field = value`` as the user writes it: ``ADDropConfig(schedule="always")`` for a config given to
    a Python API (:func:`.options.named_by_field`), else the flag, ``--ad-drop-schedule always``."""
    if getattr(config, "_named_by_field", False):
        shown = f'"{value}"' if isinstance(value, str) else value
        return f"{type(config).__name__}({field}={shown})"
    return f"{config.name(field)} {value}"


def _count(n: int, unit: str) -> str:
    return f"{n} {unit}" + ("" if n == 1 else "s")


def idle_run_warning(config, epochs: Optional[int], updates: Optional[int], plan: str) -> Optional[str]:
    """The warning for a planned run in which ``config``'s regularizer never acts, else None.

    ``epochs`` / ``updates``: the whole run's planned epochs and optimizer updates (None: not known,
    e.g. an unsized dataset; then nothing is said); ``plan``: how the user set the run's length,
    as they spelled it (``num_train_epochs=1``, ``--max-epoch 1``)."""
    if isinstance(config, ADDropConfig) and epochs is not None:
        if first_ad_drop_epoch(config.schedule, epochs) is None:
            return (
                f"{setting(config, 'schedule', config.schedule)} is plain in epoch 1 and runs AD-DROP from epoch 2 "
                f"(then every other epoch), and this run plans {_count(epochs, 'epoch')} ({plan}): AD-DROP will "
                f"never act and the run trains a plain model. Set {setting(config, 'schedule', 'always')} to use "
                f"AD-DROP in every epoch, or plan at least 2 epochs{WHY_A_WARNING}"
            )
    if isinstance(config, AttendOutConfig) and updates is not None and updates < config.dropout_step:
        return (
            f"AttendOut ends a dropout step (held-out scoring, the generator's update, the survivor's copy) every "
            f"{setting(config, 'dropout_step', config.dropout_step)} updates, and this run plans "
            f"{_count(updates, 'update')} ({plan}): no dropout step will end, so the model is trained without "
            f"AttendOut. Lower {config.name('dropout_step')} to at most {updates}, or plan more updates{WHY_A_WARNING}"
        )
    # A registry regularizer whose config can say when it first drops (a schedule over updates).
    regularizer = next((r for r in planned() if isinstance(config, r.config)), None)
    dropping = getattr(config, "first_dropping_update", None)
    if regularizer is not None and dropping is not None and config.enabled and updates is not None:
        if dropping(updates) is None:
            what = regularizer.name
            return (
                f"{setting(config, regularizer.switch, getattr(config, regularizer.switch))} is 0 at every one of the "
                f"{_count(updates, 'update')} this run plans ({plan}): {what} will never "
                f"drop anything. Give it a probability above 0 before update {updates}, or plan more "
                f"updates{WHY_A_WARNING}"
            )
    return None
