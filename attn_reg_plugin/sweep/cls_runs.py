"""attn-reg-cls-compare's runs: the data (files or a ``datasets`` name), one method and seed through the
Hugging Face Trainer scored on dev and test, and the records of every row.

A run fine-tunes the model (its new classifier head seeded by the run's seed, so every method starts
from the same weights at a seed) on the training split with the method's trainer
(:mod:`attn_reg_plugin.hf.methods`), scores dev after every epoch, keeps the weights of the best dev
epoch (``--metric``, the earliest on ties), and scores dev and test once with them
(:func:`attn_reg_plugin.classification.scores`). ``runs/<row>/seed<S>/result.json`` marks it finished;
``command.json`` beside it, written before it trains, is its identity (:func:`trainer_run_identity`). A run
stopped before its result resumes on the next command from its last checkpoint in ``trainer/``
(:mod:`.cls_checkpoint`: each epoch's end, every ``--save-steps`` steps, the step a stop signal came in).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

from ..classification import learned_nothing, scores
from ..prepare import PrepareError
from ..prepare_classification import check_labels, checked_examples, read_examples
from .options import RefusingParser, SweepError, cell_name
from .report import write_json
from .runs import _finished_seeds, all_records, claim_run, finished_result, run_dir

PROG = "attn-reg-cls-compare"
ARGUMENTS = "attn-reg-cls-compare arguments"  # what a run's identity lists, in its refusal
SPLITS = ("train", "dev", "test")


# -- the data -------------------------------------------------------------------------------------
class Data(NamedTuple):
    """The three splits' examples (``{field: text, label_field: label}``), the label names in id order."""

    splits: Dict[str, List[Dict[str, str]]]
    labels: List[str]


def label_order(labels) -> List[str]:
    """Numeric labels in numeric order (0, 1, 2, 10), any others as text."""
    try:
        return sorted(labels, key=float)
    except ValueError:
        return sorted(labels)


def read_data(opts) -> Data:
    """The splits from ``--train/--dev/--test`` files or ``--dataset``; every row checked (text fields
    non-empty, a label, dev and test labels seen in train). Raises :class:`SweepError` naming the
    file or split, the row and the field."""
    fields = text_fields(opts)
    try:
        if opts.dataset:
            splits = {split: _dataset_split(opts, split, fields) for split in SPLITS}
            sources = {split: f"--{split}-split {getattr(opts, f'{split}_split')}" for split in SPLITS}
            train_name = sources["train"]
        else:
            splits = {split: read_examples(getattr(opts, split), fields, opts.label_field) for split in SPLITS}
            sources = {split: f"--{split} {getattr(opts, split)}" for split in SPLITS}
            train_name = "--train"
        known = check_labels(splits, sources, opts.label_field, train_name)
    except PrepareError as e:
        raise SweepError(str(e)) from None
    if len(known) < 2:
        raise SweepError(f"{sources['train']}: one label ({sorted(known)}): a classifier needs at least 2")
    return Data(splits, label_order(known))


def text_fields(opts) -> List[str]:
    return [opts.text_field] + ([opts.pair_field] if opts.pair_field else [])


def _dataset_split(opts, split: str, fields: Sequence[str]) -> List[Dict[str, str]]:
    """A ``datasets`` split's rows, checked as a file's are; a ClassLabel's integer is the label."""
    import datasets

    name = getattr(opts, f"{split}_split")
    try:
        rows = datasets.load_dataset(opts.dataset, opts.dataset_config, split=name)
    except (ValueError, FileNotFoundError) as e:  # an unknown split or dataset: its own message says which
        raise SweepError(f"--dataset {opts.dataset} --{split}-split {name}: {e}") from None
    return checked_examples(enumerate(rows, 1), f"--dataset {opts.dataset}[{name}]", fields, opts.label_field)


def training_subset(examples: List[dict], size: Optional[int], seed: int) -> List[dict]:
    """``--train-size``: ``size`` examples drawn at random with the run's seed (the same for every method
    at that seed), or all of them; class shares as the draw gives them."""
    if size is None:
        return examples
    return random.Random(seed).sample(examples, size)


_DATA: Dict[str, Data] = {}  # read once per process: every run of a command shares it


def data_for(opts, settings: dict) -> Data:
    key = json.dumps([settings["data"], settings["fields"]], sort_keys=True)
    if key not in _DATA:
        _DATA[key] = read_data(opts)
    return _DATA[key]


