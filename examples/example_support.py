"""What the example scripts share: strict data reading and a per-epoch view of Trainer logs.

Readers never skip or repair a bad line: they raise ``ValueError`` naming the file and the
1-based line, before any training starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple


def read_text_lines(path: Path) -> List[str]:
    """The lines of a UTF-8 text file, without their line endings; an undecodable line is an error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    lines = []
    # Split at \n only (a CRLF's \r dropped), as fairseq-preprocess and attn-reg-prepare count lines.
    pieces = path.read_bytes().split(b"\n")
    if pieces and pieces[-1] == b"":
        pieces.pop()  # the newline that ends the last line
    for number, raw in enumerate((p[:-1] if p.endswith(b"\r") else p for p in pieces), start=1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{path}:{number}: not valid UTF-8 ({err.reason} at byte {err.start} of the line)"
            ) from None
    return lines


def read_jsonl(path: Path) -> Iterator[Tuple[int, dict]]:
    """(line number, object) for each line of a JSON-lines file; blank lines and non-objects are errors.

    A byte-order mark before the first line is dropped."""
    for number, line in enumerate(read_text_lines(path), start=1):
        if number == 1:
            line = line.removeprefix("\ufeff")
        if not line.strip():
            raise ValueError(f"{path}:{number}: empty line (every line must hold one JSON object)")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        yield number, row


def read_parallel(
    directory: Path, split: str, src: str, tgt: str, limit: Optional[int] = None
) -> Tuple[List[str], List[str]]:
    """``{split}.{src}`` and ``{split}.{tgt}``: same line count, no empty sentence; first ``limit`` pairs."""
    sides = []
    for lang in (src, tgt):
        path = Path(directory) / f"{split}.{lang}"
        lines = read_text_lines(path)
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                raise ValueError(f"{path}:{number}: empty sentence")
        sides.append((path, lines))
    (src_path, src_lines), (tgt_path, tgt_lines) = sides
    if len(src_lines) != len(tgt_lines):
        raise ValueError(f"{src_path} has {len(src_lines)} lines but {tgt_path} has {len(tgt_lines)}: not parallel")
    if limit is not None:
        src_lines, tgt_lines = src_lines[:limit], tgt_lines[:limit]
    return src_lines, tgt_lines


def epoch_table(log_history: Sequence[Dict[str, float]]) -> List[Dict[str, object]]:
    """One row per epoch from a Trainer's ``log_history`` (``logging_strategy="epoch"``).

    Rows carry the training loss, ``ad_drop_on`` / ``ad_drop_rate`` (None for a plain Trainer)
    and every ``eval_*`` value logged at that epoch.
    """
    rows: Dict[int, Dict[str, object]] = {}
    for entry in log_history:
        evals = {k: v for k, v in entry.items() if k.startswith("eval_")}
        if "epoch" not in entry or ("loss" not in entry and not evals):
            continue  # the final train_runtime summary, or a step log without loss
        epoch = int(round(entry["epoch"]))
        row = rows.setdefault(epoch, {"epoch": epoch, "train_loss": None, "ad_drop_on": None, "ad_drop_rate": None})
        if "loss" in entry:
            row["train_loss"] = entry["loss"]
            row["ad_drop_on"] = entry.get("ad_drop_on")
            row["ad_drop_rate"] = entry.get("ad_drop_rate")
        row.update(evals)
    return [rows[e] for e in sorted(rows)]


def train_and_log(
    method: str, trainer, metric: Optional[str] = None, finite: bool = False
) -> Tuple[List[Dict[str, object]], float]:
    """Train, print one line per epoch (``[method] epoch 2 | AD-DROP | ...``) and return the epoch rows
    and the training seconds; with ``finite``, an epoch without a finite training loss is an error."""
    import math
    import time

    start = time.time()
    trainer.train()
    seconds = time.time() - start
    epochs = epoch_table(trainer.state.log_history)
    for row in epochs:
        print(f"[{method}] {format_epoch_row(row, metric)}", flush=True)
    bad = [row["epoch"] for row in epochs if row["train_loss"] is None or not math.isfinite(row["train_loss"])]
    if finite and bad:
        raise FloatingPointError(f"{method}: no finite training loss logged for epochs {bad}")
    return epochs, seconds


