#!/usr/bin/env python
"""An offline stand-in for an OPUS-MT checkpoint: a tiny random MarianMTModel + a MarianTokenizer
(or, with ``--family t5``, a tiny random T5 + T5Tokenizer in T5's layout: <pad> 0, </s> 1, <unk> 2;
with ``--family nllb``, a tiny random M2M100 + NllbTokenizer with NLLB's language codes).

    python examples/opus_mt/build_tiny_marian.py --out outputs/tiny-marian-en-ro
    python examples/opus_mt/build_tiny_marian.py --out outputs/tiny-t5-en-ro --family t5
    python examples/opus_mt/build_tiny_marian.py --out outputs/tiny-nllb-en-ro --family nllb

Writes a folder that ``MarianMTModel.from_pretrained`` / ``AutoTokenizer.from_pretrained``
load exactly like a downloaded ``Helsinki-NLP/opus-mt-*`` one (source.spm, target.spm,
vocab.json, config.json, model.safetensors), so ``run_opus_mt.py --model FOLDER`` runs the
same code as with the real model. The tokenizer is a joint sentencepiece model trained on the
given parallel text; the vocabulary follows OPUS-MT's layout (``</s>`` = 0, ``<unk>`` = 1,
``<pad>`` = last, the decoder starts from ``<pad>``). The weights are random: translations
are meaningless until trained.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/example_support.py
from example_support import read_parallel


def build(
    out: Path,
    data: Path,
    src: str,
    tgt: str,
    train_lines: int = 2000,
    vocab_size: int = 1000,
    d_model: int = 64,
    layers: int = 2,
    heads: int = 4,
    ffn_dim: int = 128,
    max_positions: int = 256,
    seed: int = 0,
    family: str = "marian",
) -> Path:
    import sentencepiece as spm
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    src_lines, tgt_lines = read_parallel(data, "train", src, tgt, train_lines)
    if family == "t5":
        return _build_t5(out, src_lines + tgt_lines, vocab_size, d_model, layers, heads, ffn_dim, seed)
    if family == "nllb":
        return _build_nllb(out, src_lines + tgt_lines, vocab_size, d_model, layers, heads, ffn_dim, max_positions, seed)
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(src_lines + tgt_lines),
        model_writer=proto,
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_unknown(i))]
    vocab = {"</s>": 0, "<unk>": 1}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = len(vocab)

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        spm_path, vocab_path = Path(tmp) / "joint.spm", Path(tmp) / "vocab.json"
        spm_path.write_bytes(proto.getvalue())
        vocab_path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        tokenizer = MarianTokenizer(str(spm_path), str(spm_path), str(vocab_path), source_lang=src, target_lang=tgt)
        tokenizer.save_pretrained(out)
    pad = vocab["<pad>"]
    config = MarianConfig(
        vocab_size=len(vocab),
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn_dim,
        decoder_ffn_dim=ffn_dim,
        max_position_embeddings=max_positions,
        pad_token_id=pad,
        eos_token_id=0,
        decoder_start_token_id=pad,
        forced_eos_token_id=0,
        scale_embedding=True,
    )
    torch.manual_seed(seed)
    MarianMTModel(config).save_pretrained(out)
    return out


def _build_t5(
    out: Path, lines, vocab_size: int, d_model: int, layers: int, heads: int, ffn_dim: int, seed: int
) -> Path:
    import sentencepiece as spm
    import torch
    from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=proto,
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]  # <pad>, </s>, <unk>, pieces
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0)
    tokenizer.save_pretrained(out)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_model // heads,
        d_ff=ffn_dim,
        num_layers=layers,
        num_heads=heads,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    torch.manual_seed(seed)
    T5ForConditionalGeneration(config).save_pretrained(out)
    return out


def _build_nllb(
    out: Path,
    lines,
    vocab_size: int,
    d_model: int,
    layers: int,
    heads: int,
    ffn_dim: int,
    max_positions: int,
    seed: int,
) -> Path:
    """A tiny random M2M100 (NLLB's architecture) with an NllbTokenizer: NLLB's BPE layout (<s> 0, <pad> 1,
    </s> 2, <unk> 3) and its language codes (eng_Latn, ron_Latn, ...) as the first token of each side."""
    import json as json_module

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import M2M100Config, M2M100ForConditionalGeneration, NllbTokenizer

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=False, special_tokens=["<s>", "<pad>", "</s>", "<unk>"]
        ),
    )
    trained = json_module.loads(bpe.to_str())["model"]
    tokenizer = NllbTokenizer(vocab=trained["vocab"], merges=[tuple(m) for m in trained["merges"]])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    config = M2M100Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn_dim,
        decoder_ffn_dim=ffn_dim,
        max_position_embeddings=max_positions,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    torch.manual_seed(seed)
    M2M100ForConditionalGeneration(config).save_pretrained(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=REPO / "data" / "gettext_en_ro", help="folder with train.{src,tgt}")
    ap.add_argument("--src", default="en")
    ap.add_argument("--tgt", default="ro")
    ap.add_argument("--train-lines", type=int, default=2000, help="pairs the sentencepiece model is trained on")
    ap.add_argument("--vocab-size", type=int, default=1000)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn-dim", type=int, default=128)
    ap.add_argument("--family", choices=("marian", "t5", "nllb"), default="marian")
    args = ap.parse_args(argv)
    for name in ("train_lines", "vocab_size", "d_model", "layers", "heads", "ffn_dim"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    path = build(
        args.out,
        args.data,
        args.src,
        args.tgt,
        args.train_lines,
        args.vocab_size,
        args.d_model,
        args.layers,
        args.heads,
        args.ffn_dim,
        family=args.family,
    )
    print(f"tiny random {args.family} model and tokenizer written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
