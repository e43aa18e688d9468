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
``--post-process sentencepiece``: what ``attn-reg-prepare`` data needs), and scores the
detokenized hypotheses with sacrebleu's Python API, against ``--valid-ref PREFIX.T`` (your raw
references) when given, else against fairseq's own references (the binarized valid target, post-
processed the same way: an out-of-vocabulary piece reads ``<unk>`` there). The test split is
never used to choose; ``--test`` translates it with each run's best checkpoint and reports it
beside. A cell's score is the mean valid BLEU over its seeds (the best valid loss, mean over
seeds, breaks ties); the best AD-DROP cell is named at the end. ``--plain`` adds one cell of
plain training (``label_smoothed_cross_entropy``, same task and arguments) for reference.

Resumable: a seed's finished run writes ``runs/<cell>/seed<S>/result.json``, a finished cell
``cells/<cell>.json``; a rerun of the same command keeps them (and fairseq-train itself resumes an
interrupted run from its ``checkpoint_last.pt``), so a killed sweep continues where it stopped, and
more p, q or seeds can be added later. A rerun with another data-bin, language pair, epochs or
fairseq arguments is refused, naming what differs. Written under ``--out-dir``: ``sweep.json``
(the settings), ``cells/``, ``runs/``, ``results.json``, ``results.md`` (the table) and
``heatmap.png`` (valid BLEU over p x q, one panel per attribution, layers and schedule; needs
matplotlib). Bad options are refused before anything runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .paths import OutputOverwritesInputError, check_outputs_spare_inputs
from .prepare import fairseq_command, run_logged
from .user_dir import FAIRSEQ_USER_DIR

SCHEDULES = ("cross-tuning", "always")
ATTRIBUTIONS = ("ga", "iga", "aa", "rd")
# fairseq's --post-process values (fairseq.data.data_utils.post_process); "none" passes nothing.
POST_PROCESS = ("sentencepiece", "subword_nmt", "@@ ", "@@", "wordpiece", "letter", "_EOW", "silence", "none")
TASK = "attn_reg_translation"
AD_DROP_CRITERION = "ad_drop_label_smoothed_cross_entropy"
PLAIN_CRITERION = "label_smoothed_cross_entropy"
# Set by the sweep for every run: refused after '--'.
OWNED = {
    "--save-dir": "the sweep gives each run its own (OUT/runs/<cell>/seed<S>/checkpoints)",
    "--max-epoch": "use --epochs",
    "--seed": "use --seeds",
    "--criterion": f"AD-DROP cells run {AD_DROP_CRITERION}, the --plain cell {PLAIN_CRITERION}",
    "--ad-drop-p": "use --p",
    "--ad-drop-q": "use --q",
    "--ad-drop-attribution": "use --attribution",
    "--ad-drop-layers": "use --layers",
    "--ad-drop-schedule": "use --schedule",
    "--source-lang": "use the sweep's --source-lang",
    "-s": "use the sweep's --source-lang",
    "--target-lang": "use the sweep's --target-lang",
    "-t": "use the sweep's --target-lang",
    "--user-dir": "the sweep passes the plugin's",
    "--restore-file": "each run starts from scratch or from its own checkpoint_last.pt",
    "--no-save": "each run's checkpoint_best.pt is what the sweep translates",
    "--disable-validation": "the valid loss is part of each run's score",
}


class SweepError(ValueError):
    """A sweep that cannot run as asked; the message names the option."""


def _fmt(x: float) -> str:
    return f"{x:g}"


# -- the data-bin ---------------------------------------------------------------------------------
_BINARY = re.compile(r"^(train|valid|test)\.([^.]+)-([^.]+)\.([^.]+)\.(bin|idx)$")


def language_pairs(data_bin: Path) -> List[Tuple[str, str]]:
    """The ``(a, b)`` of every ``{split}.{a}-{b}.{lang}.bin`` in ``data_bin``, as fairseq names them."""
    pairs = []
    for name in sorted(os.listdir(data_bin)):
        m = _BINARY.match(name)
        if m and (m.group(2), m.group(3)) not in pairs:
            pairs.append((m.group(2), m.group(3)))
    return pairs


def _split_files(data_bin: Path, split: str, src: str, tgt: str) -> List[Path]:
    """The binaries fairseq reads for ``split`` of ``src -> tgt`` (either file-name order), or []."""
    for a, b in ((src, tgt), (tgt, src)):
        files = [data_bin / f"{split}.{a}-{b}.{lang}.{ext}" for lang in (src, tgt) for ext in ("bin", "idx")]
        if all(f.is_file() for f in files):
            return files
    return []


