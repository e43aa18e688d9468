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

from .registry import registered


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


def count(n: int, unit: str) -> str:
    return f"{n} {unit}" + ("" if n == 1 else "s")


def idle_run_warning(config, epochs: Optional[int], updates: Optional[int], plan: str) -> Optional[str]:
    """The warning for a planned run in which ``config``'s regularizer never acts, else None.

    ``epochs`` / ``updates``: the whole run's planned epochs and optimizer updates (None: not known,
    e.g. an unsized dataset; then nothing is said); ``plan``: how the user set the run's length,
    as they spelled it (``num_train_epochs=1``, ``--max-epoch 1``). A regularizer that can be idle in
    its own way says so (``Regularizer.idle``: AD-DROP's cross-tuning over one epoch, AttendOut's first
    dropout step past the run); a plan regularizer whose config can say when it first drops (a schedule
    over updates) is idle when it never does."""
    regularizer = next((r for r in registered() if isinstance(config, r.config)), None)
    if regularizer is None:
        return None
    if regularizer.idle is not None:
        return regularizer.idle(config, epochs, updates, plan)
    dropping = getattr(config, "first_dropping_update", None)
    if dropping is not None and config.enabled and updates is not None and dropping(updates) is None:
        return (
            f"{setting(config, regularizer.switch, getattr(config, regularizer.switch))} is 0 at every one of the "
            f"{count(updates, 'update')} this run plans ({plan}): {regularizer.name} will never "
            f"drop anything. Give it a probability above 0 before update {updates}, or plan more "
            f"updates{WHY_A_WARNING}"
        )
    return None
