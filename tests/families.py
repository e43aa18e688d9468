"""The Hugging Face model families the adapter supports, each with a tiny random configuration.

One list serves three purposes: the per-family tests build each tiny model from it
(``tests/hf/test_hf_families.py``), docs/HF.md's supported-models table is generated from it
(``.venv/bin/python tests/docs_tables.py docs/HF.md``), and it documents which attention kinds
each family has. Sizes are the smallest each family accepts; nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Tuple

_ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99)
_SEQ2SEQ = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    vocab_size=99,
    max_position_embeddings=64,
    pad_token_id=0,
    eos_token_id=2,
    bos_token_id=1,
    decoder_start_token_id=2,
)
_DECODER = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=99,
    head_dim=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_T5 = dict(
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    vocab_size=99,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
    relative_attention_num_buckets=8,
)


@dataclass(frozen=True)
class Family:
    name: str  # as docs/HF.md's table lists it
    model_type: str  # transformers' model_type
    head: str  # the Auto class the tests build: MaskedLM, Seq2SeqLM, SpeechSeq2Seq or CausalLM
    config: Dict[str, object] = field(default_factory=dict)
    kinds: Tuple[str, ...] = ("encoder-self",)
    notes: str = ""


ENCODER_DECODER = ("encoder-self", "decoder-self", "encoder-decoder")

FAMILIES = [
    Family("BERT", "bert", "MaskedLM", _ENCODER),
    Family("RoBERTa", "roberta", "MaskedLM", _ENCODER),
    Family("XLM-R", "xlm-roberta", "MaskedLM", _ENCODER),
    Family("ELECTRA", "electra", "MaskedLM", dict(_ENCODER, embedding_size=32)),
    Family("DistilBERT", "distilbert", "MaskedLM", dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=99)),
    Family(
        "ALBERT",
        "albert",
        "MaskedLM",
        dict(_ENCODER, embedding_size=16),
        notes="one attention module shared by every depth: one site per depth; no gradient checkpointing",
    ),
    Family(
        "ModernBERT",
        "modernbert",
        "MaskedLM",
        dict(
            _ENCODER,
            num_hidden_layers=3,
            global_attn_every_n_layers=2,
            local_attention=4,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        ),
        notes="fused Wqkv, rotary positions, local-window layers (the window is in the mask)",
    ),
    Family(
        "T5 / Flan-T5",
        "t5",
        "Seq2SeqLM",
        _T5,
        ENCODER_DECODER,
        notes="relative position bias added to the scores before any mask",
    ),
    Family("mT5", "mt5", "Seq2SeqLM", _T5, ENCODER_DECODER),
    Family("BART", "bart", "Seq2SeqLM", _SEQ2SEQ, ENCODER_DECODER),
    Family("mBART", "mbart", "Seq2SeqLM", _SEQ2SEQ, ENCODER_DECODER),
    Family("Marian (OPUS-MT)", "marian", "Seq2SeqLM", dict(_SEQ2SEQ, decoder_start_token_id=0), ENCODER_DECODER),
    Family("M2M100 / NLLB", "m2m_100", "Seq2SeqLM", _SEQ2SEQ, ENCODER_DECODER),
    Family(
        "Whisper",
        "whisper",
        "SpeechSeq2Seq",
        dict(
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            vocab_size=99,
            num_mel_bins=8,
            max_source_positions=8,
            max_target_positions=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
        ),
        ENCODER_DECODER,
        notes="encoder on log-mel features",
    ),
    Family(
        "GPT-2",
        "gpt2",
        "CausalLM",
        dict(n_embd=32, n_layer=2, n_head=4, vocab_size=99, n_positions=64, bos_token_id=1, eos_token_id=2),
        ("decoder-self",),
        notes="fused c_attn projection",
    ),
    Family("Llama", "llama", "CausalLM", _DECODER, ("decoder-self",)),
    Family("Qwen2", "qwen2", "CausalLM", _DECODER, ("decoder-self",)),
    Family(
        "Mistral",
        "mistral",
        "CausalLM",
        dict(_DECODER, sliding_window=4),
        ("decoder-self",),
        notes="sliding window: in the mask",
    ),
    Family("Gemma", "gemma", "CausalLM", _DECODER, ("decoder-self",)),
]

# Families that are refused at construction, with why.
REFUSED = {
    "DeBERTa-v2 / v3": "its disentangled attention does not go through transformers' AttentionInterface",
}


def build(family: Family, seed: int = 0, **overrides):
    """The tiny random model of ``family`` (sdpa attention, seeded); ``overrides`` change config fields."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(family.model_type, **{**family.config, **overrides})
    config._attn_implementation = "sdpa"
    auto = getattr(transformers, f"AutoModelFor{family.head}")
    return auto.from_config(config, attn_implementation="sdpa")


def families_table() -> str:
    """docs/HF.md's supported-models table."""
    rows = ["| family | attention kinds | status | notes |", "|---|---|---|---|"]
    for f in FAMILIES:
        rows.append(f"| {f.name} | {', '.join(f.kinds)} | supported, tested | {f.notes} |")
    for name, why in REFUSED.items():
        rows.append(f"| {name} | - | refused at construction | {why} |")
    return "\n".join(rows)
