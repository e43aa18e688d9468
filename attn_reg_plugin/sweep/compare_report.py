"""What attn-reg-mt-compare writes: the methods' table over seeds, the paired differences to plain
with sacrebleu's per-seed test, the verdicts, ``results.md``/``results.json`` and ``compare.png``,
over every method run in the ``--out-dir`` (earlier commands' too). The report is the comparisons'
own (:mod:`.comparison_report`); this module gives it the translation's metrics, rules and wording."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .comparison_report import (
    ReportLayout,
    ReportParts,
    RowRules,
    difference_table,
    options_line,
    ordered,
    row_summary,
    spread_table,
    unrecorded_verdicts,
    write_comparison,
    write_report_files,
)
from .paired import METRICS, cautions, read_lines, sacrebleu_paired_test, spread, translation_scores, verdict
from .plots import draw_comparison, forest, forest_row, wrapped
from .report import _versions, failed_lines, run_lines
from .verdict import flags


def paired_tests(record: dict, plain: dict, out: Path, tokenize: str) -> Dict[int, dict]:
    """sacrebleu's paired bootstrap test per seed both ran and translated (a run that diverged has no
    hypotheses): the method's test.hyp against plain's, on plain's test.ref (the method's must be the
    same references)."""
    tests = {}
    for seed in sorted(_translated_seeds(record) & _translated_seeds(plain)):
        base, mine = (out / "runs" / r["name"] / f"seed{seed}" for r in (plain, record))
        refs = read_lines(base / "test.ref")
        if read_lines(mine / "test.ref") != refs:
            raise RuntimeError(f"{mine / 'test.ref'} and {base / 'test.ref'} differ: not the same test set")
        tests[seed] = sacrebleu_paired_test(
            read_lines(base / "test.hyp"), read_lines(mine / "test.hyp"), refs, tokenize
        )
    return tests


def _translated_seeds(record: dict) -> set:
    return {run["seed"] for run in record["runs"] if run.get("test") is not None}


def _p(test: dict, metric: str) -> str:
    """A seed's p-value, or "same" where the scores are equal (sacrebleu's p means nothing there)."""
    return "same" if test[metric] == test[f"{metric}_plain"] else f"{test[f'{metric}_p']:.3f}"


# -- a row against plain ----------------------------------------------------------------------------
def mt_rules(out: Path, tokenize: str) -> RowRules:
    """How a translation row is judged: its fairseq scores (:data:`paired.METRICS`); flagged when it
    diverged or its regularizer mostly did not run; sacrebleu's paired test per seed on the test
    hypotheses under ``out``; cautioned when plain does not translate yet or the output is degenerate."""

    def sacrebleu_tests(summary: dict, record: dict, plain: Optional[dict]) -> None:
        summary["paired_tests"] = paired_tests(record, plain, out, tokenize) if plain is not None else {}

    def translation_cautions(summary: dict, record: dict, plain: Optional[dict]) -> List[str]:
        plain_bleu = spread(list(translation_scores(plain, "test_bleu").values()))["mean"] if plain else None
        return cautions(record, plain, plain_bleu)

    def verdict_with_tests(
        summary: dict, record: dict, plain: Optional[dict], own: List[str], notes: List[str]
    ) -> None:
        summary["verdict"] = verdict(record["name"], summary["differences"], summary["paired_tests"], own, notes)

    return RowRules(
        metric_keys=tuple(key for key, *_ in METRICS),
        scores=translation_scores,
        facts=lambda record, plain: {"flags": flags(record, plain)},
        plain_flags=lambda plain: flags(plain, plain),
        evidence=sacrebleu_tests,
        cautions=translation_cautions,
        judge=verdict_with_tests,
    )


def mt_row_summary(record: dict, plain: Optional[dict], out: Path, tokenize: str, failed: Sequence[dict] = ()) -> dict:
    """One method's row: its metrics over seeds, differences to plain, per-seed tests and verdict
    (``plain`` None when none of its runs finished: every job failed, ``failed`` names them)."""
    return row_summary(record, plain, failed, mt_rules(out, tokenize))


# -- results.md, results.json -----------------------------------------------------------------------
def _seed_tests(summary: dict) -> str:
    """A row's per-seed sacrebleu p-values, test BLEU (chrF), for its table's last column."""
    tests = summary["paired_tests"].items()
    return ", ".join(f"seed {seed}: {_p(t, 'bleu')} ({_p(t, 'chrf')})" for seed, t in tests) or "-"


def tables(summaries: List[dict]) -> List[str]:
    """results.md's two tables: each method over seeds; each method minus plain, paired over seeds."""
    spreads = [(key, f"{label} (mean ± sd)", digits) for key, label, _, digits in METRICS]
    differences = [(key, f"{label} [95% CI]", digits) for key, label, _, digits in METRICS]
    tests = ("sacrebleu paired bootstrap p, test BLEU (chrF), per seed; same: equal scores", _seed_tests)
    lines = spread_table(summaries, spreads, "method", note=lambda s: "; ".join(s["flags"]))
    return [*lines, "", *difference_table(summaries, differences, "method − plain", "test_bleu", extra=tests)]


