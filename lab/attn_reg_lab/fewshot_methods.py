"""The few-shot runner's methods: plain, AD-DROP and AttendOut Trainers, each with its own options."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Dict


@dataclass(frozen=True)
class Method:
    """One training method of the comparison.

    ``build(opts, **trainer_kwargs)`` returns a ``transformers.Trainer`` (``trainer_kwargs``:
    model, args, train_dataset, data_collator, callbacks); it must fail on bad options when
    built, which the runner does once before any training. ``settings(opts)`` is what gets
    recorded; ``min_epochs(opts)`` the fewest epochs for the method to do anything.
    """

    name: str
    help: str
    build: Callable[..., object]
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    settings: Callable[[argparse.Namespace], dict] = lambda opts: {}
    min_epochs: Callable[[argparse.Namespace], int] = lambda opts: 1


def _build_plain(opts, **trainer_kwargs):
    import transformers

    # eval_dataset is only for methods that draw held-out samples (AttendOut); plain and AD-DROP
    # never see it, so every method trains on exactly the same data.
    trainer_kwargs.pop("eval_dataset", None)
    return transformers.Trainer(**trainer_kwargs)


def _ad_drop_arguments(parser: argparse.ArgumentParser) -> None:
    from attn_reg_plugin.core.ad_drop import ADDropConfig
    from attn_reg_plugin.core.options import add_arguments

    group = parser.add_argument_group("ad-drop", "AD-DROP options (attn_reg_plugin ADDropConfig fields)")
    add_arguments(
        group, ADDropConfig, only=("p", "q", "layers", "attribution", "schedule"), defaults={"p": 0.3, "q": 0.3}
    )


def _ad_drop_config(opts):
    from attn_reg_plugin.core.ad_drop import ADDropConfig

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


METHODS: Dict[str, Method] = {
    "plain": Method("plain", "stock transformers.Trainer", _build_plain),
    "ad-drop": Method(
        "ad-drop",
        "attn_reg_plugin.hf.ADDropTrainer",
        _build_ad_drop,
        add_arguments=_ad_drop_arguments,
        settings=_ad_drop_settings,
        min_epochs=lambda opts: 2 if opts.ad_drop_schedule == "cross-tuning" else 1,
    ),
    "attendout": Method(
        "attendout",
        "attn_reg_plugin.hf.AttendOutTrainer (held-out samples: the dev subset)",
        _build_attendout,
        add_arguments=_attendout_arguments,
        settings=lambda opts: vars(_attendout_config(opts).validate()),
    ),
}
