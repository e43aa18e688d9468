"""The plugin's Hugging Face trainers by method name, each with its options: what attn-reg-cls-compare
(and the lab's attn-reg-fewshot) build per method, so that every method gets the same model,
``TrainingArguments``, data and collator and differs only in what its regularizer does.

Methods: plain (the stock ``transformers.Trainer``), then every method of the regularizer registry and
every combination, in the order :mod:`..core.regularizers.comparison_methods` gives (the plugin's and any
registered outside the package): each is trained by the ``attn_reg_plugin.hf`` class its ``Method.trainer``
names (``AttnRegTrainer`` for a plan regularizer), given each regularizer's config by its key.
A method's options are its regularizer's config fields as flags (``--ad-drop-p``, ``--rdrop-alpha``, ...:
the fairseq flags' names), one option group per registry method, so that a command adds each group once
however many methods share it; their defaults for classifiers are the method's ``defaults`` (AD-DROP
p = q = 0.3; R-Drop alpha 1.0: no single GLUE value of the R-Drop paper was found to cite, the plugin's
own default, 5, is the paper's MT value; HiddenCut its official script's; AttendOut a dropout step every
4 updates, few-shot runs are short).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from ..core.regularizers.comparison_methods import ComparisonMethod, method_table, too_few_epochs

# An option group is a registry method's options (named by the method): its regularizer's config's
# fields as flags (its FLAG_PREFIX + field; every field but ``attention``, encoder-self, found by the
# trainer), with the method's ``defaults`` for classifiers.


def registry_methods():
    from ..core.regularizers.registry import methods

    return methods()


def config_class(group: str):
    return registry_methods()[group][0].config


def group_defaults(group: str) -> dict:
    return dict(registry_methods()[group][1].defaults)


def add_option_group(parser: argparse.ArgumentParser, group: str) -> None:
    """The flags of option group ``group`` (its config's fields but ``attention``) with their defaults."""
    from ..core.regularizers.options import add_arguments, options_of

    cls = config_class(group)
    fields = [o.name for o in options_of(cls) if o.name != "attention"]
    target = parser.add_argument_group(group, f"{group} options (attn_reg_plugin {cls.__name__} fields)")
    add_arguments(target, cls, only=fields, defaults=group_defaults(group))


def option_prefix(group: str) -> str:
    return config_class(group).FLAG_PREFIX


def group_config(group: str, opts):
    """The group's config from parsed options (its flags' attributes)."""
    return config_class(group).from_namespace(opts)


@dataclass(frozen=True)
class Method:
    """One training method of a comparison.

    ``build(opts, **trainer_kwargs)`` returns a ``transformers.Trainer`` (``trainer_kwargs``: model,
    args, train_dataset, eval_dataset, data_collator, callbacks; only a method whose trainer draws
    held-out samples from it, AttendOut's, keeps eval_dataset, so every other method trains on exactly
    the same data); it fails on bad
    options when built. ``option_groups``: the groups of its options. ``settings(opts)``: its resolved
    config fields, validated (a ValueError names the field). ``min_epochs(opts)``: the fewest epochs for
    it to do anything; ``too_few(opts, epochs)``: why ``epochs`` are too few, as the commands refuse it
    (None: enough). ``log_keys``: the Trainer log keys a run records (a key ending in ``*`` is a prefix).
    """

    name: str
    help: str
    build: Callable[..., object]
    option_groups: Tuple[str, ...] = ()
    min_epochs: Callable[[argparse.Namespace], int] = lambda opts: 1
    log_keys: Tuple[str, ...] = ()
    check: Optional[Callable[[object], None]] = None  # a registry method's: its config is this method
    too_few: Callable[[argparse.Namespace, int], Optional[str]] = lambda opts, epochs: None

    def settings(self, opts) -> dict:
        out = {}
        for group in self.option_groups:
            config = group_config(group, opts).validate()
            if self.check is not None:
                self.check(config)
            out.update(_recorded_fields(group, config))
        return out

    @property
    def prefixes(self) -> Tuple[str, ...]:
        """The flag prefixes of its options (``--ad-drop-``, ``--rdrop-``)."""
        return tuple(option_prefix(g) for g in self.option_groups)

    def logged(self, log: dict) -> dict:
        """The entries of one Trainer log that this method records."""
        exact = {k for k in self.log_keys if not k.endswith("*")}
        prefixes = tuple(k[:-1] for k in self.log_keys if k.endswith("*"))
        return {k: v for k, v in log.items() if k in exact or k.startswith(prefixes)}


def _recorded_fields(group: str, config) -> dict:
    """A config's fields as a run records them (its method's ``recorded``, else all of them)."""
    recorded = registry_methods()[group][1].recorded
    return recorded(config) if recorded is not None else dict(vars(config))


def _without_eval(trainer_kwargs: dict) -> dict:
    return {k: v for k, v in trainer_kwargs.items() if k != "eval_dataset"}


def _build_plain(opts, **trainer_kwargs):
    import transformers

    return transformers.Trainer(**_without_eval(trainer_kwargs))


def _builder(method: ComparisonMethod):
    """Build the method's Trainer (``attn_reg_plugin.hf.<trainer>``), given each regularizer's config by its
    key; only a trainer that draws held-out samples keeps the dev set."""

    def build(opts, **trainer_kwargs):
        trainer = trainer_class(method.method.trainer)
        configs = {regularizer.key: group_config(part.name, opts) for regularizer, part in method.parts}
        kept = trainer_kwargs if method.method.heldout else _without_eval(trainer_kwargs)
        return trainer(**kept, **configs)

    return build


def trainer_path(name: str) -> Tuple[str, str]:
    """(module, class) of a method's ``trainer``: a name in :mod:`attn_reg_plugin.hf`, or ``"module:Class"``."""
    module, _, attribute = name.rpartition(":")
    return module or "attn_reg_plugin.hf", attribute


def trainer_class(name: str) -> type:
    """A method's Trainer class (:func:`trainer_path`)."""
    import importlib

    module, attribute = trainer_path(name)
    return getattr(importlib.import_module(module), attribute)


def _min_epochs(method: ComparisonMethod):
    """The fewest epochs in which every part of the method acts (AD-DROP's cross-tuning: 2)."""

    def min_epochs(opts) -> int:
        needs = [part.min_epochs(group_config(part.name, opts)) for _, part in method.parts if part.min_epochs]
        return max(needs, default=1)

    return min_epochs


def _trainer_method(method: ComparisonMethod) -> Method:
    """A method of the registry (or a combination of them), trained by its ``attn_reg_plugin.hf`` Trainer."""
    keywords = ", ".join(f"{r.key}={r.config.__name__}" for r, _ in method.parts)
    return Method(
        method.name,
        f"{'.'.join(trainer_path(method.method.trainer))}({keywords}): {method.method.help}",
        _builder(method),
        tuple(part.name for _, part in method.parts),
        _min_epochs(method),
        method.log_keys,
        check=method.method.check,
        too_few=lambda opts, epochs: too_few_epochs(
            method, {r.key: group_config(part.name, opts) for r, part in method.parts}, epochs
        ),
    )


METHODS: Dict[str, Method] = method_table(Method("plain", "stock transformers.Trainer", _build_plain), _trainer_method)


def add_method_options(parser: argparse.ArgumentParser, names) -> None:
    """Each option group of the methods ``names`` once."""
    for group in dict.fromkeys(g for name in names for g in METHODS[name].option_groups):
        add_option_group(parser, group)
