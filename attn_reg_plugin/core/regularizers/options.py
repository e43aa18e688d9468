"""Each option is declared once: a field of its config dataclass, with its help text as metadata.

The config dataclasses (``ADDropConfig``, ``AttendOutConfig``, ``ScheduledDropoutConfig``,
``AttentionLayerDropConfig``) are the single source of every option's name, type, default and
help. Everything else is generated from them: the fairseq flags (``--ad-drop-p`` …, see
``fairseq_plugin.options``) and the argparse options of the example and experiment runners
(:func:`add_arguments`). Validation stays in each config's ``validate``.

Each config class names its flag prefix once (``FLAG_PREFIX = "--ad-drop-"``). Errors name an
option as the user spelled it: the flag (``--ad-drop-p``) by default, which is how the fairseq
CLI and the runners spell it; ``ADDropConfig.p`` for a config handed to a Python API that marks
it with :func:`named_by_field` (the Hugging Face trainers do). No spelling is passed around.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from typing import Any, Dict, Iterable, List, NamedTuple, Optional


def option(default: Any, meaning: str, accepted: str) -> Any:
    """A config field with what it means and which values it accepts (shown by ``fairseq-train
    --help``, the runners' ``--help`` and the tables of docs/OPTIONS.md)."""
    return dataclasses.field(default=default, metadata={"meaning": meaning, "accepted": accepted})


def layers_option() -> Any:
    return option("all", "which layers", "all, or a comma list of 0-based layer indices, each < the kind's layer count")


def attention_option() -> Any:
    return option(
        "auto",
        "which attention kinds; auto: encoder-self when the model has an encoder (encoder-only and "
        "encoder-decoder models, the papers' setting), decoder-self for decoder-only models",
        "auto, or a comma list of encoder-self, decoder-self, encoder-decoder",
    )


class Option(NamedTuple):
    name: str  # the config field
    type: type  # int, float, str or bool
    default: Any
    meaning: str
    accepted: str

    @property
    def help(self) -> str:
        return f"{self.meaning}; accepted: {self.accepted}"


def options_of(config_cls) -> List[Option]:
    """The fields of a config dataclass, with their types resolved (the modules use postponed annotations)."""
    hints = typing.get_type_hints(config_cls)
    return [
        Option(f.name, hints[f.name], f.default, f.metadata["meaning"], f.metadata["accepted"])
        for f in dataclasses.fields(config_cls)
    ]


def flag_name(prefix: str, name: str) -> str:
    """``("--ad-drop-", "iga_steps")`` -> ``--ad-drop-iga-steps``."""
    return prefix + name.replace("_", "-")


def option_name(config, name: str) -> str:
    """How errors name option ``name`` of ``config``: its flag, or its field after :func:`named_by_field`."""
    if getattr(config, "_named_by_field", False):
        return f"{type(config).__name__}.{name}"
    return flag_name(config.FLAG_PREFIX, name)


def named_by_field(config):
    """Mark ``config`` so that its errors name fields (``ADDropConfig.p``), as a Python caller wrote them."""
    config._named_by_field = True  # a plain attribute, not a dataclass field: equality ignores it
    return config


def attribute_prefix(config_cls) -> str:
    """``--ad-drop-`` -> ``ad_drop_``: the prefix of the config's fields in fairseq's cfg and in parsed args."""
    return config_cls.FLAG_PREFIX[2:].replace("-", "_")


def check_probability(value, option: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{option} must be a probability in [0, 1], got {value!r}")
    return float(value)


class RegularizerOptions:
    """What every regularizer config shares (mixed into its dataclass): how its errors name an
    option, building it from parsed flags, and the attention sites its ``attention`` and
    ``layers`` options select."""

    FLAG_PREFIX = ""  # each config sets its own, e.g. "--ad-drop-"

    def name(self, field: str) -> str:
        """Option ``field`` as the user spelled it (:func:`option_name`)."""
        return option_name(self, field)

    def check_site_options(self) -> None:
        """The syntax of ``layers`` and ``attention`` (the model is not needed)."""
        from ..kernel.controller import parse_kinds, parse_layers

        parse_layers(self.layers, self.name("layers"))
        parse_kinds(self.attention, self.name("attention"))

    def select_sites(self, controller):
        """The model's sites that ``attention`` and ``layers`` select; errors say what the model has."""
        from ..kernel.controller import parse_kinds, parse_layers

        return controller.select(
            parse_kinds(self.attention, self.name("attention")),
            parse_layers(self.layers, self.name("layers")),
            self.name("layers"),
            self.name("attention"),
        )

    @classmethod
    def from_namespace(cls, ns, prefix: Optional[str] = None):
        """Build from an object carrying ``<attribute prefix><field>`` attributes (fairseq's cfg, parsed args)."""
        return config_from_namespace(cls, ns, prefix)


def add_arguments(
    parser: argparse.ArgumentParser,
    config_cls,
    prefix: Optional[str] = None,
    only: Optional[Iterable[str]] = None,
    defaults: Optional[Dict[str, Any]] = None,
) -> None:
    """Add ``prefix + field`` options for the fields of ``config_cls`` (all, or ``only``) to an
    argparse parser or group; ``defaults`` overrides a runner's defaults, the help is the field's."""
    defaults = defaults or {}
    prefix = config_cls.FLAG_PREFIX if prefix is None else prefix
    wanted = None if only is None else list(only)
    by_name = {o.name: o for o in options_of(config_cls)}
    unknown = [] if wanted is None else [n for n in wanted if n not in by_name]
    if unknown:
        raise ValueError(f"{config_cls.__name__} has no field {unknown[0]!r}")
    for opt in (by_name[n] for n in wanted) if wanted is not None else by_name.values():
        default = defaults.get(opt.name, opt.default)
        text = (
            f"{opt.help} (default {default})" if default is not None else f"{opt.help} (default: the runner's choice)"
        )
        if opt.type is bool:
            parser.add_argument(flag_name(prefix, opt.name), action="store_true", default=default, help=opt.help)
        else:
            # Optional[int] (unset by default) parses as int
            kind = next((t for t in typing.get_args(opt.type) if t is not type(None)), opt.type)
            parser.add_argument(flag_name(prefix, opt.name), type=kind, default=default, help=text)


def config_from_namespace(config_cls, ns, prefix: Optional[str] = None):
    """A config from an object carrying ``prefix + field`` attributes (fairseq's cfg, parsed
    arguments; ``prefix`` defaults to :func:`attribute_prefix`); fields the object lacks keep their defaults."""
    prefix = attribute_prefix(config_cls) if prefix is None else prefix
    return config_cls(
        **{f.name: getattr(ns, prefix + f.name) for f in dataclasses.fields(config_cls) if hasattr(ns, prefix + f.name)}
    )
