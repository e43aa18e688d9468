"""attn-reg-cls-compare's details beside the verdicts: per class precision, recall and F1 and the confusion
matrix over the seeds (from the runs' predictions files), each regularized row's drop rate (from its runs'
logs), the warnings that weaken a verdict (still learning; dev and test disagreeing in sign), the best dev
run and its kept model, and compare.png (dev score per epoch; the forest plot of :mod:`.plots`)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..classification import class_scores
from .cls_runs import MODEL_FOLDER, PREDICTION_FILES, label_order, read_predictions
from .comparison_report import mean_sd
from .paired import spread
from .plots import draw_comparison, forest, forest_row, wrapped
from .runs import run_dir


def rate_keys() -> tuple:
    """The Trainer log keys that are a share of attention the method dropped: each registered regularizer's
    rate (those that log none, R-Drop's, HiddenCut's and AttendOut's, are never found)."""
    from ..core.regularizers.registry import registered

    return tuple(r.rate_key() for r in registered())


def active_keys() -> tuple:
    """The Trainer log keys that read 0 for an epoch in which a regularizer does nothing by design
    (``Regularizer.active_key``: AD-DROP's plain epochs of cross-tuning)."""
    from ..core.regularizers.registry import registered

    return tuple(r.active_key for r in registered() if r.active_key)


CLASS_SCORES = ("precision", "recall", "f1")


# -- per class, over the seeds ----------------------------------------------------------------------
def per_class(out_dir: Optional[Path], record: dict, split: str = "test") -> Optional[dict]:
    """A row's per-class precision, recall and F1 on ``split`` (mean and sd over its seeds, each from that
    seed's predictions file), each class's support, and the confusion matrix summed over the seeds (rows
    gold, columns predicted, labels in the model's order); None when a run has no predictions file."""
    if out_dir is None:
        return None
    found = {
        r["seed"]: read_predictions(run_dir(out_dir, r["cell"], r["seed"]) / PREDICTION_FILES[split])
        for r in record["runs"]
    }
    if not found or any(rows is None for rows in found.values()):
        return None
    labels = label_order({row[k] for rows in found.values() for row in rows for k in ("gold", "predicted")})
    index = {label: i for i, label in enumerate(labels)}
    confusion = [[0] * len(labels) for _ in labels]
    values = {label: {score: [] for score in CLASS_SCORES} for label in labels}
    for rows in found.values():
        seed_confusion = [[0] * len(labels) for _ in labels]
        for row in rows:
            seed_confusion[index[row["gold"]]][index[row["predicted"]]] += 1
        for i, label in enumerate(labels):
            tp = seed_confusion[i][i]
            predicted = sum(seed_confusion[j][i] for j in range(len(labels)))
            actual = sum(seed_confusion[i])
            for score, value in zip(CLASS_SCORES, class_scores(tp, predicted, actual)):
                values[label][score].append(value)
        for i in range(len(labels)):
            for j in range(len(labels)):
                confusion[i][j] += seed_confusion[i][j]
    first = next(iter(found.values()))
    return {
        "split": split,
        "seeds": sorted(found),
        "labels": labels,
        "support": {label: sum(row["gold"] == label for row in first) for label in labels},
        "classes": {label: {score: spread(v) for score, v in scores.items()} for label, scores in values.items()},
        "confusion": confusion,
    }


def class_lines(name: str, report: dict, digits: int) -> List[str]:
    """results.md's lines of one row's :func:`per_class`: a table of the classes, then the confusion."""
    seeds = ",".join(map(str, report["seeds"]))
    lines = [f"{name}, {report['split']}, seeds {seeds} (mean ± sd over seeds):", ""]
    lines += ["| class | support | precision | recall | F1 |", "|---|---|---|---|---|"]
    for label in report["labels"]:
        c = report["classes"][label]
        cells = " | ".join(mean_sd(c[score], digits) for score in CLASS_SCORES)
        lines.append(f"| {label} | {report['support'][label]} | {cells} |")
    lines += ["", f"Confusion, summed over the {len(report['seeds'])} seed(s) (rows: gold; columns: predicted):", ""]
    lines += [
        "| gold \\ predicted | " + " | ".join(report["labels"]) + " |",
        "|---" * (len(report["labels"]) + 1) + "|",
    ]
    for label, row in zip(report["labels"], report["confusion"]):
        lines.append(f"| {label} | " + " | ".join(map(str, row)) + " |")
    return lines


# -- what a regularizer dropped ---------------------------------------------------------------------
def drop_rate(record: dict) -> Optional[dict]:
    """The share a regularized row dropped (AD-DROP's real keys on its AD-DROP epochs, a registry
    regularizer's units, as its rate counts them): per seed the mean over its epochs that logged it, and the mean over seeds; None for
    a method that logs no rate (plain, R-Drop, AttendOut, HiddenCut)."""
    per_seed = {}
    key = None
    idle_by_design = active_keys()
    for run in record["runs"]:
        values = []
        for epoch in run.get("epochs", []):
            if any(epoch.get(k) == 0 for k in idle_by_design):
                continue  # e.g. a cross-tuning plain epoch: nothing dropped, by design
            for k in rate_keys():
                if epoch.get(k) is not None:
                    key = k
                    values.append(epoch[k])
        if values:
            per_seed[run["seed"]] = statistics.fmean(values)
    if not per_seed:
        return None
    return {"key": key, "per_seed": per_seed, "mean": statistics.fmean(per_seed.values())}


# -- what weakens a verdict -------------------------------------------------------------------------
def still_learning(runs: List[dict]) -> Optional[str]:
    """A warning when the best dev epoch is the last for most of ``runs`` (a row's and plain's): the
    scores were still rising when training stopped."""
    last = [r for r in runs if r.get("epochs") and r["best_epoch"] == len(r["epochs"])]
    if not runs or 2 * len(last) <= len(runs):
        return None
    epochs = sorted({len(r["epochs"]) for r in last})
    return (
        f"still learning: the best dev epoch was the last ({', '.join(map(str, epochs))}) in {len(last)} of "
        f"{len(runs)} runs: more epochs may change this"
    )


def sign_disagreement(differences: Dict[str, dict], metric: str, label: str) -> Optional[str]:
    """A warning when the dev and test differences to plain (``metric``) point opposite ways: the means, or
    most of the seeds both moved."""
    dev, test = differences[f"dev_{metric}"], differences[f"test_{metric}"]
    if dev["mean"] is None or test["mean"] is None:
        return None
    seeds = [s for s in test["per_seed"] if s in dev["per_seed"] and dev["per_seed"][s] and test["per_seed"][s]]
    opposite = [s for s in seeds if (dev["per_seed"][s] > 0) != (test["per_seed"][s] > 0)]
    means_opposite = dev["mean"] * test["mean"] < 0
    if not means_opposite and 2 * len(opposite) <= len(seeds):
        return None
    return (
        f"dev and test disagree in sign (dev {label} {dev['mean']:+.4f}, test {test['mean']:+.4f}; opposite at "
        f"{len(opposite)} of {len(seeds)} seed(s) where both moved): neither split alone is the answer"
    )


# -- the best run and its model ---------------------------------------------------------------------
def best_run(records: List[dict], metric: str, out_dir: Path) -> Optional[dict]:
    """The run with the highest dev ``metric`` of those that learned something, else of all (then its
    ``learned_nothing`` says so); test is not looked at; ties: the earlier row, then seed. Its row, seed,
    scores and kept model folder (None if not kept); None without runs."""
    every = [(r, run) for r in records for run in r["runs"]]
    candidates = [(r, run) for r, run in every if not run["learned_nothing"]] or every
    if not candidates:
        return None
    record, run = max(candidates, key=lambda pair: pair[1]["dev"][metric])  # max keeps the first of ties
    folder = run_dir(out_dir, record["cell"], run["seed"]) / MODEL_FOLDER
    return {
        "name": record["name"],
        "seed": run["seed"],
        "dev": run["dev"][metric],
        "test": run["test"][metric],
        "model": str(folder) if run.get("model") and folder.is_dir() else None,
        "learned_nothing": run["learned_nothing"],
    }


# -- compare.png ------------------------------------------------------------------------------------
def draw_cls_comparison(
    summaries: List[dict], records: List[dict], path: Path, title: str, metric: str, label: str, log: Callable
) -> Optional[str]:
    """compare.png: each row's dev ``metric`` per epoch (the mean over its seeds, each seed a thin line),
    and each row's test and dev difference to plain with its 95% interval (:func:`plots.forest`)."""

    def epoch_and_forest_panels(axes) -> None:
        by_name = {r["name"]: r for r in records}
        for i, s in enumerate(summaries):
            curves = [[e["dev"][metric] for e in run["epochs"]] for run in by_name[s["name"]]["runs"]]
            for curve in curves:
                axes[0].plot(range(1, len(curve) + 1), curve, color=f"C{i}", alpha=0.25, lw=0.8)
            longest = max((len(c) for c in curves), default=0)
            means = [statistics.fmean(c[e] for c in curves if len(c) > e) for e in range(longest)]
            axes[0].plot(range(1, longest + 1), means, color=f"C{i}", marker="o", lw=2, label=s["name"])
        axes[0].set_xlabel("epoch")
        axes[0].xaxis.get_major_locator().set_params(integer=True)
        axes[0].set_title(wrapped(f"dev {label} per epoch\n(bold: mean over seeds; thin: each seed)"))
        axes[0].legend(fontsize="small")
        others = [s for s in summaries if "differences" in s]
        for ax, split in ((axes[1], "test"), (axes[2], "dev")):
            rows = [
                forest_row(
                    s["name"],
                    None if s["compared"] is not True else s["differences"][f"{split}_{metric}"],
                    s["compared"] or "",
                )
                for s in others
            ]
            forest(ax, rows, f"{split} {label} − plain")

    return draw_comparison(path, wrapped(title, 150), epoch_and_forest_panels, log)
