"""What the sweep writes: the records (whole or not at all), the heatmap, ``results.md`` and
``results.json``, over every cell of the ``--out-dir`` (earlier commands' cells included)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .heatmap import color_limits, heatmap
from .options import cell_name, panel_name
from .verdict import best_cell, best_line, caveats, closing_hints, flags, plain_of, scored, seed_spread

# A resumed run's notice (runs.py writes it to the console, report.py to results.md).
APPROXIMATE_RESUME = (
    "; its batches from here on are not an uninterrupted run's: give --rebuild-batches after '--' for an exact resume"
)

# The heatmap's colour scale reaches at least this far either side of plain: differences under a
# BLEU point are within seed noise in MT (DESIGN.md, "Evidence in MT") and must not look maximal.
HEATMAP_MIN_SPAN = 1.0


def write_json(path: Path, data) -> None:
    """Written whole or not at all: a kill mid-write must not leave a record that looks finished."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(partial, path)


# -- results.md and results.json ------------------------------------------------------------------
def write_results(records: List[dict], opts, settings: dict, started: float, log: Callable[[str], None]) -> None:
    """The heatmap, ``results.md`` and ``results.json`` of every cell in ``records``; logs the table."""
    out: Path = opts.out_dir
    best, plain = best_cell(records), plain_of(records)
    seeds = sorted({s for r in records for s in r["seeds"]})
    title = (
        f"AD-DROP p x q sweep, {opts.source_lang}→{opts.target_lang}, {opts.epochs} "
        f"epoch{'s' * (opts.epochs != 1)}, seeds {','.join(map(str, seeds))}"
    )
    drawn = _draw_heatmap(records, best, plain, title, opts, log)
    lines = [f"{title}, on {opts.data_bin}", "", *_table(records, opts.test), "", best_line(best, plain, records)]
    lines += run_lines(records, settings) + failed_lines(opts.failed_runs)
    translated = [run["valid"] for r in records for run in r["runs"] if run["valid"] is not None]
    reference = translated[0]["reference"] if translated else "the valid references (no run was translated)"
    lines += ["", f"BLEU: sacrebleu on detokenized fairseq-generate output (beam {opts.beam}) vs {reference}"]
    summary = _results_summary(records, best, plain, drawn, opts, settings)
    summary["failed_runs"] = opts.failed_runs
    summary["seconds"] = round(time.time() - started, 1)
    write_json(out / "results.json", summary)
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    log("\n".join(lines))
    log(f"results: {out / 'results.md'}, {out / 'results.json'}" + (f", {drawn['path']}" if drawn else ""))
    for hint in closing_hints(records):
        log(hint)


def run_lines(records: List[dict], settings: dict, checkpoint: str = "their checkpoint_last.pt") -> List[str]:
    """results.md's lines on how the runs ran: their world size when over 1 (an update then sums
    every rank's batches), and each run resumed from ``checkpoint``, whose batches from there on are
    not an uninterrupted run's unless its ``exact_resume`` (``--rebuild-batches``; attn-reg-cls-compare's
    Trainer checkpoints always) says so (none of either: no lines)."""
    lines = []
    ranks = settings.get("world_size", 1)
    if ranks > 1:
        lines += ["", f"World size {ranks}: each run is {ranks} fairseq-train ranks; an update sums their batches."]
    resumed = [
        f"- {cell_name(r['cell'])} seed {run['seed']}: {resumed_text(run)}"
        for r in records
        for run in r["runs"]
        if run.get("resumed_at_epochs")
    ]
    if resumed:
        lines += ["", f"Runs resumed from {checkpoint} (a stop, a failed job, a Slurm requeue):", *resumed]
    return lines


def resumed_text(run: dict) -> str:
    """A run's resumes as results.md and the launcher's console line say them ("" if none): the epochs
    it resumed in (and the steps, a classifier run's), and whether its batches are an uninterrupted run's."""
    epochs, steps = run.get("resumed_at_epochs"), run.get("resumed_at_steps")
    if not epochs:
        return ""
    return (
        f"resumed at epoch {', '.join(map(str, epochs))}"
        + (f" (step {', '.join(map(str, steps))})" if steps else "")
        + ("" if run.get("exact_resume") else APPROXIMATE_RESUME)
    )


def failed_lines(
    failed: List[dict], heading: str = "Failed runs (not in the tables above; the same command submits them again):"
) -> List[str]:
    """results.md's lines naming the runs whose jobs failed, under ``heading`` (none: no lines)."""
    if not failed:
        return []
    return [
        "",
        heading,
        *(f"- {f['name']} seed {f['seed']}: job {f['job']} {f['state']}: {f['error']}; log {f['log']}" for f in failed),
    ]