def mean_ad_drop_rate(epochs: Sequence[Dict[str, object]]) -> str:
    """The mean measured drop rate over the AD-DROP epochs, formatted; ``-`` when there were none."""
    rates = [row["ad_drop_rate"] for row in epochs if row.get("ad_drop_on")]
    return f"{sum(rates) / len(rates):.4f}" if rates else "-"


def format_epoch_row(row: Dict[str, object], metric: Optional[str] = None) -> str:
    """``epoch 2 | AD-DROP | train loss 0.4121 | drop rate 0.0912 | eval_accuracy 0.7500``."""
    mode = "AD-DROP" if row.get("ad_drop_on") else "plain"
    parts = [f"epoch {row['epoch']}", mode]
    if row.get("train_loss") is not None:
        parts.append(f"train loss {row['train_loss']:.4f}")
    parts.append(f"drop rate {row['ad_drop_rate']:.4f}" if row.get("ad_drop_rate") is not None else "drop rate -")
    if row.get("eval_loss") is not None:
        parts.append(f"dev loss {row['eval_loss']:.4f}")
    if metric and row.get(f"eval_{metric}") is not None:
        parts.append(f"dev {metric} {row[f'eval_{metric}']:.4f}")
    return " | ".join(parts)


# -- command-line pieces the example scripts share ---------------------------------------------
METHODS = ("plain", "ad-drop")


def add_ad_drop_options(ap, **task_defaults) -> None:
    """``--methods`` and the ``--ad-drop-*`` options (ADDropConfig's fields, as in fairseq), with the
    config's defaults except where the example's task overrides one (``p=0.3``: the paper's value for
    that task; None: the runner picks it after parsing)."""
    from attn_reg_plugin.core import ADDropConfig
    from attn_reg_plugin.core.regularizers.options import add_arguments

    ap.add_argument("--methods", default="plain,ad-drop", help=f"comma list of {', '.join(METHODS)}, run in that order")
    only = ("p", "q", "layers", "attention", "attribution", "schedule")
    unknown = set(task_defaults) - set(only)
    if unknown:
        raise TypeError(f"add_ad_drop_options: no option {sorted(unknown)}; the options are {', '.join(only)}")
    add_arguments(ap, ADDropConfig, only=only, defaults=task_defaults)


def check_common_args(ap, args, positive: Sequence[str] = ()) -> None:
    """Turn ``--methods`` into a list and reject bad values (``ap.error``), before anything is loaded."""
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        ap.error(f"--methods: unknown {unknown or 'empty list'}; accepted: {', '.join(METHODS)}")
    for name in positive:
        value = getattr(args, name)
        if value is not None and not value > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if "ad-drop" in args.methods:
        ad_drop_config(args)  # raises ValueError naming the --ad-drop-* flag


def ad_drop_config(args):
    """The validated ``ADDropConfig`` of the ``--ad-drop-*`` options."""
    from attn_reg_plugin.core import ADDropConfig

    return ADDropConfig.from_namespace(args).validate()


def hf_trainer(method: str, args, output_dir: Path, seq2seq: bool = False, **trainer_kwargs):
    """A stock (Seq2Seq)Trainer for ``plain``, ``ADDrop(Seq2Seq)Trainer`` for ``ad-drop``; both log and
    evaluate once per epoch with the same arguments (``args.lr``, ``epochs``, ``batch_size``, ``seed``, ``fp16``,
    and where the script has them ``bf16`` and ``gradient_checkpointing``)."""
    import torch
    import transformers

    from attn_reg_plugin.hf import ADDropSeq2SeqTrainer, ADDropTrainer
    from attn_reg_plugin.hf.trainer_arguments import checkpointing_argument

    bf16 = getattr(args, "bf16", False)
    arguments = (transformers.Seq2SeqTrainingArguments if seq2seq else transformers.TrainingArguments)(
        output_dir=str(output_dir),
        learning_rate=args.lr,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        eval_strategy="epoch",
        logging_strategy="epoch",
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        fp16=args.fp16,
        bf16=bf16,
        # transformers refuses bf16 without a bf16 GPU unless told to train on the CPU
        use_cpu=bf16 and not torch.cuda.is_available(),
        **checkpointing_argument(getattr(args, "gradient_checkpointing", False)),
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    if method == "plain":
        return (transformers.Seq2SeqTrainer if seq2seq else transformers.Trainer)(args=arguments, **trainer_kwargs)
    return (ADDropSeq2SeqTrainer if seq2seq else ADDropTrainer)(
        args=arguments, ad_drop=ad_drop_config(args), **trainer_kwargs
    )
