#!/usr/bin/env python
"""Fine-tune OPUS-MT (Marian) on WMT16 with transformers: plain vs AD-DROP, sacrebleu on the test set.

    python examples/opus_mt/run_opus_mt.py --pair en-ro --out outputs/opus-mt-en-ro
    python examples/opus_mt/run_opus_mt.py --pair tr-en --out outputs/opus-mt-tr-en
    python examples/opus_mt/run_opus_mt.py --pair en-tr --out outputs/opus-mt-en-tr

Defaults are the paper's OPUS-MT setting (Appendix A): ``Helsinki-NLP/opus-mt-{en-ro,tr-en}``,
learning rate 2e-5, 5 epochs, AD-DROP cross-tuned on encoder self-attention (all layers) with
EN-RO p = q = 0.2 and TR-EN p = 0.6, q = 0.1. Any other pair SRC-TGT runs
``Helsinki-NLP/opus-mt-SRC-TGT`` with p = q = 0.2 (the ``--ad-drop-*`` defaults). Data:
``datasets.load_dataset("wmt16", "ro-en")`` (WMT names a pair with English last: ``"tr-en"``
for both tr-en and en-tr; ``--dataset-config`` for anything else): train, validation
(newsdev2016, dev loss per epoch), test (newstest2016, BLEU). Each method starts from the same checkpoint and seed; plain runs the stock
``Seq2SeqTrainer``, AD-DROP runs ``attn_reg_plugin.hf.ADDropSeq2SeqTrainer``. After training,
``model.generate`` translates the test sources and sacrebleu scores them against the raw
references. ``--model`` and ``--data-dir`` swap in any local checkpoint folder and any
``{train,valid,test}.{src,tgt}`` folder (the tests use a tiny random Marian and a tiny random T5
built by build_tiny_marian.py, and the shipped EN-RO corpus).

Other translation models are a model name away (the adapter finds their attention by its calls):

    # T5 / Flan-T5: a task prefix on every source
    python examples/opus_mt/run_opus_mt.py --pair en-ro --out outputs/t5-en-ro \
        --model google-t5/t5-small --source-prefix "translate English to Romanian: " --lr 3e-4
    # NLLB / M2M100: language codes for the tokenizer; generation starts with the target's code
    python examples/opus_mt/run_opus_mt.py --pair en-ro --out outputs/nllb-en-ro \
        --model facebook/nllb-200-distilled-600M --src-lang-code eng_Latn --tgt-lang-code ron_Latn
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/example_support.py
from example_support import (
    add_ad_drop_options,
    check_common_args,
    hf_trainer,
    mean_ad_drop_rate,
    read_parallel,
    train_and_log,
)

from attn_reg_plugin.core import ADDropConfig

# The paper's AD-DROP p and q of its two OPUS-MT pairs; any other pair gets the flags' defaults.
PAPER_PQ = {"en-ro": (0.2, 0.2), "tr-en": (0.6, 0.1)}
# OPUS-MT's bilingual models are named by two ISO 639 codes (2 letters, or 3 for languages and
# groups without one: opus-mt-tr-en, opus-mt-en-zle). Which pairs exist cannot be checked offline.
PAIR_FORM = re.compile(r"([a-z]{2,3})-([a-z]{2,3})")
SPLITS = {"train": "train", "valid": "validation", "test": "test"}  # ours -> the hub dataset's

Pairs = Tuple[List[str], List[str]]


def pair_spec(pair: str) -> dict:
    """--pair SRC-TGT -> its languages, the default Helsinki-NLP/opus-mt-SRC-TGT model and WMT config name."""
    match = PAIR_FORM.fullmatch(pair)
    if match is None or match.group(1) == match.group(2):
        raise argparse.ArgumentTypeError(
            "must be SRC-TGT, two different lowercase 2- or 3-letter language codes as in "
            f"Helsinki-NLP/opus-mt-SRC-TGT (en-ro, tr-en, en-de, ...), got {pair!r}"
        )
    src, tgt = match.groups()
    # WMT's configs put English last ("ro-en" holds en-ro and ro-en); other pairs keep their order.
    config = f"{tgt}-{src}" if src == "en" else pair
    return {"pair": pair, "src": src, "tgt": tgt, "model": f"Helsinki-NLP/opus-mt-{pair}", "config": config}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--pair",
        type=pair_spec,
        required=True,
        help="SRC-TGT language codes of an OPUS-MT model Helsinki-NLP/opus-mt-SRC-TGT (en-ro, tr-en, en-de, ...)",
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--model", default=None, help="hub name or local folder (default: the pair's Helsinki-NLP/opus-mt-SRC-TGT)"
    )
    ap.add_argument(
        "--data-dir", type=Path, default=None, help="local {train,valid,test}.{src,tgt} instead of the hub dataset"
    )
    ap.add_argument("--dataset", default="wmt16", help="hub dataset name for datasets.load_dataset")
    ap.add_argument(
        "--dataset-config",
        default=None,
        help="the dataset's config (subset) name (default: WMT's name of the pair, English last: ro-en for en-ro)",
    )
    ap.add_argument(
        "--drop-empty-pairs",
        action="store_true",
        help="remove hub pairs with an empty side (counted and reported); without it they are an error",
    )
    ap.add_argument("--max-train-samples", type=int, default=None)
    ap.add_argument("--max-eval-samples", type=int, default=None, help="valid pairs for the per-epoch dev loss")
    ap.add_argument("--max-test-samples", type=int, default=None, help="test pairs translated and scored")
    ap.add_argument("--epochs", type=float, default=5)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=128, help="source / target pieces kept per sentence")
    ap.add_argument("--num-beams", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--generate-batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument(
        "--source-prefix",
        default="",
        help="text put before every source sentence (T5: 'translate English to Romanian: ')",
    )
    ap.add_argument(
        "--src-lang-code",
        default=None,
        help="source language code of a multilingual tokenizer (NLLB: eng_Latn; M2M100: en)",
    )
    ap.add_argument(
        "--tgt-lang-code",
        default=None,
        help="target language code (NLLB: ron_Latn); generation is forced to start with it",
    )
    add_ad_drop_options(ap, p=None, q=None)  # p, q: the pair's paper values
    args = ap.parse_args(argv)
    spec, args.pair = args.pair, args.pair["pair"]
    args.src, args.tgt = spec["src"], spec["tgt"]
    default = ADDropConfig()
    p, q = PAPER_PQ.get(args.pair, (default.p, default.q))
    args.ad_drop_p = p if args.ad_drop_p is None else args.ad_drop_p
    args.ad_drop_q = q if args.ad_drop_q is None else args.ad_drop_q
    args.dataset_config = args.dataset_config or spec["config"]
    check_common_args(
        ap,
        args,
        (
            "max_train_samples",
            "max_eval_samples",
            "max_test_samples",
            "batch_size",
            "max_length",
            "num_beams",
            "max_new_tokens",
            "generate_batch_size",
            "epochs",
            "lr",
        ),
    )
    args.model = args.model or spec["model"]
    return args


def load_pairs(args, load_dataset=None) -> Dict[str, Pairs]:
    """{"train", "valid", "test"} -> (sources, targets), from ``--data-dir`` or the hub dataset."""
    src_lang, tgt_lang = args.src, args.tgt
    limits = {"train": args.max_train_samples, "valid": args.max_eval_samples, "test": args.max_test_samples}
    if args.data_dir is not None:
        return {split: read_parallel(args.data_dir, split, src_lang, tgt_lang, limits[split]) for split in SPLITS}
    if load_dataset is None:
        from datasets import load_dataset
    dataset = load_dataset(args.dataset, args.dataset_config)
    out = {}
    for split, hub_split in SPLITS.items():
        rows, limit = dataset[hub_split], limits[split]
        if limit is not None and hasattr(rows, "select"):  # a datasets.Dataset: read only what is used
            rows = rows.select(range(min(limit, len(rows))))
        src, tgt, empty = [], [], 0
        for i, row in enumerate(rows["translation"]):
            if limit is not None and i >= limit:
                break
            s, t = (row[src_lang] or "").strip(), (row[tgt_lang] or "").strip()
            if not s or not t:
                if not args.drop_empty_pairs:
                    raise ValueError(
                        f"{args.dataset} {args.dataset_config} {hub_split} row {i}: empty "
                        f"{src_lang if not s else tgt_lang} side (use --drop-empty-pairs to remove such pairs)"
                    )
                empty += 1
                continue
            src.append(s)
            tgt.append(t)
        if empty:
            print(f"{hub_split}: removed {empty} pairs with an empty side (--drop-empty-pairs)")
        out[split] = (src, tgt)
    return out


def tokenize(tokenizer, pairs: Pairs, max_length: int, prefix: str = "") -> List[dict]:
    """One dict per pair: ``input_ids``, ``attention_mask`` and target ``labels`` (no padding yet)."""
    src, tgt = pairs
    enc = tokenizer([prefix + s for s in src], text_target=tgt, max_length=max_length, truncation=True)
    return [
        {"input_ids": i, "attention_mask": a, "labels": y}
        for i, a, y in zip(enc["input_ids"], enc["attention_mask"], enc["labels"])
    ]


def translate(
    model,
    tokenizer,
    sentences: Sequence[str],
    batch_size: int,
    num_beams: int,
    max_new_tokens: int,
    max_length: int,
    prefix: str = "",
    tgt_lang_code: Optional[str] = None,
) -> List[str]:
    import torch

    model.eval()
    forced = {} if tgt_lang_code is None else {"forced_bos_token_id": tokenizer.convert_tokens_to_ids(tgt_lang_code)}
    hyps: List[str] = []
    for start in range(0, len(sentences), batch_size):
        batch = tokenizer(
            [prefix + s for s in sentences[start : start + batch_size]],
            max_length=max_length,
            truncation=True,
            padding=True,
            return_tensors="pt",
        ).to(model.device)
        with torch.no_grad():
            out = model.generate(**batch, num_beams=num_beams, max_new_tokens=max_new_tokens, **forced)
        hyps.extend(tokenizer.batch_decode(out, skip_special_tokens=True))
    return hyps


def run_method(method: str, args, data: Dict[str, Pairs]) -> dict:
    import sacrebleu
    import transformers

    transformers.set_seed(args.seed)
    codes = {k: v for k, v in (("src_lang", args.src_lang_code), ("tgt_lang", args.tgt_lang_code)) if v is not None}
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model, **codes)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(args.model)
    train = tokenize(tokenizer, data["train"], args.max_length, args.source_prefix)
    dev = tokenize(tokenizer, data["valid"], args.max_length, args.source_prefix)
    trainer = hf_trainer(
        method,
        args,
        args.out / method,
        seq2seq=True,
        model=model,
        train_dataset=train,
        eval_dataset=dev,
        data_collator=transformers.DataCollatorForSeq2Seq(tokenizer, model=model),
        processing_class=tokenizer,
    )
    epochs, seconds = train_and_log(method, trainer, finite=True)
    test_src, test_ref = data["test"]
    hyps = translate(
        trainer.model,
        tokenizer,
        test_src,
        args.generate_batch_size,
        args.num_beams,
        args.max_new_tokens,
        args.max_length,
        args.source_prefix,
        args.tgt_lang_code,
    )
    bleu = sacrebleu.corpus_bleu(hyps, [test_ref])
    (args.out / method).mkdir(parents=True, exist_ok=True)
    (args.out / method / "test.hyp").write_text("\n".join(hyps) + "\n", encoding="utf-8")
    print(f"[{method}] test BLEU {bleu.score:.2f} on {len(hyps)} sentences ({bleu})", flush=True)
    return {
        "method": method,
        "epochs": epochs,
        "bleu": round(bleu.score, 2),
        "bleu_signature": str(bleu),
        "test_sentences": len(hyps),
        "train_seconds": round(seconds, 1),
    }


def main(argv=None, load_dataset=None) -> int:
    args = parse_args(argv)  # bad options fail here, before anything is loaded
    data = load_pairs(args, load_dataset)
    counts = {split: len(pairs[0]) for split, pairs in data.items()}
    print(f"{args.pair} from {args.data_dir or args.dataset}: {counts}; model {args.model}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_method(method, args, data) for method in args.methods]
    print("\n| method | test BLEU | train time (s) | AD-DROP rate (AD-DROP epochs) |\n|---|---|---|---|")
    for r in results:
        rate = mean_ad_drop_rate(r["epochs"])
        print(f"| {r['method']} | {r['bleu']:.2f} | {r['train_seconds']:.1f} | {rate} |")
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
