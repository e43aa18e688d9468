"""``attn-reg-prepare-cls``: labelled text (JSON lines, CSV or TSV) -> sentencepiece -> fairseq's classification data-bin.

    attn-reg-prepare-cls --train data/movie_reviews/train.jsonl --valid data/movie_reviews/dev.jsonl \\
        --test data/movie_reviews/test.jsonl --out work/reviews
    fairseq-train work/reviews/data-bin --user-dir "$(attn-reg-user-dir)" --task attn_reg_sentence_prediction ...

Each file holds one example per row: a text field (``--text-field``, default ``sentence``), an optional
second one for sentence pairs (``--pair-field``, e.g. ``sentence2``) and a label (``--label-field``,
default ``label``). A file ending ``.jsonl`` is JSON lines, ``.json`` JSON lines or one JSON array of
objects; ``.csv`` (quoted) and ``.tsv`` (GLUE's: tab-separated, no quoting) have a header row naming the
fields. Every row is checked before anything is written: each text is a non-empty
string and each label is present; valid and test labels must occur in train. An error names the file,
the row and the field. Then a sentencepiece model is trained on the training texts, every split is
encoded with it, and ``fairseq-preprocess --only-source`` binarizes the layout fairseq's
``sentence_prediction`` reads: ``data-bin/input0/`` (``input1/`` for pairs) and ``data-bin/label/``,
valid and test with train's dictionaries. Written under ``--out``: ``spm/spm.model`` (for predicting
new text), ``spm/{split}.input0``, ``spm/{split}.label``, ``data-bin/`` and ``logs/``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .prepare import PrepareError, fairseq_command, run_logged, train_sentencepiece


def read_examples(path: Path, fields: Sequence[str], label_field: str) -> List[Dict[str, str]]:
    """The rows of ``path`` as ``{field: text, label_field: label}``, by suffix: ``.jsonl`` JSON lines;
    ``.json`` a JSON array of objects or JSON lines; ``.csv`` quoted CSV; ``.tsv`` tab-separated with no
    quoting (GLUE's TSVs: a text that opens with ``"`` is text). A UTF-8 byte-order mark (Excel's
    "CSV UTF-8") is skipped. Row numbers are the file's line numbers (the first line holds a CSV's header)."""
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".csv", ".tsv"):
        raise PrepareError(f"{path}: a data file ends .jsonl, .json, .csv or .tsv, got {suffix or 'no suffix'!r}")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PrepareError(f"{path}: no such file") from None
    try:
        text = raw.decode("utf-8-sig")  # the whole file at once: an error's offset is the file's own
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise PrepareError(
            f"{path}:{line}: not UTF-8 ({e.reason} at byte {e.start} of the file, line {line})"
        ) from None
    if suffix == ".json" and text.lstrip().startswith("["):
        rows = _json_array_rows(path, text)
    elif suffix in (".jsonl", ".json"):
        rows = _json_lines_rows(path, text)
    else:
        rows = _table_rows(path, text, suffix)
    return checked_examples(rows, str(path), fields, label_field)


def _json_lines_rows(path: Path, text: str) -> List[Tuple[int, object]]:
    rows = []
    for number, line in enumerate(_lines(text), 1):
        if line.strip():
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                raise PrepareError(f"{path}:{number}: not a JSON object ({e.msg})") from None
    return rows


def _lines(text: str) -> List[str]:
    """The file's lines split at \\n only (``str.splitlines`` would also split inside a text at U+2028
    and other separators), each without its \\r."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def _json_array_rows(path: Path, text: str) -> List[Tuple[int, object]]:
    """A ``.json`` file holding one array of objects; a row is named by its 1-based place (``item 3``)."""
    try:
        array = json.loads(text)
    except json.JSONDecodeError as e:
        raise PrepareError(f"{path}:{e.lineno}: not a JSON array ({e.msg} at column {e.colno})") from None
    if not isinstance(array, list):
        raise PrepareError(f"{path}: a .json file holds one array of objects or JSON lines")
    return [(f"item {index}", row) for index, row in enumerate(array, 1)]


def _table_rows(path: Path, text: str, suffix: str) -> List[Tuple[int, object]]:
    """CSV with its quoting; TSV line by line, with none (csv's quoting would swallow the lines after a
    text that opens with ``"`` into it). A row with more or fewer fields than the header is refused."""
    if suffix == ".tsv":
        reader = csv.reader(_lines(text), delimiter="\t", quoting=csv.QUOTE_NONE)
    else:
        reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if not header:
        raise PrepareError(f"{path}: empty: a {suffix} file starts with a header row naming its fields")
    rows = []
    for values in reader:
        number = reader.line_num
        if not values or (len(values) == 1 and not values[0].strip()):
            continue  # a blank line
        if len(values) != len(header):
            raise PrepareError(
                f"{path}:{number}: {len(values)} fields, the header names {len(header)} ({', '.join(header)})"
            )
        rows.append((number, dict(zip(header, values))))
    return rows


