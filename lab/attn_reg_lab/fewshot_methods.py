"""The few-shot runner's methods: plain, AD-DROP, AttendOut and the papers' baselines (R-Drop, HiddenCut,
DropHead, DropKey), each a Trainer of the plugin's public HF API with its own options at the papers' defaults.

Defaults: R-Drop alpha 1.0 (the runner's choice: no single GLUE value of the R-Drop paper was found to cite;
the plugin's own default, 5, is the paper's MT value); HiddenCut ratio 0.1, top 0.4, alpha 1 (its official script); DropHead p 0.1
constant (the paper's V schedule depends on the run's length: give it with --attn-drophead-schedule as
knots, e.g. 0:0.1,N/2:0,N:0.1); DropKey rate 0.1 (layer l of L dropped at 0.1 * (1 - l/L)).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Dict, Tuple


@dataclass(frozen=True)
class Method:
    """One training method of the comparison.

    ``build(opts, **trainer_kwargs)`` returns a ``transformers.Trainer`` (``trainer_kwargs``:
    model, args, train_dataset, data_collator, callbacks); it must fail on bad options when
    built, which the runner does once before any training. ``settings(opts)`` is what gets
    recorded; ``min_epochs(opts)`` the fewest epochs for the method to do anything. ``log_keys``: the
    Trainer log keys copied into each epoch's record (a key ending in ``*`` is a prefix).
    """

    name: str
    help: str
    build: Callable[..., object]
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    settings: Callable[[argparse.Namespace], dict] = lambda opts: {}
    min_epochs: Callable[[argparse.Namespace], int] = lambda opts: 1
    log_keys: Tuple[str, ...] = ()

    def logged(self, log: dict) -> dict:
        """The entries of one Trainer log that this method records per epoch."""
        exact = {k for k in self.log_keys if not k.endswith("*")}
        prefixes = tuple(k[:-1] for k in self.log_keys if k.endswith("*"))
        return {k: v for k, v in log.items() if k in exact or k.startswith(prefixes)}


def _build_plain(opts, **trainer_kwargs):
    import transformers

    # eval_dataset is only for methods that draw held-out samples (AttendOut); plain and AD-DROP
    # never see it, so every method trains on exactly the same data.
    trainer_kwargs.pop("eval_dataset", None)
    return transformers.Trainer(**trainer_kwargs)


def _ad_drop_arguments(parser: argparse.ArgumentParser) -> None:
    from attn_reg_plugin.core.ad_drop_config import ADDropConfig
    from attn_reg_plugin.core.options import add_arguments

    group = parser.add_argument_group("ad-drop", "AD-DROP options (attn_reg_plugin ADDropConfig fields)")
    add_arguments(
        group, ADDropConfig, only=("p", "q", "layers", "attribution", "schedule"), defaults={"p": 0.3, "q": 0.3}
    )


def _ad_drop_config(opts):
    from attn_reg_plugin.core.ad_drop_config import ADDropConfig

    return ADDropConfig.from_namespace(opts)  # attention: encoder-self, the default


def _build_ad_drop(opts, **trainer_kwargs):
    from attn_reg_plugin.hf import ADDropTrainer

    trainer_kwargs.pop("eval_dataset", None)
    return ADDropTrainer(**trainer_kwargs, ad_drop=_ad_drop_config(opts))


def _attendout_arguments(parser: argparse.ArgumentParser) -> None:
    from attn_reg_plugin.core.attendout import AttendOutConfig
    from attn_reg_plugin.core.options import add_arguments

    group = parser.add_argument_group("attendout", "AttendOut options (attn_reg_plugin AttendOutConfig fields)")
    add_arguments(
        group, AttendOutConfig, only=("dropout_step", "init_drop", "lr", "layers"), defaults={"dropout_step": 4}
    )


def _attendout_config(opts):
    from attn_reg_plugin.core.attendout import AttendOutConfig

    return AttendOutConfig.from_namespace(opts)  # attention: encoder-self, the default


def _build_attendout(opts, **trainer_kwargs):
    from attn_reg_plugin.hf import AttendOutTrainer

    return AttendOutTrainer(**trainer_kwargs, attendout=_attendout_config(opts))


def _ad_drop_settings(opts) -> dict:
    config = _ad_drop_config(opts).validate()  # errors name the --ad-drop-* option
    # Fields at a value that changes nothing are left out, so runs recorded before they existed stay comparable.
    return {
        k: v
        for k, v in vars(config).items()
        if (k != "iga_steps" or config.attribution == "iga") and (k != "attribution_precision" or v != "auto")
    }


# The baselines' options: the plugin's own flags (module, config class, fields, the runner's defaults).
_BASELINE_OPTIONS = {
    "r-drop": ("rdrop", "RDropConfig", ("alpha",), {"alpha": 1.0}),
    "hiddencut": ("hiddencut", "HiddenCutConfig", ("ratio", "top", "alpha", "layers"), {}),
    "drophead": ("drophead", "DropHeadConfig", ("schedule", "layers"), {"schedule": "0:0.1"}),
    "dropkey": ("scheduled_dropout", "ScheduledDropoutConfig", ("schedule", "layers"), {"schedule": "dropkey:0.1"}),
}


def _config_options_lazy(name: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(parser: argparse.ArgumentParser) -> None:
        import importlib

        from attn_reg_plugin.core.options import add_arguments

        module, cls_name, only, defaults = _BASELINE_OPTIONS[name]
        config_cls = getattr(importlib.import_module(f"attn_reg_plugin.core.{module}"), cls_name)
        group = parser.add_argument_group(name, f"{name} options (attn_reg_plugin {cls_name} fields)")
        add_arguments(group, config_cls, only=only, defaults=defaults)

    return add


def _rdrop_config(opts):
    from attn_reg_plugin.core.rdrop import RDropConfig

    return RDropConfig.from_namespace(opts)


def _hiddencut_config(opts):
    from attn_reg_plugin.core.hiddencut import HiddenCutConfig

    return HiddenCutConfig.from_namespace(opts)


def _drophead_config(opts):
    from attn_reg_plugin.core.drophead import DropHeadConfig

    return DropHeadConfig.from_namespace(opts)


def _dropkey_config(opts):
    from attn_reg_plugin.core.scheduled_dropout import ScheduledDropoutConfig

    return ScheduledDropoutConfig.from_namespace(opts)


def _build_rdrop(opts, **trainer_kwargs):
    from attn_reg_plugin.hf import RDropTrainer

    trainer_kwargs.pop("eval_dataset", None)
    return RDropTrainer(**trainer_kwargs, rdrop=_rdrop_config(opts))


def _build_hiddencut(opts, **trainer_kwargs):
    from attn_reg_plugin.hf import HiddenCutTrainer

    trainer_kwargs.pop("eval_dataset", None)
    return HiddenCutTrainer(**trainer_kwargs, hiddencut=_hiddencut_config(opts))


def _build_attn_reg(keyword: str, config: Callable):
    def build(opts, **trainer_kwargs):
        from attn_reg_plugin.hf import AttnRegTrainer

        trainer_kwargs.pop("eval_dataset", None)
        return AttnRegTrainer(**trainer_kwargs, **{keyword: config(opts)})

    return build


def _dropkey_settings(opts) -> dict:
    config = _dropkey_config(opts).validate()
    if not config.schedule.strip().startswith("dropkey:"):
        raise ValueError(
            f"--attn-sched-dropout-schedule must be dropkey:RATE for method dropkey, got {config.schedule!r}"
        )
    return vars(config)


def _drophead_settings(opts) -> dict:
    config = _drophead_config(opts).validate()
    if not config.enabled:
        raise ValueError("--attn-drophead-schedule is empty: method drophead would not drop anything")
    return vars(config)


METHODS: Dict[str, Method] = {
    "plain": Method("plain", "stock transformers.Trainer", _build_plain),
    "ad-drop": Method(
        "ad-drop",
        "attn_reg_plugin.hf.ADDropTrainer",
        _build_ad_drop,
        add_arguments=_ad_drop_arguments,
        settings=_ad_drop_settings,
        min_epochs=lambda opts: 2 if opts.ad_drop_schedule == "cross-tuning" else 1,
        log_keys=("ad_drop_on", "ad_drop_rate"),
    ),
    "attendout": Method(
        "attendout",
        "attn_reg_plugin.hf.AttendOutTrainer (held-out samples: the dev subset)",
        _build_attendout,
        add_arguments=_attendout_arguments,
        settings=lambda opts: vars(_attendout_config(opts).validate()),
    ),
    "r-drop": Method(
        "r-drop",
        "attn_reg_plugin.hf.RDropTrainer (two passes + alpha * symmetric KL)",
        _build_rdrop,
        add_arguments=_config_options_lazy("r-drop"),
        settings=lambda opts: vars(_rdrop_config(opts).validate()),
        log_keys=("rdrop_kl",),
    ),
    "hiddencut": Method(
        "hiddencut",
        "attn_reg_plugin.hf.HiddenCutTrainer (clean + cut pass + alpha * JS)",
        _build_hiddencut,
        add_arguments=_config_options_lazy("hiddencut"),
        settings=lambda opts: vars(_hiddencut_config(opts).validate()),
        log_keys=("hiddencut_js", "hiddencut_cut", "hiddencut_tokens"),
    ),
    "drophead": Method(
        "drophead",
        "attn_reg_plugin.hf.AttnRegTrainer(drophead=DropHeadConfig)",
        _build_attn_reg("drophead", _drophead_config),
        add_arguments=_config_options_lazy("drophead"),
        settings=_drophead_settings,
        log_keys=("attn_drophead_rate", "attn_drophead_p"),
    ),
    "dropkey": Method(
        "dropkey",
        "attn_reg_plugin.hf.AttnRegTrainer(scheduled_dropout=ScheduledDropoutConfig(schedule='dropkey:RATE'))",
        _build_attn_reg("scheduled_dropout", _dropkey_config),
        add_arguments=_config_options_lazy("dropkey"),
        settings=_dropkey_settings,
        log_keys=("attn_sched_dropout_rate", "attn_sched_dropout_p_layer*"),
    ),
}
