"""The AD-DROP paper's tuning loop: a p x q grid (and optionally layers and schedules), one run per cell.

    attn-reg-sweep fewshot --out-dir outputs/sweep/fewshot64 --p 0.1,0.3,0.5 --q 0.1,0.3,0.5 --plain \\
        -- --sizes 64 --seeds 1,2,3
    attn-reg-sweep mt --out-dir outputs/sweep/mt --p 0.1,0.3 --q 0.1,0.3 -- --epochs 12

``fewshot``: everything after ``--`` goes to ``attn-reg-fewshot`` unchanged (few-shot
classification; the dev metric is the best-epoch dev accuracy, mean over seeds, higher is
better). Each cell writes ``cells/<cell>.json`` when it finishes (its settings, dev and test
metrics); the runner's own outputs stay in ``runs/<cell>/``. A rerun of the same command keeps
finished cells, so a killed sweep resumes where it stopped (the runner also resumes a
half-finished cell seed by seed); a rerun whose runner arguments differ is refused. The best
cell is picked on the dev metric only; test numbers are reported beside it, never used. A PNG
heatmap of the dev metric over p x q (the paper's Fig. 4) is written per schedule and layer
choice, side by side.

``mt``: the plugin's ``attn-reg-mt-sweep`` (:mod:`attn_reg_plugin.sweep`) over the demo's EN-RO
corpus (binarized once into ``OUT/data``) and the demo's model (``attn-reg-demo``'s sizes and
optimizer; ``--quick``: its smoke-test size on 400 pairs): valid BLEU chooses, test BLEU is
reported beside. After ``--``: ``--epochs N`` (12), ``--seeds 1,2`` (1), ``--quick``, ``--data DIR``,
``--vocab-size N``, ``--device cpu|cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Sequence

from attn_reg_plugin.sweep import probabilities

from .provenance import environment


@dataclass(frozen=True)
class Runner:
    """How a cell is run and scored: ``run(cell, runner_args, run_dir) -> (dev, test)``."""

    name: str
    dev_metric: str
    test_metric: str
    higher_is_better: bool
    run: Callable[[dict, List[str], Path], Dict[str, float]]


def _fewshot_cell(cell: dict, runner_args: List[str], run_dir: Path) -> Dict[str, float]:
    from . import fewshot

    methods = ["plain"] if cell["method"] == "plain" else ["ad-drop"]
    argv = [*runner_args, "--methods", *methods, "--out-dir", str(run_dir), "--resume"]
    if cell["method"] == "ad-drop":
        argv += [
            "--ad-drop-p",
            str(cell["p"]),
            "--ad-drop-q",
            str(cell["q"]),
            "--ad-drop-layers",
            cell["layers"],
            "--ad-drop-schedule",
            cell["schedule"],
        ]
    runs = fewshot.run_all(argv)
    return {
        "dev": statistics.fmean(r["best_dev_acc"] for r in runs),
        "test": statistics.fmean(r["test_acc"] for r in runs),
        "runs": len(runs),
    }


RUNNERS = {
    "fewshot": Runner("fewshot", "dev accuracy (best epoch, mean over seeds)", "test accuracy", True, _fewshot_cell),
}
RUNNER_CHOICES = ("fewshot", "mt")
SCHEDULES = ("cross-tuning", "always")


def cell_name(cell: dict) -> str:
    if cell["method"] == "plain":
        return "plain"
    return f"p{cell['p']:g}_q{cell['q']:g}_layers-{cell['layers'].replace(',', '-')}_{cell['schedule']}"


def grid(
    p_values: Sequence[float], q_values: Sequence[float], layers: Sequence[str], schedules: Sequence[str], plain: bool
) -> List[dict]:
    cells = [{"method": "plain"}] if plain else []
    cells += [
        {"method": "ad-drop", "p": p, "q": q, "layers": lay, "schedule": s}
        for s in schedules
        for lay in layers
        for p in p_values
        for q in q_values
    ]
    return cells


def best_cell(results: List[dict], higher_is_better: bool) -> dict:
    """The AD-DROP cell with the best dev metric (first in grid order on ties); test is not looked at."""
    candidates = [r for r in results if r["cell"]["method"] == "ad-drop"]
    sign = 1 if higher_is_better else -1
    return max(candidates, key=lambda r: sign * r["dev"])  # max keeps the first of equal keys


# -- the heatmap ------------------------------------------------------------------------------------
def heatmap(results: List[dict], runner: Runner, path: Path, title: str) -> Path:
    """One panel per (schedule, layers), p down and q across, each cell's dev metric written in it
    (drawn by :func:`attn_reg_plugin.sweep.heatmap`)."""
    from attn_reg_plugin.sweep import heatmap as draw

    best = best_cell(results, runner.higher_is_better)
    plain = next((r for r in results if r["cell"]["method"] == "plain"), None)
    points = [
        {
            "panel": f"{r['cell']['schedule']}, layers {r['cell']['layers']}",
            "p": r["cell"]["p"],
            "q": r["cell"]["q"],
            "value": r["dev"],
            "best": r["cell"] == best["cell"],
        }
        for r in results
        if r["cell"]["method"] == "ad-drop"
    ]
    subtitle = f"dev: {runner.dev_metric}" + (f"; plain {plain['dev']:.4f}" if plain else "")
    return draw(points, path, title, subtitle, runner.higher_is_better, fmt="{:.4f}")


# -- the command ------------------------------------------------------------------------------------
def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    runner_args: List[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, runner_args = argv[:split], argv[split + 1 :]
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        usage="attn-reg-sweep {fewshot,mt} [options] -- [runner options]",
    )
    ap.add_argument(
        "runner", choices=RUNNER_CHOICES, help="fewshot: attn-reg-fewshot; mt: attn-reg-mt-sweep on the demo's EN-RO"
    )
    ap.add_argument(
        "--out-dir",
        type=Path,
        help="where cells/, runs/, sweep.json and the heatmap go (default outputs/sweep/<runner>)",
    )
    ap.add_argument("--p", default="0.1,0.3,0.5", help="comma list of p (the paper's grid is 0.1..0.9)")
    ap.add_argument("--q", default="0.1,0.3,0.5", help="comma list of q")
    ap.add_argument("--layers", default="all", help="';'-separated list of --ad-drop-layers values, e.g. 'all;0'")
    ap.add_argument("--schedules", default="cross-tuning", help="comma list of cross-tuning, always")
    ap.add_argument("--plain", action="store_true", help="also run plain training once, for reference")
    opts = ap.parse_args(argv)
    opts.runner_args = runner_args
    opts.p = probabilities(ap, "--p", opts.p)
    opts.q = probabilities(ap, "--q", opts.q)
    opts.layers = [x.strip() for x in opts.layers.split(";") if x.strip()]
    if not opts.layers:
        ap.error("--layers must name at least one --ad-drop-layers value")
    opts.schedules = [x.strip() for x in opts.schedules.split(",") if x.strip()]
    if not opts.schedules or not set(opts.schedules) <= set(SCHEDULES):
        ap.error(f"--schedules must be a comma list of {', '.join(SCHEDULES)}, got {','.join(opts.schedules)!r}")
    owned = {
        "--methods",
        "--out-dir",
        "--out",
        "--resume",
        "--ad-drop-p",
        "--ad-drop-q",
        "--ad-drop-layers",
        "--ad-drop-schedule",
    }
    clash = sorted(a.split("=")[0] for a in runner_args if a.split("=")[0] in owned)
    if clash:
        ap.error(f"{', '.join(clash)} after '--' are set by the sweep for each cell; leave them out")
    if opts.runner == "fewshot":
        sizes = [runner_args[i + 1] for i, a in enumerate(runner_args[:-1]) if a == "--sizes"]
        sizes += [a.split("=", 1)[1] for a in runner_args if a.startswith("--sizes=")]
        if len(sizes) != 1 or "," in sizes[0]:
            ap.error(
                "fewshot: give exactly one training-set size after '--' (--sizes N): cells are compared on the "
                "dev accuracy of one size"
            )
    if opts.runner == "mt":
        mt_ap = _mt_parser()
        opts.mt, unknown = mt_ap.parse_known_args(runner_args)
        if unknown:
            ap.error(
                f"mt: unknown options after '--': {' '.join(unknown)} (accepted: {mt_ap.format_usage()[7:].strip()})"
            )
    if opts.out_dir is None:
        opts.out_dir = Path("outputs") / "sweep" / opts.runner
    return ap, opts


def _mt_parser() -> argparse.ArgumentParser:
    from .paths import MT_CORPUS

    ap = argparse.ArgumentParser(allow_abbrev=False, prog="attn-reg-sweep mt ... --", add_help=False)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data", type=Path, default=MT_CORPUS)
    ap.add_argument("--vocab-size", type=int, default=2000)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return ap


def _mt_main(opts) -> int:
    """The MT sweep: the plugin's attn-reg-mt-sweep over the demo's corpus and model."""
    from attn_reg_plugin import sweep as mt_sweep

    from . import demo
    from . import mt_pipeline as mt
    from .paths import checkout_data

    args, out = opts.mt, opts.out_dir
    raw = checkout_data(args.data, "--data").resolve()
    model_args, vocab_size = demo.MODEL_ARGS, args.vocab_size
    if args.quick:
        raw = demo.subset_corpus(raw, out / "raw-subset", 400)
        model_args, vocab_size = demo.QUICK_MODEL_ARGS, min(vocab_size, 500)
    data_bin = out / "data" / "data-bin"
    if not data_bin.exists():  # binarized once; a rerun resumes on it
        mt.prepare_data(raw, out / "data", "en", "ro", vocab_size, log=lambda s: print("  " + s, flush=True))
    argv = [
        str(data_bin), "--out-dir", str(out), "--source-lang", "en", "--target-lang", "ro",
        "--p", ",".join(map(str, opts.p)), "--q", ",".join(map(str, opts.q)), "--layers", ";".join(opts.layers),
        "--schedule", ",".join(opts.schedules), "--epochs", str(args.epochs), "--seeds", args.seeds,
        "--valid-ref", str(raw / "valid"), "--test", "--test-ref", str(raw / "test"), *(["--plain"] * opts.plain),
        "--", *model_args, "--ad-drop-attention", "encoder-self", *(["--cpu"] if args.device == "cpu" else []),
    ]  # fmt: skip
    return mt_sweep.main(argv, log=lambda s: print(s, flush=True))


def main(argv=None) -> int:
    ap, opts = parse_args(argv)
    if opts.runner == "mt":
        return _mt_main(opts)
    runner = RUNNERS[opts.runner]
    out: Path = opts.out_dir
    settings = {"runner": runner.name, "runner_args": opts.runner_args}
    settings_path = out / "sweep.json"
    if settings_path.exists():
        saved = json.loads(settings_path.read_text(encoding="utf-8"))
        if saved != settings:
            ap.error(
                f"{settings_path} was written by a sweep with other settings ({runner.name} "
                f"{shlex.join(saved.get('runner_args', []))!r}, not {shlex.join(opts.runner_args)!r}); "
                f"use another --out-dir"
            )
    (out / "cells").mkdir(parents=True, exist_ok=True)
    settings_path.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")

    cells = grid(opts.p, opts.q, opts.layers, opts.schedules, opts.plain)
    results: List[dict] = []
    started = time.time()
    for index, cell in enumerate(cells, 1):
        name = cell_name(cell)
        record_path = out / "cells" / f"{name}.json"
        prefix = f"[cell {index}/{len(cells)}] {name}"
        if record_path.exists():
            record = json.loads(record_path.read_text(encoding="utf-8"))
            if record["cell"] != cell or record["settings"] != settings:
                ap.error(f"{record_path} holds another cell or settings; use another --out-dir")
            results.append(record)
            print(f"{prefix}: kept from {record_path} (dev {record['dev']:.4f})", flush=True)
            continue
        print(f"{prefix}: running", flush=True)
        cell_started = time.time()
        scores = runner.run(cell, opts.runner_args, out / "runs" / name)
        record = {"cell": cell, "settings": settings, **scores, "seconds": round(time.time() - cell_started, 1)}
        # Written whole or not at all: a kill mid-write must not leave a record that looks finished.
        partial = record_path.with_suffix(".json.partial")
        partial.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        os.replace(partial, record_path)
        results.append(record)
        so_far = (
            best_cell(results, runner.higher_is_better)
            if any(r["cell"]["method"] == "ad-drop" for r in results)
            else None
        )
        print(
            f"{prefix}: dev {record['dev']:.4f}, test {record['test']:.4f}, {record['seconds']:.0f} s"
            + (f"; best so far {cell_name(so_far['cell'])} (dev {so_far['dev']:.4f})" if so_far else ""),
            flush=True,
        )

    best = best_cell(results, runner.higher_is_better)
    png = heatmap(results, runner, out / "heatmap.png", f"AD-DROP sweep, {runner.name}: {shlex.join(opts.runner_args)}")
    lines = [f"| cell | dev: {runner.dev_metric} | {runner.test_metric} (not used to choose) |", "|---|---|---|"]
    lines += [f"| {cell_name(r['cell'])} | {r['dev']:.4f} | {r['test']:.4f} |" for r in results]
    summary = {
        "environment": environment(),
        "settings": settings,
        "best": best,
        "results": results,
        "heatmap": str(png),
        "seconds": round(time.time() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    print(
        f"\nbest on dev: {cell_name(best['cell'])} (dev {best['dev']:.4f}, test {best['test']:.4f}); "
        f"heatmap {png}; summary {out / 'summary.md'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