def _draw_heatmap(
    records: List[dict], best: Optional[dict], plain: Optional[dict], title: str, opts, log: Callable[[str], None]
) -> Optional[dict]:
    """``OUT/heatmap.png`` of the AD-DROP cells' valid BLEU minus plain's (centred on 0) or, without a
    plain cell, their valid BLEU; what it shows, or None without matplotlib or AD-DROP cells."""
    cells = [r for r in records if r["cell"]["method"] == "ad-drop" and r["valid_bleu"] is not None]
    if not cells:  # none, or every one diverged before it was scored (the table names them)
        return None
    plain = scored(plain)
    base = plain["valid_bleu"] if plain else 0.0
    points = [
        {
            "panel": panel_name(r["cell"]),
            "p": r["cell"]["p"],
            "q": r["cell"]["q"],
            "value": round(r["valid_bleu"] - base, 2),
            "note": ("loss -" if r["valid_loss"] is None else f"loss {r['valid_loss']:.3f}")
            + ("\nnot ranked" if flags(r, plain) else ""),
            "best": r is best,
        }
        for r in cells
    ]
    center = 0.0 if plain else None
    span = max(HEATMAP_MIN_SPAN, 2 * (seed_spread(records) or 0.0))
    vmin, vmax = color_limits([pt["value"] for pt in points], center, span)
    if plain:
        shows = f"valid BLEU − plain's {plain['valid_bleu']:.2f} (plain valid loss {plain['valid_loss']:.3f})"
        subtitle = f"{shows}; mean over seeds, colours centred on plain (0); valid loss below"
    else:
        shows = "valid BLEU"
        subtitle = "valid BLEU (sacrebleu, mean over seeds), valid loss below; no plain cell to centre on (--plain)"
    drawn = {"path": str(opts.out_dir / "heatmap.png"), "shows": shows, "center": center, "vmin": vmin, "vmax": vmax}
    drawn["plain_valid_bleu"] = plain["valid_bleu"] if plain else None
    try:
        heatmap(
            points, Path(drawn["path"]), f"{title} ({'/'.join(opts.data_bin.parts[-2:])})", subtitle,
            higher_is_better=True, fmt="{:+.2f}" if plain else "{:.2f}", center=center, min_span=span,
            colorbar_label="valid BLEU − plain" if plain else "valid BLEU",
        )  # fmt: skip
    except ImportError:
        log("heatmap.png skipped: matplotlib is not installed (pip install 'attn_reg_plugin[plots]')")
        return None
    return drawn


def _number(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def _table(records: List[dict], with_test: bool) -> List[str]:
    head = (
        "| cell | seeds | valid BLEU (mean ± sd over seeds) | valid loss | hyp/ref length | AD-DROP rate | "
        "skipped AD-DROP steps | empty hypotheses |"
    )
    head += " test BLEU (not used to choose) |" if with_test else ""
    lines = [head + " note |", "|" + "---|" * (10 if with_test else 9)]
    plain = plain_of(records)
    for r in records:
        spread = "n/a" if r["valid_bleu_sd"] is None else f"{r['valid_bleu_sd']:.2f}"
        skipped = _number(r.get("ad_drop_skipped"), "{}")
        if r.get("ad_drop_skipped_share") is not None:
            skipped += f" ({100 * r['ad_drop_skipped_share']:.0f}%)"
        notes = flags(r, plain) + [f"seed {s} logged no epoch {e}" for s, e in r.get("missing_epochs", {}).items()]
        row = (
            f"| {r['name']} | {','.join(map(str, r['seeds']))} | {_number(r['valid_bleu'], '{:.2f}')} ± {spread} | "
            f"{_number(r['valid_loss'], '{:.3f}')} | {_number(r.get('length_ratio'), '{:.2f}')} | "
            f"{_number(r['ad_drop_rate'], '{:.4f}')} | {skipped} | {r['empty_hypotheses']} |"
        )
        if with_test:
            row += f" {_number(r['test_bleu'], '{:.2f}')} |"
        lines.append(row + f" {'; '.join(notes)} |")
    return lines


def _axis(records: List[dict], key: str) -> list:
    values = {r["cell"][key] for r in records if key in r["cell"]}
    return sorted(values)


def _results_summary(
    records: List[dict], best: Optional[dict], plain: Optional[dict], drawn: Optional[dict], opts, settings: dict
) -> dict:
    """``results.json`` but its ``seconds``: the grid of every cell so far, the best and plain cells,
    every cell with its flags, the heatmap, versions."""

    def without(record: dict, *keys: str) -> dict:
        return {k: v for k, v in record.items() if k not in keys}

    return {
        "pair": f"{opts.source_lang}-{opts.target_lang}",
        "direction": f"{opts.source_lang}→{opts.target_lang}",
        "settings": settings,
        "grid": {
            **{key: _axis(records, key) for key in ("p", "q", "attribution", "layers", "schedule")},
            "seeds": sorted({s for r in records for s in r["seeds"]}),
            "plain": plain is not None,
        },
        "best": None if best is None else without(best, "runs", "settings"),
        "best_caveats": [] if best is None else caveats(records, best),
        "seed_spread": seed_spread(records),
        "plain": None if plain is None else without(plain, "runs", "settings"),
        "cells": [{**without(r, "settings"), "flags": flags(r, plain)} for r in records],
        "heatmap": drawn,
        "versions": _versions(),
    }


def _versions() -> Dict[str, Optional[str]]:
    from importlib import metadata

    out: Dict[str, Optional[str]] = {"python": sys.version.split()[0]}
    for name in ("attn_reg_plugin", "torch", "fairseq-fixed", "fairseq", "sacrebleu", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