# -- a method's options ---------------------------------------------------------------------------
def method_options(method: str, words: Sequence[str]) -> argparse.Namespace:
    """The method's options from its ``--method-args`` words over its defaults (:class:`SweepError`
    naming a flag it does not take)."""
    from ..hf.methods import add_method_options

    parser = RefusingParser(prog=f"--method-args {method}", add_help=False, allow_abbrev=False)
    add_method_options(parser, [method])
    return parser.parse_args(list(words))


def method_settings(method: str, words: Sequence[str]) -> dict:
    """Its resolved config fields, validated (:class:`SweepError` naming the field and range)."""
    from ..hf.methods import METHODS

    try:
        return METHODS[method].settings(method_options(method, words))
    except ValueError as e:
        raise SweepError(str(e)) from None


# -- a run's identity -----------------------------------------------------------------------------
def trainer_run_identity(cell: dict, seed: int, opts) -> List[str]:
    """What a run is, as a command line: the command's shared settings (model, data and their digests,
    training), the method, its options as given and as resolved (a plugin whose defaults changed
    runs another run), and the seed."""
    words = [PROG]
    for key, value in sorted(opts.settings.items()):
        if key != "command":
            words += [
                f"--{key.replace('_', '-')}",
                value if isinstance(value, str) else json.dumps(value, sort_keys=True),
            ]
    resolved = json.dumps(method_settings(cell["method"], cell["args"]), sort_keys=True)
    return [*words, "--method", cell["method"], *cell["args"], "--method-settings", resolved, "--seed", str(seed)]


# -- one run --------------------------------------------------------------------------------------
def _encode(tokenizer, examples: Sequence[dict], opts, label_ids: Dict[str, int]) -> List[dict]:
    fields = text_fields(opts)
    texts = [[e[f] for e in examples] for f in fields]
    encoded = tokenizer(*texts, truncation=True, max_length=opts.max_length)
    return [
        {**{k: v[i] for k, v in encoded.items()}, "labels": label_ids[e[opts.label_field]]}
        for i, e in enumerate(examples)
    ]


def predict(model, tokenizer, features: List[dict], batch_size: int) -> List[int]:
    """The model's class per example (in order), batched by length so that little is padding."""
    import torch

    order = sorted(range(len(features)), key=lambda i: len(features[i]["input_ids"]))
    out = [0] * len(features)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = tokenizer.pad(
                [{k: v for k, v in features[i].items() if k != "labels"} for i in chunk], return_tensors="pt"
            )
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
            for i, label in zip(chunk, logits.argmax(-1).tolist()):
                out[i] = label
    model.train(was_training)
    return out


def _best_epoch_callback(tokenizer, dev: List[dict], metric: str, batch_size: int, say: Callable[[str], None] = None):
    import torch
    import transformers

    gold = [f["labels"] for f in dev]

    class BestDevEpoch(transformers.TrainerCallback):
        """Dev scores after every epoch; the best epoch's weights (``metric``, earliest on ties) copied."""

        def __init__(self):
            self.dev: List[dict] = []
            self.best_state = None
            self.best_epoch: Optional[int] = None  # 1-based

        def on_epoch_end(self, args, state, control, model=None, **kwargs):
            result = scores(predict(model, tokenizer, dev, batch_size), gold)
            best = result[metric] > max((d[metric] for d in self.dev), default=-float("inf"))
            if best:
                with torch.no_grad():
                    self.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                self.best_epoch = len(self.dev) + 1
            self.dev.append(result)
            if say is not None:
                say(
                    f"epoch {len(self.dev)} of {round(state.num_train_epochs)}: dev accuracy {result['accuracy']:.4f}, "
                    f"macro-F1 {result['macro_f1']:.4f}, MCC {result['mcc']:.4f}"
                    + (" (best so far)" if best else f" (best: epoch {self.best_epoch})")
                )

    return BestDevEpoch()


PROGRESS_LINES_PER_EPOCH = 5  # --log-steps 0: about this many progress lines an epoch