def checked_examples(
    rows: Iterable[Tuple[object, object]], source: str, fields: Sequence[str], label_field: str
) -> List[Dict[str, str]]:
    """``(row number, row)`` pairs read from ``source`` (a file, a ``datasets`` split) as
    ``{field: text, label_field: label}``; the first bad row raises :class:`PrepareError` naming
    ``source``, the row and the field; a field the row lacks is named with the row's fields and the
    flag that names it (``--text-field``, ``--pair-field``, ``--label-field``)."""
    flags = {**dict(zip(fields, ("--text-field", "--pair-field"))), label_field: "--label-field"}
    examples = []
    for number, row in rows:
        if not isinstance(row, dict):
            raise PrepareError(f"{source}:{number}: not a JSON object")
        for field in (*fields, label_field):
            if field not in row:
                raise PrepareError(
                    f"{source}:{number}: no field {field!r}; the row's fields are {', '.join(map(repr, row))} "
                    f"(name the right one with {flags[field]})"
                )
        example = {}
        for field in fields:
            text = row[field]
            if not isinstance(text, str) or not text.strip():
                raise PrepareError(f"{source}:{number}: field {field!r} must be a non-empty string, got {text!r}")
            example[field] = " ".join(text.split())  # one line per example: newlines and tabs become spaces
        label = row[label_field]
        if label is None or isinstance(label, (dict, list)) or not str(label).strip():
            raise PrepareError(f"{source}:{number}: field {label_field!r} must hold a label, got {label!r}")
        example[label_field] = str(label).strip()
        examples.append(example)
    if not examples:
        raise PrepareError(f"{source}: no examples")
    return examples


def check_labels(
    splits: Dict[str, List[Dict[str, str]]], sources: Dict[str, str], label_field: str, train_name: str = "--train"
) -> Set[str]:
    """Train's labels; a label of another split that train (``train_name``) never has raises
    :class:`PrepareError` naming the split's ``sources`` entry."""
    known = {example[label_field] for example in splits["train"]}
    for split, examples in splits.items():
        unknown = sorted({e[label_field] for e in examples} - known)
        if unknown:
            raise PrepareError(f"{sources[split]}: labels {unknown} never occur in {train_name}'s {sorted(known)}")
    return known


def prepare_classification(
    files: Dict[str, Path],
    out: Path,
    fields: Sequence[str],
    label_field: str,
    vocab_size: int,
    workers: int = 1,
    log=print,
) -> Path:
    """Check every split, train sentencepiece on train's texts, encode, binarize; return the data-bin folder."""
    import sentencepiece as spm

    preprocess = fairseq_command("fairseq-preprocess")  # before any work: a missing fairseq fails now
    splits = {split: read_examples(path, fields, label_field) for split, path in files.items()}
    known = check_labels(splits, {split: f"--{split} {path}" for split, path in files.items()}, label_field)
    log(
        f"data: {', '.join(f'{split} {len(rows)} examples ({files[split]})' for split, rows in splits.items())}; "
        f"labels {sorted(known)}"
    )
    spm_dir = out / "spm"
    spm_dir.mkdir(parents=True, exist_ok=True)
    train_text = spm_dir / "train.text"
    train_text.write_text("".join(e[f] + "\n" for e in splits["train"] for f in fields), encoding="utf-8")
    train_sentencepiece(
        [train_text], spm_dir, vocab_size, 1.0, f"--vocab-size {vocab_size}", f"--train {files['train']}"
    )
    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "spm.model"))
    columns = {f"input{i}": field for i, field in enumerate(fields)}
    for split, examples in splits.items():
        for column, field in columns.items():
            pieces = "".join(" ".join(sp.encode(e[field], out_type=str)) + "\n" for e in examples)
            (spm_dir / f"{split}.{column}").write_text(pieces, encoding="utf-8")
        (spm_dir / f"{split}.label").write_text("".join(e[label_field] + "\n" for e in examples), encoding="utf-8")
    data_bin = out / "data-bin"
    for column in (*columns, "label"):
        flags = [flag for split in splits for flag in (f"--{split}pref", str(spm_dir / f"{split}.{column}"))]
        run_logged(
            [preprocess, "--only-source", *flags, "--destdir", str(data_bin / column), "--workers", str(workers)],
            out / "logs" / f"preprocess.{column}.log",
        )
    log(f"sentencepiece ({vocab_size} pieces, {spm_dir / 'spm.model'}) + fairseq-preprocess -> {data_bin}")
    return data_bin


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="attn-reg-prepare-cls", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    ap.add_argument("--train", required=True, type=Path, help="training file (.jsonl, .json, .csv, .tsv)")
    ap.add_argument("--valid", required=True, type=Path, help="validation file")
    ap.add_argument("--test", type=Path, help="test file (optional)")
    ap.add_argument("--out", required=True, type=Path, help="output folder (spm/, data-bin/, logs/)")
    ap.add_argument("--text-field", default="sentence", help="the text's field (default sentence)")
    ap.add_argument("--pair-field", help="a second text's field, for sentence pairs (input1)")
    ap.add_argument("--label-field", default="label", help="the label's field (default label)")
    ap.add_argument("--vocab-size", type=int, default=8000, help="sentencepiece vocabulary (>= 100; default 8000)")
    ap.add_argument("--workers", type=int, default=1, help="fairseq-preprocess workers (>= 1)")
    args = ap.parse_args(argv)
    if args.vocab_size < 100:
        ap.error(f"--vocab-size {args.vocab_size}: must be at least 100")
    if args.workers < 1:
        ap.error(f"--workers {args.workers}: must be at least 1")
    if (args.out / "data-bin").exists():
        ap.error(f"--out {args.out}: {args.out / 'data-bin'} already exists (choose an empty folder or remove it)")
    fields = [args.text_field] + ([args.pair_field] if args.pair_field else [])
    if args.label_field in fields or len(set(fields)) != len(fields):
        ap.error(
            f"--text-field, --pair-field and --label-field must name different fields, got {fields + [args.label_field]}"
        )
    files = {"train": args.train, "valid": args.valid}
    if args.test is not None:
        files["test"] = args.test
    try:
        prepare_classification(files, args.out, fields, args.label_field, args.vocab_size, args.workers)
    except PrepareError as e:
        print(f"attn-reg-prepare-cls: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