def resolve_pair(data_bin: Path, src: Optional[str], tgt: Optional[str], splits: Sequence[str]) -> Tuple[str, str]:
    """The direction to train: the one given, else the data-bin's only pair in its file-name order
    (fairseq's own inference). Checks the dictionaries and every split's binaries; raises :class:`SweepError`."""
    if not data_bin.is_dir():
        raise SweepError(f"DATA_BIN {data_bin}: no such folder (give the data-bin fairseq-preprocess wrote)")
    pairs = language_pairs(data_bin)
    dicts = sorted(p.name[5:-4] for p in data_bin.glob("dict.*.txt"))
    if (src is None) != (tgt is None):
        raise SweepError("--source-lang and --target-lang go together: give both or neither")
    if src is None:
        if len(pairs) != 1:
            found = ", ".join(f"{a}-{b}" for a, b in pairs) or "none"
            raise SweepError(
                f"DATA_BIN {data_bin}: cannot tell the language pair (binarized pairs found: {found}); "
                "give --source-lang and --target-lang"
            )
        src, tgt = pairs[0]
    if src == tgt:
        raise SweepError(f"--source-lang and --target-lang are both {src!r}")
    for lang, option in ((src, "--source-lang"), (tgt, "--target-lang")):
        if not (data_bin / f"dict.{lang}.txt").is_file():
            raise SweepError(
                f"{option} {lang}: DATA_BIN {data_bin} has no dict.{lang}.txt (dictionaries found: "
                f"{', '.join(dicts) or 'none'})"
            )
    for split in splits:
        if not _split_files(data_bin, split, src, tgt):
            raise SweepError(
                f"DATA_BIN {data_bin}: no {split} split for {src}-{tgt} ({split}.{src}-{tgt}.{{{src},{tgt}}}.{{bin,idx}} "
                f"or {split}.{tgt}-{src}.*); fairseq-preprocess --{split}pref writes it"
            )
    return src, tgt


# -- the options ----------------------------------------------------------------------------------
def _floats(ap, option: str, text: str) -> List[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0.0 < v < 1.0 for v in values) or len(set(values)) != len(values):
        ap.error(f"{option} must be a comma list of distinct numbers in the open interval (0, 1), got {text!r}")
    return values


def _choices(ap, option: str, text: str, accepted: Sequence[str], sep: str = ",") -> List[str]:
    values = [x.strip() for x in text.split(sep) if x.strip()]
    if not values or not set(values) <= set(accepted) or len(set(values)) != len(values):
        ap.error(
            f"{option} must be a {'comma' if sep == ',' else repr(sep)} list of {', '.join(accepted)}, got {text!r}"
        )
    return values


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0]


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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="attn-reg-mt-sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="attn-reg-mt-sweep DATA_BIN --out-dir DIR [options] -- FAIRSEQ-TRAIN-ARGS...",
    )
    ap.add_argument("data_bin", metavar="DATA_BIN", type=Path, help="the fairseq-preprocess output to train on")
    ap.add_argument("--out-dir", type=Path, required=True, help="where cells/, runs/, results.* and heatmap.png go")
    ap.add_argument("--p", default="0.1,0.3,0.5", help="comma list of p in (0, 1) (default 0.1,0.3,0.5)")
    ap.add_argument("--q", default="0.1,0.3,0.5", help="comma list of q in (0, 1) (default 0.1,0.3,0.5)")
    ap.add_argument("--attribution", default="ga", help=f"comma list of {', '.join(ATTRIBUTIONS)} (default ga)")
    ap.add_argument(
        "--layers", default="all", help="';'-separated list of --ad-drop-layers values, e.g. 'all;0' (default all)"
    )
    ap.add_argument("--schedule", default="cross-tuning", help=f"comma list of {', '.join(SCHEDULES)}")
    ap.add_argument("--epochs", type=int, required=True, help="fairseq-train --max-epoch of every run (>= 1)")
    ap.add_argument("--seeds", default="1", help="comma list of seeds; a cell's score is the mean over them")
    ap.add_argument("--source-lang", help="source language (default: the data-bin's only pair)")
    ap.add_argument("--target-lang", help="target language")
    ap.add_argument("--plain", action="store_true", help="also run plain training, for reference")
    ap.add_argument(
        "--post-process",
        default="sentencepiece",
        help="fairseq-generate --post-process: how hypotheses are detokenized (default sentencepiece, what "
        "attn-reg-prepare writes; subword_nmt for '@@ ' BPE; none)",
    )
    ap.add_argument("--beam", type=int, default=5, help="beam size of fairseq-generate (default 5)")
    ap.add_argument(
        "--valid-ref",
        type=Path,
        help="prefix of the raw valid text (PREFIX.TARGET-LANG is the reference); default: fairseq's references",
    )
    ap.add_argument(
        "--test", action="store_true", help="also translate the test split (reported, never used to choose)"
    )
    ap.add_argument("--test-ref", type=Path, help="prefix of the raw test text, with --test")
    ap.add_argument("--tokenize", default="13a", help="sacrebleu tokenizer (default 13a; zh, ja-mecab, ... )")
    ap.add_argument(
        "--generate-args",
        default="",
        help="extra fairseq-generate arguments, one string (e.g. '--tokenizer moses'); --cpu is passed when training has it",
    )
    return ap


