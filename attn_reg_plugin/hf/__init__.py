"""Hugging Face transformers adapter for attn_reg_plugin (AD-DROP), no copied modeling files."""
from .attention import ATTN_IMPLEMENTATION, attn_reg_attention, install_attention_sites, register_attn_reg
from .trainer import ADDropSeq2SeqTrainer, ADDropTrainer, ADDropTrainerMixin

__all__ = [
    "ADDropTrainer",
    "ADDropSeq2SeqTrainer",
    "ADDropTrainerMixin",
    "install_attention_sites",
    "attn_reg_attention",
    "register_attn_reg",
    "ATTN_IMPLEMENTATION",
]
