"""What the sweep writes: the records (whole or not at all), the cells' scores, the best cell, the
heatmap, ``results.md`` and ``results.json``."""

from __future__ import annotations

import json
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .options import cell_name, number_text, panel_name


def write_json(path: Path, data) -> None:
    """Written whole or not at all: a kill mid-write must not leave a record that looks finished."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(partial, path)


# -- the cells' scores ----------------------------------------------------------------------------
def _mean(values: List[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None


def summarize(cell: dict, runs: List[dict], settings: dict) -> dict:
    """A cell's record: its seeds' runs and their means."""
    bleus = [r["valid_bleu"] for r in runs]
    return {
        "cell": cell,
        "name": cell_name(cell),
        "settings": settings,
        "seeds": [r["seed"] for r in runs],
        "valid_bleu": round(statistics.fmean(bleus), 2),
        "valid_bleu_sd": round(statistics.stdev(bleus), 2) if len(bleus) > 1 else 0.0,
        "valid_loss": _mean([r["valid_loss"] for r in runs]),
        "test_bleu": _mean([r["test_bleu"] for r in runs]),
        "ad_drop_rate": _mean([r["ad_drop_rate"] for r in runs]),
        "empty_hypotheses": sum(r["valid"]["empty_hypotheses"] for r in runs),
        "runs": runs,
    }


def best_cell(records: List[dict]) -> dict:
    """The AD-DROP cell with the highest mean valid BLEU; the lower mean valid loss breaks ties, then
    grid order. Test is not looked at."""
    candidates = [r for r in records if r["cell"]["method"] == "ad-drop"]
    return max(candidates, key=lambda r: (r["valid_bleu"], -r["valid_loss"]))  # max keeps the first of equal keys


# -- the heatmap ----------------------------------------------------------------------------------
def heatmap(
    points: List[dict], path: Path, title: str, subtitle: str, higher_is_better: bool, fmt: str = "{:.2f}"
) -> Path:
    """p down, q across, one panel per distinct ``point["panel"]``; each point is
    ``{"panel", "p", "q", "value", "best": bool, "note": optional second line}``. Brighter is better."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(pt["panel"] for pt in points))
    ps = sorted({pt["p"] for pt in points})
    qs = sorted({pt["q"] for pt in points})
    values = [pt["value"] for pt in points]
    low, high = min(values), max(values)
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(max(5.0, 1.4 + 1.3 * len(qs) * len(panels) + 1.0 * len(panels)), max(3.8, 2.2 + 0.9 * len(ps))),
        squeeze=False,
    )
    for ax, panel in zip(axes[0], panels):
        shown = [[float("nan")] * len(qs) for _ in ps]
        for pt in points:
            if pt["panel"] == panel:
                shown[ps.index(pt["p"])][qs.index(pt["q"])] = pt["value"]
        image = ax.imshow(
            shown, cmap="viridis" if higher_is_better else "viridis_r", vmin=low, vmax=high if high > low else low + 1
        )
        for pt in points:
            if pt["panel"] != panel:
                continue
            goodness = (pt["value"] - low) / ((high - low) or 1.0)
            goodness = goodness if higher_is_better else 1.0 - goodness
            text = fmt.format(pt["value"]) + (f"\n{pt['note']}" if pt.get("note") else "")
            ax.text(
                qs.index(pt["q"]),
                ps.index(pt["p"]),
                text + ("\nbest" if pt.get("best") else ""),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if goodness < 0.5 else "black",
            )
        ax.set_xticks(range(len(qs)), [number_text(q) for q in qs])
        ax.set_yticks(range(len(ps)), [number_text(p) for p in ps])
        ax.set_xlabel("q (drop probability)")
        ax.set_ylabel("p (candidate share)")
        ax.set_title(panel, fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
    width = int(fig.get_size_inches()[0] * 13)  # characters that fit at fontsize 9
    fig.suptitle(
        textwrap.fill(title, width, break_on_hyphens=False) + "\n" + textwrap.fill(subtitle, width), fontsize=9
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- results.md and results.json ------------------------------------------------------------------
def write_results(records: List[dict], opts, settings: dict, started: float, log: Callable[[str], None]) -> None:
    """The heatmap, ``results.md`` and ``results.json`` of the finished cells; logs the table."""
    out: Path = opts.out_dir
    best = best_cell(records)
    plain = next((r for r in records if r["cell"]["method"] == "plain"), None)
    seeds = ",".join(map(str, opts.seeds))
    title = (
        f"AD-DROP p x q sweep, {opts.source_lang}→{opts.target_lang}, {opts.epochs} "
        f"epoch{'s' * (opts.epochs != 1)}, seeds {seeds}"
    )
    png = _draw_heatmap(records, best, plain, title, opts, log)
    lines = _results_lines(records, best, plain, title, opts)
    summary = _results_summary(records, best, plain, png, opts, settings)
    summary["seconds"] = round(time.time() - started, 1)
    write_json(out / "results.json", summary)
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    log("\n".join(lines))
    log(f"results: {out / 'results.md'}, {out / 'results.json'}" + (f", {png}" if png else ""))
    if all(r["valid_bleu"] == 0.0 for r in records):
        log(
            "every cell's valid BLEU is 0: the runs are too short to translate (empty or repeated-token "
            "hypotheses); raise --epochs, the cells were ranked by valid loss"
        )


def _draw_heatmap(
    records: List[dict], best: dict, plain: Optional[dict], title: str, opts, log: Callable[[str], None]
) -> Optional[Path]:
    """``OUT/heatmap.png`` of the AD-DROP cells' valid BLEU, or None without matplotlib."""
    png = opts.out_dir / "heatmap.png"
    try:
        points = [
            {
                "panel": panel_name(r["cell"]),
                "p": r["cell"]["p"],
                "q": r["cell"]["q"],
                "value": r["valid_bleu"],
                "note": f"loss {r['valid_loss']:.3f}",
                "best": r is best,
            }
            for r in records
            if r["cell"]["method"] == "ad-drop"
        ]
        subtitle = "valid BLEU (sacrebleu, mean over seeds), valid loss below" + (
            f"; plain {plain['valid_bleu']:.2f} / {plain['valid_loss']:.3f}" if plain else ""
        )
        heatmap(points, png, f"{title} ({'/'.join(opts.data_bin.parts[-2:])})", subtitle, higher_is_better=True)
    except ImportError:
        log("heatmap.png skipped: matplotlib is not installed (pip install 'attn_reg_plugin[plots]')")
        return None
    return png


def _table(records: List[dict], with_test: bool) -> List[str]:
    head = "| cell | valid BLEU (mean ± sd over seeds) | valid loss | AD-DROP rate | empty hypotheses |"
    head += " test BLEU (not used to choose) |" if with_test else ""
    lines = [head, "|" + "---|" * (6 if with_test else 5)]
    for r in records:
        rate = "-" if r["ad_drop_rate"] is None else f"{r['ad_drop_rate']:.4f}"
        row = (
            f"| {r['name']} | {r['valid_bleu']:.2f} ± {r['valid_bleu_sd']:.2f} | {r['valid_loss']:.3f} | "
            f"{rate} | {r['empty_hypotheses']} |"
        )
        if with_test:
            row += f" {r['test_bleu']:.2f} |"
        lines.append(row)
    return lines


def _results_lines(records: List[dict], best: dict, plain: Optional[dict], title: str, opts) -> List[str]:
    """``results.md``: the title, the table, the best cell and how BLEU was computed."""
    lines = [f"{title}, on {opts.data_bin}", "", *_table(records, opts.test)]
    best_line = (
        f"best on valid: {best['name']} (p {number_text(best['cell']['p'])}, q {number_text(best['cell']['q'])}): "
        f"valid BLEU {best['valid_bleu']:.2f}, valid loss {best['valid_loss']:.3f}"
        + (f"; plain: valid BLEU {plain['valid_bleu']:.2f}, valid loss {plain['valid_loss']:.3f}" if plain else "")
    )
    lines += ["", best_line, "", f"BLEU: sacrebleu on detokenized fairseq-generate output (beam {opts.beam}) "
              f"vs {best['runs'][0]['valid']['reference']}"]  # fmt: skip
    return lines


def _results_summary(
    records: List[dict], best: dict, plain: Optional[dict], png: Optional[Path], opts, settings: dict
) -> dict:
    """``results.json`` but its ``seconds``: the grid, the best and plain cells, every cell, versions."""

    def without(record: dict, *keys: str) -> dict:
        return {k: v for k, v in record.items() if k not in keys}

    return {
        "pair": f"{opts.source_lang}-{opts.target_lang}",
        "direction": f"{opts.source_lang}→{opts.target_lang}",
        "settings": settings,
        "grid": {
            "p": opts.p,
            "q": opts.q,
            "attribution": opts.attribution,
            "layers": opts.layers,
            "schedule": opts.schedule,
            "seeds": opts.seeds,
            "plain": opts.plain,
        },
        "best": without(best, "runs", "settings"),
        "plain": None if plain is None else without(plain, "runs", "settings"),
        "cells": [without(r, "settings") for r in records],
        "heatmap": None if png is None else str(png),
        "versions": _versions(),
    }


def _versions() -> Dict[str, Optional[str]]:
    from importlib import metadata

    out: Dict[str, Optional[str]] = {"python": sys.version.split()[0]}
    for name in ("attn_reg_plugin", "torch", "fairseq-fixed", "fairseq", "sacrebleu"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