def _title(opts, seeds: List[int]) -> str:
    return (
        f"Regularizers against plain, {opts.source_lang}→{opts.target_lang}, {opts.epochs} "
        f"epoch{'s' * (opts.epochs != 1)}, seeds {','.join(map(str, seeds))}"
    )


def mt_layout(opts, log: Callable[[str], None]) -> ReportLayout:
    """attn-reg-mt-compare's report: the two tables, each row's options, the verdicts, the runs, and
    how BLEU, chrF and the intervals were computed; results.json names the pair."""

    def translation_report(parts: ReportParts):
        records, summaries = parts.records, parts.summaries
        translated = [run["test"] for r in records for run in r["runs"] if run.get("test") is not None]
        reference = translated[0]["reference"] if translated else "the test references (no run was translated)"
        # A row's name is the user's, or a short form of its options (':' left out): its method and
        # options in full, as run, once.
        options = [options_line(s["name"], s["method"], s["args"]) for s in summaries]
        lines = [f"{parts.title}, on {opts.data_bin}", "", *tables(summaries)]
        lines += [
            "",
            "Each row's own fairseq-train options:",
            *options,
            "",
            "Verdicts:",
            *(f"- {v}" for v in parts.verdicts),
        ]
        lines += run_lines(records, records[0]["settings"]) + failed_lines(opts.failed_runs)
        lines += [
            "",
            f"BLEU and chrF: sacrebleu on detokenized fairseq-generate output (beam {opts.beam}) vs {reference}; "
            "sd: sample sd over seeds (n/a for one seed); 95% CI: mean ± t(0.975, n-1) x sd / sqrt(n) of the "
            "per-seed differences; p: sacrebleu's paired bootstrap resampling (1000 resamples) of each seed's "
            "test hypotheses against plain's, which alone over-claims: the verdict rests on the seeds.",
        ]
        fields = {
            "pair": f"{opts.source_lang}-{opts.target_lang}",
            "direction": f"{opts.source_lang}→{opts.target_lang}",
            "settings": records[0]["settings"],
            "seeds": parts.seeds,
            "methods": summaries,
            "verdicts": parts.verdicts,
            "failed_runs": opts.failed_runs,
            "plot": parts.drawn,
        }
        return lines, fields

    return ReportLayout(
        rules=mt_rules(opts.out_dir, opts.tokenize),
        title=lambda seeds: _title(opts, seeds),
        draw=lambda summaries, records, path, title: draw_mt_comparison(summaries, path, title, log),
        compose=translation_report,
    )


