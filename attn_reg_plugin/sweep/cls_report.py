"""What attn-reg-cls-compare writes: each row's accuracy, macro-F1 and MCC on dev and test over seeds,
its paired differences to plain with 95% intervals, whether its runs learned anything, and the verdicts
(the statistics and the verdict's wording are attn-reg-mt-compare's: :mod:`.paired`). The report is the
comparisons' own (:mod:`.comparison_report`); this module gives it the classifier's metrics, rules and
wording."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..classification import BOOTSTRAP_SAMPLES, paired_bootstrap_sd
from .cls_details import (
    best_run,
    class_lines,
    draw_cls_comparison,
    drop_rate,
    per_class,
    sign_disagreement,
    still_learning,
)
from .cls_runs import PREDICTION_FILES, learning_advice, read_predictions
from .comparison_report import (
    ReportLayout,
    ReportParts,
    RowRules,
    difference_table,
    difference_text,
    mean_sd,
    options_line,
    row_summary,
    spread_table,
    write_comparison,
)
from .paired import VerdictMetric, verdict
from .report import failed_lines, run_lines
from .runs import run_dir

SCORES = (("accuracy", "accuracy"), ("macro_f1", "macro-F1"), ("mcc", "MCC"))
DIGITS = 4
ZERO_WIDTH = 1e-12  # a half-width below this is rounding, e.g. the sd of three equal differences
# (record key, label) of each metric the comparison reports: dev first, then test
METRICS = tuple((f"{split}_{key}", f"{split} {label}") for split in ("dev", "test") for key, label in SCORES)


def metric_label(metric: str) -> str:
    return dict(SCORES)[metric]


def classifier_scores(record: dict, key: str) -> Dict[int, float]:
    """``{seed: value}`` of one metric (``test_mcc``) over a classifier row's runs."""
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


def cls_rules(metric: str, out_dir: Optional[Path]) -> RowRules:
    """How a classifier row is judged, on ``metric`` (test first, then dev): flagged when its runs
    learned nothing at every seed; its intervals widened by the test examples' own noise (with the runs'
    predictions under ``out_dir``); warned when still learning or when dev and test disagree in sign."""
    label = metric_label(metric)

    def facts(record: dict, plain: Optional[dict]) -> dict:
        return {
            "best_epochs": {run["seed"]: run["best_epoch"] for run in record["runs"]},
            "learned_nothing": learned_nothing_seeds(record),
            "flags": learning_flags(record),
            "notes": learning_notes(record),
            "per_class": per_class(out_dir, record),
            "drop_rate": drop_rate(record),
        }

    def test_noise(summary: dict, record: dict, plain: Optional[dict]) -> None:
        if plain is None:
            return
        seeds = summary["differences"]["test_accuracy"]["seeds"]  # each split's predictions read once
        classes = {split: paired_classes(out_dir, record, plain, seeds, split) for split in PREDICTION_FILES}
        summary["differences"] = {
            key: with_test_noise(d, key.split("_", 1)[1], classes[key.split("_", 1)[0]])
            for key, d in summary["differences"].items()
        }

    def learning_cautions(summary: dict, record: dict, plain: Optional[dict]) -> List[str]:
        return summary["notes"] + (learning_notes(plain) if plain is not None else [])

    def verdict_with_warnings(
        summary: dict, record: dict, plain: Optional[dict], own: List[str], notes: List[str]
    ) -> None:
        metrics = (
            VerdictMetric(f"test_{metric}", f"test {label}", f"test {label}", True, DIGITS),
            VerdictMetric(f"dev_{metric}", f"dev {label}", f"dev {label}", True, DIGITS),
        )
        paired_seeds = set(summary["differences"][f"test_{metric}"]["seeds"])
        runs = [r for side in (record, plain or {"runs": []}) for r in side["runs"] if r["seed"] in paired_seeds]
        summary["warnings"] = [
            w for w in (sign_disagreement(summary["differences"], metric, label), still_learning(runs)) if w
        ]
        summary["verdict"] = verdict(
            record["name"], summary["differences"], None, own, notes + summary["warnings"], metrics
        )
        summary["compared"] = _compared(summary, own)

    return RowRules(
        metric_keys=tuple(key for key, _ in METRICS),
        scores=classifier_scores,
        facts=facts,
        plain_flags=learning_flags,
        evidence=test_noise,
        cautions=learning_cautions,
        judge=verdict_with_warnings,
    )


def cls_row_summary(
    record: dict, plain: Optional[dict], metric: str, failed: List[dict], out_dir: Optional[Path] = None
) -> dict:
    """One row: its metrics over seeds, what it learned, its differences to plain (their intervals over
    seeds and, with the runs' predictions under ``out_dir``, the test examples) and its verdict, on
    ``metric`` (test first, then dev)."""
    return row_summary(record, plain, failed, cls_rules(metric, out_dir))


