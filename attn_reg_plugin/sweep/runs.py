"""The sweep's runs: fairseq-train of each cell and seed, fairseq-generate and sacrebleu of its best
checkpoint, and the record of every cell."""

from __future__ import annotations

import contextlib
import io
import json
import re
import statistics
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..prepare import fairseq_command, run_logged
from ..user_dir import FAIRSEQ_USER_DIR
from .options import AD_DROP_CRITERION, PLAIN_CRITERION, TASK, SweepError, cell_name, number_text, option_name
from .report import summarize, write_json


# -- the fairseq-train command --------------------------------------------------------------------
def _drop_ad_drop_args(args: Sequence[str]) -> List[str]:
    """``args`` without ``--ad-drop-*`` options (each takes one value): the plain criterion has none."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a.startswith("--ad-drop-"):
            skip = "=" not in a
        else:
            out.append(a)
    return out


def train_command(cell: dict, seed: int, opts, save_dir: Path) -> List[str]:
    """The fairseq-train argument list (without the command) of one run."""
    user = list(opts.train_args)
    if cell["method"] == "plain":
        user = _drop_ad_drop_args(user)
        method = ["--criterion", PLAIN_CRITERION]
    else:
        method = [
            "--criterion", AD_DROP_CRITERION,
            "--ad-drop-p", number_text(cell["p"]), "--ad-drop-q", number_text(cell["q"]),
            "--ad-drop-attribution", cell["attribution"], "--ad-drop-layers", cell["layers"],
            "--ad-drop-schedule", cell["schedule"],
        ]  # fmt: skip
    flags = set(map(option_name, user))
    logging = [] if "--log-format" in flags else ["--log-format", "simple"]
    if "--no-progress-bar" not in flags:
        logging.append("--no-progress-bar")
    keep = [] if flags & {"--keep-last-epochs", "--save-interval"} else ["--no-epoch-checkpoints"]
    return [
        str(opts.data_bin), "--user-dir", FAIRSEQ_USER_DIR, *user, "--task", TASK,
        "--source-lang", opts.source_lang, "--target-lang", opts.target_lang, *method,
        "--max-epoch", str(opts.epochs), "--seed", str(seed), "--save-dir", str(save_dir), *logging, *keep,
    ]  # fmt: skip


def check_fairseq_args(opts, cells: List[dict]) -> None:
    """Parse each method's fairseq-train command line in process, as fairseq-train will: a typo fails
    here, before any run, with fairseq's own message."""
    import logging

    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from fairseq import options  # its import sets the root logger to DEBUG with a handler: undone below

    root.setLevel(level)
    root.handlers[:] = handlers
    for cell in {c["method"]: c for c in cells}.values():
        argv = train_command(cell, opts.seeds[0], opts, opts.out_dir / "runs" / "check")
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                options.parse_args_and_arch(options.get_training_parser(), argv)
        except SystemExit:
            lines = err.getvalue().strip().splitlines() or ["(no message)"]
            message = re.sub(r"^\S+: error: ", "", lines[-1])  # argparse's prog is this process's argv[0]
            raise SweepError(
                f"the fairseq-train arguments after '--' do not parse for the {cell['method']} runs: "
                f"fairseq-train: error: {message}"
            ) from None


# -- one run --------------------------------------------------------------------------------------
def run_appended(cmd: Sequence[str], log_path: Path, on_line: Optional[Callable[[str], None]] = None) -> float:
    """``prepare.run_logged`` after the log's earlier lines: a resumed run keeps its earlier attempts'."""
    return run_logged(cmd, log_path, on_line, append=True)


def log_fields(text: str) -> Dict[str, str]:
    """The ``key value`` fields of one of fairseq-train's ``|``-separated log lines."""
    out = {}
    for part in text.split("|"):
        bits = part.strip().split(" ", 1)
        if len(bits) == 2:
            out[bits[0]] = bits[1].strip()
    return out


_SIMPLE_LINE = re.compile(r"\| (train|valid) \| epoch (\d+) \|(.*)$")
_JSON_LINE = re.compile(r"\| (train|valid) \| (\{.*\})\s*$")


