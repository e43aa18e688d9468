"""``attn-reg-prepare``: raw parallel text for any language pair -> joint sentencepiece -> fairseq-preprocess.

    attn-reg-prepare --src en --tgt tr --train raw/train --valid raw/valid --test raw/test --out work/en-tr
    fairseq-train work/en-tr/data-bin --user-dir "$(attn-reg-user-dir)" --task attn_reg_translation ...

Prefixes are as ``fairseq-preprocess`` takes them: ``--train raw/train`` means ``raw/train.en``
and ``raw/train.tr``. Every file is checked before anything is written (it exists, is non-empty,
is UTF-8, has no empty line or stray carriage return, and both sides have the same number of
lines); an error names the file and the line. A line is empty when sentencepiece's normalisation
(nmt_nfkc, what the model is trained with) leaves nothing of it: a line holding only U+200B, a
BOM or control characters would otherwise become an empty sentence. No output may be an input
(``--out W`` with ``--train W/spm/train``, through a symlink or a hard link too): that is
refused before anything is written. Then one sentencepiece model is trained on both
sides of the training text, every split is encoded with it, and ``fairseq-preprocess`` binarizes
them with one joined dictionary (what ``--share-all-embeddings`` needs). Written under ``--out``:
``spm/spm.model`` (what ``--remove-bpe sentencepiece`` undoes), ``spm/{split}.{lang}``,
``data-bin/`` and ``logs/preprocess.log``.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import unicodedata
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Sequence

from .paths import OutputOverwritesInputError, check_outputs_spare_inputs


class PrepareError(ValueError):
    """Input ``attn-reg-prepare`` cannot use; the message names the option or the file."""


class CorpusError(PrepareError):
    """Malformed parallel text; the message names the file and, where there is one, the line."""


# What sentencepiece's default nmt_nfkc rule removes after NFKC (U+2581 and U+FFFD included: they
# become spaces), for a sentencepiece without SentencePieceNormalizer (before 0.2.0); the tests
# check it against the real normaliser over every code point.
_NMT_NFKC_REMOVED = frozenset(
    [*range(0x01, 0x21), 0x7F, 0x8F, 0x9F, 0x061C, 0x1680, 0x200B, 0x200C, 0x200E, 0x200F]
    + [0x2028, 0x2029, 0x2581, 0xFEFF, 0xFFFD]
)


@functools.cache
def _normaliser():
    """sentencepiece's normaliser with the trainer's defaults (nmt_nfkc, extra whitespace removed),
    or None where sentencepiece is missing or too old to have one."""
    try:
        import sentencepiece
    except ImportError:
        return None
    normaliser = getattr(sentencepiece, "SentencePieceNormalizer", None)
    return None if normaliser is None else normaliser(rule_name="nmt_nfkc")


def _nmt_nfkc_leaves_text(text: str) -> bool:
    """The fallback of :func:`_has_pieces`: NFKC, then the characters nmt_nfkc removes."""
    return any(ord(c) not in _NMT_NFKC_REMOVED for c in unicodedata.normalize("NFKC", text))


def _has_pieces(text: str) -> bool:
    """Whether sentencepiece's normalisation (the model does not exist yet, but its rule does)
    leaves any text of the line, i.e. whether it becomes at least one piece."""
    normaliser = _normaliser()
    if normaliser is None:
        return _nmt_nfkc_leaves_text(text)
    return normaliser.normalize(text) != ""


def check_text_file(path: Path) -> int:
    """Number of lines of ``path`` after checking every one; raises :class:`CorpusError`.

    Read as bytes split at ``\\n`` only, so the count is the one every later tool sees:
    a line must be UTF-8, must keep some text after sentencepiece's normalisation (see
    :func:`_has_pieces`: not only whitespace, U+200B, a BOM or control characters), and must not contain a lone
    ``\\r``: Python's text mode (which encodes the corpus below) and fairseq-preprocess end a
    line there while ``wc -l`` does not, so one side would silently shift. CRLF endings are fine.
    """
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    count = 0
    with open(path, "rb") as f:
        for count, raw in enumerate(f, start=1):
            line = raw[:-1] if raw.endswith(b"\n") else raw
            if line.endswith(b"\r"):
                line = line[:-1]
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CorpusError(
                    f"{path}:{count}: not valid UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line)"
                ) from None
            if "\r" in text:
                raise CorpusError(
                    f"{path}:{count}: carriage return inside the line (tools disagree on where such a line ends)"
                )
            if not text.strip() or not _has_pieces(text):
                held = sorted({f"U+{ord(c):04X}" for c in text if not c.isspace()})
                what = f" (it holds only {', '.join(held[:8])}{', ...' if len(held) > 8 else ''})" if held else ""
                raise CorpusError(
                    f"{path}:{count}: empty line after normalisation{what}: sentencepiece's nmt_nfkc leaves nothing "
                    "of it (every line must be a sentence; remove the pair from both sides)"
                )
    if count == 0:
        raise CorpusError(f"{path}: the file is empty")
    return count


def check_parallel(prefixes: Mapping[str, Path], src: str, tgt: str) -> Dict[str, int]:
    """Pairs per split (``{"train": prefix, ...}``) after checking every line of both sides.

    Nothing is skipped or truncated: the first problem raises :class:`CorpusError` naming its
    file and line (invalid UTF-8, an empty line, a carriage return inside a line, or sides with
    different line counts).
    """
    counts = {}
    for split, prefix in prefixes.items():
        paths = {lang: Path(f"{prefix}.{lang}") for lang in (src, tgt)}
        n = {lang: check_text_file(path) for lang, path in paths.items()}
        if n[src] != n[tgt]:
            longer = src if n[src] > n[tgt] else tgt
            raise CorpusError(
                f"{paths[src]} has {n[src]} lines but {paths[tgt]} has {n[tgt]}: "
                f"{paths[longer]}:{min(n.values()) + 1} has no counterpart"
            )
        counts[split] = n[src]
    return counts


def run_logged(
    cmd: Sequence[str],
    log_path: Path,
    on_line: Optional[Callable[[str], None]] = None,
    env: Optional[Dict[str, str]] = None,
    append: bool = False,
) -> float:
    """Run ``cmd``, tee its output into ``log_path`` (``append``: after the lines already there, as a
    resumed run keeps its earlier attempts'), call ``on_line`` per line; return seconds; raise
    RuntimeError with the log's tail on failure."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log_path, "a" if append else "w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace",
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        for line in proc.stdout:
            log.write(line)
            if on_line is not None:
                on_line(line.rstrip("\n"))
        code = proc.wait()
    if code != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
        raise RuntimeError(f"{Path(cmd[0]).name} failed with exit code {code}; log {log_path}:\n" + "\n".join(tail))
    return time.time() - start


def fairseq_command(name: str) -> str:
    """The console script ``name`` (fairseq-preprocess, fairseq-train, ...): the one beside this
    interpreter (a venv), else the one on PATH (a system or --user install)."""
    exe = Path(sys.executable).parent / name
    if exe.exists():
        return str(exe)
    found = shutil.which(name)
    if found is None:
        raise PrepareError(f"{name} not found beside {sys.executable} nor on PATH: install fairseq for this Python")
    return found


def check_outputs_spare_prefixes(src: str, tgt: str, prefixes: Mapping[str, Path], out: Path) -> None:
    """:class:`PrepareError` if anything :func:`prepare` writes under ``out`` (``spm/spm.model``,
    ``spm/spm.vocab``, ``spm/{split}.{lang}``, ``data-bin/``, ``logs/preprocess.log``) is, holds or
    links to one of the ``{prefix}.{lang}`` files it reads (e.g. re-preparing ``W/spm/train`` into ``W``)."""
    spm_dir = out / "spm"
    outputs = [("--out", spm_dir / "spm.model"), ("--out", spm_dir / "spm.vocab")]
    outputs += [("--out", spm_dir / f"{split}.{lang}") for split in prefixes for lang in (src, tgt)]
    outputs += [("--out", out / "data-bin"), ("--out", out / "logs" / "preprocess.log")]
    inputs = [(f"--{split}", Path(f"{prefix}.{lang}")) for split, prefix in prefixes.items() for lang in (src, tgt)]
    try:
        check_outputs_spare_inputs(outputs, inputs)
    except OutputOverwritesInputError as e:
        raise PrepareError(str(e)) from None


def prepare(
    src: str,
    tgt: str,
    prefixes: Mapping[str, Path],
    out: Path,
    vocab_size: int,
    workers: int = 2,
    log: Callable[[str], None] = print,
    character_coverage: float = 1.0,
) -> Path:
    """Check the corpus, train a joint sentencepiece model on train, encode every split, binarize;
    return the data-bin folder. ``prefixes`` maps split names (train, valid, test) to prefixes.
    Nothing is written when an output would overwrite an input (:func:`check_outputs_spare_prefixes`)."""
    for name, path in [("--out", out), *((f"--{split}", prefix) for split, prefix in prefixes.items())]:
        if "," in str(path):
            # sentencepiece's input and fairseq-preprocess's prefixes are comma-separated lists
            raise PrepareError(
                f"{name} {path}: a path with a comma cannot be passed to sentencepiece / fairseq-preprocess"
            )
    check_outputs_spare_prefixes(src, tgt, prefixes, out)
    preprocess = fairseq_command("fairseq-preprocess")  # before any work: a missing fairseq fails now
    counts = check_parallel(prefixes, src, tgt)
    log(f"data: {', '.join(f'{split} {n} pairs ({prefixes[split]}.{{{src},{tgt}}})' for split, n in counts.items())}")
    spm_dir = out / "spm"
    train = prefixes["train"]
    train_sentencepiece(
        [Path(f"{train}.{src}"), Path(f"{train}.{tgt}")], spm_dir, vocab_size, character_coverage,
        f"--vocab-size {vocab_size} / --character-coverage {character_coverage}", f"{train}.{{{src},{tgt}}}",
    )  # fmt: skip
    encode_splits(spm_dir, prefixes, src, tgt)
    data_bin = out / "data-bin"
    split_flags = [flag for split in prefixes for flag in (f"--{split}pref", str(spm_dir / split))]
    run_logged(
        [
            preprocess, "--source-lang", src, "--target-lang", tgt, *split_flags, "--destdir", str(data_bin),
            "--joined-dictionary", "--workers", str(workers),
        ],
        out / "logs" / "preprocess.log",
    )  # fmt: skip
    log(f"sentencepiece ({vocab_size} pieces, {spm_dir / 'spm.model'}) + fairseq-preprocess -> {data_bin}")
    return data_bin


def train_sentencepiece(
    inputs: Sequence[Path], spm_dir: Path, vocab_size: int, character_coverage: float, options: str, source: str
) -> None:
    """One unigram model on the text files ``inputs``: ``spm_dir/spm.model``; a vocabulary sentencepiece
    cannot build is a :class:`PrepareError` naming the command's ``options`` and the ``source`` text (and
    leaves no new ``spm_dir``)."""
    import sentencepiece as spm

    created = not spm_dir.exists()
    spm_dir.mkdir(parents=True, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            input=",".join(map(str, inputs)),
            model_prefix=str(spm_dir / "spm"),
            vocab_size=vocab_size,
            character_coverage=character_coverage,
            model_type="unigram",
            num_threads=2,
            minloglevel=2,
            seed_sentencepiece_size=200000,
        )
    except RuntimeError as e:  # e.g. "Vocabulary size too high (8000). Please set it to a value <= 5263."
        if created:
            shutil.rmtree(spm_dir, ignore_errors=True)
        reason = str(e).strip().splitlines()[-1]
        raise PrepareError(f"{options}: sentencepiece cannot build this vocabulary from {source}: {reason}") from None


def encode_splits(spm_dir: Path, prefixes: Mapping[str, Path], src: str, tgt: str) -> None:
    """Every split's both sides as pieces: ``spm_dir/{split}.{lang}``."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "spm.model"))
    for split, prefix in prefixes.items():
        for lang in (src, tgt):
            with (
                open(f"{prefix}.{lang}", encoding="utf-8") as fin,
                open(spm_dir / f"{split}.{lang}", "w", encoding="utf-8") as fout,
            ):
                for line in fin:
                    fout.write(" ".join(sp.encode(line.rstrip("\n"), out_type=str)) + "\n")


# No '-': fairseq reads the pair back from file names like train.en-tr.en by splitting at '-'.
_LANG = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="attn-reg-prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--src", required=True, help="source language suffix (e.g. en: files PREFIX.en)")
    ap.add_argument("--tgt", required=True, help="target language suffix (e.g. tr)")
    ap.add_argument("--train", required=True, type=Path, help="training prefix (PREFIX.SRC, PREFIX.TGT)")
    ap.add_argument("--valid", required=True, type=Path, help="validation prefix")
    ap.add_argument("--test", type=Path, help="test prefix (optional)")
    ap.add_argument("--out", required=True, type=Path, help="output folder (spm/, data-bin/, logs/)")
    ap.add_argument(
        "--vocab-size", type=int, default=8000, help="joint sentencepiece vocabulary (>= 100; default 8000)"
    )
    ap.add_argument(
        "--character-coverage",
        type=float,
        default=1.0,
        help="characters sentencepiece must cover, in (0, 1] (default 1.0; 0.9995 for Chinese or Japanese)",
    )
    ap.add_argument("--workers", type=int, default=2, help="fairseq-preprocess workers (>= 1)")
    args = ap.parse_args(argv)
    for option, lang in (("--src", args.src), ("--tgt", args.tgt)):
        if not _LANG.match(lang):
            ap.error(
                f"{option} {lang!r}: a language suffix is letters, digits or '_', starting with a letter "
                "(fairseq splits file names at '-': write en_US, not en-US)"
            )
    if args.src == args.tgt:
        ap.error(f"--src and --tgt are both {args.src!r}: they must differ")
    if args.vocab_size < 100:
        ap.error(f"--vocab-size {args.vocab_size}: must be at least 100")
    if not 0 < args.character_coverage <= 1:
        ap.error(f"--character-coverage {args.character_coverage}: must be in (0, 1]")
    if args.workers < 1:
        ap.error(f"--workers {args.workers}: must be at least 1")
    if (args.out / "data-bin").exists():
        ap.error(f"--out {args.out}: {args.out / 'data-bin'} already exists (choose an empty folder or remove it)")
    prefixes = {"train": args.train, "valid": args.valid}
    if args.test is not None:
        prefixes["test"] = args.test
    try:
        prepare(
            args.src,
            args.tgt,
            prefixes,
            args.out,
            args.vocab_size,
            args.workers,
            character_coverage=args.character_coverage,
        )
    except PrepareError as e:
        print(f"attn-reg-prepare: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
