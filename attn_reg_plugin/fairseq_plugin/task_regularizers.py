"""The regularizers an attn_reg task runs, each one running object the task loops over.

An attn_reg task runs every regularizer of the registry that it can turn on with its own flags:

- a plan regularizer (:data:`~..core.regularizers.registry.PLAN`: the plugin's, one registered outside
  the package): its running object's ``hooks(update)`` are set around fairseq's ``train_step`` and the
  kernel's two counts are logged as its rate;
- a regularizer of its own passes that the task runs (AttendOut's Attacker beside the trainer's model):
  bound here by a :class:`TaskBinding` (its switch and fairseq-only flags, how it is built from the
  task and its model); its running object is a :class:`TaskRunner`.

AD-DROP, R-Drop and HiddenCut run in criteria (:mod:`.criterion`); the task checks them against its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Tuple

from ..core.regularizers.registry import PLAN, Regularizer, registered


class TaskRunner:
    """What an attn_reg task asks of a running regularizer of its own passes; each default does nothing."""

    config = None

    def begin_epoch(self, task, epoch: int) -> None:
        """After fairseq's ``begin_epoch`` (and, at the first, after it loaded its checkpoint)."""

    def after_train_step(self, task, sample, model, criterion, optimizer, update_num, ignore_grad) -> dict:
        """After the model's forward and backward on ``sample``: its own passes; returns log entries."""
        return {}

    @contextlib.contextmanager
    def around_optimizer_step(self, task, optimizer, model, update_num) -> Iterator[None]:
        """Around fairseq's optimizer step."""
        yield

    def state_dict(self) -> dict:
        """What the checkpoint's task state keeps of it (nothing: {})."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass(frozen=True)
class TaskBinding:
    """How an attn_reg task runs a registered regularizer of its own passes.

    ``switch``: the task flag that turns it on, as a fairseq option field ``(name, type, field)``;
    ``extra``: its fairseq-only options, same form; ``validate(cfg)``: checks them (and what the run
    needs) before any data is read, on or off; ``build(task, model, config)``: its :class:`TaskRunner`
    once the model is built; ``reduce_metrics(logging_outputs)``: its training metrics from the workers'
    logs (fairseq calls the task's for every run, this one off too)."""

    key: str
    switch: Tuple[str, type, dataclasses.Field]
    extra: Tuple[Tuple[str, type, dataclasses.Field], ...]
    validate: Callable[[object], None]
    build: Callable[[object, object, object], TaskRunner]
    reduce_metrics: Callable[[object], None]

    @property
    def flag(self) -> str:
        return "--" + self.switch[0].replace("_", "-")

    def on(self, cfg) -> bool:
        return bool(getattr(cfg, self.switch[0], False))


TASK_BINDINGS: Dict[str, TaskBinding] = {}
# The plugin's modules that bind a regularizer to the task (they import this module).
TASK_MODULES = ("attendout",)


def bind_to_task(binding: TaskBinding) -> TaskBinding:
    TASK_BINDINGS[binding.key] = binding
    return binding


def _load_bindings() -> None:
    for module in TASK_MODULES:
        importlib.import_module(f"{__package__}.{module}")


def task_regularizers() -> List[Regularizer]:
    """The registry's regularizers an attn_reg task turns on with its flags, in the registry's order."""
    _load_bindings()
    return [r for r in registered() if r.passes == PLAN or r.key in TASK_BINDINGS]


def binding_of(regularizer: Regularizer):
    """Its :class:`TaskBinding`, or None for a plan regularizer."""
    return None if regularizer.passes == PLAN else TASK_BINDINGS[regularizer.key]


def whole_config(cfg):
    """fairseq-train's whole config, reached from the task's node (fairseq hands tasks ``cfg.task``
    only); None when the task is built from a plain namespace."""
    get_root = getattr(cfg, "_get_root", None)
    return get_root() if callable(get_root) else None
