"""The plugin's Hugging Face trainers by method name, each with its options: what attn-reg-cls-compare
(and the lab's attn-reg-fewshot) build per method, so that every method gets the same model,
``TrainingArguments``, data and collator and differs only in what its regularizer does.

Methods: plain (the stock ``transformers.Trainer``), ad-drop, attendout, r-drop, hiddencut, the methods of
the regularizer registry (:mod:`..core.regularizers.registry`: the plugin's and any registered outside the
package, each through ``AttnRegTrainer``) and ad-drop-r-drop (R-Drop over AD-DROP's masked pass, the one
combination the plugin allows).
A method's options are its config's fields as flags (``--ad-drop-p``, ``--rdrop-alpha``, ...: the
fairseq flags' names), declared once per option group (:data:`OPTION_GROUPS`), so that a command adds
each group once however many methods share it. Defaults for sentence classifiers: AD-DROP p = q = 0.3;
R-Drop alpha 1.0 (no single GLUE value of the R-Drop paper was found to cite; the plugin's own default,
5, is the paper's MT value); HiddenCut ratio 0.1, top 0.4, alpha 1 (its official script); AttendOut a
dropout step every 4 updates (few-shot runs are short); a registry method's are its ``Method.defaults``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from ..core.regularizers.registry import method_table

# An option group: (the core module, its config class, the defaults for classifiers). Its flags are
# the config's FLAG_PREFIX + field; every field but ``attention`` (encoder-self, found by the trainer).
# A registry method is an option group of its own (its regularizer's config, its Method.defaults).
OPTION_GROUPS: Dict[str, Tuple[str, str, dict]] = {
    "ad-drop": ("regularizers.ad_drop_config", "ADDropConfig", {"p": 0.3, "q": 0.3}),
    "attendout": ("regularizers.attendout", "AttendOutConfig", {"dropout_step": 4}),
    "r-drop": ("regularizers.rdrop", "RDropConfig", {"alpha": 1.0}),
    "hiddencut": ("regularizers.hiddencut", "HiddenCutConfig", {}),
}


def config_class(group: str):
    if group in OPTION_GROUPS:
        module, name, _ = OPTION_GROUPS[group]
        return getattr(importlib.import_module(f"attn_reg_plugin.core.{module}"), name)
    return registry_methods()[group][0].config


def group_defaults(group: str) -> dict:
    return OPTION_GROUPS[group][2] if group in OPTION_GROUPS else dict(registry_methods()[group][1].defaults)


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
    args, train_dataset, eval_dataset, data_collator, callbacks; only AttendOut keeps eval_dataset,
    its held-out draws, so every other method trains on exactly the same data); it fails on bad
    options when built. ``option_groups``: the groups of its options. ``settings(opts)``: its resolved
    config fields, validated (a ValueError names the field). ``min_epochs(opts)``: the fewest epochs for
    it to do anything. ``log_keys``: the Trainer log keys a run records (a key ending in ``*`` is a prefix).
    """

    name: str
    help: str
    build: Callable[..., object]
    option_groups: Tuple[str, ...] = ()
    min_epochs: Callable[[argparse.Namespace], int] = lambda opts: 1
    log_keys: Tuple[str, ...] = ()
    check: Optional[Callable[[object], None]] = None  # a registry method's: its config is this method

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
    """A config's fields as recorded: AD-DROP's at a value that changes nothing are left out, so that runs
    recorded before they existed stay comparable."""
    fields = vars(config)
    if group != "ad-drop":
        return dict(fields)
    return {
        k: v
        for k, v in fields.items()
        if (k != "iga_steps" or config.attribution == "iga") and (k != "attribution_precision" or v != "auto")
    }


def _without_eval(trainer_kwargs: dict) -> dict:
    return {k: v for k, v in trainer_kwargs.items() if k != "eval_dataset"}


def _build_plain(opts, **trainer_kwargs):
    import transformers

    return transformers.Trainer(**_without_eval(trainer_kwargs))


def _build_ad_drop(opts, **trainer_kwargs):
    from . import ADDropTrainer

    return ADDropTrainer(**_without_eval(trainer_kwargs), ad_drop=group_config("ad-drop", opts))