def read_train_log(text: str) -> dict:
    """Per-epoch valid loss and AD-DROP rate (epochs that ran AD-DROP) from fairseq-train's
    end-of-epoch lines, in the simple or the json log format."""
    valid: Dict[int, float] = {}
    rates: Dict[int, float] = {}
    for line in text.splitlines():
        m = _SIMPLE_LINE.search(line)
        if m:
            kind, epoch, fields = m.group(1), int(m.group(2)), log_fields(m.group(3))
        else:
            m = _JSON_LINE.search(line)
            if not m:
                continue
            kind, data = m.group(1), json.loads(m.group(2))
            tag = f"{kind}_"  # the json format prefixes every key with its tag: valid_loss
            fields = {k[len(tag) :] if k.startswith(tag) else k: str(v) for k, v in data.items()}
            epoch = int(float(fields["epoch"]))
        if kind == "valid" and "loss" in fields:
            valid[epoch] = float(fields["loss"])
        elif kind == "train" and fields.get("ad_drop_on") in ("1", "1.0"):
            rates[epoch] = float(fields["ad_drop_rate"])
    return {"valid_loss": valid, "ad_drop_rate": rates}


def _references(path: Path) -> List[str]:
    # Lines end at \n only, as fairseq-preprocess counts them (splitlines would also split at \u2028).
    refs = path.read_text(encoding="utf-8").split("\n")
    if refs and refs[-1] == "":
        refs.pop()
    return [r[:-1] if r.endswith("\r") else r for r in refs]


def translate_and_score(opts, checkpoint: Path, split: str, out_dir: Path, ref_prefix: Optional[Path]) -> dict:
    """fairseq-generate ``split`` with ``checkpoint``; sacrebleu of the detokenized hypotheses."""
    import sacrebleu

    # --required-batch-size-multiple 1: with the default 8 fairseq drops a last batch smaller than 8.
    cmd = [
        fairseq_command("fairseq-generate"), str(opts.data_bin), "--user-dir", FAIRSEQ_USER_DIR,
        "--path", str(checkpoint), "--gen-subset", split,
        "--source-lang", opts.source_lang, "--target-lang", opts.target_lang,
        "--beam", str(opts.beam), "--required-batch-size-multiple", "1", "--max-tokens", "4096",
        *([] if opts.post_process == "none" else ["--post-process", opts.post_process]),
        *(["--cpu"] if "--cpu" in opts.train_args else []),
        *opts.generate_args,
    ]  # fmt: skip
    log = out_dir / f"generate-{split}.log"
    if log.exists():
        log.unlink()  # a rerun translates again from scratch
    seconds = run_appended(cmd, log)
    hyps: Dict[int, str] = {}
    targets: Dict[int, str] = {}
    for line in log.read_text(encoding="utf-8").split("\n"):
        if line.startswith("D-") or line.startswith("T-"):
            parts = line.split("\t")
            ident = int(parts[0][2:])
            if line[0] == "D":
                hyps[ident] = parts[2] if len(parts) > 2 else ""
            else:
                targets[ident] = parts[1] if len(parts) > 1 else ""
    if ref_prefix is not None:
        ref_path = Path(f"{ref_prefix}.{opts.target_lang}")
        refs = _references(ref_path)
        reference = str(ref_path)
    else:
        refs = [targets.get(i, "") for i in range(len(targets))]
        reference = f"fairseq's {split} references (binarized target, --post-process {opts.post_process})"
    if len(hyps) != len(refs) or set(hyps) != set(range(len(refs))):
        raise RuntimeError(f"fairseq-generate wrote {len(hyps)} hypotheses for {len(refs)} references ({log})")
    ordered = [hyps[i] for i in range(len(refs))]
    (out_dir / f"{split}.hyp").write_text("".join(h + "\n" for h in ordered), encoding="utf-8")
    metric = sacrebleu.BLEU(tokenize=opts.tokenize)
    score = metric.corpus_score(ordered, [refs])
    return {
        "bleu": round(score.score, 2),
        "sacrebleu": f"{score} ({metric.get_signature()})",
        "reference": reference,
        "sentences": len(refs),
        "empty_hypotheses": sum(1 for h in ordered if not h.strip()),
        "seconds": round(seconds, 1),
    }