def duration_text(seconds: float) -> str:
    """``45 s``, ``3 min 05 s``, ``1 h 02 min``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def progress_callback(say: Callable[[str], None], every: int):
    """A ``TrainerCallback`` saying, every ``every`` optimizer steps (0: about
    :data:`PROGRESS_LINES_PER_EPOCH` times an epoch) and at the last, the step of all, the epoch, the
    training loss's mean since the epoch began (the Trainer's own sum, as its epoch log reads it), the
    time this attempt has trained and an ETA at this attempt's pace. Its ``trainer`` must be set."""
    import transformers

    from .cls_checkpoint import steps_per_epoch

    class Progress(transformers.TrainerCallback):
        def __init__(self):
            self.trainer = None
            self.started = None
            self.first_step = 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.started, self.first_step = time.time(), state.global_step

        def on_step_end(self, args, state, control, **kwargs):
            step, total = state.global_step, state.max_steps
            n = every or max(1, steps_per_epoch(state) // PROGRESS_LINES_PER_EPOCH)
            if step % n and step != total:
                return
            elapsed = time.time() - self.started
            done = step - self.first_step
            eta = elapsed / done * (total - step) if done else 0.0
            summed = getattr(self.trainer, "_tr_loss", None)
            since = step - getattr(self.trainer, "_globalstep_last_logged", step)
            loss = f", loss {float(summed) / since:.4f}" if summed is not None and since > 0 else ""
            say(
                f"step {step}/{total} (epoch {state.epoch:.2f} of {round(state.num_train_epochs)}){loss}, "
                f"{duration_text(elapsed)} in, ETA {duration_text(eta)}"
            )

    return Progress()


def training_arguments(opts, seed: int, output_dir: Path, warmup_steps: float, **overrides):
    """Every method's ``TrainingArguments`` (``opts``: epochs, batch_size, lr, weight_decay; the lab's
    few-shot runner's too): a log per epoch, nothing evaluated or reported, nothing saved unless
    ``overrides`` say so. ``warmup_steps``: steps, or a float in [0, 1), a share of them."""
    import transformers

    return transformers.TrainingArguments(
        output_dir=str(output_dir),
        num_train_epochs=opts.epochs,
        per_device_train_batch_size=opts.batch_size,
        learning_rate=opts.lr,
        weight_decay=opts.weight_decay,
        warmup_steps=warmup_steps,
        lr_scheduler_type="linear",
        seed=seed,
        data_seed=seed,
        logging_strategy="epoch",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_pin_memory=False,
        **{"save_strategy": "no", **overrides},
    )


def load_model(opts, seed: int, labels: Sequence[str]):
    import transformers

    transformers.set_seed(seed)  # before loading: the new classifier head is the same for every method at a seed
    return transformers.AutoModelForSequenceClassification.from_pretrained(
        opts.model,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        ignore_mismatched_sizes=True,  # a classifier of another label count: its head is replaced by a new one
    )


def encoded_splits(opts, data: Data, tokenizer, seed: int) -> Dict[str, List[dict]]:
    ids = {label: i for i, label in enumerate(data.labels)}
    train = training_subset(data.splits["train"], opts.train_size, seed)
    return {
        "train": _encode(tokenizer, train, opts, ids),
        "dev": _encode(tokenizer, data.splits["dev"], opts, ids),
        "test": _encode(tokenizer, data.splits["test"], opts, ids),
    }


def build_trainer(
    cell: dict, opts, model, tokenizer, features: Dict[str, List[dict]], output_dir: Path, seed: int, callbacks=()
):
    """The cell's method's trainer, as every run of the command builds it (the dev set is AttendOut's held-out
    draws); a checkpoint at each epoch's end, which :mod:`.cls_checkpoint`'s callback completes and rotates."""
    import transformers

    from ..hf.methods import METHODS

    trainer = METHODS[cell["method"]].build(
        method_options(cell["method"], cell["args"]),
        model=model,
        args=training_arguments(opts, seed, output_dir, opts.warmup_ratio, save_strategy="epoch"),
        train_dataset=features["train"],
        eval_dataset=features["dev"],
        data_collator=transformers.DataCollatorWithPadding(tokenizer),
        callbacks=list(callbacks),
    )
    trainer.remove_callback(transformers.PrinterCallback)  # one line per run is printed instead
    return trainer


def run_classifier(
    cell: dict, seed: int, opts, settings: dict, seed_dir: Path, log: Callable[[str], None] = print
) -> dict:
    """Train and score one run, unless ``result.json`` already holds it; returns its result. Training
    resumes from the run's last checkpoint (:mod:`.cls_checkpoint`), which is removed once the result is written."""
    import transformers

    quiet_transformers()

    done = finished_result(seed_dir, cell, settings)
    if done is not None:
        return done
    # a folder started with other arguments is refused
    claim_run(seed_dir, trainer_run_identity(cell, seed, opts), ARGUMENTS)
    data = data_for(opts, settings)
    tokenizer = transformers.AutoTokenizer.from_pretrained(opts.model)
    features = encoded_splits(opts, data, tokenizer, seed)
    trained = _trainer_train(cell, seed, opts, seed_dir / "trainer", tokenizer, features, data.labels, log)
    result, predicted = _result(cell, seed, opts, settings, data, features, tokenizer, trained)
    for split, name in PREDICTION_FILES.items():  # before result.json, which marks the run finished
        write_predictions(seed_dir / name, features[split], predicted[split], data.labels)
    if getattr(opts, "keep_models", False):
        save_model(trained.trainer.model, tokenizer, seed_dir / MODEL_FOLDER)
        result["model"] = MODEL_FOLDER
    write_json(seed_dir / "result.json", result)
    shutil.rmtree(seed_dir / "trainer", ignore_errors=True)  # its checkpoint: the run is finished
    return result


MODEL_FOLDER = "model"  # --keep-models: the run's best dev epoch as a save_pretrained folder, in its run folder


def save_model(model, tokenizer, folder: Path) -> None:
    """The model (its best dev epoch's weights, loaded by :func:`_result`) and its tokenizer as one
    ``save_pretrained`` folder that stock transformers loads without the plugin (transformers does not
    save the attention implementation; the config names the label names, ``id2label``/``label2id``).
    Written beside, then moved into place, so that a folder there is whole."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.replace(folder)


class _Trained(NamedTuple):
    trainer: object
    dev: object  # the dev-epoch callback: its ``dev`` scores, ``best_epoch`` and ``best_state``
    resumed: dict  # the state of the checkpoint this attempt resumed from ({}: none)
    seconds: float  # training, over every attempt up to its last checkpoint and this one


def _trainer_train(cell: dict, seed: int, opts, folder: Path, tokenizer, features, labels, log: Callable) -> _Trained:
    """The run's training, resumed from its last whole checkpoint in ``folder`` if an earlier attempt
    left one; a stop signal meanwhile saves at the end of its step first (:class:`processes.DeferredStop`)."""
    from .cls_checkpoint import checkpoint_callback, last_checkpoint, load_best
    from .processes import DeferredStop

    def say(line: str) -> None:
        log(f"    {cell_name(cell)} seed {seed}: {line}")

    dev = _best_epoch_callback(tokenizer, features["dev"], opts.metric, opts.eval_batch_size, say)
    found = last_checkpoint(folder) if folder.is_dir() else None
    resumed = {}
    if found is not None:
        path, state = found
        resumed = {**state, "resumed_at_steps": [*state["resumed_at_steps"], state["step"]]}
        dev.dev, dev.best_epoch, dev.best_state = list(state["dev"]), state["best_epoch"], load_best(folder, state)
        say(
            f"resuming from {path.name}, saved by an earlier attempt (step {state['step']} of {state['max_steps']}; "
            f"{len(state['dev'])} epoch(s) scored on dev)"
        )
    stop = DeferredStop()
    saver = checkpoint_callback(folder, opts.save_steps, dev, stop, say, resumed)
    progress = progress_callback(say, getattr(opts, "log_steps", 0))
    callbacks = [dev, saver, progress]
    trainer = build_trainer(cell, opts, load_model(opts, seed, labels), tokenizer, features, folder, seed, callbacks)
    saver.trainer = progress.trainer = trainer
    started = time.time()
    with stop:
        trainer.train(resume_from_checkpoint=str(found[0]) if found is not None else None)
    return _Trained(trainer, dev, resumed, resumed.get("train_seconds", 0.0) + time.time() - started)


# Each run's predictions with its best dev epoch's weights, one JSON line per example in the split's
# order: the paired bootstrap over test examples reads them (cls_report), and so can a user.
PREDICTION_FILES = {"test": "predictions.jsonl", "dev": "dev_predictions.jsonl"}


def write_predictions(path: Path, features: List[dict], predicted: List[int], labels: Sequence[str]) -> None:
    """``{"id": i, "gold": label, "predicted": label}`` per example, ``i`` its 0-based place in the split."""
    lines = (
        json.dumps({"id": i, "gold": labels[f["labels"]], "predicted": labels[p]}) + "\n"
        for i, (f, p) in enumerate(zip(features, predicted))
    )
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(lines), encoding="utf-8")
    partial.replace(path)


def read_predictions(path: Path) -> Optional[List[dict]]:
    """A run's predictions file as written by :func:`write_predictions`; None when the run has none."""
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _result(cell: dict, seed: int, opts, settings: dict, data: Data, features, tokenizer, trained: _Trained):
    """The run's record (the best dev epoch's scores on dev and test, each epoch's, and its resumes)
    and its predictions ``{split: class per example}`` with those weights."""
    from ..hf.methods import METHODS
    from .cls_checkpoint import steps_per_epoch

    trainer, callback = trained.trainer, trained.dev
    model = trainer.model
    model.load_state_dict(callback.best_state)
    best = callback.best_epoch  # the earliest on ties
    predicted = {split: predict(model, tokenizer, features[split], opts.eval_batch_size) for split in PREDICTION_FILES}
    test = scores(predicted["test"], [f["labels"] for f in features["test"]])
    dev = callback.dev[best - 1]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    per_epoch = steps_per_epoch(trainer.state)
    steps = trained.resumed.get("resumed_at_steps", [])
    mid_epoch = {step // per_epoch + 1: step for step in steps if step % per_epoch}  # its method's logs: since then
    method = METHODS[cell["method"]]
    epochs = [
        {"epoch": i + 1, "train_loss": entry["loss"], "dev": callback.dev[i], **method.logged(entry)}
        | ({"resumed_at_step": mid_epoch[i + 1]} if i + 1 in mid_epoch else {})
        for i, entry in enumerate(logs[: len(callback.dev)])
    ]
    train_labels = [f["labels"] for f in features["train"]]
    return {
        "cell": cell,
        "seed": seed,
        "settings": settings,
        "best_epoch": best,
        "dev": dev,
        "test": test,
        "learned_nothing": learned_nothing(dev, metric=opts.metric),
        "train_examples": len(train_labels),
        "train_labels": {label: train_labels.count(i) for i, label in enumerate(data.labels)},
        "train_seconds": round(trained.seconds, 1),
        "epochs": epochs,
        "resumed_at_steps": steps,
        "resumed_at_epochs": [step // per_epoch + 1 for step in steps],
        "exact_resume": True,  # the weights bit for bit on the CPU (cls_checkpoint); not a method's logs of its epoch
    }, predicted


def quiet_transformers() -> None:
    """transformers' INFO lines and progress bars off: the command prints one line per run."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def run_cls_job(cell: dict, seed: int, opts, settings: dict) -> dict:
    """One run as one submitit job (``--launcher slurm`` or ``local --jobs N``); its progress lines go
    to the job's log as they come."""
    say = lambda line: print(line, flush=True)  # noqa: E731
    return run_classifier(cell, seed, opts, settings, run_dir(opts.out_dir, cell, seed), say)


def _run_line(run: dict, metric: str) -> str:
    dev, test = run["dev"], run["test"]
    out = (
        f"best epoch {run['best_epoch']}: dev {metric} {dev[metric]:.4f}, test accuracy {test['accuracy']:.4f}, "
        f"macro-F1 {test['macro_f1']:.4f}, MCC {test['mcc']:.4f}; {run['train_seconds']:.0f} s training"
    )
    return out + (f"; LEARNED NOTHING: {run['learned_nothing']}" if run["learned_nothing"] else "")


def collect(cells: List[dict], opts, settings: dict, log: Callable[[str], None], collect_only: bool) -> List[dict]:
    """Every row's record (``cells/<row>.json``): its finished runs kept, the missing ones run here
    (``collect_only``: left out, as after jobs); every row recorded in ``--out-dir`` returned, earlier
    commands' too. Plain's runs come first: once plain has learned nothing at every seed it ran so far,
    the runs still missing are not run (unless ``--keep-going``), and ``opts.stopped`` says which and why."""
    opts.stopped = getattr(opts, "stopped", None)
    for index, cell in enumerate(cells, 1):
        name = cell_name(cell)
        runs = []
        cell_dir = run_dir(opts.out_dir, cell, 0).parent
        for seed in sorted(set(opts.seeds) | set(_finished_seeds(cell, settings, cell_dir))):
            seed_dir = run_dir(opts.out_dir, cell, seed)
            prefix = f"[row {index}/{len(cells)}] {name} seed {seed}"
            run = finished_result(seed_dir, cell, settings)
            if run is not None:
                kept = (
                    ""
                    if run.get("model") or not getattr(opts, "keep_models", False)
                    else " (no model: it finished without --keep-models)"
                )
                log(f"{prefix}: kept from {seed_dir / 'result.json'}{kept}")
            elif collect_only:
                continue
            elif opts.stopped is not None:
                opts.stopped["skipped"].append(f"{name} seed {seed}")
                continue
            else:
                log(f"{prefix}: training")
                run = run_classifier(cell, seed, opts, settings, seed_dir, log)
                log(f"{prefix}: {_run_line(run, opts.metric)}")
            runs.append(run)
            if cell["method"] == "plain" and not collect_only and opts.stopped is None:
                opts.stopped = plain_stop(runs, opts, settings, log)
        if runs:
            record = {
                "cell": cell,
                "name": name,
                "settings": settings,
                "seeds": [r["seed"] for r in runs],
                "runs": runs,
            }
            record["train_seconds"] = round(sum(r["train_seconds"] for r in runs), 1)
            write_json(opts.out_dir / "cells" / f"{name}.json", record)
    if opts.stopped is not None and opts.stopped["skipped"]:
        log(f"not run (plain learned nothing): {', '.join(opts.stopped['skipped'])}")
    return all_records(opts.out_dir, settings)


# What a pretrained encoder's fine-tuning needs to leave the majority class on a small set (measured on
# 400 imbalanced movie reviews with the offline MiniLM, docs/HF.md): about 120 updates or more (125 learned, 50 did
# not), a rate of 5e-5 to 1e-4 after a warm-up.
ENOUGH_UPDATES = 120
LOW_LR, HIGH_LR = 5e-5, 5e-4
IMBALANCED = 0.6  # a majority class over this share of dev: accuracy rewards predicting it


def learning_advice(settings: dict, run: dict, stopping: bool = True) -> str:
    """Which settings to change when plain learned nothing, in a sentence, from the command's
    ``settings`` and one of plain's runs (its training size and dev scores)."""
    per_epoch = math.ceil(run["train_examples"] / settings["batch_size"])
    updates = per_epoch * settings["epochs"]
    out = []
    if updates < ENOUGH_UPDATES:
        epochs = math.ceil(ENOUGH_UPDATES / per_epoch)
        out.append(
            f"--epochs {epochs} or more (now {settings['epochs']}: {updates} updates in all, {per_epoch} an epoch)"
        )
    if settings["lr"] < LOW_LR:
        out.append(f"--lr 1e-4 (now {settings['lr']:g})")
    elif settings["lr"] > HIGH_LR:
        out.append(f"--lr 1e-4 (now {settings['lr']:g}: too high a rate also ends in one class)")
    if not settings.get("warmup_ratio"):
        out.append("--warmup-ratio 0.1 (now 0)")
    share = run["dev"].get("majority_rate", 0.0)
    if settings["metric"] == "accuracy" and share > IMBALANCED:
        out.append(
            f"--metric macro_f1 (the majority class is {100 * share:.0f}% of dev: accuracy picks epochs that predict it)"
        )
    if not out:
        out.append(
            "more epochs, or --lr 1e-4 with --warmup-ratio 0.1 (the model may be too small or the task too hard)"
        )
    return "Change: " + "; ".join(out) + (" (or --keep-going to run the other runs anyway)." if stopping else ".")


def plain_stop(runs: List[dict], opts, settings: dict, log: Callable[[str], None]) -> Optional[dict]:
    """After each of plain's runs: when every one so far learned nothing, the comparison would be empty,
    so the runs still missing are stopped (``--keep-going``: they run) and the settings to change said."""
    if not runs or not all(run["learned_nothing"] for run in runs) or getattr(opts, "keep_going", False):
        return None
    seeds = ", ".join(str(r["seed"]) for r in runs)
    text = learning_advice(settings, runs[-1])
    log(f"STOPPED: plain learned nothing at every seed so far ({seeds}): the other runs would compare nothing. {text}")
    return {"plain_seeds": [r["seed"] for r in runs], "advice": text, "skipped": []}
