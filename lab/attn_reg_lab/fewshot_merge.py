"""Tables over several attn-reg-fewshot runs: one baseline file, variants from other files.

    attn-reg-fewshot-merge --baseline outputs/fewshot-main/results.json \
        --variant "layer 0=outputs/fewshot-inv/layer0/results.json" --variant "p=q=0.1=outputs/..." \
        [--size 64] [--seeds 1,2,3] [--out table.md]

The baseline file's runs of ``--baseline-method`` (default plain) are paired, by size and
seed, with every other method's runs of each variant file, named "METHOD (LABEL)"; one LABEL
may gather several files (more seeds of a variant), but never the same run twice. A variant
is only comparable when it shares the baseline's model, data files, dev subset, tokenization
and training settings (epochs, lr, batch size, ...), so anything else is refused: a variant
that changes those must carry its own baseline run (and then is a results file of its own).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .fewshot_summary import markdown, summarize

SHARED = ("model", "num_labels", "max_length", "training", "files", "dev_subset")


def _files_key(config: dict) -> dict:
    return {name: f["sha256"] for name, f in config["files"].items()}


def mismatches(base: dict, other: dict) -> List[str]:
    """The settings that make ``other`` not comparable with ``base`` (both results.json configs)."""
    bad = []
    for key in SHARED:
        a, b = base.get(key), other.get(key)
        if key == "files":
            a, b = _files_key(base), _files_key(other)
        if a != b:
            bad.append(f"{key}: {a!r} != {b!r}")
    return bad


def merge(
    baseline: dict,
    variants: Sequence[Tuple[str, dict]],
    baseline_method: str = "plain",
    sizes: Optional[Sequence[int]] = None,
    seeds: Optional[Sequence[int]] = None,
):
    """(runs, sizes, methods) with variant methods renamed "METHOD (LABEL)"; raises ValueError if not comparable."""
    runs = [r for r in baseline["runs"] if r["method"] == baseline_method]
    if not runs:
        raise ValueError(f"the baseline file has no {baseline_method!r} runs")
    methods = [baseline_method]
    for label, result in variants:
        bad = mismatches(baseline["config"], result["config"])
        if bad:
            raise ValueError(f"variant {label!r} is not comparable with the baseline: " + "; ".join(bad))
        for r in result["runs"]:
            if r["method"] == baseline_method:
                continue
            name = f"{r['method']} ({label})"
            runs.append(dict(r, method=name))
            if name not in methods:
                methods.append(name)
    seen = set()
    for r in runs:  # one label may gather several files (e.g. more seeds later), never the same run twice
        key = (r["size"], r["seed"], r["method"])
        if key in seen:
            raise ValueError(f"run size {key[0]} seed {key[1]} {key[2]!r} appears twice")
        seen.add(key)
    if seeds is not None:
        runs = [r for r in runs if r["seed"] in seeds]
    all_sizes = sorted({r["size"] for r in runs})
    sizes = [s for s in all_sizes if sizes is None or s in sizes]
    runs = [r for r in runs if r["size"] in sizes]
    return runs, sizes, methods


def _variant(text: str) -> Tuple[str, Path]:
    label, sep, path = text.rpartition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"--variant must be LABEL=PATH, got {text!r}")
    return label, Path(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--baseline", type=Path, required=True, help="results.json holding the baseline runs")
    ap.add_argument("--baseline-method", default="plain")
    ap.add_argument("--variant", type=_variant, action="append", default=[], help="LABEL=results.json (repeatable)")
    ap.add_argument("--size", type=int, action="append", help="keep only this size (repeatable)")
    ap.add_argument("--seeds", help="keep only these seeds, comma list")
    ap.add_argument("--out", type=Path, help="also write the markdown here")
    opts = ap.parse_args(argv)
    seeds = [int(s) for s in opts.seeds.split(",")] if opts.seeds else None
    from attn_reg_plugin.paths import OutputOverwritesInputError, check_outputs_spare_inputs

    try:  # before anything is read: --out results.json would replace the runs it merges
        check_outputs_spare_inputs(
            [("--out", opts.out)],
            [("--baseline", opts.baseline), *(("--variant", path) for _label, path in opts.variant)],
        )
    except OutputOverwritesInputError as e:
        ap.error(str(e))

    def load(path: Path) -> dict:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"{path}: cannot read a results.json: {e}")

    try:
        runs, sizes, methods = merge(
            load(opts.baseline), [(label, load(p)) for label, p in opts.variant], opts.baseline_method, opts.size, seeds
        )
    except ValueError as e:
        ap.error(str(e))
    summary, paired = summarize(runs, sizes, methods, baseline=opts.baseline_method)
    table = markdown(summary, paired, sizes, methods)
    print(table, end="")
    if opts.out:
        opts.out.write_text(table, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