def _build_attendout(opts, **trainer_kwargs):
    from . import AttendOutTrainer

    return AttendOutTrainer(**trainer_kwargs, attendout=group_config("attendout", opts))


def _build_rdrop(opts, **trainer_kwargs):
    from . import RDropTrainer

    return RDropTrainer(**_without_eval(trainer_kwargs), rdrop=group_config("r-drop", opts))


def _build_hiddencut(opts, **trainer_kwargs):
    from . import HiddenCutTrainer

    return HiddenCutTrainer(**_without_eval(trainer_kwargs), hiddencut=group_config("hiddencut", opts))


def _build_attn_reg(keyword: str, group: str):
    def build(opts, **trainer_kwargs):
        from . import AttnRegTrainer

        return AttnRegTrainer(**_without_eval(trainer_kwargs), **{keyword: group_config(group, opts)})

    return build


def registry_methods():
    from ..core.regularizers.registry import methods

    return methods()


def _trainer_method(regularizer, method) -> Method:
    """A method of the regularizer registry, trained by ``AttnRegTrainer(<key>=<config>)``."""
    return Method(
        method.name,
        f"attn_reg_plugin.hf.AttnRegTrainer({regularizer.key}={regularizer.config.__name__}): {method.help}",
        _build_attn_reg(regularizer.key, method.name),
        (method.name,),
        log_keys=regularizer.log_keys(),
        check=method.check,
    )


@functools.cache
def ad_drop_rdrop_trainer_class():
    """R-Drop over AD-DROP's masked pass: the bases in the one order the plugin allows (HF.md, R-Drop)."""
    import transformers

    from . import ADDropTrainerMixin, RDropTrainerMixin

    class ADDropRDropTrainer(ADDropTrainerMixin, RDropTrainerMixin, transformers.Trainer):
        pass

    return ADDropRDropTrainer


def _build_ad_drop_rdrop(opts, **trainer_kwargs):
    return ad_drop_rdrop_trainer_class()(
        **_without_eval(trainer_kwargs), ad_drop=group_config("ad-drop", opts), rdrop=group_config("r-drop", opts)
    )


def _ad_drop_epochs(opts) -> int:
    return 2 if opts.ad_drop_schedule == "cross-tuning" else 1


METHODS: Dict[str, Method] = method_table(
    {
        "plain": Method("plain", "stock transformers.Trainer", _build_plain),
        "ad-drop": Method(
            "ad-drop",
            "attn_reg_plugin.hf.ADDropTrainer",
            _build_ad_drop,
            ("ad-drop",),
            _ad_drop_epochs,
            ("ad_drop_on", "ad_drop_rate"),
        ),
        "attendout": Method(
            "attendout",
            "attn_reg_plugin.hf.AttendOutTrainer (held-out samples: the dev set)",
            _build_attendout,
            ("attendout",),
        ),
        "r-drop": Method(
            "r-drop",
            "attn_reg_plugin.hf.RDropTrainer (two passes + alpha * symmetric KL)",
            _build_rdrop,
            ("r-drop",),
            log_keys=("rdrop_kl",),
        ),
        "hiddencut": Method(
            "hiddencut",
            "attn_reg_plugin.hf.HiddenCutTrainer (clean + cut pass + alpha * JS)",
            _build_hiddencut,
            ("hiddencut",),
            log_keys=("hiddencut_js", "hiddencut_cut", "hiddencut_tokens"),
        ),
        "ad-drop-r-drop": Method(
            "ad-drop-r-drop",
            "R-Drop over AD-DROP's masked pass (ADDropTrainerMixin, RDropTrainerMixin, transformers.Trainer)",
            _build_ad_drop_rdrop,
            ("ad-drop", "r-drop"),
            _ad_drop_epochs,
            ("ad_drop_on", "ad_drop_rate", "rdrop_kl"),
        ),
    },
    _trainer_method,
)


def add_method_options(parser: argparse.ArgumentParser, names) -> None:
    """Each option group of the methods ``names`` once."""
    for group in dict.fromkeys(g for name in names for g in METHODS[name].option_groups):
        add_option_group(parser, group)
