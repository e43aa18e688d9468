"""Each option is declared once: a field of its config dataclass, with its help text as metadata.

The config dataclasses (``ADDropConfig``, ``AttendOutConfig``, ``ScheduledDropoutConfig``,
``AttentionLayerDropConfig``) are the single source of every option's name, type, default and
help. Everything else is generated from them: the fairseq flags (``--ad-drop-p`` …, see
``fairseq_plugin.options``) and the argparse options of the example and experiment runners
(:func:`add_arguments`). Validation stays in each config's ``validate``.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence


def option(default: Any, help: str) -> Any:
    """A config field with its help text (shown by ``fairseq-train --help`` and the runners' ``--help``)."""
    return dataclasses.field(default=default, metadata={"help": help})


class Option(NamedTuple):
    name: str  # the config field
    type: type  # int, float, str or bool
    default: Any
    help: str


def options_of(config_cls) -> List[Option]:
    """The fields of a config dataclass, with their types resolved (the modules use postponed annotations)."""
    hints = typing.get_type_hints(config_cls)
    return [Option(f.name, hints[f.name], f.default, f.metadata.get("help", "")) for f in dataclasses.fields(config_cls)]


def flag_name(prefix: str, name: str) -> str:
    """``("--ad-drop-", "iga_steps")`` -> ``--ad-drop-iga-steps``."""
    return prefix + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, config_cls, prefix: str, only: Optional[Iterable[str]] = None,
                  defaults: Optional[Dict[str, Any]] = None) -> None:
    """Add ``prefix + field`` options for the fields of ``config_cls`` (all, or ``only``) to an
    argparse parser or group; ``defaults`` overrides a runner's defaults, the help is the field's."""
    defaults = defaults or {}
    wanted = None if only is None else list(only)
    by_name = {o.name: o for o in options_of(config_cls)}
    unknown = [] if wanted is None else [n for n in wanted if n not in by_name]
    if unknown:
        raise ValueError(f"{config_cls.__name__} has no field {unknown[0]!r}")
    for opt in (by_name[n] for n in wanted) if wanted is not None else by_name.values():
        default = defaults.get(opt.name, opt.default)
        text = f"{opt.help} (default {default})"
        if opt.type is bool:
            parser.add_argument(flag_name(prefix, opt.name), action="store_true", default=default, help=opt.help)
        else:
            parser.add_argument(flag_name(prefix, opt.name), type=opt.type, default=default, help=text)


def config_from_namespace(config_cls, ns, prefix: str):
    """A config from an object carrying ``prefix + field`` attributes (fairseq's cfg, parsed
    arguments with ``prefix`` like ``"ad_drop_"``); fields the object lacks keep their defaults."""
    return config_cls(**{f.name: getattr(ns, prefix + f.name) for f in dataclasses.fields(config_cls)
                         if hasattr(ns, prefix + f.name)})


def one_regularizer(enabled: Sequence[str]) -> None:
    """Refuse a run that turns on more than one attention regularizer (named as the user spelled them)."""
    if len(enabled) > 1:
        raise ValueError(f"choose one attention regularizer per run; got {' and '.join(enabled)}")