def run_seed(cell: dict, seed: int, opts, settings: dict, seed_dir: Path, log: Callable[[str], None] = print) -> dict:
    """Train (resuming from checkpoint_last.pt if an earlier attempt stopped), translate valid (and
    test), score; ``seed_dir/result.json`` marks it finished."""
    result_path = seed_dir / "result.json"
    if result_path.exists():
        saved = json.loads(result_path.read_text(encoding="utf-8"))
        if saved.get("settings") == settings and saved.get("cell") == cell:
            return saved
    save_dir = seed_dir / "checkpoints"
    train_log = seed_dir / "train.log"
    trained_path = seed_dir / "trained.json"
    if not trained_path.exists():

        def progress(line: str) -> None:
            for epoch, loss in read_train_log(line)["valid_loss"].items():
                log(f"    {cell_name(cell)} seed {seed} epoch {epoch}/{opts.epochs}: valid loss {loss:.3f}")

        seconds = run_appended(
            [fairseq_command("fairseq-train"), *train_command(cell, seed, opts, save_dir)], train_log, progress
        )
        trained = {"train_seconds": round(seconds, 1)}
        write_json(trained_path, trained)
    trained = json.loads(trained_path.read_text(encoding="utf-8"))
    epochs = read_train_log(train_log.read_text(encoding="utf-8"))
    if not epochs["valid_loss"]:
        raise RuntimeError(f"no validation result in {train_log}")
    checkpoint = save_dir / "checkpoint_best.pt"
    valid = translate_and_score(opts, checkpoint, "valid", seed_dir, opts.valid_ref)
    test = translate_and_score(opts, checkpoint, "test", seed_dir, opts.test_ref) if opts.test else None
    rates = list(epochs["ad_drop_rate"].values())
    result = {
        "cell": cell,
        "seed": seed,
        "settings": settings,
        "valid_loss": min(epochs["valid_loss"].values()),
        "valid_bleu": valid["bleu"],
        "valid": valid,
        "test_bleu": test["bleu"] if test else None,
        "test": test,
        "ad_drop_rate": round(statistics.fmean(rates), 4) if rates else None,
        "epochs": max(epochs["valid_loss"]),
        "train_seconds": trained["train_seconds"],
    }
    write_json(result_path, result)
    return result


# -- the grid's cells -----------------------------------------------------------------------------
def run_cells(cells: List[dict], opts, settings: dict, log: Callable[[str], None]) -> List[dict]:
    """Every cell's record, in grid order: kept from ``OUT/cells/<cell>.json`` when that holds the same
    seeds, else run (each seed resuming on its own) and written there. Raises :class:`SweepError` when
    such a file holds another cell or settings."""
    records: List[dict] = []
    for index, cell in enumerate(cells, 1):
        name = cell_name(cell)
        record_path = opts.out_dir / "cells" / f"{name}.json"
        prefix = f"[cell {index}/{len(cells)}] {name}"
        record = _kept_record(record_path, cell, settings, opts.seeds)
        if record is not None:
            log(f"{prefix}: kept from {record_path} (valid BLEU {record['valid_bleu']:.2f})")
        else:
            record = summarize(cell, _run_seeds(cell, prefix, opts, settings, log), settings)
            write_json(record_path, record)
        records.append(record)
    return records


def _kept_record(record_path: Path, cell: dict, settings: dict, seeds: List[int]) -> Optional[dict]:
    """The finished record at ``record_path`` if it covers ``seeds``; None when there is none or it
    has other seeds (the cell is then run again, its finished seeds kept)."""
    if not record_path.exists():
        return None
    record = json.loads(record_path.read_text(encoding="utf-8"))
    if record["cell"] != cell or record["settings"] != settings:
        raise SweepError(f"{record_path} holds another cell or settings; use another --out-dir")
    return record if record["seeds"] == seeds else None


def _run_seeds(cell: dict, prefix: str, opts, settings: dict, log: Callable[[str], None]) -> List[dict]:
    """Each seed's result for ``cell``; a finished seed's is kept."""
    runs = []
    for seed in opts.seeds:
        seed_dir = opts.out_dir / "runs" / cell_name(cell) / f"seed{seed}"
        done = (seed_dir / "result.json").exists()
        log(f"{prefix} seed {seed}: {'kept' if done else 'training'}")
        run = run_seed(cell, seed, opts, settings, seed_dir, log)
        runs.append(run)
        if not done:
            log(
                f"{prefix} seed {seed}: valid BLEU {run['valid_bleu']:.2f}, valid loss {run['valid_loss']:.3f}"
                + (f", AD-DROP rate {run['ad_drop_rate']:.4f}" if run["ad_drop_rate"] is not None else "")
                + f", {run['train_seconds']:.0f} s training"
            )
    return runs
