"""The sweep's runs: fairseq-train of each cell and seed, fairseq-generate and sacrebleu of its best
checkpoint, and the record of every cell."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..prepare import fairseq_command
from ..user_dir import FAIRSEQ_USER_DIR
from .options import AD_DROP_CRITERION, PLAIN_CRITERION, TASK, SweepError, cell_name, number_text, option_name
from .processes import SweepStopped, run_child
from .records import Attempts, diverged_in, divergence_bound, read_train_log, resumed_from, train_facts
from .report import APPROXIMATE_RESUME, write_json
from .verdict import summarize


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
    if "args" in cell:  # a cell of attn-reg-mt-compare: its method's own fairseq-train arguments
        method = list(cell["args"])
    elif cell["method"] == "plain":
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


# -- a run's identity -----------------------------------------------------------------------------
IDENTITY_FILE = "command.json"  # in the run's folder: the fairseq-train command line it was started with
RUN_FOLDER = "<run>"  # the run's folder in an identity: the same run in a moved or copied --out-dir


def fairseq_run_identity(cell: dict, seed: int, opts) -> List[str]:
    """What a run is: its whole fairseq-train command line (without the executable, the run's folder
    as ``<run>``, without a Slurm job's per-rank options)."""
    return train_command(cell, seed, opts, Path(RUN_FOLDER) / "checkpoints")


def identity_conflict(
    seed_dir: Path, identity: Sequence[str], arguments: str = "fairseq-train arguments"
) -> Optional[str]:
    """Why ``seed_dir`` cannot be run as ``identity``: it was started (trained, or queued as a job)
    with another command line (its ``arguments``, for the message), both named and what differs; None
    when it was not, or with this one."""
    path = seed_dir / IDENTITY_FILE
    if not path.exists():
        return None
    recorded = json.loads(path.read_text(encoding="utf-8"))["command"]
    if recorded == list(identity):
        return None
    import difflib

    pairs = difflib.SequenceMatcher(a=recorded, b=list(identity), autojunk=False).get_opcodes()
    then = [" ".join(recorded[i1:i2]) or "(nothing)" for tag, i1, i2, _, _ in pairs if tag != "equal"]
    now = [" ".join(identity[j1:j2]) or "(nothing)" for tag, _, _, j1, j2 in pairs if tag != "equal"]
    return (
        f"{seed_dir} was started with other {arguments} ({'; '.join(then)} then, {'; '.join(now)} "
        f"now): it was `{shlex.join(recorded)}`, this command's is `{shlex.join(identity)}`. Rerun with the "
        "same options to resume it, name this row otherwise (--method-args METHOD:ROW=ARGS), use another "
        f"--out-dir, or delete {seed_dir} to train it anew"
    )


def claim_run(seed_dir: Path, identity: Sequence[str], arguments: str = "fairseq-train arguments") -> None:
    """Record ``identity`` as the run's before it is trained or queued; :class:`SweepError` when the
    folder was started with another (:func:`identity_conflict`)."""
    conflict = identity_conflict(seed_dir, identity, arguments)
    if conflict is not None:
        raise SweepError(conflict)
    if not (seed_dir / IDENTITY_FILE).exists():
        write_json(seed_dir / IDENTITY_FILE, {"command": list(identity)})


# -- one run --------------------------------------------------------------------------------------
def run_appended(
    cmd: Sequence[str],
    log_path: Path,
    on_line: Optional[Callable[[str], None]] = None,
    on_tick: Optional[Callable[[float], None]] = None,
) -> float:
    """:func:`processes.run_child`: the child writes after the log's earlier lines (a resumed run
    keeps its earlier attempts'), and never outlives the sweep."""
    return run_child(cmd, log_path, on_line, on_tick)


def _references(path: Path) -> List[str]:
    # Lines end at \n only, as fairseq-preprocess counts them (splitlines would also split at \u2028).
    refs = path.read_text(encoding="utf-8").split("\n")
    if refs and refs[-1] == "":
        refs.pop()
    return [r[:-1] if r.endswith("\r") else r for r in refs]


def generate_command(opts, checkpoint: Path, split: str) -> List[str]:
    """fairseq-generate of ``split`` with ``checkpoint``, its length bounded (--max-len-a/-b)."""
    # --required-batch-size-multiple 1: with the default 8 fairseq drops a last batch smaller than 8.
    return [
        fairseq_command("fairseq-generate"), str(opts.data_bin), "--user-dir", FAIRSEQ_USER_DIR,
        "--path", str(checkpoint), "--gen-subset", split,
        "--source-lang", opts.source_lang, "--target-lang", opts.target_lang,
        "--beam", str(opts.beam), "--required-batch-size-multiple", "1", "--max-tokens", "4096",
        "--max-len-a", number_text(opts.max_len_a), "--max-len-b", str(opts.max_len_b),
        *([] if opts.post_process == "none" else ["--post-process", opts.post_process]),
        *(["--cpu"] if "--cpu" in opts.train_args else []),
        *opts.generate_args,
    ]  # fmt: skip


def _generated(log: Path) -> tuple:
    """The ``D-`` hypotheses and ``T-`` references of a fairseq-generate log, by sentence id."""
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
    return hyps, targets


def translate_and_score(opts, checkpoint: Path, split: str, out_dir: Path, ref_prefix: Optional[Path]) -> dict:
    """fairseq-generate ``split`` with ``checkpoint``; sacrebleu of the detokenized hypotheses."""
    import sacrebleu

    log = out_dir / f"generate-{split}.log"
    if log.exists():
        log.unlink()  # a rerun translates again from scratch
    seconds = run_appended(generate_command(opts, checkpoint, split), log)
    hyps, targets = _generated(log)
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
    (out_dir / f"{split}.ref").write_text("".join(r + "\n" for r in refs), encoding="utf-8")
    metric, chrf = sacrebleu.BLEU(tokenize=opts.tokenize), sacrebleu.CHRF()
    score, chrf_score = metric.corpus_score(ordered, [refs]), chrf.corpus_score(ordered, [refs])
    return {
        "bleu": round(score.score, 2),
        "sacrebleu": f"{score} ({metric.get_signature()})",
        "chrf": round(chrf_score.score, 2),
        "chrf_sacrebleu": f"{chrf_score} ({chrf.get_signature()})",
        "reference": reference,
        "sentences": len(refs),
        "empty_hypotheses": sum(1 for h in ordered if not h.strip()),
        "length_ratio": round(score.sys_len / score.ref_len, 3) if score.ref_len else None,
        "seconds": round(seconds, 1),
    }


# fairseq builds a process's batches once, ordering equal-length sentences by seed + the epoch it
# starts in, so a resumed run's batches differ from an uninterrupted one's (docs/CHECKPOINTS.md).
def _fairseq_train(
    cell: dict, seed: int, opts, seed_dir: Path, log: Callable[[str], None], distributed: Sequence[str]
) -> None:
    """fairseq-train of one run (resuming from its checkpoint_last.pt when an earlier attempt left
    one), its attempts in ``attempts.json``; ``trained.json`` marks it trained, or diverged when
    fairseq-train stopped on a NaN/Inf (its ``diverged`` says why). ``distributed``: rank 0's
    options in a Slurm job of several ranks (:mod:`.ranks`)."""
    attempts = Attempts(seed_dir / "attempts.json")
    entry = attempts.start()
    name = f"{cell_name(cell)} seed {seed}"

    def on_line(line: str) -> None:
        resumed = resumed_from(line)
        if resumed is not None:
            entry["resumed_from_epoch"] = resumed[0]
            done = f"all {opts.epochs} epochs done" if resumed[0] > opts.epochs else f"{resumed[1]} updates done"
            log(
                f"    resuming {name} from epoch {resumed[0]} (checkpoint_last.pt: {done}; the record covers every attempt)"
                + ("" if exact else APPROXIMATE_RESUME)
            )
        for epoch, loss in read_train_log(line)["valid_loss"].items():
            log(f"    {name} epoch {epoch}/{opts.epochs}: valid loss {loss:.3f}")

    cmd = [fairseq_command("fairseq-train"), *train_command(cell, seed, opts, seed_dir / "checkpoints"), *distributed]
    exact = "--rebuild-batches" in cmd
    train_log = seed_dir / "train.log"
    attempt_start = train_log.stat().st_size if train_log.exists() else 0
    try:
        seconds = run_appended(cmd, train_log, on_line, attempts.tick)
    except BaseException as e:
        diverged = None if isinstance(e, SweepStopped) else _attempt_diverged(train_log, attempt_start)
        if diverged is None:
            attempts.end(_attempt_end(e))
            raise
        # Recorded, not raised: the other runs are still compared, and a rerun keeps the record
        # instead of training into the same NaN again.
        attempts.end("diverged")
        trained = {"train_seconds": attempts.seconds, "attempts": len(attempts.entries), "diverged": diverged}
        write_json(seed_dir / "trained.json", trained)
        return
    attempts.end("finished", seconds)
    write_json(seed_dir / "trained.json", {"train_seconds": attempts.seconds, "attempts": len(attempts.entries)})


def _resumes(seed_dir: Path, opts) -> dict:
    """The epochs the run resumed at (a stop, a failed job, a Slurm requeue), and whether its batches
    are then an uninterrupted run's (``--rebuild-batches``): what the report says of it."""
    path = seed_dir / "attempts.json"
    entries = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
    epochs = [e["resumed_from_epoch"] for e in entries if e.get("resumed_from_epoch") is not None]
    return {"resumed_at_epochs": epochs, "exact_resume": "--rebuild-batches" in opts.train_args}


def _attempt_end(e: BaseException) -> str:
    if isinstance(e, SweepStopped):
        return f"stopped by {e}"
    if isinstance(e, SystemExit):  # submitit's exit after the requeue (launcher.RunJob.checkpoint)
        return "saved and requeued at the Slurm job's time limit"
    if type(e).__name__ == "UncompletedJobError":  # the same, its requeues spent
        return "saved at the Slurm job's time limit, not requeued: --slurm-max-requeues spent"
    return f"failed ({type(e).__name__})"


def _attempt_diverged(train_log: Path, attempt_start: int) -> Optional[str]:
    """:func:`records.diverged_in` of the output the last attempt appended to ``train_log``."""
    if not train_log.exists():
        return None
    with open(train_log, "rb") as f:
        f.seek(attempt_start)
        return diverged_in(f.read().decode("utf-8", errors="replace"))


def run_seed(
    cell: dict,
    seed: int,
    opts,
    settings: dict,
    seed_dir: Path,
    log: Callable[[str], None] = print,
    distributed: Sequence[str] = (),
) -> dict:
    """Train (resuming from checkpoint_last.pt if an earlier attempt stopped), translate valid (and
    test), score; ``seed_dir/result.json`` marks it finished. The epochs are read from every
    attempt's lines in ``train.log``, the time from every attempt's ``attempts.json`` entry."""
    result_path = seed_dir / "result.json"
    if result_path.exists():
        saved = json.loads(result_path.read_text(encoding="utf-8"))
        if saved.get("settings") == settings and saved.get("cell") == cell:
            return saved
    claim_run(seed_dir, fairseq_run_identity(cell, seed, opts))  # a folder trained with other arguments is refused
    if not (seed_dir / "trained.json").exists():
        _fairseq_train(cell, seed, opts, seed_dir, log, distributed)
    trained = json.loads((seed_dir / "trained.json").read_text(encoding="utf-8"))
    train_log = seed_dir / "train.log"
    epochs = read_train_log(train_log.read_text(encoding="utf-8"))
    stopped = trained.get("diverged")
    if not epochs["valid_loss"] and stopped is None:
        raise RuntimeError(f"no validation result in {train_log}")
    facts = train_facts(epochs, opts.train_args, divergence_bound(opts.data_bin, opts.target_lang), stopped)
    valid = test = None
    if stopped is None:  # a run that diverged has no translations to score: its record says why
        checkpoint = seed_dir / "checkpoints" / "checkpoint_best.pt"
        valid = translate_and_score(opts, checkpoint, "valid", seed_dir, opts.valid_ref)
        test = translate_and_score(opts, checkpoint, "test", seed_dir, opts.test_ref) if opts.test else None
    result = {
        "cell": cell,
        "seed": seed,
        "settings": settings,
        **facts,
        "valid_bleu": valid["bleu"] if valid else None,
        "valid": valid,
        "test_bleu": test["bleu"] if test else None,
        "test": test,
        "train_seconds": trained["train_seconds"],
        "attempts": trained.get("attempts", 1),
        **_resumes(seed_dir, opts),
    }
    write_json(result_path, result)
    return result


# -- the grid's cells -----------------------------------------------------------------------------
def run_cells(
    cells: List[dict], opts, settings: dict, log: Callable[[str], None], collect_only: bool = False
) -> List[dict]:
    """Every cell's record, this command's and earlier ones' in ``OUT/cells/``: a cell of this command
    is kept from ``OUT/cells/<cell>.json`` when that holds its seeds, else its missing seeds are run
    (``collect_only``: left out, the launcher ran them as jobs) and the record rewritten over every
    finished seed. Raises :class:`SweepError` when such a file holds another cell or settings."""
    for index, cell in enumerate(cells, 1):
        name = cell_name(cell)
        record_path = opts.out_dir / "cells" / f"{name}.json"
        prefix = f"[cell {index}/{len(cells)}] {name}"
        record = _kept_record(record_path, cell, settings, opts.seeds)
        if record is not None:
            log(f"{prefix}: kept from {record_path} ({_bleu_text(record['valid_bleu'])}, seeds {record['seeds']})")
        else:
            runs = _run_seeds(cell, prefix, opts, settings, log, collect_only)
            if runs:  # a cell none of whose jobs finished has no record yet
                write_json(record_path, summarize(cell, runs, settings))
    return all_records(opts.out_dir, settings)


def _read_record(record_path: Path, cell: Optional[dict], settings: dict) -> dict:
    record = json.loads(record_path.read_text(encoding="utf-8"))
    if (cell is not None and record["cell"] != cell) or record["settings"] != settings:
        raise SweepError(f"{record_path} holds another cell or settings; use another --out-dir")
    return record


def _kept_record(record_path: Path, cell: dict, settings: dict, seeds: List[int]) -> Optional[dict]:
    """The finished record at ``record_path`` if it covers ``seeds``; None when there is none or it
    lacks one of them (the cell's missing seeds then run, its finished ones kept)."""
    if not record_path.exists():
        return None
    record = _read_record(record_path, cell, settings)
    return record if set(seeds) <= set(record["seeds"]) else None


def all_records(out: Path, settings: dict) -> List[dict]:
    """Every cell record under ``out/cells``: plain first, then in grid order."""
    records = [_read_record(path, None, settings) for path in sorted((out / "cells").glob("*.json"))]

    def order(r: dict) -> tuple:
        c = r["cell"]
        if c["method"] == "plain":
            return (0,)
        if "p" not in c:  # a cell of attn-reg-mt-compare
            return (2, cell_name(c))
        return (1, c["schedule"], c["layers"], c["attribution"], c["p"], c["q"])

    return sorted(records, key=order)


def run_dir(out: Path, cell: dict, seed: int) -> Path:
    """The folder of one run: its checkpoints, logs and result.json."""
    return out / "runs" / cell_name(cell) / f"seed{seed}"


def finished_result(seed_dir: Path, cell: dict, settings: dict) -> Optional[dict]:
    """The run's ``result.json`` when it finished as a run of ``cell`` under these settings, else None."""
    path = seed_dir / "result.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text(encoding="utf-8"))
    from .launcher_options import with_world_size

    return saved if with_world_size(saved.get("settings") or {}) == settings and saved.get("cell") == cell else None


def _finished_seeds(cell: dict, settings: dict, cell_dir: Path) -> List[int]:
    """Seeds of ``cell`` finished by earlier commands (a ``result.json`` of the same cell and settings)."""
    finished = (finished_result(path.parent, cell, settings) for path in cell_dir.glob("seed*/result.json"))
    return [saved["seed"] for saved in finished if saved is not None]


def _bleu_text(bleu: Optional[float]) -> str:
    return "diverged, not translated" if bleu is None else f"valid BLEU {bleu:.2f}"


def _run_seeds(
    cell: dict, prefix: str, opts, settings: dict, log: Callable[[str], None], collect_only: bool
) -> List[dict]:
    """Each seed's result for ``cell``, this command's seeds and those finished earlier; a finished
    seed's is kept, an unfinished one run (``collect_only``: left out)."""
    runs = []
    cell_dir = run_dir(opts.out_dir, cell, 0).parent
    for seed in sorted(set(opts.seeds) | set(_finished_seeds(cell, settings, cell_dir))):
        seed_dir = run_dir(opts.out_dir, cell, seed)
        if (seed_dir / "result.json").exists():
            state = "kept"
        elif collect_only:
            continue
        elif (seed_dir / "trained.json").exists():
            state = "trained earlier, scoring"
        elif (seed_dir / "checkpoints" / "checkpoint_last.pt").exists():
            state = "resuming an earlier attempt"
        else:
            state = "training"
        log(f"{prefix} seed {seed}: {state}")
        run = run_seed(cell, seed, opts, settings, seed_dir, log)
        runs.append(run)
        if state != "kept" and run["valid"] is None:
            log(
                f"{prefix} seed {seed}: DIVERGED: {run['diverged']}; recorded as diverged, not translated "
                f"({run['train_seconds']:.0f} s training over {run['attempts']} attempt(s))"
            )
        elif state != "kept":
            log(
                f"{prefix} seed {seed}: valid BLEU {run['valid_bleu']:.2f}, valid loss "
                + ("-" if run["valid_loss"] is None else f"{run['valid_loss']:.3f}")
                + (f", AD-DROP rate {run['ad_drop_rate']:.4f}" if run["ad_drop_rate"] is not None else "")
                + (f", {run['ad_drop_skipped']} AD-DROP steps skipped" if run.get("ad_drop_skipped") else "")
                + (f", DIVERGED: {run['diverged']}" if run.get("diverged") else "")
                + f", {run['train_seconds']:.0f} s training over {run['attempts']} attempt(s)"
            )
    return runs
