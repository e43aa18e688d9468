"""Few-shot data: the JSON-lines loader with its errors, class-balanced subsets, file digests."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple


class DataError(ValueError):
    """Malformed input file; the message starts with ``path:line:`` (``path:`` for a whole-file problem)."""


@dataclass(frozen=True)
class Example:
    sentence: str
    label: int


def _json_objects(path: Path) -> Iterator[Tuple[int, dict]]:
    """(1-based line, object) per line: UTF-8 split at ``\\n`` (a CRLF's ``\\r`` and a leading BOM
    dropped); an undecodable, blank or non-object line raises :class:`DataError`."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    data = path.read_bytes()
    for number, raw in enumerate(data.removesuffix(b"\n").split(b"\n") if data else [], start=1):
        try:
            line = raw.removesuffix(b"\r").decode("utf-8").removeprefix("\ufeff" if number == 1 else "")
        except UnicodeDecodeError as err:
            raise DataError(
                f"{path}:{number}: not valid UTF-8 ({err.reason} at byte {err.start} of the line)"
            ) from None
        if not line.strip():
            raise DataError(f"{path}:{number}: empty line (every line must hold one JSON object)")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        yield number, row


def load_jsonl(path: Path, num_labels: int = 2) -> List[Example]:
    """Every line of ``path`` as an :class:`Example`; any malformed line raises :class:`DataError`."""
    path = Path(path)
    try:
        rows = list(_json_objects(path))
    except OSError as e:
        raise DataError(f"{path}: {e.strerror}") from None
    label_set = "{" + ", ".join(str(i) for i in range(num_labels)) + "}"
    examples = []
    for number, record in rows:
        where = f"{path}:{number}"
        for key in ("sentence", "label"):
            if key not in record:
                raise DataError(f"{where}: missing key {key!r}")
        sentence, label = record["sentence"], record["label"]
        if not isinstance(sentence, str):
            raise DataError(f"{where}: 'sentence' must be a string, got {type(sentence).__name__}")
        if not sentence.strip():
            raise DataError(f"{where}: empty sentence")
        # bool is an int in Python; true/false are not labels.
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < num_labels:
            raise DataError(f"{where}: label {label!r} is not in the label set {label_set}")
        examples.append(Example(sentence, label))
    if not examples:
        raise DataError(f"{path}: no examples (empty file)")
    return examples


def class_counts(size: int, labels: Sequence[int], rng: random.Random) -> Dict[int, int]:
    """``size`` split evenly over ``labels``; the remainder goes to classes drawn with ``rng``."""
    base, extra = divmod(size, len(labels))
    counts = {c: base for c in labels}
    for c in rng.sample(list(labels), extra):
        counts[c] += 1
    return counts


def sample_balanced(examples: Sequence[Example], size: int, seed: int, num_labels: int) -> List[Example]:
    """A class-balanced random subset of ``size`` examples, determined by ``seed``, in random order.

    Balanced because a few-shot subset drawn at random can miss a class entirely (16 draws from
    a 50/50 pool give an 8/8 split only 20% of the time).
    """
    rng = random.Random(seed)
    labels = list(range(num_labels))
    pools = {c: [e for e in examples if e.label == c] for c in labels}
    counts = class_counts(size, labels, rng)
    for c in labels:
        if counts[c] > len(pools[c]):
            raise DataError(
                f"training size {size} needs {counts[c]} examples of label {c}, but the training file has {len(pools[c])}"
            )
    picked = [e for c in labels for e in rng.sample(pools[c], counts[c])]
    rng.shuffle(picked)
    return picked


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
