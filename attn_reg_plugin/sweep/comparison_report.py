"""The comparison report of attn-reg-mt-compare and attn-reg-cls-compare: each row against plain (its
metrics over seeds, its paired differences, its verdict), the tables of those, and results.md and
results.json. What a command reads from a run, judges a row by and says around the rows are parameters
(:class:`RowRules`, :class:`ReportLayout`): :mod:`.compare_report` gives the translation comparison's,
:mod:`.cls_report` the classifier comparison's."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .methods import METHODS
from .paired import paired_difference, spread
from .report import _versions, write_json
from .verdict import plain_of


@dataclass(frozen=True)
class RowRules:
    """How one command judges a row against plain (each field the command's own)."""

    metric_keys: Tuple[str, ...]
    scores: Callable[[dict, str], Dict[int, float]]  # (record, metric key) -> {seed: value}
    facts: Callable[[dict, Optional[dict]], dict]  # (record, plain) -> the row's own fields, "flags" among them
    plain_flags: Callable[[dict], List[str]]  # why plain itself cannot be compared with
    evidence: Callable[[dict, dict, Optional[dict]], None]  # (summary, record, plain): per-seed tests, wider intervals
    cautions: Callable[[dict, dict, Optional[dict]], List[str]]  # (summary, record, plain) -> what weakens the verdict
    # (summary, record, plain, flags, notes): sets summary["verdict"]
    judge: Callable[[dict, dict, Optional[dict], List[str], List[str]], None]


class ReportParts(NamedTuple):
    """What :func:`write_comparison` hands a command's :attr:`ReportLayout.compose`."""

    title: str
    seeds: List[int]
    plain: Optional[dict]
    summaries: List[dict]
    records: List[dict]
    verdicts: List[str]
    drawn: Optional[str]


@dataclass(frozen=True)
class ReportLayout:
    """One command's report around the rows: its title, its compare.png and its results.md and results.json."""

    rules: RowRules
    title: Callable[[List[int]], str]  # seeds -> the title
    draw: Callable[[List[dict], List[dict], Path, str], Optional[str]]  # (summaries, records, path, title) -> png
    compose: Callable[[ReportParts], Tuple[List[str], dict]]  # results.md's lines, results.json's own fields


# -- the rows ---------------------------------------------------------------------------------------
def ordered(records: List[dict]) -> List[dict]:
    """Plain first, then the methods in METHODS order, each method's rows by name."""
    rank = {name: i for i, name in enumerate(METHODS)}
    return sorted(records, key=lambda r: (rank.get(r["cell"]["method"], len(rank)), r["name"]))


def failed_notes(name: str, failed: Sequence[dict]) -> List[str]:
    """What the comparison of row ``name`` with plain lacks: each run of either whose job failed."""
    return [
        f"{f['name']}'s run at seed {f['seed']} failed (job {f['job']}, {f['state']}): seed {f['seed']} is not compared"
        for f in failed
        if f["name"] in (name, "plain")
    ]


def unrecorded_verdicts(records: List[dict], failed: Sequence[dict]) -> List[str]:
    """The verdict of each row none of whose runs finished (plain's failures are in every other row's)."""
    recorded = {r["name"] for r in records} | {"plain"}
    unrecorded = dict.fromkeys(f["name"] for f in failed if f["name"] not in recorded)
    return [f"{name}: not compared: " + "; ".join(failed_notes(name, failed)) for name in unrecorded]


def row_summary(record: dict, plain: Optional[dict], failed: Sequence[dict], rules: RowRules) -> dict:
    """One row: its metrics over seeds and its own facts; for a row other than plain, its differences to
    plain paired by seed, the missing runs and the verdict (``plain`` None when none of plain's runs
    finished: ``failed`` names them)."""
    values = {key: rules.scores(record, key) for key in rules.metric_keys}
    summary = {
        "name": record["name"],
        "method": record["cell"]["method"],
        "args": record["cell"].get("args"),
        "seeds": record["seeds"],
        "metrics": {key: {**spread(list(v.values())), "per_seed": v} for key, v in values.items()},
        **rules.facts(record, plain),
    }
    if record is plain:
        return summary
    base = {key: rules.scores(plain, key) if plain is not None else {} for key in rules.metric_keys}
    summary["differences"] = {key: paired_difference(values[key], base[key]) for key in values}
    rules.evidence(summary, record, plain)
    missing = summary["missing_runs"] = failed_notes(record["name"], failed)
    own = summary["flags"] + ([f"plain {f}" for f in rules.plain_flags(plain)] if plain is not None else missing)
    notes = rules.cautions(summary, record, plain) + (missing if plain is not None else [])
    rules.judge(summary, record, plain, own, notes)
    return summary


# -- the tables -------------------------------------------------------------------------------------
def _num(x: Optional[float], digits: int, sign: bool = False) -> str:
    return "-" if x is None else f"{{:{'+' if sign else ''}.{digits}f}}".format(x)


def mean_sd(m: dict, digits: int) -> str:
    if m["mean"] is None:
        return "-"
    return f"{_num(m['mean'], digits)} ± {'n/a' if m['sd'] is None else _num(m['sd'], digits)}"


def difference_text(d: dict, digits: int) -> str:
    """A difference to plain with its 95% interval; one of zero width (no evidence) says so."""
    if d["mean"] is None:
        return "-"
    if d.get("no_interval"):
        return f"{d['mean']:+.{digits}f} (zero width)"
    interval = "n/a" if d["ci"] is None else f"[{_num(d['ci'][0], digits, True)}, {_num(d['ci'][1], digits, True)}]"
    return f"{_num(d['mean'], digits, True)} {interval}"


Column = Tuple[str, str, int]  # (metric key, header, digits)


def spread_table(
    summaries: List[dict], columns: Sequence[Column], first: str, note: Optional[Callable[[dict], str]] = None
) -> List[str]:
    """A table of each row's metrics over seeds (mean ± sd), ``first`` its first column's header, with a
    last column ``note`` when given."""
    lines = [f"| {first} | seeds | " + " | ".join(header for _, header, _ in columns) + (" | note |" if note else " |")]
    lines.append("|" + "---|" * (len(columns) + 2 + (note is not None)))
    for s in summaries:
        cells = " | ".join(mean_sd(s["metrics"][key], digits) for key, _, digits in columns)
        end = f" | {note(s)} |" if note else " |"
        lines.append(f"| {s['name']} | {','.join(map(str, s['seeds']))} | {cells}{end}")
    return lines


def difference_table(
    summaries: List[dict],
    columns: Sequence[Column],
    first: str,
    seeds_key: str,
    extra: Optional[Tuple[str, Callable[[dict], str]]] = None,
    shown: Callable[[dict], bool] = lambda s: True,
) -> List[str]:
    """A table of each row minus plain, paired by seed, with 95% intervals (the seeds those of
    ``seeds_key``; a row not ``shown`` reads "not compared"), with a last column ``extra`` (header,
    text of a row) when given."""
    head = f"| {first} | paired seeds | " + " | ".join(header for _, header, _ in columns)
    lines = [head + (f" | {extra[0]} |" if extra else " |"), "|" + "---|" * (len(columns) + 2 + (extra is not None))]
    for s in summaries:
        if "differences" not in s:
            continue
        d = s["differences"]
        if shown(s):
            cells = " | ".join(difference_text(d[key], digits) for key, _, digits in columns)
        else:
            cells = " | ".join("not compared" for _ in columns)
        paired = ",".join(map(str, d[seeds_key]["seeds"])) or "-"  # none: a diverged row has no scores
        lines.append(f"| {s['name']} | {paired} | {cells}" + (f" | {extra[1](s)} |" if extra else " |"))
    return lines


def options_line(name: str, method: str, args: Optional[List[str]], none: Optional[str] = None) -> str:
    """results.md's line of a row's method and options, as run (``none``: the words for no options)."""
    given = f"`{' '.join(args or [])}`" if args or none is None else none
    return f"- {name}{'' if name == method else ' (' + method + ')'}: {given}"


# -- results.md and results.json --------------------------------------------------------------------
def write_report_files(out: Path, lines: List[str], summary: dict) -> None:
    write_json(out / "results.json", summary)
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_comparison(
    records: List[dict],
    failed: Sequence[dict],
    out: Path,
    started: float,
    log: Callable[[str], None],
    layout: ReportLayout,
) -> dict:
    """results.md, results.json and compare.png of every row in ``records`` (and of each row in ``failed``
    none of whose runs finished), as ``layout`` says; logs results.md; returns results.json's content."""
    plain = plain_of(records)
    summaries = [row_summary(r, plain, failed, layout.rules) for r in ordered(records)]
    seeds = sorted({s for r in records for s in r["seeds"]} or {f["seed"] for f in failed})
    title = layout.title(seeds)
    drawn = layout.draw(summaries, records, out / "compare.png", title) if records else None
    verdicts = [s["verdict"] for s in summaries if "verdict" in s] + unrecorded_verdicts(records, failed)
    lines, fields = layout.compose(ReportParts(title, seeds, plain, summaries, records, verdicts, drawn))
    summary = {**fields, "versions": _versions(), "seconds": round(time.time() - started, 1)}
    write_report_files(out, lines, summary)
    log("\n".join(lines))
    log(f"results: {out / 'results.md'}, {out / 'results.json'}" + (f", {drawn}" if drawn else ""))
    return summary
