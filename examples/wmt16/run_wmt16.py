#!/usr/bin/env python
"""WMT16 EN-RO / TR-EN with fairseq: plain Transformer vs AD-DROP, BLEU on newstest2016.

    python examples/wmt16/run_wmt16.py --pair en-ro --out outputs/wmt16-en-ro
    python examples/wmt16/run_wmt16.py --pair tr-en --out outputs/wmt16-tr-en

Stages (``--stages``, default all): ``download`` (datasets.load_dataset("wmt16", ...): train,
newsdev2016 as valid, newstest2016 as test, written as raw text), ``prepare`` (the plugin's
``attn-reg-prepare``: joint sentencepiece + fairseq-preprocess), ``train`` (the plugin's
``attn-reg-mt-sweep`` with one cell, the paper's p/q for the pair: EN-RO p=q=0.2, TR-EN p=0.6
q=0.1, encoder self-attention, all layers, cross-tuning, and ``--plain`` beside it; each run is
translated with its best checkpoint, beam 5, sacrebleu on detokenized output against the raw
newsdev2016 / newstest2016 references). It needs internet for ``download`` and a GPU for
``train`` in reasonable time. Results: ``OUT/sweep/results.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attn_reg_plugin import sweep
from attn_reg_plugin.prepare import prepare

# The paper's AD-DROP hyper-parameters per pair (Appendix A, OPUS-MT fine-tuning).
PAIRS = {
    "en-ro": {"config": "ro-en", "src": "en", "tgt": "ro", "p": 0.2, "q": 0.2},
    "tr-en": {"config": "tr-en", "src": "tr", "tgt": "en", "p": 0.6, "q": 0.1},
}
SPLIT_NAMES = {"train": "train", "validation": "valid", "test": "test"}

TRANSFORMER_BASE = [
    "--arch",
    "transformer_wmt_en_de",
    "--share-all-embeddings",
    "--optimizer",
    "adam",
    "--adam-betas",
    "(0.9, 0.98)",
    "--clip-norm",
    "0.0",
    "--lr",
    "7e-4",
    "--lr-scheduler",
    "inverse_sqrt",
    "--warmup-updates",
    "4000",
    "--dropout",
    "0.3",
    "--weight-decay",
    "0.0001",
    "--label-smoothing",
    "0.1",
    "--max-tokens",
    "8192",
    "--no-epoch-checkpoints",
    "--log-interval",
    "100",
]


def download(pair: str, raw_dir: Path, load_dataset=None) -> dict:
    """Write WMT16 ``pair`` as raw parallel text: {train,valid,test}.{src,tgt}; return counts."""
    if load_dataset is None:
        from datasets import load_dataset
    spec = PAIRS[pair]
    raw_dir.mkdir(parents=True, exist_ok=True)
    dataset = load_dataset("wmt16", spec["config"])
    counts = {}
    for hf_split, name in SPLIT_NAMES.items():
        rows = dataset[hf_split]["translation"]
        with (
            open(raw_dir / f"{name}.{spec['src']}", "w", encoding="utf-8") as fs,
            open(raw_dir / f"{name}.{spec['tgt']}", "w", encoding="utf-8") as ft,
        ):
            for i, row in enumerate(rows):
                src, tgt = (row[spec["src"]] or "").strip(), (row[spec["tgt"]] or "").strip()
                if "\n" in src or "\n" in tgt:
                    raise ValueError(f"wmt16 {spec['config']} {hf_split} row {i}: embedded newline")
                fs.write(src + "\n")
                ft.write(tgt + "\n")
        counts[name] = len(rows)
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pair", choices=sorted(PAIRS), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", default="download,prepare,train")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--seeds", default="1", help="comma list of seeds (each method runs each)")
    ap.add_argument("--train-args", default="", help="extra fairseq-train arguments (e.g. '--fp16 --max-update 60000')")
    args = ap.parse_args(argv)
    spec = PAIRS[args.pair]
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in ("download", "prepare", "train")]
    if bad:
        ap.error(f"--stages: unknown {bad}; accepted: download, prepare, train")
    out = args.out.resolve()
    raw = out / "raw"
    if "download" in stages:
        print("downloaded", download(args.pair, raw))
    if "prepare" in stages:
        prepare(spec["src"], spec["tgt"], {split: raw / split for split in SPLIT_NAMES.values()}, out, args.vocab_size)
    if "train" not in stages:
        return 0
    return sweep.main(
        [
            str(out / "data-bin"), "--out-dir", str(out / "sweep"), "--source-lang", spec["src"],
            "--target-lang", spec["tgt"], "--p", str(spec["p"]), "--q", str(spec["q"]), "--plain",
            "--epochs", str(args.epochs), "--seeds", args.seeds, "--valid-ref", str(raw / "valid"),
            "--test", "--test-ref", str(raw / "test"),
            "--", *TRANSFORMER_BASE, "--ad-drop-attention", "encoder-self", *args.train_args.split(),
        ]
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
