"""``attn-reg-mt-sweep``: tune AD-DROP's p and q on your own fairseq translation run.

    attn-reg-mt-sweep work/en-tr/data-bin --source-lang tr --target-lang en --out-dir work/sweep-tr-en \\
        --p 0.2,0.4,0.6 --q 0.1,0.2,0.3 --epochs 20 --seeds 1,2 --plain -- \\
        --arch transformer --share-all-embeddings --optimizer adam --lr 5e-4 --lr-scheduler inverse_sqrt \\
        --warmup-updates 4000 --max-tokens 4096 --label-smoothing 0.1

Everything after ``--`` is your own ``fairseq-train`` command line without the data-bin (model,
optimizer, batch, ``--cpu``/``--fp16``, ...). For each cell of the grid (p x q, times the
``--attribution``, ``--layers`` and ``--schedule`` values given) and each seed, the sweep runs

    fairseq-train DATA_BIN --user-dir <the plugin> YOUR ARGS --task attn_reg_translation
        --criterion ad_drop_label_smoothed_cross_entropy --ad-drop-p P --ad-drop-q Q ...
        --source-lang S --target-lang T --max-epoch N --seed SEED --save-dir OUT/runs/<cell>/seed<SEED>/checkpoints

then ``fairseq-generate`` on the **valid** split with that run's ``checkpoint_best.pt`` (beam 5,
``--post-process sentencepiece``: what ``attn-reg-prepare`` data needs; hypotheses bounded by
``--max-len-a 1.2 --max-len-b 10``, i.e. 1.2 x source length + 10 tokens), and scores the
detokenized hypotheses with sacrebleu's Python API, against ``--valid-ref PREFIX.T`` (your raw
references) when given, else against fairseq's own references (the binarized valid target, post-
processed the same way: an out-of-vocabulary piece reads ``<unk>`` there). The test split is
never used to choose; ``--test`` translates it with each run's best checkpoint and reports it
beside. A cell's score is the mean valid BLEU over its seeds (the best valid loss, mean over
seeds, breaks ties); the best AD-DROP cell is named at the end, with what weakens the choice (one
seed; differences within the seed spread; BLEU near 0; hypotheses far from the references'
length). A cell that diverged, or whose AD-DROP steps were mostly skipped, is flagged and not
ranked. ``--plain`` adds one cell of plain training (``label_smoothed_cross_entropy``, same task
and arguments) for reference.

Resumable and cumulative: a seed's finished run writes ``runs/<cell>/seed<S>/result.json``, a
finished cell ``cells/<cell>.json``; a rerun keeps them (and fairseq-train resumes an interrupted
run from its ``checkpoint_last.pt``, the console saying from which epoch; the run's record reads
every attempt's epochs and time). A later command with more seeds or another grid adds its cells
to the results, never drops the earlier ones. A rerun with another data-bin, language pair,
epochs, fairseq or scoring arguments is refused, naming what differs. SIGTERM, SIGINT or SIGHUP
ends the running fairseq child before the sweep exits (and on Linux a child ends when the sweep
dies by any means); a second sweep on a running sweep's ``--out-dir`` is refused. Written under
``--out-dir``: ``sweep.json`` (the settings), ``sweep.lock`` (while running), ``cells/``,
``runs/``, ``results.json``, ``results.md`` (the table) and ``heatmap.png`` (valid BLEU minus
plain's over p x q on a scale centred on 0, one panel per attribution, layers and schedule;
needs matplotlib). Bad options are refused before anything runs. ``--launcher slurm`` runs every
missing (cell, seed) run as one Slurm job of one job array (through submitit; ``--launcher local
--jobs N``: N at a time here), collected the same way (docs/FAIRSEQ.md, "On a Slurm cluster").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..core.regularizers.ad_drop_config import SCHEDULES
from ..core.regularizers.attribution import ATTRIBUTIONS
from ..paths import OutputOverwritesInputError, check_outputs_spare_inputs
from .fairseq_check import check_fairseq_args
from .heatmap import heatmap
from .launcher import MT_RUNS, launch_and_report
from .launcher_options import with_world_size, world_size
from .options import (
    OWNED,
    POST_PROCESS,
    TASK,
    SweepError,
    build_sweep_parser,
    cell_name,
    grid,
    language_pairs,
    parse_sweep_args,
    probabilities,
    resolve_pair,
)
from .processes import run_locked
from .records import log_fields
from .report import write_json, write_results
from .runs import run_appended, translate_and_score
from .verdict import best_cell

__all__ = [
    "ATTRIBUTIONS",
    "OWNED",
    "POST_PROCESS",
    "SCHEDULES",
    "TASK",
    "SweepError",
    "best_cell",
    "build_sweep_parser",
    "cell_name",
    "grid",
    "heatmap",
    "language_pairs",
    "log_fields",
    "main",
    "parse_sweep_args",
    "probabilities",
    "resolve_pair",
    "run_appended",
    "translate_and_score",
]


# What the sweep writes (not the whole --out-dir: the data-bin may sit beside them).
SWEEP_OUTPUTS = (
    "sweep.json", "sweep.lock", "cells", "runs", "jobs", "jobs.json", "results.json", "results.md", "heatmap.png",
)  # fmt: skip


def main(argv: Optional[Sequence[str]] = None, log: Callable[[str], None] = print) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap, opts = parse_sweep_args(argv)
    try:
        _check_inputs(opts)
        opts.data_bin = opts.data_bin.resolve()
        settings = sweep_settings(opts)
        cells = grid(opts)
        check_fairseq_args(opts, cells)
    except (SweepError, OutputOverwritesInputError) as e:
        ap.error(str(e))
    body = lambda: _sweep_locked(ap, opts, settings, cells, log)
    return run_locked(ap, opts.out_dir, "attn-reg-mt-sweep", argv, body, log)


def _sweep_locked(ap, opts, settings: dict, cells: list, log: Callable[[str], None]) -> int:
    """The sweep, with its ``--out-dir`` locked."""
    try:
        _check_same_settings(opts.out_dir, settings)
    except SweepError as e:
        ap.error(str(e))
    (opts.out_dir / "cells").mkdir(parents=True, exist_ok=True)
    write_json(opts.out_dir / "sweep.json", settings)
    log(
        f"== AD-DROP sweep {opts.source_lang}→{opts.target_lang} on {opts.data_bin}: {len(cells)} cell(s) x "
        f"{len(opts.seeds)} seed(s), {opts.epochs} epoch(s) each; outputs in {opts.out_dir}"
    )
    report = lambda records, started: write_results(records, opts, settings, started, log)
    return launch_and_report(ap, cells, opts, settings, log, MT_RUNS, report)


def _check_inputs(opts, written: Sequence[str] = SWEEP_OUTPUTS) -> None:
    """Sets the language pair; checks the data-bin, the reference files, and that nothing the sweep
    writes is one of them. Raises :class:`SweepError` or :class:`OutputOverwritesInputError`."""
    splits = ["train", "valid"] + (["test"] if opts.test else [])
    opts.source_lang, opts.target_lang = resolve_pair(opts.data_bin, opts.source_lang, opts.target_lang, splits)
    refs = [("--valid-ref", opts.valid_ref), ("--test-ref", opts.test_ref)]
    for option, prefix in refs:
        if prefix is not None and not Path(f"{prefix}.{opts.target_lang}").is_file():
            raise SweepError(f"{option} {prefix}: no such file {prefix}.{opts.target_lang}")
    check_outputs_spare_inputs(
        [("--out-dir", opts.out_dir / name) for name in written],
        [("DATA_BIN", opts.data_bin)]
        + [(option, Path(f"{prefix}.{opts.target_lang}")) for option, prefix in refs if prefix is not None],
    )


def sweep_settings(opts) -> dict:
    """What every run of the sweep shares (``sweep.json``): a rerun must match it to resume."""
    return {
        "data_bin": str(opts.data_bin),
        "source_lang": opts.source_lang,
        "target_lang": opts.target_lang,
        "epochs": opts.epochs,
        "train_args": opts.train_args,
        "post_process": opts.post_process,
        "beam": opts.beam,
        "tokenize": opts.tokenize,
        "valid_ref": None if opts.valid_ref is None else str(Path(f"{opts.valid_ref}.{opts.target_lang}").resolve()),
        "test": opts.test,
        "test_ref": None if opts.test_ref is None else str(Path(f"{opts.test_ref}.{opts.target_lang}").resolve()),
        "generate_args": opts.generate_args,
        "max_len_a": opts.max_len_a,
        "max_len_b": opts.max_len_b,
        # fairseq-train ranks per run: an update sums every rank's batches, so another world size is another run
        "world_size": world_size(opts),
    }


def _check_same_settings(out: Path, settings: dict) -> None:
    """Raises :class:`SweepError` naming what differs when ``out`` holds a sweep with other settings."""
    settings_path = out / "sweep.json"
    if not settings_path.exists():
        return
    saved = with_world_size(json.loads(settings_path.read_text(encoding="utf-8")))
    if saved != settings:
        keys = [k for k in dict.fromkeys([*saved, *settings]) if saved.get(k) != settings.get(k)]
        differences = "; ".join(f"{k}: {saved.get(k)!r} then, {settings.get(k)!r} now" for k in keys)
        raise SweepError(
            f"--out-dir {out} holds a sweep with other settings ({differences}): rerun with "
            "the same ones to resume it, or use another --out-dir"
        )
