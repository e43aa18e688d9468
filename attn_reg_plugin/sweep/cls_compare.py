"""``attn-reg-cls-compare``: the regularizers against plain fine-tuning of your own sentence classifier,
over seeds, through the Hugging Face Trainer, with a verdict that says how sure it is.

    attn-reg-cls-compare MODEL --train train.jsonl --dev dev.jsonl --test test.jsonl --out-dir work/cls \\
        --methods plain,ad-drop,r-drop --seeds 1,2,3 --metric macro_f1 --keep-models \\
        --method-args 'ad-drop=--ad-drop-p 0.3 --ad-drop-q 0.3 --ad-drop-attribution iga'

MODEL is a hub name or a local folder (``AutoModelForSequenceClassification``: a new classifier head
for your labels). The data: ``--train/--dev/--test`` files (.jsonl/.json, .csv or .tsv with a header),
or ``--dataset NAME`` (``datasets.load_dataset``, ``--dataset-config``, the three ``--*-split`` names);
each row a text (``--text-field``), optionally a second one (``--pair-field``) and a label
(``--label-field``); dev and test labels must occur in train. The data is used as given, imbalanced
classes included; ``--train-size N`` draws N training examples at random per seed (the same for every
method at that seed) for a few-shot comparison.

Methods (:mod:`attn_reg_plugin.hf.methods`): plain (the stock Trainer), ad-drop (any attribution: ga,
iga, aa, rd), attendout, r-drop, hiddencut, the regularizer registry's methods, ad-drop-r-drop. ``--method-args
METHOD='ARGS'`` (or ``METHOD:ROW='ARGS'`` to name the row) gives a method its own options, its config's
flags (``--ad-drop-p``, ``--rdrop-alpha``, ``--attendout-dropout-step``, ...), over its defaults; a row
run with options is named after them (``ad-drop_attribution=iga``). Every option is checked, and every
method's trainer built once, before anything trains.

Each method and seed is one run: the model with its head seeded by the seed, fine-tuned with the
method's trainer (every method the same ``TrainingArguments``, data and collator), dev scored after
every epoch, the best dev epoch's weights (``--metric``) scored on dev and test: accuracy, macro-F1,
MCC. For each row: the mean and sd over seeds; the paired difference to plain over the seeds both ran,
with its 95% t-interval; whether its runs learned anything (a run whose dev predictions are one class,
or whose dev accuracy is within noise of the majority class's share, is flagged in its row); and the
verdict in words, on ``--metric``'s test interval, then dev's, with its warnings (still learning: the best
dev epoch the last in most runs; dev and test disagreeing in sign). The defaults (5 epochs, lr 5e-5, 10%
warm-up) learn on a few hundred examples with a pretrained encoder; plain runs first, and once it has
learned nothing at every seed so far the other runs stop and the settings to change are said
(``--keep-going`` runs them). Each run says its step, epoch, loss and ETA as it trains (``--log-steps``);
``--keep-models`` keeps each run's best dev epoch as a ``save_pretrained`` folder (runs/ROW/seedS/model)
that stock transformers loads. Written under ``--out-dir``: results.md (verdicts, one table, then per
class scores and confusion matrices, drop rates), compare.png (dev per epoch, forest plots of the
differences), results.json, cells/, runs/ (each run's command.json, result.json). Results accumulate over commands
(more seeds, more rows); a finished run is never run again, a run folder started with other arguments
is refused, a rerun with other shared settings (model, data, training) is refused naming what differs.
Each run saves a resumable Trainer checkpoint in its folder at every epoch's end and every
``--save-steps`` steps, keeping the last; the next command resumes a stopped run there, with an
uninterrupted run's result (:mod:`.cls_checkpoint`). SIGTERM, SIGINT or SIGHUP saves one at the end of
the running step, then stops the command (a second signal stops it at once); in a Slurm job the
time-limit signal saves one the same way before the job is requeued to resume it. ``--launcher local
--jobs N`` runs N at a time, ``--launcher slurm`` one Slurm job per run (one job array, through
submitit), as attn-reg-mt-compare does.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..paths import OutputOverwritesInputError, check_outputs_spare_inputs
from .cls_checkpoint import SAVE_STEPS
from .cls_report import SCORES, write_cls_comparison
from .cls_runs import (
    ARGUMENTS,
    PROG,
    SPLITS,
    build_trainer,
    collect,
    data_for,
    encoded_splits,
    load_model,
    method_options,
    method_settings,
    plain_stop,
    quiet_transformers,
    run_cls_job,
    trainer_run_identity,
)
from .compare import prepare_out_dir
from .launcher import RunKind, launch_and_collect, launch_and_report
from .launcher_options import add_launcher_options, check_launcher
from .methods import add_methods_options, derived_name, parse_method_args, parse_methods
from .options import SweepError, cell_name, command_parser, parse_epochs_seeds
from .processes import run_locked
from .runs import all_records, finished_result, run_dir

CLS_RUNS = RunKind(run_cls_job, trainer_run_identity, collect, ARGUMENTS)
OUTPUTS = ("sweep.json", "sweep.lock", "cells", "runs", "jobs", "jobs.json", "results.json", "results.md")


def build_cls_compare_parser() -> argparse.ArgumentParser:
    from ..hf.methods import METHODS

    ap = command_parser(
        PROG, __doc__, "MODEL (--train F --dev F --test F | --dataset NAME) --out-dir DIR --methods plain,... [options]"
    )
    ap.add_argument(
        "model", metavar="MODEL", help="a hub name or a local folder (a sequence classifier is built on it)"
    )
    data = ap.add_argument_group("data", "three files, or a datasets name with its splits")
    for split in SPLITS:
        data.add_argument(f"--{split}", type=Path, help=f"the {split} file (.jsonl, .json, .csv, .tsv)")
    data.add_argument("--dataset", metavar="NAME", help="a datasets name (datasets.load_dataset) instead of files")
    data.add_argument("--dataset-config", metavar="NAME", help="its configuration, e.g. sst2 of glue")
    for split, default in zip(SPLITS, ("train", "validation", "test")):
        data.add_argument(f"--{split}-split", default=default, help=f"--dataset's {split} split (default {default})")
    data.add_argument("--text-field", default="sentence", help="the text's field (default sentence)")
    data.add_argument("--pair-field", help="a second text's field, for sentence pairs")
    data.add_argument("--label-field", default="label", help="the label's field (default label)")
    data.add_argument(
        "--train-size",
        type=int,
        metavar="N",
        help="train on N examples drawn per seed (default: the whole train split)",
    )
    ap.add_argument("--out-dir", type=Path, required=True, help="where cells/, runs/ and results.* go")
    add_methods_options(
        ap, METHODS, "options (its config's flags)", "r-drop=--rdrop-alpha 3", "ad-drop:iga=--ad-drop-attribution iga"
    )
    ap.add_argument("--seeds", default="1", help="comma list of seeds, 0 to 4294967295 (default 1)")
    train = ap.add_argument_group("training, the same for every method")
    train.add_argument(
        "--epochs", type=int, default=5, help="epochs, >= 1 (default 5: a pretrained encoder on a few hundred examples)"
    )
    train.add_argument("--lr", type=float, default=5e-5, help="peak learning rate, > 0 (default 5e-5)")
    train.add_argument("--batch-size", type=int, default=16, help="training batch size, >= 1 (default 16)")
    train.add_argument("--eval-batch-size", type=int, default=64, help="dev/test batch size, >= 1 (default 64)")
    train.add_argument("--max-length", type=int, default=128, help="tokens per example, >= 8 (default 128)")
    train.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay, >= 0 (default 0)")
    train.add_argument(
        "--warmup-ratio", type=float, default=0.1, help="share of the steps warming up, in [0, 1) (default 0.1)"
    )
    train.add_argument(
        "--metric",
        choices=[key for key, _ in SCORES],
        default="accuracy",
        help="picks each run's best dev epoch and is the verdict's (default accuracy; macro_f1 or mcc weigh "
        "every class, for imbalanced labels)",
    )
    ap.add_argument(
        "--save-steps",
        type=int,
        default=SAVE_STEPS,
        metavar="N",
        help=f"a run's resumable checkpoint every N optimizer steps besides each epoch's end, >= 0; 0: at epoch "
        f"ends only (default {SAVE_STEPS}; a run keeps only its last one and resumes from it under any N)",
    )
    out = ap.add_argument_group("what comes out")
    out.add_argument(
        "--keep-models",
        action="store_true",
        help="keep each run's best dev epoch as a save_pretrained folder with its tokenizer and label names, "
        "runs/ROW/seedS/model (stock transformers loads it; results.md names the best run's)",
    )
    out.add_argument(
        "--keep-going",
        action="store_true",
        help="run every run even when plain has learned nothing at every seed so far (default: the other runs "
        "stop, and the settings to change are said)",
    )
    out.add_argument(
        "--log-steps",
        type=int,
        default=0,
        metavar="N",
        help="a progress line (step, epoch, loss, ETA) every N optimizer steps, >= 0 (default 0: about five an epoch)",
    )
    add_launcher_options(ap, "tasks per job: 1 only (default 1), each run one Trainer process")
    return ap


def _check_numbers(ap, opts) -> None:
    checks = [
        (opts.lr > 0 and math.isfinite(opts.lr), f"--lr must be a positive number, got {opts.lr}"),
        (opts.batch_size >= 1, f"--batch-size must be an integer >= 1, got {opts.batch_size}"),
        (opts.eval_batch_size >= 1, f"--eval-batch-size must be an integer >= 1, got {opts.eval_batch_size}"),
        (opts.max_length >= 8, f"--max-length must be an integer >= 8, got {opts.max_length}"),
        (opts.log_steps >= 0, f"--log-steps must be an integer >= 0 (0: about five lines an epoch), got {opts.log_steps}"),
        (opts.save_steps >= 0, f"--save-steps must be an integer >= 0 (0: at epoch ends only), got {opts.save_steps}"),
        (opts.weight_decay >= 0, f"--weight-decay must be a number >= 0, got {opts.weight_decay}"),
        (0 <= opts.warmup_ratio < 1, f"--warmup-ratio must be in [0, 1), got {opts.warmup_ratio}"),
        (opts.train_size is None or opts.train_size >= 2, f"--train-size must be an integer >= 2, got {opts.train_size}"),
        (opts.slurm_tasks_per_node == 1, f"--slurm-tasks-per-node must be 1 here (one Trainer process per run), got {opts.slurm_tasks_per_node}"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            ap.error(message)


def _check_data_options(ap, opts) -> None:
    files = [f"--{s}" for s in SPLITS if getattr(opts, s) is not None]
    if opts.dataset and files:
        ap.error(f"--dataset {opts.dataset} and {', '.join(files)}: give files or a dataset, not both")
    if not opts.dataset and len(files) != len(SPLITS):
        missing = [f"--{s}" for s in SPLITS if getattr(opts, s) is None]
        ap.error(f"give --train, --dev and --test files (missing {', '.join(missing)}), or --dataset NAME")
    if opts.dataset_config and not opts.dataset:
        ap.error("--dataset-config is --dataset's: give --dataset too")
    fields = [opts.text_field, opts.pair_field, opts.label_field]
    fields = [f for f in fields if f]
    if len(set(fields)) != len(fields):
        ap.error(f"--text-field, --pair-field and --label-field must name different fields, got {fields}")


def parse_cls_compare_args(argv: Sequence[str]):
    """``(parser, options)``, ``options.cells`` the rows; a bad option is ``parser.error`` naming it."""
    from ..hf.methods import METHODS

    ap = build_cls_compare_parser()
    opts = ap.parse_args(list(argv))
    parse_epochs_seeds(ap, opts)
    _check_numbers(ap, opts)
    _check_data_options(ap, opts)
    try:
        methods = parse_methods(opts.methods, None, METHODS)
        given = parse_method_args(opts.method_args, methods, METHODS)
        opts.cells = []
        for method in methods:
            groups = given[method].groups if method in given else []
            words = [w for g in groups for w in g]
            try:
                method_settings(method, words)  # each field in its range
                why = METHODS[method].too_few(method_options(method, words), opts.epochs)
            except SweepError as e:
                raise SweepError(f"--method-args {method}: {e}") from None
            if why:
                raise SweepError(why)
            row = given[method].row if method in given else None
            name = row if row is not None else derived_name(method, groups, METHODS)
            opts.cells.append({"method": method, "name": name, "args": words})
        opts.named_rows = {g.row for g in given.values() if g.row is not None}
    except SweepError as e:
        ap.error(str(e))
    check_launcher(ap, opts)
    return ap, opts


def data_settings(opts) -> dict:
    """What the data is, for the settings: each file's path and sha256, or the dataset and its splits."""
    if opts.dataset:
        return {
            "dataset": opts.dataset,
            "config": opts.dataset_config,
            **{s: getattr(opts, f"{s}_split") for s in SPLITS},
        }
    return {
        s: {
            "path": str(getattr(opts, s).resolve()),
            "sha256": hashlib.sha256(getattr(opts, s).read_bytes()).hexdigest(),
        }
        for s in SPLITS
    }


