"""Hugging Face transformers adapter for attn_reg_plugin, no copied modeling files."""

from .ad_drop_trainer import ADDropSeq2SeqTrainer, ADDropTrainer, ADDropTrainerMixin
from .attendout_trainer import AttendOutSeq2SeqTrainer, AttendOutTrainer, AttendOutTrainerMixin
from .attention import ATTN_IMPLEMENTATION, attn_reg_attention, install_attention_sites, register_attn_reg
from .attn_reg_trainer import AttnRegSeq2SeqTrainer, AttnRegTrainer, AttnRegTrainerMixin
from .hiddencut_trainer import HiddenCutSeq2SeqTrainer, HiddenCutTrainer, HiddenCutTrainerMixin
from .rdrop_trainer import RDropSeq2SeqTrainer, RDropTrainer, RDropTrainerMixin

__all__ = [
    "ADDropTrainer",
    "ADDropSeq2SeqTrainer",
    "ADDropTrainerMixin",
    "AttendOutTrainer",
    "AttendOutSeq2SeqTrainer",
    "AttendOutTrainerMixin",
    "AttnRegTrainer",
    "AttnRegSeq2SeqTrainer",
    "AttnRegTrainerMixin",
    "HiddenCutSeq2SeqTrainer",
    "HiddenCutTrainer",
    "HiddenCutTrainerMixin",
    "RDropTrainer",
    "RDropSeq2SeqTrainer",
    "RDropTrainerMixin",
    "install_attention_sites",
    "attn_reg_attention",
    "register_attn_reg",
    "ATTN_IMPLEMENTATION",
]