def _compared(summary: dict, own: List[str]) -> object:
    """True when the row's differences are evidence to show, else a few words why not (the plot's note)."""
    if own:
        return "learned nothing" if any("learned nothing" in f for f in own) else "run failed"
    if summary["differences"]["test_accuracy"]["mean"] is None:
        return "no seed in common"
    return True


TABLE_DIGITS = 3  # results.md's tables (the verdicts keep DIGITS): each table fits 100 columns
WIDTH = 100  # results.md's prose lines are wrapped to this many columns


def compact_table(summaries: List[dict], metric: str) -> List[str]:
    """results.md's first table: per row its seeds, dev and test ``metric`` (mean ± sd), the test
    difference to plain with its 95% interval, its drop rate and how many of its runs learned."""
    label = metric_label(metric)
    lines = [
        f"| row | seeds | dev {label} | test {label} | test − plain [95% CI] | dropped | learned |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        m = s["metrics"]
        if "differences" not in s:
            difference = "(baseline)"
        elif s["compared"] is not True:
            difference = f"not compared: {s['compared']}"  # numbers here would read as evidence
        else:
            difference = difference_text(s["differences"][f"test_{metric}"], TABLE_DIGITS)
        rate = "-" if s["drop_rate"] is None else f"{100 * s['drop_rate']['mean']:.1f}%"
        learned = f"{len(s['seeds']) - len(s['learned_nothing'])} of {len(s['seeds'])}"
        lines.append(
            f"| {s['name']} | {','.join(map(str, s['seeds']))} | {mean_sd(m[f'dev_{metric}'], TABLE_DIGITS)} | "
            f"{mean_sd(m[f'test_{metric}'], TABLE_DIGITS)} | {difference} | {rate} | {learned} |"
        )
    return lines


def detail_tables(summaries: List[dict]) -> List[str]:
    """results.md's details: each split's three metrics over seeds, and each row minus plain, paired by
    seed, with 95% intervals (a row not compared says so)."""
    lines = []
    for split in ("dev", "test"):
        columns = [(f"{split}_{key}", label, TABLE_DIGITS) for key, label in SCORES]
        lines += ["", f"{split.capitalize()}, mean ± sd over seeds:", ""]
        lines += spread_table(summaries, columns, "row")
        if not any("differences" in s for s in summaries):
            continue
        lines += ["", f"{split.capitalize()}, row − plain paired by seed [95% CI]:", ""]
        shown = lambda s: s["compared"] is True or s["compared"] == "no seed in common"  # noqa: E731
        lines += difference_table(summaries, columns, "row", "test_accuracy", shown=shown)
    return lines


def _wrap(lines: List[str]) -> List[str]:
    """Prose and bullets wrapped to :data:`WIDTH` columns (a bullet's next lines indented); tables,
    headings and blank lines as they are."""
    out = []
    for line in lines:
        if not line or line.startswith(("|", "#")) or len(line) <= WIDTH:
            out.append(line)
        elif line.startswith("- "):
            out += textwrap.wrap(line, WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
        else:
            out += textwrap.wrap(line, WIDTH, break_long_words=False, break_on_hyphens=False)
    return out


def _stop_lines(opts, plain: Optional[dict]) -> List[str]:
    """What to change when plain learned nothing at every seed: the advice, and the runs this command
    stopped (``opts.stopped``, the local launcher's) or, after jobs, that ran anyway."""
    stopped = getattr(opts, "stopped", None)
    if plain is None or not learning_flags(plain):
        return []
    seeds = ", ".join(str(r["seed"]) for r in plain["runs"])
    stopping = not getattr(opts, "keep_going", False)
    text = stopped["advice"] if stopped else learning_advice(opts.settings, plain["runs"][-1], stopping)
    lines = ["", f"- PLAIN LEARNED NOTHING at every seed so far ({seeds}): nothing can be compared. {text}"]
    if stopped and stopped["skipped"]:
        lines.append(f"- Not run, so as not to spend them on an empty comparison: {', '.join(stopped['skipped'])}.")
    return lines


def _best_lines(best: Optional[dict], label: str, keep_models: bool) -> List[str]:
    if best is None:
        return []
    line = (
        f"Best dev run: {best['name']} seed {best['seed']} (dev {label} {best['dev']:.4f}, test {best['test']:.4f}); "
    )
    if best["learned_nothing"]:
        line += "NO RUN LEARNED ANYTHING, this one neither; "
    if best["model"]:
        line += f"its model: {best['model']} (transformers.pipeline('text-classification', model=that folder))"
    else:
        line += "its model was not kept (" + (
            "it finished before --keep-models was given)" if keep_models else "--keep-models keeps each run's)"
        )
    return ["", line]


def cls_layout(opts, data_text: str, log: Callable[[str], None]) -> ReportLayout:
    """attn-reg-cls-compare's report: results.md the verdicts first, then a table that fits 100 columns,
    then the details (every metric, the differences, per class and the confusion, options, resumes,
    method); results.json with the best run and the runs not run."""
    label = metric_label(opts.metric)

    def title(seeds: List[int]) -> str:
        return (
            f"Regularizers against plain, {opts.model} on {data_text}, {opts.epochs} "
            f"epoch{'s' * (opts.epochs != 1)}, seeds {','.join(map(str, seeds))}"
        )

    def draw(summaries: List[dict], records: List[dict], path: Path, title: str) -> Optional[str]:
        return draw_cls_comparison(summaries, records, path, title, opts.metric, label, log)

    def classifier_report(parts: ReportParts):
        records, summaries, verdicts, drawn = parts.records, parts.summaries, parts.verdicts, parts.drawn
        options = [options_line(s["name"], s["method"], s["args"], "its defaults") for s in summaries]
        best = best_run(records, opts.metric, opts.out_dir)
        lines = ["# attn-reg-cls-compare: the regularizers against plain", "", parts.title, ""]
        if not records:  # every job failed (launch_and_report's report_failures): say so, and name them
            failed = len(opts.failed_runs)
            lines += [f"No run finished: all {failed} run(s) of this command failed, so nothing is compared.", ""]
        if verdicts:
            lines += [f"Verdicts (on test {label}, then dev {label}):", *(f"- {v}" for v in verdicts)]
        lines += _stop_lines(opts, parts.plain)
        if records:
            lines += _best_lines(best, label, getattr(opts, "keep_models", False))
            if drawn:
                lines += ["", f"Plot: {Path(drawn).name} (dev {label} per epoch; each row − plain with its 95% CI)."]
            lines += ["", *compact_table(summaries, opts.metric), "", "## Details", *detail_tables(summaries)]
            lines += _class_and_learning_lines(summaries)
            lines += ["", "Each row's own options (over the method's defaults):", *options]
        lines += run_lines(records, opts.settings, "their last Trainer checkpoint, as if uninterrupted")
        lines += failed_lines(opts.failed_runs)
        lines += ["", METHOD_PARAGRAPH.format(label=label, samples=BOOTSTRAP_SAMPLES)]
        fields = {
            "settings": opts.settings,
            "metric": opts.metric,
            "seeds": parts.seeds,
            "methods": summaries,
            "verdicts": verdicts,
            "best_run": best,
            "stopped": getattr(opts, "stopped", None),
            "plot": drawn,
            "failed_runs": opts.failed_runs,
        }
        return _wrap(lines), fields

    return ReportLayout(rules=cls_rules(opts.metric, opts.out_dir), title=title, draw=draw, compose=classifier_report)


# results.md's last paragraph: how every number above was computed
METHOD_PARAGRAPH = (
    "Each run keeps the weights of its best dev epoch ({label}, the earliest on ties) and scores dev and test "
    "with them. sd: sample sd over seeds (n/a for one seed). 95% CI of a difference to plain: mean ± "
    "sqrt(h_seeds² + h_examples²), h_seeds = t(0.975, n-1) x sd / sqrt(n) of the per-seed differences (the "
    "same seed: the same classifier head at the start and the same training subset), h_examples = 1.96 x the "
    "sd of the seed-mean difference over {samples} paired bootstrap resamples of the split's "
    "examples (each run's predictions: runs/ROW/seedS/predictions.jsonl, dev_predictions.jsonl); an interval "
    "of zero width is shown as such and is no evidence. "
    "Learned nothing: every dev prediction one class, or dev {label} within 1.96 standard errors of what a "
    "predictor that ignores the text scores on dev (accuracy: always the majority class; macro-F1: the best "
    "of that, uniform and label-share guessing; MCC: 0). Dropped: the mean over seeds of the share each "
    "regularized run's log gives (AD-DROP: real keys dropped on its AD-DROP epochs; the others: the units "
    "their rate counts, heads or keys). Still learning: the best dev epoch was the last in most of a comparison's runs."
)


def write_cls_comparison(records: List[dict], opts, data_text: str, started: float, log: Callable[[str], None]) -> dict:
    """results.md, results.json and compare.png of every row in ``records`` (:func:`cls_layout`); logs
    results.md; returns results.json's content."""
    return write_comparison(records, opts.failed_runs, opts.out_dir, started, log, cls_layout(opts, data_text, log))


def _class_and_learning_lines(summaries: List[dict]) -> List[str]:
    """results.md's per-class tables and confusion matrices (test) and the runs that learned nothing."""
    lines = []
    reports = [(s["name"], s["per_class"]) for s in summaries if s.get("per_class")]
    if reports:
        lines += ["", "### Per class on test"]
        for name, report in reports:
            lines += ["", *class_lines(name, report, TABLE_DIGITS)]
    empty = [f"- {s['name']} seed {seed}: {why}" for s in summaries for seed, why in s["learned_nothing"].items()]
    if empty:
        lines += ["", "Runs that learned nothing (on dev):", *empty]
    return lines
