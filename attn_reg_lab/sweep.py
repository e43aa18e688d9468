"""The AD-DROP paper's tuning loop: a p x q grid (and optionally layers and schedules), one run per cell.

    attn-reg-sweep fewshot --out-dir outputs/sweep/fewshot64 --p 0.1,0.3,0.5 --q 0.1,0.3,0.5 --plain \\
        -- --sizes 64 --seeds 1,2,3
    attn-reg-sweep mt --out-dir outputs/sweep/mt --p 0.1,0.3 --q 0.1,0.3 -- --epochs 12

Everything after ``--`` goes to the runner unchanged: ``attn-reg-fewshot`` (few-shot
classification; the dev metric is the best-epoch dev accuracy, mean over seeds, higher is
better) or ``attn-reg-demo`` (EN-RO translation; the dev metric is the best valid loss, lower is
better). Each cell writes ``cells/<cell>.json`` when it finishes (its settings, dev and test
metrics); the runner's own outputs stay in ``runs/<cell>/``. A rerun of the same command keeps
finished cells, so a killed sweep resumes where it stopped (the few-shot runner also resumes a
half-finished cell seed by seed); a rerun whose runner arguments differ is refused. The best
cell is picked on the dev metric only; test numbers are reported beside it, never used. A PNG
heatmap of the dev metric over p x q (the paper's Fig. 4) is written per schedule and layer
choice, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Sequence

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
    if fewshot.main(argv) != 0:
        raise RuntimeError(f"attn-reg-fewshot {shlex.join(argv)} failed")
    runs = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))["runs"]
    return {
        "dev": statistics.fmean(r["best_dev_acc"] for r in runs),
        "test": statistics.fmean(r["test_acc"] for r in runs),
        "runs": len(runs),
    }


def _mt_cell(cell: dict, runner_args: List[str], run_dir: Path) -> Dict[str, float]:
    from . import demo

    method = "plain" if cell["method"] == "plain" else "AD-DROP"
    argv = [*runner_args, "--methods", method, "--out", str(run_dir)]
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
    if demo.main(argv) != 0:
        raise RuntimeError(f"attn-reg-demo {shlex.join(argv)} failed")
    (row,) = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))["rows"]
    return {"dev": float(row["valid_loss"]), "test": float(row["test_bleu"])}


RUNNERS = {
    "fewshot": Runner("fewshot", "dev accuracy (best epoch, mean over seeds)", "test accuracy", True, _fewshot_cell),
    "mt": Runner("mt", "best valid loss", "test BLEU", False, _mt_cell),
}
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
    """One panel per (schedule, layers), p down and q across, each cell's dev metric written in it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [r for r in results if r["cell"]["method"] == "ad-drop"]
    panels = list(dict.fromkeys((r["cell"]["schedule"], r["cell"]["layers"]) for r in cells))
    ps = sorted({r["cell"]["p"] for r in cells})
    qs = sorted({r["cell"]["q"] for r in cells})
    values = [r["dev"] for r in cells]
    low, high = min(values), max(values)
    best = best_cell(results, runner.higher_is_better)
    plain = next((r for r in results if r["cell"]["method"] == "plain"), None)
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(1.2 + 1.1 * len(qs) * len(panels) + 1.0 * len(panels), 1.6 + 0.8 * len(ps)),
        squeeze=False,
    )
    for ax, (schedule, layers) in zip(axes[0], panels):
        table = [[None] * len(qs) for _ in ps]
        for r in cells:
            if (r["cell"]["schedule"], r["cell"]["layers"]) == (schedule, layers):
                table[ps.index(r["cell"]["p"])][qs.index(r["cell"]["q"])] = r["dev"]
        shown = [[float("nan") if v is None else v for v in row] for row in table]
        # Brighter is better whichever way the metric points.
        image = ax.imshow(shown, cmap="viridis" if runner.higher_is_better else "viridis_r", vmin=low, vmax=high)
        for i, row in enumerate(table):
            for j, v in enumerate(row):
                if v is None:
                    continue
                mark = best["cell"] == {
                    "method": "ad-drop",
                    "p": ps[i],
                    "q": qs[j],
                    "layers": layers,
                    "schedule": schedule,
                }
                goodness = (v - low) / ((high - low) or 1.0)
                goodness = goodness if runner.higher_is_better else 1.0 - goodness
                ax.text(
                    j,
                    i,
                    f"{v:.4f}" + ("\nbest" if mark else ""),
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if goodness < 0.5 else "black",
                )
        ax.set_xticks(range(len(qs)), [f"{q:g}" for q in qs])
        ax.set_yticks(range(len(ps)), [f"{p:g}" for p in ps])
        ax.set_xlabel("q (drop probability)")
        ax.set_ylabel("p (candidate share)")
        ax.set_title(f"{schedule}, layers {layers}", fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
    subtitle = f"dev: {runner.dev_metric}" + (f"; plain {plain['dev']:.4f}" if plain else "")
    width = int(fig.get_size_inches()[0] * 13)  # characters that fit at fontsize 9
    fig.suptitle(textwrap.fill(title, width, break_on_hyphens=False) + f"\n{subtitle}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- the command ------------------------------------------------------------------------------------
def _floats(ap, option: str, text: str) -> List[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0.0 < v < 1.0 for v in values) or len(set(values)) != len(values):
        ap.error(f"{option} must be a comma list of distinct numbers in the open interval (0, 1), got {text!r}")
    return values


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    runner_args: List[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, runner_args = argv[:split], argv[split + 1 :]
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], usage="attn-reg-sweep {fewshot,mt} [options] -- [runner options]"
    )
    ap.add_argument("runner", choices=tuple(RUNNERS), help="fewshot: attn-reg-fewshot; mt: attn-reg-demo (EN-RO)")
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
    opts.p = _floats(ap, "--p", opts.p)
    opts.q = _floats(ap, "--q", opts.q)
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
    if opts.out_dir is None:
        opts.out_dir = Path("outputs") / "sweep" / opts.runner
    return ap, opts


def main(argv=None) -> int:
    ap, opts = parse_args(argv)
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