def model_digest(model: Path) -> str:
    """sha256 over a local model folder's files (names and bytes; its top level, what ``from_pretrained``
    reads): weights replaced at the same path make another model, and a rerun on it is refused."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model.iterdir() if p.is_file()):
        digest.update(path.name.encode("utf-8") + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def settings_of(opts) -> dict:
    """What every run of the command shares (``sweep.json``): a rerun must match it to resume. A local
    model is its folder and the sha256 of its files; a hub name is the name (its cache may update)."""
    model = Path(opts.model)
    return {
        "command": PROG,
        "model": str(model.resolve()) if model.is_dir() else opts.model,
        **({"model_sha256": model_digest(model)} if model.is_dir() else {}),
        "data": data_settings(opts),
        "fields": {"text": opts.text_field, "pair": opts.pair_field, "label": opts.label_field},
        "train_size": opts.train_size,
        "epochs": opts.epochs,
        "lr": opts.lr,
        "batch_size": opts.batch_size,
        "max_length": opts.max_length,
        "weight_decay": opts.weight_decay,
        "warmup_ratio": opts.warmup_ratio,
        "metric": opts.metric,
    }


def check_methods_build(opts, data) -> None:
    """Every row's trainer built once on the model and one example: a refusal (a model the plugin
    cannot route, a combination) comes before any training. Raises :class:`SweepError`."""
    import tempfile

    import transformers

    quiet_transformers()
    tokenizer = transformers.AutoTokenizer.from_pretrained(opts.model)
    features = {k: v[:1] for k, v in encoded_splits(opts, data, tokenizer, 0).items()}
    with tempfile.TemporaryDirectory(prefix="cls-compare-check-") as tmp:
        for cell in opts.cells:  # a fresh model each: a trainer may re-route the model's attention
            try:
                build_trainer(cell, opts, load_model(opts, 0, data.labels), tokenizer, features, Path(tmp), 0)
            except (ValueError, TypeError, RuntimeError) as e:
                raise SweepError(f"{cell['name']} ({cell['method']}): its trainer refuses this model: {e}") from None


def main(argv: Optional[Sequence[str]] = None, log: Callable[[str], None] = print) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap, opts = parse_cls_compare_args(argv)
    try:
        check_outputs_spare_inputs(
            [("--out-dir", opts.out_dir / name) for name in OUTPUTS],
            [(f"--{s}", getattr(opts, s)) for s in SPLITS if getattr(opts, s) is not None],
        )
        for split in SPLITS:
            path = getattr(opts, split)
            if path is not None and not path.is_file():
                raise SweepError(f"--{split} {path}: no such file")
        opts.settings = settings = settings_of(opts)
        data = data_for(opts, settings)
        if opts.train_size is not None and opts.train_size > len(data.splits["train"]):
            raise SweepError(
                f"--train-size must be from 2 to the {len(data.splits['train'])} training examples, got {opts.train_size}"
            )
        check_methods_build(opts, data)
    except (SweepError, OutputOverwritesInputError, OSError) as e:
        ap.error(str(e))
    counts = {label: sum(e[opts.label_field] == label for e in data.splits["train"]) for label in data.labels}
    data_text = f"--dataset {opts.dataset}" if opts.dataset else " / ".join(str(getattr(opts, s)) for s in SPLITS)
    body = lambda: _compare_cls_locked(ap, opts, settings, data_text, counts, log)
    return run_locked(ap, opts.out_dir, PROG, argv, body, log)


def _compare_cls_locked(ap, opts, settings: dict, data_text: str, counts: dict, log: Callable[[str], None]) -> int:
    names = prepare_out_dir(ap, opts, settings, log)
    log(
        f"== {PROG} {opts.model} on {data_text} (the train split's labels {counts}): {names} x {len(opts.seeds)} seed(s), "
        f"{opts.epochs} epoch(s) each; outputs in {opts.out_dir}"
    )
    report = lambda records, started: write_cls_comparison(records, opts, data_text, started, log)
    if _plain_goes_first(opts):
        stopped = _plain_wave(ap, opts, settings, log)
        if stopped is not None:  # plain learned nothing: its results, the advice, the rest not run
            opts.stopped = stopped
            report(all_records(opts.out_dir, settings), stopped.pop("started"))
            return 1 if opts.failed_runs else 0
    return launch_and_report(ap, opts.cells, opts, settings, log, CLS_RUNS, report, report_failures=True)


def _plain_goes_first(opts) -> bool:
    """Whether plain's runs are launched as a wave of their own before the rest: with jobs (``--jobs N``,
    Slurm), which would otherwise all start together, unless ``--keep-going`` or ``--detach`` (which
    waits for nothing). The command that runs its runs itself (``--jobs 1``) takes plain's first anyway."""
    serial = opts.launcher == "local" and opts.jobs == 1
    methods = {cell["method"] for cell in opts.cells}
    return not serial and not opts.keep_going and not opts.detach and "plain" in methods and len(methods) > 1


