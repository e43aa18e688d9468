#!/usr/bin/env python
"""Train the plain-PyTorch encoder-decoder of seq2seq_model.py with AD-DROP through the core API.

    python examples/custom_seq2seq/train.py                       # EN->RO, shipped corpus, AD-DROP
    python examples/custom_seq2seq/train.py --method plain        # the same run without AD-DROP
    python examples/custom_seq2seq/train.py --epochs 2 --train-size 200 --dim 32 --layers 1   # a smoke run

A joint sentencepiece vocabulary is trained on the training pairs; the model trains with
label-smoothed cross-entropy; with ``--method ad-drop`` every epoch the schedule selects
(cross-tuning: the 2nd, 4th, ...) wraps the training forward in ``ADDrop.masked`` (steps 3
and 4 of ``attn_reg_plugin.core``'s guide). One line per epoch: train loss, valid loss, the
measured drop rate. At the end the best-valid-loss weights greedy-decode the first
``--bleu-sentences`` test sentences, scored with sacrebleu against the raw references.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
from seq2seq_model import Seq2SeqTransformer  # this example's model, next to this file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/example_support.py
from example_support import ad_drop_config, read_parallel

from attn_reg_plugin.core import ADDrop, ad_drop_epoch, token_loss_target

PAD, UNK, BOS, EOS = 0, 1, 2, 3


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--data",
        type=Path,
        default=REPO / "data" / "gettext_en_ro",
        help="folder with {train,valid,test}.{src,tgt} (one sentence per line)",
    )
    ap.add_argument("--src", default="en")
    ap.add_argument("--tgt", default="ro")
    ap.add_argument("--train-size", type=int, default=None, help="first N training pairs (default: all)")
    ap.add_argument("--valid-size", type=int, default=None, help="first N valid pairs (default: all)")
    ap.add_argument("--bleu-sentences", type=int, default=200, help="test sentences to decode and score")
    ap.add_argument("--vocab-size", type=int, default=2000, help="joint sentencepiece pieces")
    ap.add_argument("--max-len", type=int, default=128, help="sentences are cut to this many pieces")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn-dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=3, help="encoder and decoder layers each")
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--attention-dropout", type=float, default=0.1)
    ap.add_argument(
        "--norm", choices=("pre", "post"), default="pre", help="LayerNorm before or after each residual sum"
    )
    ap.add_argument("--positions", choices=("sinusoidal", "learned"), default="sinusoidal")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=64, help="sentence pairs per update")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=300, help="linear warm-up updates, then inverse square root")
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--method", choices=("ad-drop", "plain"), default="ad-drop")
    ap.add_argument("--ad-drop-p", type=float, default=0.2)
    ap.add_argument("--ad-drop-q", type=float, default=0.2)
    ap.add_argument("--ad-drop-layers", default="all")
    ap.add_argument("--ad-drop-attention", default="encoder-self")
    ap.add_argument("--ad-drop-attribution", default="ga")
    ap.add_argument("--ad-drop-schedule", default="cross-tuning")
    ap.add_argument("--out", type=Path, default=None, help="write results.json and the sentencepiece model here")
    args = ap.parse_args(argv)
    positive = (
        "train_size",
        "valid_size",
        "vocab_size",
        "max_len",
        "dim",
        "heads",
        "ffn_dim",
        "layers",
        "epochs",
        "batch_size",
    )
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.bleu_sentences < 0 or args.warmup < 0:
        ap.error(f"--bleu-sentences and --warmup must be >= 0, got {args.bleu_sentences}, {args.warmup}")
    for name in ("dropout", "attention_dropout", "label_smoothing"):
        if not 0.0 <= getattr(args, name) < 1.0:
            ap.error(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    if args.dim % args.heads:
        ap.error(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    if not args.lr > 0:
        ap.error(f"--lr must be > 0, got {args.lr}")
    return args


def train_sentencepiece(lines: Sequence[str], vocab_size: int):
    import sentencepiece as spm

    proto = io.BytesIO()
    try:
        _train_pieces(spm, lines, proto, vocab_size)
    except RuntimeError as error:  # sentencepiece's own check, e.g. fewer pieces than the data's characters
        raise SystemExit(f"train.py: error: --vocab-size {vocab_size} does not fit this data: {error}") from None
    return spm.SentencePieceProcessor(model_proto=proto.getvalue()), proto.getvalue()


def _train_pieces(spm, lines: Sequence[str], proto, vocab_size: int) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=proto,
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        pad_id=PAD,
        unk_id=UNK,
        bos_id=BOS,
        eos_id=EOS,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )


def pad_batch(seqs: List[List[int]]) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [PAD] * (width - len(s)) for s in seqs], dtype=torch.long)


def make_batch(src_ids, tgt_ids, index):
    """Encoder input ``src + </s>``, decoder input ``<s> + tgt``, target ``tgt + </s>``."""
    src = pad_batch([src_ids[i] + [EOS] for i in index])
    prev = pad_batch([[BOS] + tgt_ids[i] for i in index])
    target = pad_batch([tgt_ids[i] + [EOS] for i in index])
    return src, prev, target


def shuffled_batches(lengths: Sequence[int], batch_size: int) -> List[List[int]]:
    """Random batches of similar lengths: shuffle, sort windows of 100 batches by length, shuffle the batches.

    Batching similar lengths together cuts the padding the model computes on.
    """
    order = torch.randperm(len(lengths)).tolist()
    window = batch_size * 100
    batches = []
    for first in range(0, len(order), window):
        chunk = sorted(order[first : first + window], key=lengths.__getitem__)
        batches.extend(chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size))
    return [batches[i] for i in torch.randperm(len(batches)).tolist()]


def learning_rate(step: int, base: float, warmup: int) -> float:
    """Linear warm-up to ``base`` over ``warmup`` updates, then base * sqrt(warmup / step)."""
    if warmup == 0:
        return base
    return base * min(step / warmup, math.sqrt(warmup / max(step, 1)))


def evaluate_loss(model, src_ids, tgt_ids, batch_size) -> float:
    """Per-token cross-entropy (no label smoothing) on the given pairs."""
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(src_ids), batch_size):
            src, prev, target = make_batch(src_ids, tgt_ids, range(start, min(start + batch_size, len(src_ids))))
            logits = model(src, prev)
            total += F.cross_entropy(logits.transpose(1, 2), target, ignore_index=PAD, reduction="sum").item()
            tokens += int(target.ne(PAD).sum())
    return total / tokens


def translate(model, sp, sentences: Sequence[str], max_len: int, batch_size: int = 32) -> List[str]:
    model.eval()
    out = []
    for start in range(0, len(sentences), batch_size):
        ids = [sp.encode(s)[:max_len] for s in sentences[start : start + batch_size]]
        src = pad_batch([x + [EOS] for x in ids])
        # Stop at twice the source length + 10 pieces, within the model's positions (one is <s>).
        hyp = model.greedy(src, BOS, EOS, max_len=min(2 * src.shape[1] + 10, model.max_positions - 1))
        for row in hyp.tolist():
            row = row[: row.index(EOS)] if EOS in row else row
            out.append(sp.decode([t for t in row if t != PAD]))
    return out


def run(args: argparse.Namespace) -> Dict[str, object]:
    config = ad_drop_config(args) if args.method == "ad-drop" else None
    train_src, train_tgt = read_parallel(args.data, "train", args.src, args.tgt, args.train_size)
    valid_src, valid_tgt = read_parallel(args.data, "valid", args.src, args.tgt, args.valid_size)
    test_src, test_tgt = read_parallel(args.data, "test", args.src, args.tgt, args.bleu_sentences)
    for split, lines in (("train", train_src), ("valid", valid_src)):
        if not lines:
            raise ValueError(f"{args.data}: no {split} pairs ({split}.{args.src} is empty)")

    torch.manual_seed(args.seed)
    sp, sp_proto = train_sentencepiece(train_src + train_tgt, args.vocab_size)
    encode = lambda lines: [sp.encode(s)[: args.max_len] for s in lines]  # noqa: E731
    train_x, train_y, valid_x, valid_y = encode(train_src), encode(train_tgt), encode(valid_src), encode(valid_tgt)
    lengths = [max(len(x), len(y)) for x, y in zip(train_x, train_y)]

    model = Seq2SeqTransformer(
        sp.get_piece_size(),
        PAD,
        dim=args.dim,
        heads=args.heads,
        ffn_dim=args.ffn_dim,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        dropout=args.dropout,
        attention_dropout=args.attention_dropout,
        pre_norm=args.norm == "pre",
        positions=args.positions,
        max_positions=args.max_len + 2,
    )
    # Steps 3-4 of the porting guide. ADDrop checks the layers / kinds against the model's sites now.
    ad_drop = ADDrop(config, model.controller) if config is not None else None
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    print(
        f"data {args.data}: {len(train_x)} train / {len(valid_x)} valid pairs, {sp.get_piece_size()} pieces; "
        f"model {sum(p.numel() for p in model.parameters())} parameters; method {args.method}"
        + (
            f" (p={config.p}, q={config.q}, {config.attention}, layers {config.layers}, {config.schedule})"
            if config
            else ""
        ),
        flush=True,
    )

    history, best = [], (math.inf, None, 0)
    step = 0
    for epoch in range(1, args.epochs + 1):
        model.train()
        use_ad_drop = ad_drop is not None and ad_drop_epoch(config.schedule, epoch)
        loss_sum, token_sum, dropped, droppable = 0.0, 0, 0, 0
        start = time.time()
        for index in shuffled_batches(lengths, args.batch_size):
            src, prev, target = make_batch(train_x, train_y, index)
            keep = target.ne(PAD)

            def loss_of(logits):
                return F.cross_entropy(
                    logits.transpose(1, 2),
                    target,
                    ignore_index=PAD,
                    label_smoothing=args.label_smoothing,
                    reduction="sum",
                )

            if use_ad_drop:
                # F = minus the token loss against pass-1 argmax tokens, over non-pad targets.
                target_fn = lambda logits, labels: token_loss_target(logits, keep, labels)  # noqa: E731
                with ad_drop.masked(lambda: model(src, prev), target_fn, frozen=model) as stats:
                    loss = loss_of(model(src, prev))
                dropped += int(stats["dropped"])
                droppable += int(stats["droppable"])
            else:
                loss = loss_of(model(src, prev))
            step += 1
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.lr, args.warmup)
            optimizer.zero_grad(set_to_none=True)
            (loss / keep.sum()).backward()
            optimizer.step()
            loss_sum += loss.item()
            token_sum += int(keep.sum())
        train_loss = loss_sum / token_sum
        if not math.isfinite(train_loss):
            raise FloatingPointError(f"epoch {epoch}: training loss is {train_loss}")
        valid_loss = evaluate_loss(model, valid_x, valid_y, args.batch_size)
        rate = dropped / droppable if droppable else 0.0
        record = {
            "epoch": epoch,
            "ad_drop": use_ad_drop,
            "train_loss": round(train_loss, 4),
            "valid_loss": round(valid_loss, 4),
            "drop_rate": round(rate, 4),
            "seconds": round(time.time() - start, 1),
        }
        history.append(record)
        print(
            f"epoch {epoch:3d} | {'AD-DROP' if use_ad_drop else 'plain  '} | train loss {train_loss:.4f} | "
            f"valid loss {valid_loss:.4f} | drop rate {rate:.4f} | {record['seconds']:.1f} s",
            flush=True,
        )
        if valid_loss < best[0]:
            best = (valid_loss, copy.deepcopy(model.state_dict()), epoch)

    model.load_state_dict(best[1])
    result: Dict[str, object] = {
        "method": args.method,
        "epochs": history,
        "best_epoch": best[2],
        "best_valid_loss": round(best[0], 4),
    }
    if test_src:
        import sacrebleu

        hyps = translate(model, sp, test_src, args.max_len)
        bleu = sacrebleu.corpus_bleu(hyps, [test_tgt])
        result.update(
            bleu=round(bleu.score, 2),
            bleu_signature=str(bleu),
            bleu_sentences=len(hyps),
            examples=[{"src": s, "ref": r, "hyp": h} for s, r, h in list(zip(test_src, test_tgt, hyps))[:3]],
        )
        for ex in result["examples"]:
            print(f"  src: {ex['src']}\n  ref: {ex['ref']}\n  hyp: {ex['hyp']}")
        print(
            f"best epoch {best[2]} (valid loss {best[0]:.4f}); greedy BLEU on {len(hyps)} test sentences: "
            f"{bleu.score:.2f}  ({bleu})",
            flush=True,
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "spm.model").write_bytes(sp_proto)
        (args.out / "results.json").write_text(
            json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
    return result


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
