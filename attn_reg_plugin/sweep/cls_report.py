"""What attn-reg-cls-compare writes: each row's accuracy, macro-F1 and MCC on dev and test over seeds,
its paired differences to plain with 95% intervals, whether its runs learned anything, and the verdicts
(the statistics and the verdict's wording are attn-reg-mt-compare's: :mod:`.paired`)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..classification import BOOTSTRAP_SAMPLES, paired_bootstrap_sd
from .cls_runs import PREDICTION_FILES, read_predictions
from .compare_report import _difference, _mean_sd, failed_notes, ordered
from .paired import VerdictMetric, paired_difference, spread, verdict
from .report import _versions, failed_lines, run_lines, write_json
from .runs import run_dir
from .verdict import plain_of

SCORES = (("accuracy", "accuracy"), ("macro_f1", "macro-F1"), ("mcc", "MCC"))
DIGITS = 4
ZERO_WIDTH = 1e-12  # a half-width below this is rounding, e.g. the sd of three equal differences
# (record key, label) of each metric the comparison reports: dev first, then test
METRICS = tuple((f"{split}_{key}", f"{split} {label}") for split in ("dev", "test") for key, label in SCORES)


def metric_label(metric: str) -> str:
    return dict(SCORES)[metric]


def per_seed(record: dict, key: str) -> Dict[int, float]:
    """``{seed: value}`` of one metric (``test_mcc``) over a row's runs."""
    split, metric = key.split("_", 1)
    return {run["seed"]: run[split][metric] for run in record["runs"]}


def learned_nothing_seeds(record: dict) -> Dict[int, str]:
    """The seeds whose runs learned nothing (``classification.learned_nothing`` on dev), and why."""
    return {run["seed"]: run["learned_nothing"] for run in record["runs"] if run["learned_nothing"]}


def learning_flags(record: dict) -> List[str]:
    """A row every run of which learned nothing cannot be compared: why, in a sentence."""
    empty = learned_nothing_seeds(record)
    if not empty or len(empty) < len(record["runs"]):
        return []
    seed, why = next(iter(empty.items()))
    return [f"learned nothing at every seed ({', '.join(map(str, empty))}); seed {seed} on dev: {why}"]


def learning_notes(record: dict) -> List[str]:
    """A row some runs of which learned nothing: which, for its verdict and its table note."""
    empty = learned_nothing_seeds(record)
    if not empty or len(empty) == len(record["runs"]):
        return []
    return [f"{record['name']} learned nothing at seed {seed} (on dev: {why})" for seed, why in empty.items()]


def paired_classes(out_dir: Optional[Path], record: dict, plain: dict, seeds: List[int], split: str):
    """``(method's, plain's, gold)`` classes of one split from the runs' predictions files, read once
    for every metric of that split: ``{seed: class per example}`` each side, the labels numbered by name;
    None unless every run of ``seeds`` on both sides has its file."""
    if out_dir is None or not seeds:
        return None
    found = {
        side: {s: read_predictions(run_dir(out_dir, r["cell"], s) / PREDICTION_FILES[split]) for s in seeds}
        for side, r in (("method", record), ("plain", plain))
    }
    if any(rows is None for side in found.values() for rows in side.values()):
        return None
    names = sorted(
        {row[k] for side in found.values() for rows in side.values() for row in rows for k in ("gold", "predicted")}
    )
    ids = {name: i for i, name in enumerate(names)}
    classes = {side: {s: [ids[row["predicted"]] for row in rows] for s, rows in v.items()} for side, v in found.items()}
    return classes["method"], classes["plain"], [ids[row["gold"]] for row in found["plain"][seeds[0]]]


