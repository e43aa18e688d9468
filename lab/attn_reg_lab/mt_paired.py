"""``attn-reg-mt-paired``: an ``attn-reg-mt-sweep``'s cells against its plain cell, seed by seed.

    attn-reg-mt-paired OUT/results.json            # the sweep's --out-dir, run with --plain and seeds

Every cell that shares seeds with the plain cell gets, for valid BLEU, test BLEU (when the sweep
ran ``--test``) and best valid loss: the per-seed values, and the differences to plain at the same
seed (same initial weights and batches), with their mean, sample std and Student's paired t-test.
Prints a Markdown table; ``--json`` also writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

from .fewshot_summary import paired_difference

MEASURES = (("valid_bleu", "valid BLEU"), ("test_bleu", "test BLEU"), ("valid_loss", "best valid loss"))


def per_seed(cell_record: dict, measure: str) -> Dict[int, float]:
    return {run["seed"]: run[measure] for run in cell_record["runs"] if run.get(measure) is not None}


def paired_rows(results: dict) -> List[dict]:
    """One row per (cell, measure): the seeds' values, and the differences to the plain cell."""
    cells = results["cells"]
    plain = [c for c in cells if c["cell"].get("method") == "plain"]
    if not plain:
        raise ValueError("the sweep has no plain cell: run it with --plain")
    rows = []
    for record in cells:
        for measure, title in MEASURES:
            values = per_seed(record, measure)
            if not values:
                continue
            is_plain = record is plain[0]
            diff = None if is_plain else paired_difference(values, per_seed(plain[0], measure))
            rows.append({"cell": record["name"], "measure": title, "values": values, "vs_plain": diff})
    return rows


def _number(x: Optional[float], digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(rows: List[dict]) -> str:
    lines = [
        "| cell | measure | per seed | − plain: mean | std | p (paired t) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        digits = 3 if row["measure"] == "best valid loss" else 2
        seeds = ", ".join(f"{seed}: {value:.{digits}f}" for seed, value in sorted(row["values"].items()))
        diff = row["vs_plain"] or {}
        mean = "-" if not diff else f"{diff['mean_diff']:+.{digits}f} ({diff['pairs']} pairs)"
        lines.append(
            f"| {row['cell']} | {row['measure']} | {seeds} | {mean} | {_number(diff.get('std_diff'), digits)} | "
            f"{_number(diff.get('p'), 3)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="attn-reg-mt-paired",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("results", type=Path, help="results.json of an attn-reg-mt-sweep --plain run")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    opts = ap.parse_args(argv)
    if not opts.results.is_file():
        ap.error(f"{opts.results}: no such file (the sweep writes OUT/results.json when it finishes)")
    try:
        rows = paired_rows(json.loads(opts.results.read_text(encoding="utf-8")))
    except (ValueError, KeyError) as err:
        ap.error(f"{opts.results}: {err}")
    print(markdown(rows))
    if opts.json is not None:
        opts.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
