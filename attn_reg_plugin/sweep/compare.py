"""``attn-reg-mt-compare``: the papers' regularizers against plain training on your own fairseq
translation run, over seeds, with a verdict that says how sure it is.

    attn-reg-mt-compare work/en-ro/data-bin --out-dir work/compare-en-ro --epochs 60 --seeds 1,2,3 \\
        --methods plain,ad-drop,r-drop,dropkey,attendout \\
        --method-args 'ad-drop=--ad-drop-p 0.5 --ad-drop-q 0.5' --method-args 'r-drop=--rdrop-alpha 5' -- \\
        --arch transformer --share-all-embeddings --optimizer adam --lr 5e-4 --lr-scheduler inverse_sqrt \\
        --warmup-updates 4000 --max-tokens 4096 --label-smoothing 0.1 --dropout 0.1

Everything after ``--`` is your own ``fairseq-train`` command line, shared by every method (no
criterion, no method's own flags). Methods: plain (label_smoothed_cross_entropy), ad-drop
(ad_drop_label_smoothed_cross_entropy, the plugin's --ad-drop-* defaults), r-drop
(rdrop_label_smoothed_cross_entropy --rdrop-alpha 5, the paper's MT alpha), dropkey
(--attn-sched-dropout-schedule dropkey:0.1), attendout (--attendout), hiddencut
(hiddencut_label_smoothed_cross_entropy, its defaults), ad-drop-r-drop (ad_drop_rdrop_label_smoothed_cross_entropy:
R-Drop over AD-DROP's masked pass, alpha 5) and every other method of the regularizer registry (its
task flags over label_smoothed_cross_entropy: :mod:`..core.regularizers.registry`), each accepted only when the
installed plugin provides it.
``--method-args METHOD='ARGS'`` (repeatable) gives a method its own options (only its own flags:
--ad-drop-*, --rdrop-*, --attendout*, --hiddencut-*, a registry regularizer's FLAG_PREFIX); they
replace its defaults, and a method run with other options is another row, named after them without
the method's flag prefix (``r-drop_alpha=3``), or as you name it: ``METHOD:ROW='ARGS'``
(``'dropkey:strong=--attn-sched-dropout-schedule dropkey:0.3'``; letters, digits and . _ , + = -,
not a method's name). results.md lists every row's method and options in full. Every method's
options are checked before anything trains (its task, model and criterion built as fairseq-train
builds them), and a run that diverges (fairseq-train's FloatingPointError) is recorded as diverged:
its row is flagged and not compared, the other methods are.

Each method and seed runs as attn-reg-mt-sweep runs a cell (task attn_reg_translation, the same
resume, lock, signals and length-bounded fairseq-generate), and the valid and test splits are
translated with its checkpoint_best.pt and scored by sacrebleu (detokenized BLEU and chrF). For
each method: mean and sample sd over seeds of valid BLEU, test BLEU, test chrF and best valid
loss ("n/a" for one seed); the paired difference to plain over the seeds both ran, with a 95%
t-interval (mean ± t(0.975, n-1) sd / sqrt(n)); per seed, sacrebleu's paired bootstrap test of
the method's test hypotheses against plain's (sacrebleu.significance.PairedTest, 1000 resamples),
its p-value; and the verdict in words, on the interval over seeds (seeds are the evidence; a
per-seed test alone over-claims). Written under ``--out-dir``: results.md, results.json,
compare.png (needs matplotlib), cells/, runs/; results accumulate over commands (more seeds, more
methods), never erasing runs already recorded.

``--launcher slurm`` runs every missing (method, seed) run as one Slurm job of one job array
(through submitit; ``--launcher local --jobs N``: N at a time on this machine) and collects them
the same way; the same command again submits only what is missing (docs/FAIRSEQ.md, "On a Slurm
cluster").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from ..paths import OutputOverwritesInputError
from . import _check_inputs, _check_same_settings, sweep_settings
from .compare_report import write_mt_comparison
from .fairseq_check import check_fairseq_args
from .launcher import MT_RUNS, launch_and_report
from .launcher_options import add_launcher_options, check_launcher, check_ranks
from .methods import (
    METHODS,
    add_methods_options,
    check_shared_args,
    method_cell,
    parse_method_args,
    parse_methods,
    plugin_provides,
)
from .options import (
    SweepError,
    add_run_options,
    check_train_args,
    command_parser,
    parse_epochs_seeds,
    parse_scoring,
    split_train_args,
)
from .processes import run_locked
from .report import write_json

PROG = "attn-reg-mt-compare"
COMPARE_OUTPUTS = (
    "sweep.json", "sweep.lock", "cells", "runs", "jobs", "jobs.json", "results.json", "results.md", "compare.png",
)  # fmt: skip


def build_mt_compare_parser() -> argparse.ArgumentParser:
    ap = command_parser(PROG, __doc__, "DATA_BIN --out-dir DIR --methods plain,... [options] -- FAIRSEQ-TRAIN-ARGS...")
    ap.add_argument(
        "data_bin", metavar="DATA_BIN", type=Path, help="the fairseq-preprocess output (train, valid, test)"
    )
    ap.add_argument("--out-dir", type=Path, required=True, help="where cells/, runs/, results.* and compare.png go")
    add_methods_options(
        ap, METHODS, "fairseq-train options", "r-drop=--rdrop-alpha 3", "r-drop:strong=--rdrop-alpha 10"
    )
    add_run_options(ap, test_is_optional=False)
    add_launcher_options(ap)
    return ap


def parse_mt_compare_args(argv: Sequence[str], provided: Optional[set] = None):
    """``(parser, options)``, ``options.cells`` the methods' cells; a bad option is ``parser.error``."""
    own, train_args = split_train_args(argv)
    ap = build_mt_compare_parser()
    opts = ap.parse_args(own)
    opts.train_args, opts.test = train_args, True  # the comparison is on the test split
    parse_epochs_seeds(ap, opts)
    parse_scoring(ap, opts)
    try:
        check_shared_args(train_args)
        methods = parse_methods(opts.methods, provided)
        given = parse_method_args(opts.method_args, methods)
        opts.cells = [
            method_cell(m, given[m].groups, opts.epochs, given[m].row)
            if m in given
            else method_cell(m, [], opts.epochs)
            for m in methods
        ]
        opts.named_rows = {g.row for g in given.values() if g.row is not None}
        names = [c["name"] for c in opts.cells]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise SweepError(f"--method-args: two rows are named {', '.join(twice)}; give each row its own name")
    except SweepError as e:
        ap.error(str(e))
    check_train_args(ap, train_args)
    check_launcher(ap, opts)
    check_ranks(ap, opts)
    return ap, opts