def with_test_noise(d: dict, metric: str, classes) -> dict:
    """The paired difference ``d`` of one metric with its interval widened by the split's own sampling
    noise: half-width sqrt((t x sd / sqrt(n))^2 + (1.96 x bootstrap sd)^2), the seeds' t-interval and a
    paired bootstrap over the split's examples (:func:`paired_bootstrap_sd` on ``classes``, from
    :func:`paired_classes`) being independent sources of error. Without every run's predictions
    (``classes`` None) the interval stays over seeds only, and says so. An interval of zero width is
    evidence of nothing: it is dropped, with the reason."""
    d = {**d, "bootstrap_sd": None}
    if classes is not None:
        d["bootstrap_sd"] = paired_bootstrap_sd(*classes, metric)
        d["interval"] = "seeds and test examples"
    else:
        d["interval"] = "seeds only (no predictions files)"
    if d["ci"] is not None:
        seed_half = (d["ci"][1] - d["ci"][0]) / 2
        half = math.hypot(seed_half, 1.96 * (d["bootstrap_sd"] or 0.0))
        d["seed_ci"], d["ci"] = d["ci"], [d["mean"] - half, d["mean"] + half]
        if half < ZERO_WIDTH:
            d["ci"], d["no_interval"] = None, "zero width: no spread over seeds or test examples, no evidence"
    return d


def method_summary(
    record: dict, plain: Optional[dict], metric: str, failed: List[dict], out_dir: Optional[Path] = None
) -> dict:
    """One row: its metrics over seeds, what it learned, its differences to plain (their intervals over
    seeds and, with the runs' predictions under ``out_dir``, the test examples) and its verdict, on
    ``metric`` (test first, then dev)."""
    values = {key: per_seed(record, key) for key, _ in METRICS}
    summary = {
        "name": record["name"],
        "method": record["cell"]["method"],
        "args": record["cell"]["args"],
        "seeds": record["seeds"],
        "metrics": {key: {**spread(list(v.values())), "per_seed": v} for key, v in values.items()},
        "best_epochs": {run["seed"]: run["best_epoch"] for run in record["runs"]},
        "learned_nothing": learned_nothing_seeds(record),
        "flags": learning_flags(record),
        "notes": learning_notes(record),
    }
    if record is plain:
        return summary
    base = {key: per_seed(plain, key) if plain is not None else {} for key, _ in METRICS}
    summary["differences"] = {key: paired_difference(values[key], base[key]) for key in values}
    if plain is not None:  # each split's predictions read once, for its three metrics
        seeds = summary["differences"]["test_accuracy"]["seeds"]
        classes = {split: paired_classes(out_dir, record, plain, seeds, split) for split in PREDICTION_FILES}
        summary["differences"] = {
            key: with_test_noise(d, key.split("_", 1)[1], classes[key.split("_", 1)[0]])
            for key, d in summary["differences"].items()
        }
    missing = summary["missing_runs"] = failed_notes(record["name"], failed)
    if plain is None:
        own = summary["flags"] + missing
    else:
        own = summary["flags"] + [f"plain {f}" for f in learning_flags(plain)]
    notes = (
        summary["notes"] + (learning_notes(plain) if plain is not None else []) + (missing if plain is not None else [])
    )
    label = metric_label(metric)
    metrics = (
        VerdictMetric(f"test_{metric}", f"test {label}", f"test {label}", True, DIGITS),
        VerdictMetric(f"dev_{metric}", f"dev {label}", f"dev {label}", True, DIGITS),
    )
    summary["verdict"] = verdict(record["name"], summary["differences"], None, own, notes, metrics)
    return summary


def tables(summaries: List[dict]) -> List[str]:
    """results.md's two tables: each row over seeds; each row minus plain, paired over seeds."""
    head = "| method | seeds | " + " | ".join(f"{label} (mean ± sd)" for _, label in METRICS) + " | note |"
    lines = [head, "|" + "---|" * (len(METRICS) + 3)]
    for s in summaries:
        cells = " | ".join(_mean_sd(s["metrics"][key], DIGITS) for key, _ in METRICS)
        note = "; ".join(s["flags"] + s["notes"])
        lines.append(f"| {s['name']} | {','.join(map(str, s['seeds']))} | {cells} | {note} |")
    lines += ["", "| method − plain | paired seeds | " + " | ".join(f"{label} [95% CI]" for _, label in METRICS) + " |"]
    lines.append("|" + "---|" * (len(METRICS) + 2))
    for s in summaries:
        if "differences" not in s:
            continue
        d = s["differences"]
        if s["verdict"].startswith(f"{s['name']}: not compared"):
            cells = " | ".join("not compared" for _ in METRICS)  # numbers here would read as evidence
        else:
            cells = " | ".join(_difference_text(d[key]) for key, _ in METRICS)
        paired = ",".join(map(str, d["test_accuracy"]["seeds"])) or "-"
        lines.append(f"| {s['name']} | {paired} | {cells} |")
    return lines


