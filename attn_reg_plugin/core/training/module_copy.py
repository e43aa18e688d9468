"""A deep copy of a model that runs as itself, also where a library wrapped its forward on the instance.

``copy.deepcopy`` copies a module's ``__dict__``, so an instance-level method
(``model.forward = types.MethodType(wrapper, model)``) is bound to the copy, but it keeps every
function as it is: a wrapper whose closure holds the original model's own ``forward`` (TRL's fused
LM head, ``trl.trainer.utils.add_fused_lm_head``), possibly under accelerate's mixed-precision
wrappers around it, makes the copy run the original's layers. AttendOut's Attacker is such a copy,
so it would have no attention sites of its own and its held-out scores would be the Defender's.
:func:`deepcopy_module` also re-points those wrappers at the copy.
"""

from __future__ import annotations

import copy
import types
from typing import Dict, Optional

import torch

_MAX_DEPTH = 16  # wrappers of wrappers of a forward; deeper chains are left as they are


class _Repointer:
    """Maps a value reachable from an instance-level method to the one the copy should hold: the copy's
    object where the value is, or is a method of, something copied with the model; a new wrapper where
    a wrapper (a closure, or a callable object such as accelerate's ``ConvertOutputsToFp32``) holds
    one; otherwise the value itself, shared."""

    def __init__(self, memo: Dict[int, object]):
        self.memo, self.done = memo, {}

    def __call__(self, value, depth: int = 0):
        key = id(value)
        if key not in self.done:
            self.done[key] = value  # a cycle ends here, unchanged
            self.done[key] = self._repointed(value, depth)
        return self.done[key]

    def _repointed(self, value, depth: int):
        # A method first: deepcopy already made one for the copy (in memo), but with the same function.
        if isinstance(value, types.MethodType) and id(value.__self__) in self.memo:
            return types.MethodType(self(value.__func__, depth + 1), self.memo[id(value.__self__)])
        if id(value) in self.memo:
            return self.memo[id(value)]
        if depth >= _MAX_DEPTH or isinstance(value, (type, torch.nn.Module, torch.Tensor)):
            return value
        if isinstance(value, types.FunctionType):
            return self._function(value, depth) if value.__closure__ else value
        if callable(value) and isinstance(getattr(value, "__dict__", None), dict):
            fields = {name: self(item, depth + 1) for name, item in vars(value).items() if callable(item)}
            changed = {name: item for name, item in fields.items() if item is not vars(value)[name]}
            if changed:
                twin = object.__new__(type(value))  # not copy.copy: such wrappers may refuse pickling
                twin.__dict__.update(vars(value), **changed)
                return twin
        return value

    def _function(self, function: types.FunctionType, depth: int):
        cells = []
        for cell in function.__closure__:
            try:
                contents = cell.cell_contents
            except ValueError:  # a cell not filled yet
                cells.append(cell)
                continue
            new = self(contents, depth + 1)
            cells.append(cell if new is contents else types.CellType(new))
        if all(new is old for new, old in zip(cells, function.__closure__)):
            return function
        twin = types.FunctionType(
            function.__code__, function.__globals__, function.__name__, function.__defaults__, tuple(cells)
        )
        twin.__kwdefaults__, twin.__qualname__ = function.__kwdefaults__, function.__qualname__
        twin.__dict__.update(function.__dict__)  # functools.wraps' __wrapped__
        return twin


def deepcopy_module(model: torch.nn.Module, memo: Optional[Dict[int, object]] = None) -> torch.nn.Module:
    """``copy.deepcopy(model, memo)``, with each module's instance-level methods made to call the copy."""
    memo = {} if memo is None else memo
    copied = copy.deepcopy(model, memo)
    repoint = _Repointer(memo)
    for module, twin in zip(model.modules(), copied.modules()):
        for name, value in module.__dict__.items():
            if isinstance(value, types.MethodType) and value.__self__ is module:
                twin.__dict__[name] = repoint(value)
    return copied