def main(argv: Optional[Sequence[str]] = None, log: Callable[[str], None] = print) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    provided = plugin_provides()
    ap, opts = parse_mt_compare_args(argv, provided)
    try:
        _check_inputs(opts, COMPARE_OUTPUTS)
        opts.data_bin = opts.data_bin.resolve()
        settings = {**sweep_settings(opts), "command": PROG}
        check_fairseq_args(opts, opts.cells)
    except (SweepError, OutputOverwritesInputError) as e:
        ap.error(str(e))
    return run_locked(ap, opts.out_dir, PROG, argv, lambda: _compare_mt_locked(ap, opts, settings, log), log)


def _compare_mt_locked(ap, opts, settings: dict, log: Callable[[str], None]) -> int:
    names = prepare_out_dir(ap, opts, settings, log)
    log(
        f"== {PROG} {opts.source_lang}→{opts.target_lang} on {opts.data_bin}: {names} x {len(opts.seeds)} "
        f"seed(s), {opts.epochs} epoch(s) each; outputs in {opts.out_dir}"
    )
    report = lambda records, started: write_mt_comparison(records, opts, started, log, settings)
    # Every run failed: results.md and results.json still name them (their rows, seeds, states, logs).
    return launch_and_report(ap, opts.cells, opts, settings, log, MT_RUNS, report, report_failures=True)


def prepare_out_dir(ap, opts, settings: dict, log: Callable[[str], None]) -> str:
    """attn-reg-mt-compare's and -cls-compare's ``--out-dir`` under the lock: other settings refused,
    each row continued under its recorded name (:func:`recorded_name`) and refused when its name ran other
    options (:func:`check_same_cells`), the settings written; returns the rows' names for the header."""
    try:
        _check_same_settings(opts.out_dir, settings)
        opts.cells = [recorded_name(opts.out_dir, cell, opts.named_rows, log) for cell in opts.cells]
        check_same_cells(opts.out_dir, opts.cells)
    except SweepError as e:
        ap.error(str(e))
    (opts.out_dir / "cells").mkdir(parents=True, exist_ok=True)
    write_json(opts.out_dir / "sweep.json", settings)
    return ", ".join(c["name"] for c in opts.cells)


def recorded_name(out: Path, cell: dict, named_rows: set, log: Callable[[str], None]) -> dict:
    """``cell``, or the cell of the same method and options that ``out`` recorded under another name
    (an earlier version's name, r-drop__rdrop-alpha-3): its runs are kept and its row continued, not
    retrained under a second name. A row the user named is refused there instead."""
    import json

    for path in [*sorted((out / "cells").glob("*.json")), *sorted((out / "runs").glob("*/seed*/result.json"))]:
        saved = json.loads(path.read_text(encoding="utf-8")).get("cell", {})
        if saved.get("name") == cell["name"] or (saved.get("method"), saved.get("args")) != (
            cell["method"],
            cell["args"],
        ):
            continue
        if cell["name"] in named_rows:
            raise SweepError(
                f"--method-args names a row {cell['name']}, but --out-dir {out} has run its method and options as "
                f"{saved['name']}: leave the name out (or name it {saved['name']}) to continue that row"
            )
        log(f"{cell['name']}: recorded in {out} as {saved['name']} (the same method and options): continued as that")
        return saved
    return cell


def check_same_cells(out: Path, cells: List[dict]) -> None:
    """A run folder of this name trained with other arguments (an older plugin's defaults) is
    refused before anything runs: its checkpoints would be scored as this cell's."""
    import json

    for cell in cells:
        for path in sorted((out / "runs" / cell["name"]).glob("seed*/result.json")):
            saved = json.loads(path.read_text(encoding="utf-8"))
            if saved.get("cell") != cell:
                raise SweepError(
                    f"{path} ran {cell['name']} with {saved.get('cell', {}).get('args')}, now "
                    f"{cell['args']}: name this row (--method-args METHOD:ROW=ARGS) or use another --out-dir"
                )


if __name__ == "__main__":  # python -m attn_reg_plugin.sweep.compare, before a reinstall adds the command
    sys.exit(main())
