"""Hugging Face transformers adapter for attn_reg_plugin, no copied modeling files."""
from .attention import ATTN_IMPLEMENTATION, attn_reg_attention, install_attention_sites, register_attn_reg
from .regularizers import (
    AttendOutSeq2SeqTrainer,
    AttendOutTrainer,
    AttendOutTrainerMixin,
    AttnRegSeq2SeqTrainer,
    AttnRegTrainer,
    AttnRegTrainerMixin,
)
from .trainer import ADDropSeq2SeqTrainer, ADDropTrainer, ADDropTrainerMixin

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
    "install_attention_sites",
    "attn_reg_attention",
    "register_attn_reg",
    "ATTN_IMPLEMENTATION",
]