def parse_args(argv: Optional[Sequence[str]] = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args: List[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, train_args = argv[:split], argv[split + 1 :]
    ap = build_parser()
    opts = ap.parse_args(argv)
    opts.train_args = train_args
    opts.p = _floats(ap, "--p", opts.p)
    opts.q = _floats(ap, "--q", opts.q)
    opts.attribution = _choices(ap, "--attribution", opts.attribution, ATTRIBUTIONS)
    opts.schedule = _choices(ap, "--schedule", opts.schedule, SCHEDULES)
    opts.layers = [x.strip().replace(" ", "") for x in opts.layers.split(";") if x.strip()]
    bad_layers = [x for x in opts.layers if x != "all" and not re.fullmatch(r"\d+(,\d+)*", x)]
    if not opts.layers or bad_layers or len(set(opts.layers)) != len(opts.layers):
        ap.error(
            "--layers must be a ';'-separated list of distinct --ad-drop-layers values (all, or comma lists of "
            f"0-based layer indices), got {';'.join(opts.layers)!r}"
        )
    if opts.epochs < 1:
        ap.error(f"--epochs must be an integer >= 1, got {opts.epochs}")
    if opts.epochs < 2 and "cross-tuning" in opts.schedule:
        ap.error(
            f"--epochs {opts.epochs} with --schedule cross-tuning never runs AD-DROP (its first AD-DROP epoch is "
            "epoch 2): give --epochs >= 2, or --schedule always"
        )
    try:
        opts.seeds = [int(x) for x in opts.seeds.split(",") if x.strip()]
    except ValueError:
        opts.seeds = []
    if not opts.seeds or len(set(opts.seeds)) != len(opts.seeds) or min(opts.seeds) < 0:
        ap.error(f"--seeds must be a comma list of distinct integers >= 0, got {opts.seeds!r}")
    if opts.post_process not in POST_PROCESS:
        ap.error(f"--post-process must be one of {', '.join(map(repr, POST_PROCESS))}, got {opts.post_process!r}")
    if opts.beam < 1:
        ap.error(f"--beam must be an integer >= 1, got {opts.beam}")
    if opts.test_ref is not None and not opts.test:
        ap.error("--test-ref is the reference of --test: give --test too")
    try:
        import sacrebleu

        sacrebleu.BLEU(tokenize=opts.tokenize)
    except ImportError:
        ap.error("sacrebleu is not installed: pip install 'attn_reg_plugin[fairseq]'")
    except Exception as e:  # sacrebleu raises a bare RuntimeError / KeyError naming the tokenizer
        ap.error(f"--tokenize {opts.tokenize!r}: sacrebleu refuses it ({e})")
    opts.generate_args = shlex.split(opts.generate_args)
    clash = [a for a in train_args if _flag(a) in OWNED]
    if clash:
        why = "; ".join(f"{_flag(a)}: {OWNED[_flag(a)]}" for a in dict.fromkeys(clash))
        ap.error(f"{', '.join(dict.fromkeys(map(_flag, clash)))} after '--' are set by the sweep for each run ({why})")
    tasks = [train_args[i + 1] for i, a in enumerate(train_args[:-1]) if a == "--task"]
    tasks += [a.split("=", 1)[1] for a in train_args if a.startswith("--task=")]
    other = [t for t in tasks if t != TASK]
    if other:
        ap.error(
            f"--task after '--': the sweep trains with --task {TASK} (fairseq's translation, routed); got {other[0]}"
        )
    if not train_args or ("--arch" not in map(_flag, train_args) and "-a" not in train_args):
        ap.error("give your fairseq-train arguments after '--', at least --arch (and your optimizer, lr, batch size)")
    return ap, opts


# -- the grid -------------------------------------------------------------------------------------
def grid(opts) -> List[dict]:
    cells = [{"method": "plain"}] if opts.plain else []
    cells += [
        {"method": "ad-drop", "p": p, "q": q, "attribution": a, "layers": lay, "schedule": s}
        for s in opts.schedule
        for lay in opts.layers
        for a in opts.attribution
        for p in opts.p
        for q in opts.q
    ]
    return cells


def cell_name(cell: dict) -> str:
    if cell["method"] == "plain":
        return "plain"
    layers = cell["layers"].replace(",", "-")
    return f"p{_fmt(cell['p'])}_q{_fmt(cell['q'])}_{cell['attribution']}_layers-{layers}_{cell['schedule']}"


def panel_name(cell: dict) -> str:
    return f"{cell['attribution']}, layers {cell['layers']}, {cell['schedule']}"


def train_command(cell: dict, seed: int, opts, save_dir: Path) -> List[str]:
    """The fairseq-train argument list (without the command) of one run."""
    user = list(opts.train_args)
    if cell["method"] == "plain":
        user = _drop_ad_drop_args(user)
        method = ["--criterion", PLAIN_CRITERION]
    else:
        method = [
            "--criterion", AD_DROP_CRITERION, "--ad-drop-p", _fmt(cell["p"]), "--ad-drop-q", _fmt(cell["q"]),
            "--ad-drop-attribution", cell["attribution"], "--ad-drop-layers", cell["layers"],
            "--ad-drop-schedule", cell["schedule"],
        ]  # fmt: skip
    flags = set(map(_flag, user))
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
        _write_json(trained_path, trained)
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
    _write_json(result_path, result)
    return result


def _write_json(path: Path, data) -> None:
    """Written whole or not at all: a kill mid-write must not leave a record that looks finished."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(partial, path)


def _mean(values: List[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None


def summarize(cell: dict, runs: List[dict], settings: dict) -> dict:
    bleus = [r["valid_bleu"] for r in runs]
    return {
        "cell": cell,
        "name": cell_name(cell),
        "settings": settings,
        "seeds": [r["seed"] for r in runs],
        "valid_bleu": round(statistics.fmean(bleus), 2),
        "valid_bleu_sd": round(statistics.stdev(bleus), 2) if len(bleus) > 1 else 0.0,
        "valid_loss": _mean([r["valid_loss"] for r in runs]),
        "test_bleu": _mean([r["test_bleu"] for r in runs]),
        "ad_drop_rate": _mean([r["ad_drop_rate"] for r in runs]),
        "empty_hypotheses": sum(r["valid"]["empty_hypotheses"] for r in runs),
        "runs": runs,
    }


def best_cell(records: List[dict]) -> dict:
    """The AD-DROP cell with the highest mean valid BLEU; the lower mean valid loss breaks ties, then
    grid order. Test is not looked at."""
    candidates = [r for r in records if r["cell"]["method"] == "ad-drop"]
    return max(candidates, key=lambda r: (r["valid_bleu"], -r["valid_loss"]))  # max keeps the first of equal keys


# -- the heatmap ----------------------------------------------------------------------------------
def heatmap(
    points: List[dict], path: Path, title: str, subtitle: str, higher_is_better: bool, fmt: str = "{:.2f}"
) -> Path:
    """p down, q across, one panel per distinct ``point["panel"]``; each point is
    ``{"panel", "p", "q", "value", "best": bool, "note": optional second line}``. Brighter is better."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(pt["panel"] for pt in points))
    ps = sorted({pt["p"] for pt in points})
    qs = sorted({pt["q"] for pt in points})
    values = [pt["value"] for pt in points]
    low, high = min(values), max(values)
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(max(5.0, 1.4 + 1.3 * len(qs) * len(panels) + 1.0 * len(panels)), max(3.8, 2.2 + 0.9 * len(ps))),
        squeeze=False,
    )
    for ax, panel in zip(axes[0], panels):
        shown = [[float("nan")] * len(qs) for _ in ps]
        for pt in points:
            if pt["panel"] == panel:
                shown[ps.index(pt["p"])][qs.index(pt["q"])] = pt["value"]
        image = ax.imshow(
            shown, cmap="viridis" if higher_is_better else "viridis_r", vmin=low, vmax=high if high > low else low + 1
        )
        for pt in points:
            if pt["panel"] != panel:
                continue
            goodness = (pt["value"] - low) / ((high - low) or 1.0)
            goodness = goodness if higher_is_better else 1.0 - goodness
            text = fmt.format(pt["value"]) + (f"\n{pt['note']}" if pt.get("note") else "")
            ax.text(
                qs.index(pt["q"]),
                ps.index(pt["p"]),
                text + ("\nbest" if pt.get("best") else ""),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if goodness < 0.5 else "black",
            )
        ax.set_xticks(range(len(qs)), [_fmt(q) for q in qs])
        ax.set_yticks(range(len(ps)), [_fmt(p) for p in ps])
        ax.set_xlabel("q (drop probability)")
        ax.set_ylabel("p (candidate share)")
        ax.set_title(panel, fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
    width = int(fig.get_size_inches()[0] * 13)  # characters that fit at fontsize 9
    fig.suptitle(
        textwrap.fill(title, width, break_on_hyphens=False) + "\n" + textwrap.fill(subtitle, width), fontsize=9
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- the command ----------------------------------------------------------------------------------
def _table(records: List[dict], with_test: bool) -> List[str]:
    head = "| cell | valid BLEU (mean ± sd over seeds) | valid loss | AD-DROP rate | empty hypotheses |"
    head += " test BLEU (not used to choose) |" if with_test else ""
    lines = [head, "|" + "---|" * (6 if with_test else 5)]
    for r in records:
        rate = "-" if r["ad_drop_rate"] is None else f"{r['ad_drop_rate']:.4f}"
        row = (
            f"| {r['name']} | {r['valid_bleu']:.2f} ± {r['valid_bleu_sd']:.2f} | {r['valid_loss']:.3f} | "
            f"{rate} | {r['empty_hypotheses']} |"
        )
        if with_test:
            row += f" {r['test_bleu']:.2f} |"
        lines.append(row)
    return lines


def _versions() -> Dict[str, Optional[str]]:
    from importlib import metadata

    out: Dict[str, Optional[str]] = {"python": sys.version.split()[0]}
    for name in ("attn_reg_plugin", "torch", "fairseq-fixed", "fairseq", "sacrebleu"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _differences(saved: dict, settings: dict) -> str:
    keys = [k for k in dict.fromkeys([*saved, *settings]) if saved.get(k) != settings.get(k)]
    return "; ".join(f"{k}: {saved.get(k)!r} then, {settings.get(k)!r} now" for k in keys)


def main(argv: Optional[Sequence[str]] = None, log: Callable[[str], None] = print) -> int:
    ap, opts = parse_args(argv)
    out: Path = opts.out_dir
    splits = ["train", "valid"] + (["test"] if opts.test else [])
    try:
        opts.source_lang, opts.target_lang = resolve_pair(opts.data_bin, opts.source_lang, opts.target_lang, splits)
        refs = [("--valid-ref", opts.valid_ref), ("--test-ref", opts.test_ref)]
        for option, prefix in refs:
            if prefix is not None and not Path(f"{prefix}.{opts.target_lang}").is_file():
                raise SweepError(f"{option} {prefix}: no such file {prefix}.{opts.target_lang}")
        # What the sweep writes (not the whole --out-dir: the data-bin may sit beside them).
        written = ["sweep.json", "cells", "runs", "results.json", "results.md", "heatmap.png"]
        check_outputs_spare_inputs(
            [("--out-dir", out / name) for name in written],
            [("DATA_BIN", opts.data_bin)]
            + [(option, Path(f"{prefix}.{opts.target_lang}")) for option, prefix in refs if prefix is not None],
        )
    except (SweepError, OutputOverwritesInputError) as e:
        ap.error(str(e))
    opts.data_bin = opts.data_bin.resolve()
    pair = f"{opts.source_lang}→{opts.target_lang}"
    settings = {
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
    }
    settings_path = out / "sweep.json"
    if settings_path.exists():
        saved = json.loads(settings_path.read_text(encoding="utf-8"))
        if saved != settings:
            ap.error(
                f"--out-dir {out} holds a sweep with other settings ({_differences(saved, settings)}): rerun with "
                "the same ones to resume it, or use another --out-dir"
            )
    cells = grid(opts)
    try:
        check_fairseq_args(opts, cells)
    except SweepError as e:
        ap.error(str(e))
    (out / "cells").mkdir(parents=True, exist_ok=True)
    _write_json(settings_path, settings)

    log(
        f"== AD-DROP sweep {pair} on {opts.data_bin}: {len(cells)} cell(s) x {len(opts.seeds)} seed(s), "
        f"{opts.epochs} epoch(s) each; outputs in {out}"
    )
    records: List[dict] = []
    started = time.time()
    for index, cell in enumerate(cells, 1):
        name = cell_name(cell)
        record_path = out / "cells" / f"{name}.json"
        prefix = f"[cell {index}/{len(cells)}] {name}"
        if record_path.exists():
            record = json.loads(record_path.read_text(encoding="utf-8"))
            if record["cell"] != cell or record["settings"] != settings:
                ap.error(f"{record_path} holds another cell or settings; use another --out-dir")
            if record["seeds"] == opts.seeds:
                records.append(record)
                log(f"{prefix}: kept from {record_path} (valid BLEU {record['valid_bleu']:.2f})")
                continue
        runs = []
        for seed in opts.seeds:
            seed_dir = out / "runs" / name / f"seed{seed}"
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
        record = summarize(cell, runs, settings)
        _write_json(record_path, record)
        records.append(record)

    ad_drop = [r for r in records if r["cell"]["method"] == "ad-drop"]
    best = best_cell(records)
    plain = next((r for r in records if r["cell"]["method"] == "plain"), None)
    seeds = ",".join(map(str, opts.seeds))
    title = f"AD-DROP p x q sweep, {pair}, {opts.epochs} epoch{'s' * (opts.epochs != 1)}, seeds {seeds}"
    png: Optional[Path] = out / "heatmap.png"
    try:
        points = [
            {
                "panel": panel_name(r["cell"]),
                "p": r["cell"]["p"],
                "q": r["cell"]["q"],
                "value": r["valid_bleu"],
                "note": f"loss {r['valid_loss']:.3f}",
                "best": r is best,
            }
            for r in ad_drop
        ]
        subtitle = "valid BLEU (sacrebleu, mean over seeds), valid loss below" + (
            f"; plain {plain['valid_bleu']:.2f} / {plain['valid_loss']:.3f}" if plain else ""
        )
        heatmap(points, png, f"{title} ({'/'.join(opts.data_bin.parts[-2:])})", subtitle, higher_is_better=True)
    except ImportError:
        png = None
        log("heatmap.png skipped: matplotlib is not installed (pip install 'attn_reg_plugin[plots]')")
    lines = [f"{title}, on {opts.data_bin}", "", *_table(records, opts.test)]
    best_line = (
        f"best on valid: {best['name']} (p {_fmt(best['cell']['p'])}, q {_fmt(best['cell']['q'])}): valid BLEU "
        f"{best['valid_bleu']:.2f}, valid loss {best['valid_loss']:.3f}"
        + (f"; plain: valid BLEU {plain['valid_bleu']:.2f}, valid loss {plain['valid_loss']:.3f}" if plain else "")
    )
    lines += ["", best_line, "", f"BLEU: sacrebleu on detokenized fairseq-generate output (beam {opts.beam}) "
              f"vs {best['runs'][0]['valid']['reference']}"]  # fmt: skip
    summary = {
        "pair": f"{opts.source_lang}-{opts.target_lang}",
        "direction": pair,
        "settings": settings,
        "grid": {
            "p": opts.p,
            "q": opts.q,
            "attribution": opts.attribution,
            "layers": opts.layers,
            "schedule": opts.schedule,
            "seeds": opts.seeds,
            "plain": opts.plain,
        },
        "best": {k: v for k, v in best.items() if k not in ("runs", "settings")},
        "plain": None if plain is None else {k: v for k, v in plain.items() if k not in ("runs", "settings")},
        "cells": [{k: v for k, v in r.items() if k != "settings"} for r in records],
        "heatmap": None if png is None else str(png),
        "versions": _versions(),
        "seconds": round(time.time() - started, 1),
    }
    _write_json(out / "results.json", summary)
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    log("\n".join(lines))
    log(f"results: {out / 'results.md'}, {out / 'results.json'}" + (f", {png}" if png else ""))
    if all(r["valid_bleu"] == 0.0 for r in records):
        log(
            "every cell's valid BLEU is 0: the runs are too short to translate (empty or repeated-token "
            "hypotheses); raise --epochs, the cells were ranked by valid loss"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
