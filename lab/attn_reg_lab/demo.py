"""The main job: EN->RO Transformer from scratch, plain vs AD-DROP vs AttendOut, on the shipped corpus.

    make demo                      # = .venv/bin/attn-reg-demo
    attn-reg-demo --epochs 20 --out outputs/demo-long

Trains a joint sentencepiece model, binarizes with fairseq-preprocess, trains the same small
Transformer twice with the same budget (epochs, seed) through fairseq-train with the plugin
(plain label-smoothed cross-entropy; AD-DROP, cross-tuned, paper EN-RO p=q=0.2 on encoder
self-attention; AttendOut on encoder self-attention, dropout step T=20), translates the test
set with fairseq-generate, and prints one table: method, best valid loss, test BLEU
(sacrebleu, detokenized output vs raw references), train time. AttendOut's per-layer drop
probability is written to attendout_drop_prob.jsonl and plotted (paper Fig. 3). The two
no-extra-cost regularizers run with ``--methods sched-dropout,attn-layerdrop``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.options import add_arguments
from attn_reg_plugin.paths import OutputOverwritesInputError, check_outputs_spare_inputs

from . import mt_pipeline as mt
from .paths import MT_CORPUS as DEFAULT_DATA
from .paths import checkout_data

MODEL_ARGS = [
    "--task",
    "attn_reg_translation",
    "--arch",
    "transformer",
    "--encoder-layers",
    "3",
    "--decoder-layers",
    "3",
    "--encoder-embed-dim",
    "128",
    "--decoder-embed-dim",
    "128",
    "--encoder-ffn-embed-dim",
    "512",
    "--decoder-ffn-embed-dim",
    "512",
    "--encoder-attention-heads",
    "4",
    "--decoder-attention-heads",
    "4",
    "--share-all-embeddings",
    "--dropout",
    "0.3",
    "--optimizer",
    "adam",
    "--adam-betas",
    "(0.9, 0.98)",
    "--lr",
    "2e-3",
    "--lr-scheduler",
    "inverse_sqrt",
    "--warmup-updates",
    "300",
    "--max-tokens",
    "1024",
    "--label-smoothing",
    "0.1",
    "--no-epoch-checkpoints",
    "--log-interval",
    "1000",
]
QUICK_MODEL_ARGS = [  # a smoke-test size for CI: same pipeline, tiny model
    "--task",
    "attn_reg_translation",
    "--arch",
    "transformer",
    "--encoder-layers",
    "1",
    "--decoder-layers",
    "1",
    "--encoder-embed-dim",
    "32",
    "--decoder-embed-dim",
    "32",
    "--encoder-ffn-embed-dim",
    "64",
    "--decoder-ffn-embed-dim",
    "64",
    "--encoder-attention-heads",
    "2",
    "--decoder-attention-heads",
    "2",
    "--share-all-embeddings",
    "--optimizer",
    "adam",
    "--lr",
    "1e-3",
    "--max-tokens",
    "1024",
    "--label-smoothing",
    "0.1",
    "--no-epoch-checkpoints",
    "--log-interval",
    "1000",
]
METHODS = {
    "plain": ["--criterion", "label_smoothed_cross_entropy"],
    "AD-DROP": ["--criterion", "ad_drop_label_smoothed_cross_entropy", "--ad-drop-attention", "encoder-self"],
    "AttendOut": [
        "--criterion",
        "label_smoothed_cross_entropy",
        "--attendout",
        "--attendout-dropout-step",
        "20",
        "--attendout-attention",
        "encoder-self",
        "--attendout-layers",
        "all",
    ],
    # Paper Sec. 7: the random stand-ins (not run by default; add them with --methods).
    "sched-dropout": [
        "--criterion",
        "label_smoothed_cross_entropy",
        "--attn-sched-dropout-schedule",
        "0:0.3,1500:0.1",
        "--attn-sched-dropout-attention",
        "encoder-self",
    ],
    "attn-layerdrop": [
        "--criterion",
        "label_smoothed_cross_entropy",
        "--attn-layerdrop-p",
        "0.2",
        "--attn-layerdrop-attention",
        "encoder-self",
    ],
}
DEFAULT_METHODS = ("plain", "AD-DROP", "AttendOut")
AD_DROP_DEFAULTS = {"p": 0.2, "q": 0.2, "layers": "all", "schedule": "cross-tuning", "attribution_precision": "auto"}


def subset_corpus(raw: Path, dest: Path, n_train: int) -> Path:
    """First ``n_train`` training pairs plus the full valid/test splits (quick mode)."""
    dest.mkdir(parents=True, exist_ok=True)
    for split in mt.SPLITS:
        for lang in ("en", "ro"):
            lines = (raw / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)
            limit = n_train if split == "train" else max(50, n_train // 8)
            (dest / f"{split}.{lang}").write_text("".join(lines[:limit]), encoding="utf-8")
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DATA,
        help="folder with {train,valid,test}.{en,ro} (default: the shipped corpus)",
    )
    ap.add_argument("--out", type=Path, default=Path("outputs") / "demo", help="where everything is written")
    ap.add_argument(
        "--epochs",
        type=int,
        default=12,
        help="training epochs for each method (>= 2, so cross-tuning has an AD-DROP epoch)",
    )
    ap.add_argument("--vocab-size", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma list of {', '.join(METHODS)}")
    ap.add_argument("--quick", action="store_true", help="tiny model and data: checks the pipeline in about a minute")
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where fairseq trains and translates (default cpu, which the published table used)",
    )
    # The AD-DROP method's settings (the paper's EN-RO p = q = 0.2 by default).
    add_arguments(
        ap.add_argument_group("AD-DROP method"), ADDropConfig, only=tuple(AD_DROP_DEFAULTS), defaults=AD_DROP_DEFAULTS
    )
    args = ap.parse_args(argv)
    try:
        ADDropConfig.from_namespace(args).validate()  # before any data is prepared
    except ValueError as e:
        ap.error(str(e))
    if args.epochs < 2:
        ap.error(f"--epochs must be >= 2 (cross-tuning's first AD-DROP epoch is epoch 2), got {args.epochs}")
    # Any case: the few-shot runner and the benchmark spell the same methods ad-drop, attendout.
    by_key = {name.lower(): name for name in METHODS}
    requested = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in requested if m.lower() not in by_key]
    if unknown or not requested:
        ap.error(f"--methods: unknown {unknown}; accepted (any case): {', '.join(METHODS)}")
    methods = [by_key[m.lower()] for m in requested]
    if len(set(methods)) < len(methods):  # a second run would resume the first one's finished checkpoints
        ap.error(f"--methods: {args.methods!r} names a method twice")

    started = time.time()
    out = args.out.resolve()
    checkout_data(args.data, "--data")  # before anything is removed or written
    try:  # --out is cleared and refilled: the corpus must not lie in it
        check_outputs_spare_inputs(
            [("--out", out)],
            [("--data", args.data / f"{split}.{lang}") for split in mt.SPLITS for lang in ("en", "ro")],
        )
    except OutputOverwritesInputError as e:
        ap.error(str(e))
    if out.exists():
        shutil.rmtree(out)  # a rerun starts clean: fairseq would otherwise resume old checkpoints
    out.mkdir(parents=True)
    print(f"== attn_reg_plugin demo: EN->RO, {', '.join(methods)}; outputs in {out}", flush=True)
    raw = args.data.resolve()
    model_args = MODEL_ARGS
    if args.quick:
        raw = subset_corpus(raw, out / "raw-subset", 400)
        model_args = QUICK_MODEL_ARGS
        args.vocab_size = min(args.vocab_size, 500)
    data_bin = mt.prepare_data(raw, out, "en", "ro", args.vocab_size, log=lambda s: print("  " + s, flush=True))

    device_args = ["--cpu"] if args.device == "cpu" else []
    rows = []
    for method in methods:
        print(f"== training {method} ({args.epochs} epochs)", flush=True)
        extra = []
        method_args = list(METHODS[method])
        if method == "AD-DROP":
            for name in AD_DROP_DEFAULTS:
                method_args += [f"--ad-drop-{name.replace('_', '-')}", str(getattr(args, f"ad_drop_{name}"))]
        drop_log = out / "attendout_drop_prob.jsonl"
        if "--attendout" in METHODS[method]:
            extra = ["--attendout-log-file", str(drop_log)]
        result = mt.train(
            method,
            data_bin,
            out / "checkpoints" / method,
            [
                *model_args,
                *device_args,
                *method_args,
                *extra,
                "--max-epoch",
                str(args.epochs),
                "--seed",
                str(args.seed),
            ],
            log=lambda s: print(s, flush=True),
        )
        if extra and drop_log.exists():
            from . import plot_attendout

            plot_attendout.plot(drop_log, out / "attendout_drop_prob.png")
        print(f"== translating the test set with {method}'s best checkpoint", flush=True)
        bleu = mt.generate_bleu(
            data_bin,
            result.save_dir / "checkpoint_best.pt",
            raw / "test.ro",
            out / "translations" / method,
            extra=device_args,
        )
        last = result.epochs[-1] if result.epochs else {}
        rates = [float(e["ad_drop_rate"]) for e in result.epochs if e.get("ad_drop_on") == "1"]
        # AttendOut: the generator's mean drop probability over layers in the last epoch.
        layer_probs = [float(v) for k, v in last.get("train_metrics", {}).items() if k.startswith("attendout_p_")]
        rows.append(
            {
                "method": method,
                "valid_loss": result.best_valid_loss,
                "test_bleu": bleu["bleu"],
                "train_seconds": round(result.train_seconds, 1),
                "ad_drop_rate": round(sum(rates) / len(rates), 4) if rates else "-",
                "attendout_drop_prob": round(sum(layer_probs) / len(layer_probs), 4) if layer_probs else "-",
                "epochs": len(result.epochs),
                "final_train_loss": last.get("train_loss"),
            }
        )
    table = mt.write_table(
        rows,
        [
            ("method", "method"),
            ("best valid loss", "valid_loss"),
            ("test BLEU", "test_bleu"),
            ("train time (s)", "train_seconds"),
            ("AD-DROP rate", "ad_drop_rate"),
            ("AttendOut drop prob. (last epoch)", "attendout_drop_prob"),
        ],
        out / "results.md",
        out / "results.json",
    )
    print()
    print(table)
    print()
    print(
        f"valid loss: fairseq's label-smoothed loss (base 2) of checkpoint_best; BLEU: sacrebleu "
        f"on detokenized fairseq-generate output (beam 5) vs raw {raw / 'test.ro'}"
    )
    print(
        f"outputs: {out} (results.md/json, checkpoints/, translations/, logs in each folder); "
        f"total {time.time() - started:.0f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
