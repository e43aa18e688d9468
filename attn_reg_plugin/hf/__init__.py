"""Hugging Face transformers adapter for attn_reg_plugin, no copied modeling files.

Each public name is imported from its module on first use (PEP 562), so that a command that only
needs :mod:`.methods`' option tables (attn-reg-cls-compare's ``--help`` and input checks) does not
pay for transformers' Trainer and peft first.
"""

import importlib

# public name -> the submodule that defines it
_HOMES = {
    **dict.fromkeys(("ADDropTrainer", "ADDropSeq2SeqTrainer", "ADDropTrainerMixin"), "ad_drop_trainer"),
    "ADDropRDropTrainer": "ad_drop_rdrop_trainer",
    **dict.fromkeys(("AttendOutTrainer", "AttendOutSeq2SeqTrainer", "AttendOutTrainerMixin"), "attendout_trainer"),
    **dict.fromkeys(("AttnRegTrainer", "AttnRegSeq2SeqTrainer", "AttnRegTrainerMixin"), "attn_reg_trainer"),
    **dict.fromkeys(("HiddenCutTrainer", "HiddenCutSeq2SeqTrainer", "HiddenCutTrainerMixin"), "hiddencut_trainer"),
    **dict.fromkeys(("RDropTrainer", "RDropSeq2SeqTrainer", "RDropTrainerMixin"), "rdrop_trainer"),
    **dict.fromkeys(("OwnPassesTrainerMixin", "TrainerStep"), "own_passes_trainer"),
    **dict.fromkeys(
        ("install_attention_sites", "attn_reg_attention", "register_attn_reg", "ATTN_IMPLEMENTATION"), "attention"
    ),
}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
        globals()[name] = value  # once: later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