def write_mt_comparison(
    records: List[dict], opts, started: float, log: Callable[[str], None], settings: Optional[dict] = None
) -> None:
    """results.md, results.json and compare.png of every method in ``records``; logs the tables.
    No records (no run has finished, every job failed: ``opts.failed_runs``): :func:`write_failures`,
    with ``settings`` the command's."""
    if not records:
        return write_failures(opts, settings or {}, started, log)
    write_comparison(records, opts.failed_runs, opts.out_dir, started, log, mt_layout(opts, log))


def write_failures(opts, settings: dict, started: float, log: Callable[[str], None]) -> None:
    """results.md and results.json when no run has finished, every job having failed: no table and
    no plot, each failed run named (its row, seed, job, state, error and log), results.json with the
    keys of :func:`write_mt_comparison`'s (``methods`` empty); one line on the console."""
    out: Path = opts.out_dir
    failed = opts.failed_runs
    title = _title(opts, sorted({f["seed"] for f in failed}))
    rows = ordered([{"name": cell["name"], "cell": cell} for cell in opts.cells])
    options = [options_line(r["name"], r["cell"]["method"], r["cell"].get("args")) for r in rows]
    lines = [f"{title}, on {opts.data_bin}", "", f"No run finished: all {len(failed)} run(s) of this command failed"]
    lines[-1] += ", so nothing is compared."
    lines += ["", "Each row's own fairseq-train options:", *options]
    lines += failed_lines(failed, "Failed runs (the same command submits them again):")
    summary = {
        "pair": f"{opts.source_lang}-{opts.target_lang}",
        "direction": f"{opts.source_lang}→{opts.target_lang}",
        "settings": settings,
        "seeds": [],
        "methods": [],
        "verdicts": unrecorded_verdicts([], failed),
        "failed_runs": failed,
        "plot": None,
        "versions": _versions(),
        "seconds": round(time.time() - started, 1),
    }
    write_report_files(out, lines, summary)
    log(
        f"no run finished: all {len(failed)} run(s) failed; {out / 'results.md'} and results.json name them, "
        "and the same command again submits them"
    )


# -- compare.png ------------------------------------------------------------------------------------
def _why_missing(summary: dict) -> str:
    """Why a row has nothing to draw: it diverged, its run failed, or it shares no seed with plain."""
    why = "diverged" if any(f.startswith("diverged") for f in summary["flags"]) else "no seed in common"
    return "run failed" if why != "diverged" and summary.get("missing_runs") else why


def draw_mt_comparison(summaries: List[dict], path: Path, title: str, log: Callable[[str], None]) -> Optional[str]:
    """compare.png: per method the mean test BLEU with each seed's point; each method's difference to
    plain (test BLEU, best valid loss) with its 95% interval and the per-seed differences, as forest
    plots (:func:`plots.forest`, attn-reg-cls-compare's too)."""

    def bleu_and_forest_panels(axes) -> None:
        names = [s["name"] for s in summaries]
        for i, s in enumerate(summaries):
            m = s["metrics"]["test_bleu"]
            axes[0].scatter([i] * len(m["per_seed"]), list(m["per_seed"].values()), color="gray", s=14, zorder=2)
            if m["mean"] is not None:
                axes[0].scatter([i], [m["mean"]], color="black", marker="_", s=400, zorder=3)
            else:
                axes[0].annotate(
                    _why_missing(s), (i, 0.5), xycoords=("data", "axes fraction"), ha="center", va="center",
                    rotation=90, color="C3",
                )  # fmt: skip
        axes[0].set_title(wrapped("test BLEU\n(bar: mean; dots: seeds)"))
        others = [s for s in summaries if "differences" in s]
        for ax, key, label in (
            (axes[1], "test_bleu", "test BLEU − plain"),
            (axes[2], "valid_loss", "valid loss − plain, lower better"),
        ):
            forest(ax, [forest_row(s["name"], s["differences"][key], _why_missing(s)) for s in others], label)
        axes[0].set_xticks(range(len(names)), names, rotation=30, ha="right")
        axes[0].set_xlim(-0.5, len(names) - 0.5)

    return draw_comparison(path, title, bleu_and_forest_panels, log)
