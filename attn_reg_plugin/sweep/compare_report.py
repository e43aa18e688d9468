"""What attn-reg-mt-compare writes: the methods' table over seeds, the paired differences to plain
with sacrebleu's per-seed test, the verdicts, ``results.md``/``results.json`` and ``compare.png``,
over every method run in the ``--out-dir`` (earlier commands' too)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .methods import METHODS
from .paired import (
    METRICS,
    cautions,
    paired_difference,
    per_seed,
    read_lines,
    sacrebleu_paired_test,
    spread,
    verdict,
)
from .plots import forest, forest_row, pyplot, wrapped
from .report import _versions, failed_lines, run_lines, write_json
from .verdict import flags, plain_of


def ordered(records: List[dict]) -> List[dict]:
    """Plain first, then the methods in METHODS order, each method's rows by name."""
    rank = {name: i for i, name in enumerate(METHODS)}
    return sorted(records, key=lambda r: (rank.get(r["cell"]["method"], len(rank)), r["name"]))


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


def failed_notes(name: str, failed: List[dict]) -> List[str]:
    """What the comparison of row ``name`` with plain lacks: each run of either whose job failed."""
    return [
        f"{f['name']}'s run at seed {f['seed']} failed (job {f['job']}, {f['state']}): seed {f['seed']} is not compared"
        for f in failed
        if f["name"] in (name, "plain")
    ]


def method_summary(record: dict, plain: Optional[dict], out: Path, tokenize: str, failed: Sequence[dict] = ()) -> dict:
    """One method's row: its metrics over seeds, differences to plain, per-seed tests and verdict
    (``plain`` None when none of its runs finished: every job failed, ``failed`` names them)."""
    values = {key: per_seed(record, key) for key, *_ in METRICS}
    base = {key: per_seed(plain, key) if plain is not None else {} for key, *_ in METRICS}
    summary = {
        "name": record["name"],
        "method": record["cell"]["method"],
        "args": record["cell"].get("args"),
        "seeds": record["seeds"],
        "metrics": {key: {**spread(list(v.values())), "per_seed": v} for key, v in values.items()},
        "flags": flags(record, plain),
    }
    if record is plain:
        return summary
    summary["differences"] = {key: paired_difference(values[key], base[key]) for key in values}
    summary["paired_tests"] = paired_tests(record, plain, out, tokenize) if plain is not None else {}
    plain_bleu = spread(list(base["test_bleu"].values()))["mean"]
    missing = summary["missing_runs"] = failed_notes(record["name"], list(failed))
    own = summary["flags"] + ([f"plain {f}" for f in flags(plain, plain)] if plain is not None else missing)
    notes = cautions(record, plain, plain_bleu) + (missing if plain is not None else [])
    summary["verdict"] = verdict(record["name"], summary["differences"], summary["paired_tests"], own, notes)
    return summary


def _num(x: Optional[float], digits: int, sign: bool = False) -> str:
    return "-" if x is None else f"{{:{'+' if sign else ''}.{digits}f}}".format(x)


def _mean_sd(m: dict, digits: int) -> str:
    if m["mean"] is None:
        return "-"
    return f"{_num(m['mean'], digits)} ± {'n/a' if m['sd'] is None else _num(m['sd'], digits)}"


def _difference(d: dict, digits: int) -> str:
    if d["mean"] is None:
        return "-"
    interval = "n/a" if d["ci"] is None else f"[{_num(d['ci'][0], digits, True)}, {_num(d['ci'][1], digits, True)}]"
    return f"{_num(d['mean'], digits, True)} {interval}"


def _p(test: dict, metric: str) -> str:
    """A seed's p-value, or "same" where the scores are equal (sacrebleu's p means nothing there)."""
    return "same" if test[metric] == test[f"{metric}_plain"] else f"{test[f'{metric}_p']:.3f}"


def tables(summaries: List[dict]) -> List[str]:
    """results.md's two tables: each method over seeds; each method minus plain, paired over seeds."""
    head = "| method | seeds | " + " | ".join(f"{label} (mean ± sd)" for _, label, _, _ in METRICS) + " | note |"
    lines = [head, "|" + "---|" * (len(METRICS) + 3)]
    for s in summaries:
        cells = " | ".join(_mean_sd(s["metrics"][key], digits) for key, _, _, digits in METRICS)
        lines.append(f"| {s['name']} | {','.join(map(str, s['seeds']))} | {cells} | {'; '.join(s['flags'])} |")
    lines += ["", "| method − plain | paired seeds | " + " | ".join(f"{label} [95% CI]" for _, label, _, _ in METRICS)]
    lines[-1] += " | sacrebleu paired bootstrap p, test BLEU (chrF), per seed; same: equal scores |"
    lines.append("|" + "---|" * (len(METRICS) + 3))
    for s in summaries:
        if "differences" not in s:
            continue
        d = s["differences"]
        cells = " | ".join(_difference(d[key], digits) for key, _, _, digits in METRICS)
        tests = ", ".join(f"seed {seed}: {_p(t, 'bleu')} ({_p(t, 'chrf')})" for seed, t in s["paired_tests"].items())
        paired = ",".join(map(str, d["test_bleu"]["seeds"])) or "-"  # none: a diverged row has no scores
        lines.append(f"| {s['name']} | {paired} | {cells} | {tests or '-'} |")
    return lines