def _plain_wave(ap, opts, settings: dict, log: Callable[[str], None]) -> Optional[dict]:
    """Plain's runs as jobs, waited for; when every seed of plain learned nothing, ``opts.stopped``'s
    record (the advice, the other rows' runs not run) with the wave's start time, else None."""
    started = time.time()
    plain = [cell for cell in opts.cells if cell["method"] == "plain"]
    try:
        records = launch_and_collect(plain, opts, settings, log, CLS_RUNS)
    except SweepError as e:
        ap.error(str(e))
    runs = [run for record in records or [] if record["cell"]["method"] == "plain" for run in record["runs"]]
    stopped = plain_stop(sorted(runs, key=lambda r: r["seed"]), opts, settings, log)
    if stopped is None:
        return None
    stopped["skipped"] = [
        f"{cell_name(cell)} seed {seed}"
        for cell in opts.cells
        if cell["method"] != "plain"
        for seed in opts.seeds
        if finished_result(run_dir(opts.out_dir, cell, seed), cell, settings) is None
    ]
    log(f"not run (plain learned nothing): {', '.join(stopped['skipped'])}")
    return {**stopped, "started": started}


if __name__ == "__main__":  # python -m attn_reg_plugin.sweep.cls_compare, before a reinstall adds the command
    sys.exit(main())