def _difference_text(d: dict) -> str:
    if d["mean"] is not None and d.get("no_interval"):
        return f"{d['mean']:+.{DIGITS}f} (zero width)"
    return _difference(d, DIGITS)


def write_comparison(records: List[dict], opts, data_text: str, started: float, log: Callable[[str], None]) -> dict:
    """results.md and results.json of every row in ``records``; logs the tables; returns results.json's content."""
    out: Path = opts.out_dir
    plain = plain_of(records)
    summaries = [method_summary(r, plain, opts.metric, opts.failed_runs, out) for r in ordered(records)]
    seeds = sorted({s for r in records for s in r["seeds"]} or {f["seed"] for f in opts.failed_runs})
    title = (
        f"Regularizers against plain, {opts.model} on {data_text}, {opts.epochs} epoch{'s' * (opts.epochs != 1)}, "
        f"seeds {','.join(map(str, seeds))}"
    )
    verdicts = [s["verdict"] for s in summaries if "verdict" in s]
    recorded = {r["name"] for r in records} | {"plain"}
    unrecorded = dict.fromkeys(f["name"] for f in opts.failed_runs if f["name"] not in recorded)
    verdicts += [f"{name}: not compared: " + "; ".join(failed_notes(name, opts.failed_runs)) for name in unrecorded]
    options = [
        f"- {s['name']}{'' if s['name'] == s['method'] else ' (' + s['method'] + ')'}: "
        + (f"`{' '.join(s['args'])}`" if s["args"] else "its defaults")
        for s in summaries
    ]
    label = metric_label(opts.metric)
    if records:
        lines = [title, "", *tables(summaries), "", "Each row's own options (over the method's defaults):", *options]
    else:  # every job failed (launch_and_report's report_failures): say so, and name them
        failed = len(opts.failed_runs)
        lines = [title, "", f"No run finished: all {failed} run(s) of this command failed, so nothing is compared."]
    lines += ["", f"Verdicts (on test {label}, then dev {label}):", *(f"- {v}" for v in verdicts)]
    lines += run_lines(records, opts.settings, "their last Trainer checkpoint, as if uninterrupted")
    lines += failed_lines(opts.failed_runs)
    lines += [
        "",
        f"Each run keeps the weights of its best dev epoch ({label}, the earliest on ties) and scores dev and test "
        "with them. sd: sample sd over seeds (n/a for one seed). 95% CI of a difference to plain: mean ± "
        "sqrt(h_seeds² + h_examples²), h_seeds = t(0.975, n-1) x sd / sqrt(n) of the per-seed differences (the "
        "same seed: the same classifier head at the start and the same training subset), h_examples = 1.96 x the "
        f"sd of the seed-mean difference over {BOOTSTRAP_SAMPLES} paired bootstrap resamples of the split's "
        "examples (each run's predictions: runs/ROW/seedS/predictions.jsonl, dev_predictions.jsonl); an interval "
        "of zero width is shown as such and is no evidence. "
        f"Learned nothing: every dev prediction one class, or dev {label} within 1.96 standard errors of what a "
        "predictor that ignores the text scores on dev (accuracy: always the majority class; macro-F1: the best "
        "of that, uniform and label-share guessing; MCC: 0).",
    ]
    summary = {
        "settings": opts.settings,
        "metric": opts.metric,
        "seeds": seeds,
        "methods": summaries,
        "verdicts": verdicts,
        "failed_runs": opts.failed_runs,
        "versions": _versions(),
        "seconds": round(time.time() - started, 1),
    }
    write_json(out / "results.json", summary)
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    log("\n".join(lines))
    log(f"results: {out / 'results.md'}, {out / 'results.json'}")
    return summary
