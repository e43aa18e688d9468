"""The comparison commands' methods, from the registry alone.

``attn-reg-mt-compare`` and ``attn-reg-cls-compare`` list the same methods in one order: plain, every
registered regularizer's methods (:func:`.registry.methods`: those of their own passes, then the plan
regularizers' by name), then each combination the plugin allows (:data:`.combinations.COMBINATIONS`).
Each command turns a :class:`ComparisonMethod` into how its framework trains it (a fairseq-train
criterion and flags, a Trainer class and keywords) with one function (:func:`method_table`); no command
names a regularizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from .combinations import COMBINATIONS
from .registry import Method, Regularizer, methods


@dataclass(frozen=True)
class ComparisonMethod:
    """A method and the regularizers it turns on, each with the method whose options it takes: one for a
    regularizer's own method, several for a combination."""

    method: Method
    parts: Tuple[Tuple[Regularizer, Method], ...]

    @property
    def name(self) -> str:
        return self.method.name

    @property
    def mt_defaults(self) -> Tuple[Tuple[str, ...], ...]:
        """Its fairseq-train flag groups: each part's (a regularizer's own method is its one part)."""
        return tuple(group for _, part in self.parts for group in part.mt_defaults)

    @property
    def required(self) -> Tuple[str, ...]:
        return tuple(flag for _, part in self.parts for flag in part.required)

    @property
    def flag_prefixes(self) -> Tuple[str, ...]:
        """The flags its ``--method-args`` may give: each part's."""
        return tuple(p for r, part in self.parts for p in (part.flag_prefixes or (r.config.FLAG_PREFIX,)))

    @property
    def log_keys(self) -> Tuple[str, ...]:
        """The Trainer log keys a run records: each part's."""
        keys = (k for r, part in self.parts for k in (r.log_keys() if part.log_keys is None else part.log_keys))
        return tuple(dict.fromkeys(keys))


def too_few_epochs(method: ComparisonMethod, configs: Mapping[str, Any], epochs: int) -> Optional[str]:
    """Why ``epochs`` are too few for ``method`` to do anything (a part's ``min_epochs`` of its config in
    ``configs``, by regularizer key), as both commands refuse it; None when they are enough."""
    for regularizer, part in method.parts:
        if part.min_epochs is None:
            continue
        config = configs[regularizer.key]
        need = part.min_epochs(config)
        if epochs < need:
            setting, instead = part.epochs_advice(config) if part.epochs_advice else (None, None)
            name, with_what = regularizer.name, f"{method.name}'s {setting}" if setting else method.name
            return (
                f"--epochs {epochs} with {with_what} never runs {name} (its first {name} epoch is "
                f"epoch {need}): give --epochs >= {need}"
                + (f", or --method-args '{method.name}={instead}'" if instead else "")
            )
    return None


def comparison_methods() -> Dict[str, ComparisonMethod]:
    """Every method but plain, in the commands' order. A registered method named as a combination's is
    refused, naming both."""
    registry = methods()
    own = {name: ComparisonMethod(method, ((regularizer, method),)) for name, (regularizer, method) in registry.items()}
    taken = [c for c in COMBINATIONS if c.method is not None and c.method.name in own]
    if taken:
        name = taken[0].method.name
        raise ValueError(
            f"regularizer {registry[name][0].name!r}: its method {name!r} is the name of the combination "
            f"{taken[0].name}; name the method otherwise"
        )
    combined = {
        c.method.name: ComparisonMethod(c.method, tuple(registry[part] for part in c.parts))
        for c in COMBINATIONS
        if c.method is not None and all(part in registry for part in c.parts)
    }
    return {**own, **combined}


def method_names() -> Tuple[str, ...]:
    """Every comparison method's name, in the commands' order."""
    return ("plain", *comparison_methods())


def method_table(plain: Any, make: Callable[[ComparisonMethod], Any]) -> Dict[str, Any]:
    """A command's method table in :func:`method_names`' order: ``plain``, the command's reference, and
    ``make(method)`` for every other."""
    return {"plain": plain, **{name: make(method) for name, method in comparison_methods().items()}}
