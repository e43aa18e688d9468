"""The sweep's command line, the data-bin's language pair, and the grid of cells the options describe."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ..core.regularizers.ad_drop_config import SCHEDULES, first_ad_drop_epoch
from ..core.regularizers.attribution import ATTRIBUTIONS
from .launcher_options import add_launcher_options, check_launcher, check_ranks

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


class RefusingParser(argparse.ArgumentParser):
    """A parser whose errors raise :class:`SweepError` (a method's --method-args are not the command's)."""

    def error(self, message):
        raise SweepError(message)


def number_text(x: float) -> str:
    """``x`` as cell names, fairseq arguments and the report spell it: 0.5, not 0.50."""
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
def probabilities(ap, option: str, text: str) -> List[float]:
    """A comma list of distinct values in (0, 1) (``--p``, ``--q``); anything else is ``ap.error``."""
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


def option_name(arg: str) -> str:
    """The option of a command-line word: ``--lr`` of ``--lr=5e-4``."""
    return arg.split("=", 1)[0]


def command_parser(prog: str, doc: str, usage: str) -> argparse.ArgumentParser:
    """A command's parser: no abbreviations (a later option must not change what an old one meant), its
    module docstring as the description, laid out as written."""
    return argparse.ArgumentParser(
        allow_abbrev=False,
        prog=prog,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{prog} {usage}",
    )


def build_sweep_parser() -> argparse.ArgumentParser:
    from . import __doc__ as description  # the package's docstring is the command's --help

    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="attn-reg-mt-sweep",
        description=description,
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
    ap.add_argument("--plain", action="store_true", help="also run plain training, for reference")
    add_run_options(ap, test_is_optional=True)
    ap.add_argument(
        "--test", action="store_true", help="also translate the test split (reported, never used to choose)"
    )
    add_launcher_options(ap)
    return ap


def add_run_options(ap: argparse.ArgumentParser, test_is_optional: bool) -> None:
    """The options of every run, shared by attn-reg-mt-sweep and attn-reg-mt-compare: epochs, seeds,
    the pair, and how translations are generated and scored. ``test_is_optional``: the command has
    ``--test`` (the sweep); the comparison always translates the test split."""
    ap.add_argument("--epochs", type=int, required=True, help="fairseq-train --max-epoch of every run (>= 1)")
    ap.add_argument("--seeds", default="1", help="comma list of seeds; a cell's score is the mean over them")
    ap.add_argument("--source-lang", help="source language (default: the data-bin's only pair)")
    ap.add_argument("--target-lang", help="target language")
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
        "--test-ref",
        type=Path,
        help="prefix of the raw test text (PREFIX.TARGET-LANG is the reference)"
        + (", with --test" if test_is_optional else "")
        + "; default: fairseq's references",
    )
    ap.add_argument(
        "--max-len-a",
        type=float,
        default=1.2,
        help="fairseq-generate --max-len-a: hypotheses end by A x source length + B tokens (default 1.2), so a "
        "degenerate model's looping output cannot run to fairseq's 200 tokens per sentence",
    )
    ap.add_argument("--max-len-b", type=int, default=10, help="fairseq-generate --max-len-b (default 10)")
    ap.add_argument("--tokenize", default="13a", help="sacrebleu tokenizer (default 13a; zh, ja-mecab, ... )")
    ap.add_argument(
        "--generate-args",
        default="",
        help="extra fairseq-generate arguments, one string (e.g. '--tokenizer moses'); --cpu is passed when training has it",
    )


def parse_sweep_args(argv: Optional[Sequence[str]] = None):
    """``(parser, options)``: the sweep's options checked and parsed into lists, ``options.train_args``
    the fairseq-train arguments after ``--``. A bad option exits through ``parser.error``."""
    own, train_args = split_train_args(sys.argv[1:] if argv is None else argv)
    ap = build_sweep_parser()
    opts = ap.parse_args(own)
    opts.train_args = train_args
    _parse_grid(ap, opts)
    parse_scoring(ap, opts)
    check_train_args(ap, train_args)
    check_launcher(ap, opts)
    check_ranks(ap, opts)
    return ap, opts


def split_train_args(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """``(the command's own arguments, the fairseq-train arguments after '--')``."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]


def _parse_grid(ap, opts) -> None:
    """The grid's axes, epochs and seeds, as lists."""
    opts.p = probabilities(ap, "--p", opts.p)
    opts.q = probabilities(ap, "--q", opts.q)
    opts.attribution = _choices(ap, "--attribution", opts.attribution, ATTRIBUTIONS)
    opts.schedule = _choices(ap, "--schedule", opts.schedule, SCHEDULES)
    opts.layers = [x.strip().replace(" ", "") for x in opts.layers.split(";") if x.strip()]
    bad_layers = [x for x in opts.layers if x != "all" and not re.fullmatch(r"\d+(,\d+)*", x)]
    if not opts.layers or bad_layers or len(set(opts.layers)) != len(opts.layers):
        ap.error(
            "--layers must be a ';'-separated list of distinct --ad-drop-layers values (all, or comma lists of "
            f"0-based layer indices), got {';'.join(opts.layers)!r}"
        )
    parse_epochs_seeds(ap, opts)
    if any(first_ad_drop_epoch(schedule, opts.epochs) is None for schedule in opts.schedule):
        ap.error(
            f"--epochs {opts.epochs} with --schedule cross-tuning never runs AD-DROP (its first AD-DROP epoch is "
            "epoch 2): give --epochs >= 2, or --schedule always"
        )


def parse_epochs_seeds(ap, opts) -> None:
    """``--epochs`` checked, ``--seeds`` as a list of ints."""
    if opts.epochs < 1:
        ap.error(f"--epochs must be an integer >= 1, got {opts.epochs}")
    try:
        opts.seeds = [int(x) for x in opts.seeds.split(",") if x.strip()]
    except ValueError:
        opts.seeds = []
    # fairseq-train seeds numpy with it, whose seeds end at 2**32 - 1: a larger one failed in the run.
    if not opts.seeds or len(set(opts.seeds)) != len(opts.seeds) or not 0 <= min(opts.seeds) <= max(opts.seeds) < 2**32:
        ap.error(f"--seeds must be a comma list of distinct integers from 0 to {2**32 - 1}, got {opts.seeds!r}")


def parse_scoring(ap, opts) -> None:
    """The fairseq-generate and sacrebleu options."""
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
    if not 0 <= opts.max_len_a < float("inf"):
        ap.error(f"--max-len-a must be a finite number >= 0, got {opts.max_len_a:g}")
    if opts.max_len_b < 1:
        ap.error(f"--max-len-b must be an integer >= 1, got {opts.max_len_b}")
    opts.generate_args = shlex.split(opts.generate_args)
    own = [a for a in map(option_name, opts.generate_args) if a in ("--max-len-a", "--max-len-b")]
    if own:
        ap.error(f"{own[0]} in --generate-args: give it as the sweep's own {own[0]} (it bounds every translation)")


def check_train_args(ap, train_args: List[str]) -> None:
    """The fairseq-train arguments after ``--``: none the sweep sets itself, no other task, an --arch."""
    clash = [a for a in train_args if option_name(a) in OWNED]
    if clash:
        why = "; ".join(f"{option_name(a)}: {OWNED[option_name(a)]}" for a in dict.fromkeys(clash))
        ap.error(
            f"{', '.join(dict.fromkeys(map(option_name, clash)))} after '--' are set by the sweep for each run ({why})"
        )
    tasks = [train_args[i + 1] for i, a in enumerate(train_args[:-1]) if a == "--task"]
    tasks += [a.split("=", 1)[1] for a in train_args if a.startswith("--task=")]
    other = [t for t in tasks if t != TASK]
    if other:
        ap.error(
            f"--task after '--': the sweep trains with --task {TASK} (fairseq's translation, routed); got {other[0]}"
        )
    if not train_args or ("--arch" not in map(option_name, train_args) and "-a" not in train_args):
        ap.error("give your fairseq-train arguments after '--', at least --arch (and your optimizer, lr, batch size)")


# -- the grid -------------------------------------------------------------------------------------
def grid(opts) -> List[dict]:
    """The cells to run, in order: plain first (with ``--plain``), then every AD-DROP combination."""
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
    """The cell's folder and file name under ``--out-dir``, and its row in the table."""
    if "name" in cell:  # a cell of attn-reg-mt-compare names itself (sweep.methods.method_cell)
        return cell["name"]
    if cell["method"] == "plain":
        return "plain"
    p, q, layers = number_text(cell["p"]), number_text(cell["q"]), cell["layers"].replace(",", "-")
    return f"p{p}_q{q}_{cell['attribution']}_layers-{layers}_{cell['schedule']}"


def panel_name(cell: dict) -> str:
    """The heatmap panel an AD-DROP cell is drawn in: all but its p and q."""
    return f"{cell['attribution']}, layers {cell['layers']}, {cell['schedule']}"
