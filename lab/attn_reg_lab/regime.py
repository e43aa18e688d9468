"""EN-RO translation trained into overfitting: does an attention regularizer help there? (``attn-reg-regime``)

    attn-reg-regime --out-dir outputs/regime                        # 6 methods x 3 seeds, resumable
    attn-reg-regime --train-size 500 --epochs 40 --methods plain,rd --seeds 1 --out-dir OUT

The demo (attn-reg-demo) trains 12 epochs on all 6,526 shipped pairs, and its valid loss is still
falling at the end: no run so far has overfit, which is the regime a dropout regularizer exists
for. This runner keeps the demo's Transformer and optimizer (dropout 0.3, lr 2e-3, inverse-sqrt
decay) and trains it on the first ``--train-size`` pairs (1,000) for ``--epochs`` epochs (60), with
a warm-up of ``--warmup-updates`` (50; a 1,000-pair epoch is 29 updates, so the demo's 300 would
last 10 epochs). In that setting plain training's valid loss is lowest at epoch 40 and then
rises while its training loss keeps falling (the AD-DROP Fig. 2 pilot, docs/RESULTS.md). The full
valid set picks the best epoch, and the test set (all 1,000 pairs, or the first ``--test-size``) is
translated with that checkpoint (beam 5; sacrebleu on detokenized output against the raw
references). Methods:

* ``plain``: label-smoothed cross-entropy;
* ``ad-drop``: AD-DROP, cross-tuned, with the paper's EN-RO p = q = 0.2 on all encoder
  self-attention layers (as the demo);
* ``ad-drop-always``: the same on every epoch;
* ``rd``: the random control, a random candidate region at the same p and q, always;
* ``attendout``: AttendOut on encoder self-attention, T = 20 (as the demo);
* ``sched-dropout``: scheduled attention dropout, 0.3 falling to 0.1 by update 1,500 (as the demo).

For every run it records:
* the best valid loss and its epoch;
* the test BLEU of that checkpoint;
* every epoch's train and valid loss. These are fairseq's label-smoothed loss in base 2; the
  train loss is the running loss, under the method's own dropping;
* the final train–valid gap;
* the wall time.

It also records the paired differences against plain by seed (mean, sample std, Student's t
p-value). A run goes to ``runs.jsonl`` when it finishes, and a rerun with the same settings skips
the runs already there. An interrupted run starts again from scratch: its partial checkpoints are
removed first, so fairseq does not resume them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Dict, List

from attn_reg_plugin.paths import OutputOverwritesInputError, check_outputs_spare_inputs

from . import mt_pipeline as mt
from .arguments import comma_list
from .curves import band, draw_band, seeds_label, zoom_start
from .demo import METHODS as DEMO_METHODS
from .demo import MODEL_ARGS
from .fewshot_summary import paired_difference
from .paths import MT_CORPUS, checkout_data
from .provenance import environment
from .resume import finished_runs, record_run

AD_DROP = ["--criterion", "ad_drop_label_smoothed_cross_entropy", "--ad-drop-attention", "encoder-self",
           "--ad-drop-p", "0.2", "--ad-drop-q", "0.2"]  # fmt: skip
METHODS: Dict[str, List[str]] = {
    "plain": DEMO_METHODS["plain"],
    "ad-drop": [*AD_DROP, "--ad-drop-schedule", "cross-tuning"],
    "ad-drop-always": [*AD_DROP, "--ad-drop-schedule", "always"],
    "rd": [*AD_DROP, "--ad-drop-schedule", "always", "--ad-drop-attribution", "rd"],
    "attendout": DEMO_METHODS["AttendOut"],
    "sched-dropout": DEMO_METHODS["sched-dropout"],
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=MT_CORPUS, help="folder with {train,valid,test}.{en,ro}")
    ap.add_argument("--train-size", type=int, default=1000, help="the first N training pairs")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--test-size", type=int, default=0, help="translate the first N test pairs (0: all 1,000)")
    ap.add_argument("--vocab-size", type=int, default=2000)
    ap.add_argument(
        "--warmup-updates",
        type=int,
        default=50,
        help="learning-rate warm-up (the demo's 300 updates are 10 epochs of 1,000 pairs)",
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--fp16", action="store_true", help="fairseq --fp16 (GPU)")
    ap.add_argument("--out-dir", type=Path, default=Path("outputs/regime"))
    opts = ap.parse_args(argv)
    try:
        opts.methods = comma_list("--methods", opts.methods, accepted=tuple(METHODS))
        opts.seeds = comma_list("--seeds", opts.seeds, minimum=0)
    except argparse.ArgumentTypeError as err:
        ap.error(str(err))
    if opts.warmup_updates < 1:
        ap.error(f"--warmup-updates must be >= 1, got {opts.warmup_updates}")
    if opts.test_size < 0:
        ap.error(f"--test-size must be >= 0, got {opts.test_size}")
    if opts.train_size < 10:
        ap.error(f"--train-size must be >= 10, got {opts.train_size}")
    if opts.epochs < 2:
        ap.error(f"--epochs must be >= 2 (cross-tuning's first AD-DROP epoch is epoch 2), got {opts.epochs}")
    if opts.fp16 and opts.device != "cuda":
        ap.error("--fp16 needs --device cuda (fairseq cannot recover from an fp16 overflow on a CPU)")
    opts.data = checkout_data(opts.data, "--data")
    written = ("data", "checkpoints", "runs.jsonl", "results.json", "results.md", "curves.png")
    try:  # data/ (the subset and its data-bin) and checkpoints/ are refilled, the rest rewritten
        check_outputs_spare_inputs(
            [("--out-dir", opts.out_dir / name) for name in written],
            [("--data", opts.data / f"{split}.{lang}") for split in mt.SPLITS for lang in ("en", "ro")],
        )
    except OutputOverwritesInputError as err:
        ap.error(str(err))
    return opts


def settings(opts) -> Dict:
    keys = ("train_size", "test_size", "epochs", "vocab_size", "warmup_updates", "device", "fp16")
    return {**{k: getattr(opts, k) for k in keys}, "data": str(opts.data)}


def model_args(opts) -> List[str]:
    """The demo's model and optimizer, with a warm-up that fits a subset's few updates per epoch."""
    args = list(MODEL_ARGS)
    args[args.index("--warmup-updates") + 1] = str(opts.warmup_updates)
    return args


def run_one(opts, method: str, seed: int, data_bin: Path) -> Dict:
    name = f"{method}-seed{seed}"
    save_dir = opts.out_dir / "checkpoints" / name
    if save_dir.exists():  # an interrupted run: fairseq would resume it, and its log would lack the first epochs
        shutil.rmtree(save_dir)
    device = ["--cpu"] if opts.device == "cpu" else (["--fp16"] if opts.fp16 else [])
    result = mt.train(
        name,
        data_bin,
        save_dir,
        [*model_args(opts), *device, *METHODS[method], "--max-epoch", str(opts.epochs), "--seed", str(seed)],
        log=lambda line: print(line, flush=True),
    )
    if len(result.epochs) != opts.epochs:
        raise RuntimeError(
            f"{name}: expected {opts.epochs} epochs in {save_dir / 'train.log'}, got {len(result.epochs)}"
        )
    bleu = mt.generate_bleu(
        data_bin,
        save_dir / "checkpoint_best.pt",
        opts.out_dir / "data" / "raw" / "test.ro",
        opts.out_dir / "translations" / name,
        extra=["--cpu"] if opts.device == "cpu" else [],
    )
    valid = [e["valid_loss"] for e in result.epochs]
    best = min(range(len(valid)), key=lambda i: valid[i])
    last = result.epochs[-1]
    return {
        "method": method,
        "seed": seed,
        "best_valid_loss": valid[best],
        "best_epoch": best + 1,
        "test_bleu": bleu["bleu"],
        "final_gap": round(last["valid_loss"] - last["train_loss"], 4),
        "train_seconds": round(result.train_seconds, 1),
        "epochs": [
            {
                "epoch": e["epoch"],
                "train_loss": e["train_loss"],
                "valid_loss": e["valid_loss"],
                "ad_drop_rate": float(e.get("ad_drop_rate") or 0.0),
            }
            for e in result.epochs
        ],  # fmt: skip
    }


MEASURES = {
    "best_valid_loss": lambda run: run["best_valid_loss"],
    "best_epoch": lambda run: run["best_epoch"],
    "test_bleu": lambda run: run["test_bleu"],
    # Beside the best, how far valid loss climbed back by the end: the overfitting a regularizer should curb.
    "final_valid_loss": lambda run: run["epochs"][-1]["valid_loss"],
    "final_gap": lambda run: run["final_gap"],
    "train_seconds": lambda run: run["train_seconds"],
}
PAIRED_MEASURES = ("best_valid_loss", "test_bleu", "final_valid_loss")


def summarize(runs: List[Dict], methods: List[str]) -> Dict:
    table, paired = [], []
    by = {(r["method"], r["seed"]): r for r in runs}
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            continue
        row = {"method": method, "seeds": len(mine)}
        for key, measure in MEASURES.items():
            values = [measure(r) for r in mine]
            row[key] = statistics.fmean(values)
            row[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else None
        table.append(row)
        if method == "plain":
            continue
        for key in PAIRED_MEASURES:
            measure = MEASURES[key]
            diff = paired_difference(
                {s: measure(r) for (m, s), r in by.items() if m == method},
                {s: measure(r) for (m, s), r in by.items() if m == "plain"},
            )
            if diff is not None:
                paired.append({"method": method, "measure": key, **diff})
    return {"table": table, "paired": paired}


def plot(runs: List[Dict], methods: List[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = min(len(r["epochs"]) for r in runs)
    late = zoom_start(epochs)
    panels = [("train_loss", "train loss (running, base 2)", 1), ("valid_loss", "valid loss (base 2)", 1)]
    if late:
        panels.append(("valid_loss", f"valid loss from epoch {late} (base 2)", late))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, method in enumerate(methods):
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            continue
        for ax, (key, label, first) in zip(axes, panels):
            draw_band(
                ax,
                **band(mine, key, epochs),
                first=first,
                color=colors[i % len(colors)],
                label=seeds_label(method, len(mine)),
            )
            ax.set_ylabel(label)
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(summary: Dict) -> str:
    def cell(row, key, digits):
        std = row.get(f"{key}_std")
        return f"{row[key]:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")

    lines = [
        "| method | seeds | best valid loss | best epoch | test BLEU | last valid loss | last valid − train | "
        "train time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["table"]:
        lines.append(
            f"| {r['method']} | {r['seeds']} | {cell(r, 'best_valid_loss', 3)} | {cell(r, 'best_epoch', 1)} | "
            f"{cell(r, 'test_bleu', 2)} | {cell(r, 'final_valid_loss', 3)} | {cell(r, 'final_gap', 3)} | "
            f"{cell(r, 'train_seconds', 0)} |"
        )
    if summary["paired"]:
        lines += [
            "",
            "| method − plain | measure | pairs | mean diff | std | p (paired t) |",
            "|---|---|---|---|---|---|",
        ]
        for p in summary["paired"]:
            std = "-" if p["std_diff"] is None else f"{p['std_diff']:.3f}"
            pv = "-" if p["p"] is None else f"{p['p']:.3f}"
            lines.append(f"| {p['method']} | {p['measure']} | {p['pairs']} | {p['mean_diff']:+.3f} | {std} | {pv} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    opts = parse_args(argv)
    opts.out_dir = opts.out_dir.resolve()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    runs_file = opts.out_dir / "runs.jsonl"
    config = settings(opts)
    done = finished_runs(runs_file, config, lambda run: (run["method"], run["seed"]), "attn-reg-regime")
    data_bin = mt.prepare_subset(
        opts.data,
        opts.out_dir / "data",
        {"train": opts.train_size, "test": opts.test_size},
        opts.vocab_size,
        log=lambda line: print("  " + line, flush=True),
    )
    runs = []
    for seed in opts.seeds:
        for method in opts.methods:
            if (method, seed) in done:
                runs.append(done[(method, seed)])
                continue
            print(f"== {method}, seed {seed}: {opts.epochs} epochs on {opts.train_size} pairs", flush=True)
            run = run_one(opts, method, seed, data_bin)
            runs.append(run)
            record_run(runs_file, config, run)
            print(
                f"== {method}, seed {seed}: best valid loss {run['best_valid_loss']:.3f} at epoch {run['best_epoch']}, "
                f"test BLEU {run['test_bleu']}, final gap {run['final_gap']:+.3f}, {run['train_seconds']} s",
                flush=True,
            )
    summary = summarize(runs, opts.methods)
    result = {"environment": environment(), "settings": config, "summary": summary, "runs": runs}
    (opts.out_dir / "results.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    table = markdown(summary)
    (opts.out_dir / "results.md").write_text(table, encoding="utf-8")
    title = f"EN-RO, {opts.train_size} training pairs, {opts.epochs} epochs"
    plot(runs, opts.methods, opts.out_dir / "curves.png", title)
    print(table)
    print(f"wrote {opts.out_dir / 'results.json'}, results.md and curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