def _title(opts, seeds: List[int]) -> str:
    return (
        f"Regularizers against plain, {opts.source_lang}→{opts.target_lang}, {opts.epochs} "
        f"epoch{'s' * (opts.epochs != 1)}, seeds {','.join(map(str, seeds))}"
    )


def _unrecorded_verdicts(records: List[dict], failed: List[dict]) -> List[str]:
    """The verdict of each row none of whose runs finished (plain's failures are in every other row's)."""
    recorded = {r["name"] for r in records} | {"plain"}
    unrecorded = dict.fromkeys(f["name"] for f in failed if f["name"] not in recorded)
    return [f"{name}: not compared: " + "; ".join(failed_notes(name, failed)) for name in unrecorded]


def _options_line(name: str, method: str, args: Optional[List[str]]) -> str:
    """results.md's line of a row's method and options, as run."""
    return f"- {name}{'' if name == method else ' (' + method + ')'}: `{' '.join(args or [])}`"


def write_comparison(
    records: List[dict], opts, started: float, log: Callable[[str], None], settings: Optional[dict] = None
) -> None:
    """results.md, results.json and compare.png of every method in ``records``; logs the tables.
    No records (no run has finished, every job failed: ``opts.failed_runs``): :func:`write_failures`,
    with ``settings`` the command's."""
    if not records:
        return write_failures(opts, settings or {}, started, log)
    out: Path = opts.out_dir
    plain = plain_of(records)
    summaries = [method_summary(r, plain, out, opts.tokenize, opts.failed_runs) for r in ordered(records)]
    seeds = sorted({s for r in records for s in r["seeds"]})
    title = _title(opts, seeds)
    drawn = draw(summaries, out / "compare.png", title, log)
    verdicts = [s["verdict"] for s in summaries if "verdict" in s]
    verdicts += _unrecorded_verdicts(records, opts.failed_runs)  # a row none of whose runs finished
    translated = [run["test"] for r in records for run in r["runs"] if run.get("test") is not None]
    reference = translated[0]["reference"] if translated else "the test references (no run was translated)"
    # A row's name is the user's, or a short form of its options (':' left out): its method and
    # options in full, as run, once.
    options = [_options_line(s["name"], s["method"], s["args"]) for s in summaries]
    lines = [f"{title}, on {opts.data_bin}", "", *tables(summaries), "", "Each row's own fairseq-train options:"]
    lines += [*options, "", "Verdicts:", *(f"- {v}" for v in verdicts)]
    lines += run_lines(records, records[0]["settings"]) + failed_lines(opts.failed_runs)
    lines += [
        "",
        f"BLEU and chrF: sacrebleu on detokenized fairseq-generate output (beam {opts.beam}) vs {reference}; "
        "sd: sample sd over seeds (n/a for one seed); 95% CI: mean ± t(0.975, n-1) x sd / sqrt(n) of the "
        "per-seed differences; p: sacrebleu's paired bootstrap resampling (1000 resamples) of each seed's "
        "test hypotheses against plain's, which alone over-claims: the verdict rests on the seeds.",
    ]
    summary = {
        "pair": f"{opts.source_lang}-{opts.target_lang}",
        "direction": f"{opts.source_lang}→{opts.target_lang}",
        "settings": records[0]["settings"],
        "seeds": seeds,
        "methods": summaries,
        "verdicts": verdicts,
        "failed_runs": opts.failed_runs,
        "plot": drawn,
        "versions": _versions(),
        "seconds": round(time.time() - started, 1),
    }
    write_json(out / "results.json", summary)
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    log("\n".join(lines))
    log(f"results: {out / 'results.md'}, {out / 'results.json'}" + (f", {drawn}" if drawn else ""))


def write_failures(opts, settings: dict, started: float, log: Callable[[str], None]) -> None:
    """results.md and results.json when no run has finished, every job having failed: no table and
    no plot, each failed run named (its row, seed, job, state, error and log), results.json with the
    keys of :func:`write_comparison`'s (``methods`` empty); one line on the console."""
    out: Path = opts.out_dir
    failed = opts.failed_runs
    title = _title(opts, sorted({f["seed"] for f in failed}))
    rows = ordered([{"name": cell["name"], "cell": cell} for cell in opts.cells])
    options = [_options_line(r["name"], r["cell"]["method"], r["cell"].get("args")) for r in rows]
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
        "verdicts": _unrecorded_verdicts([], failed),
        "failed_runs": failed,
        "plot": None,
        "versions": _versions(),
        "seconds": round(time.time() - started, 1),
    }
    write_json(out / "results.json", summary)
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    log(
        f"no run finished: all {len(failed)} run(s) failed; {out / 'results.md'} and results.json name them, "
        "and the same command again submits them"
    )


def _why_missing(summary: dict) -> str:
    """Why a row has nothing to draw: it diverged, its run failed, or it shares no seed with plain."""
    why = "diverged" if any(f.startswith("diverged") for f in summary["flags"]) else "no seed in common"
    return "run failed" if why != "diverged" and summary.get("missing_runs") else why


def draw(summaries: List[dict], path: Path, title: str, log: Callable[[str], None]) -> Optional[str]:
    """compare.png: per method the mean test BLEU with each seed's point; each method's difference to
    plain (test BLEU, best valid loss) with its 95% interval and the per-seed differences, as forest
    plots (:func:`plots.forest`, attn-reg-cls-compare's too)."""
    plt = pyplot(log)
    if plt is None:
        return None
    # Constrained layout makes room for every title and rotated method name inside the figure; the
    # titles are wrapped so that none is wider than its panel.
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5), layout="constrained")
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
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
