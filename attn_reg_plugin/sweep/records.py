"""What a run's record is read from: what survives the sweep, not one process's pipe.

- ``train.log``: every attempt's fairseq-train output, appended by the child itself, so a run
  killed at epoch 3 and resumed keeps epochs 1-3 beside 4-N (the later attempt's line wins for an
  epoch logged twice: its checkpoint is the one the run continues from).
- ``attempts.json``: each attempt's start, seconds (rewritten every few seconds while it runs, so a
  sweep killed without warning still counts most of it), the epoch fairseq resumed from, and how it ended.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .options import option_name

# A run whose valid loss exceeds this many times the loss of a uniform guess over the target
# dictionary (log2 V bits, fairseq's unit) has diverged: it predicts worse than knowing nothing.
DIVERGED_OVER_UNIFORM = 2.0
# A cell whose regularizer was skipped in more than this share of its steps did not run it.
MOSTLY_SKIPPED = 0.5
ATTEMPT_SAVE_SECONDS = 1.0


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
_LOADED = re.compile(r"Loaded checkpoint (.*) \(epoch (\d+) @ (\d+) updates\)")
# fairseq-train's end when the loss or gradients became NaN/Inf: trainer.py raises FloatingPointError
# ("gradients are Nan/Inf"; with fp16 "Minimum loss scale reached ..."), and its NaN-detector
# replay of the step may raise another exception on top of it (StopIteration with R-Drop).
_FLOATING_POINT_ERROR = re.compile(r"^FloatingPointError: (.*)$", re.M)
_EPOCH_BEGUN = re.compile(r"begin training epoch (\d+)")


def _epoch_line(line: str):
    """``(kind, epoch, fields)`` of an end-of-epoch train or valid line (simple or json format), or None."""
    m = _SIMPLE_LINE.search(line)
    if m:
        return m.group(1), int(m.group(2)), log_fields(m.group(3))
    m = _JSON_LINE.search(line)
    if not m:
        return None
    kind, data = m.group(1), json.loads(m.group(2))
    tag = f"{kind}_"  # the json format prefixes every key with its tag: valid_loss
    fields = {k[len(tag) :] if k.startswith(tag) else k: str(v) for k, v in data.items()}
    return kind, int(float(fields["epoch"])), fields


def read_train_log(text: str) -> dict:
    """Per epoch: the valid loss, and from the train line the AD-DROP share of steps (``ad_drop_on``),
    rate (of epochs that ran AD-DROP), skipped steps and the update count."""
    out: Dict[str, Dict[int, float]] = {
        k: {} for k in ("valid_loss", "ad_drop_on", "ad_drop_rate", "ad_drop_skipped", "num_updates")
    }
    for line in text.splitlines():
        found = _epoch_line(line)
        if found is None:
            continue
        kind, epoch, fields = found
        if kind == "valid" and "loss" in fields:
            out["valid_loss"][epoch] = float(fields["loss"])
            continue
        if kind != "train":
            continue
        for key in ("ad_drop_on", "ad_drop_skipped", "num_updates"):
            if key in fields:
                out[key][epoch] = float(fields[key])
        if float(fields.get("ad_drop_on", 0)) > 0:
            out["ad_drop_rate"][epoch] = float(fields["ad_drop_rate"])
    return out


def diverged_in(attempt_output: str) -> Optional[str]:
    """Why a failed fairseq-train attempt diverged (its loss or gradients became NaN/Inf), from its
    output; None when it failed for another reason."""
    found = _FLOATING_POINT_ERROR.findall(attempt_output)
    if not found:
        return None
    epochs = _EPOCH_BEGUN.findall(attempt_output)
    where = f" in epoch {epochs[-1]}" if epochs else ""
    return f"fairseq-train stopped{where}: FloatingPointError: {found[0].strip()}"


def resumed_from(line: str) -> Optional[tuple]:
    """``(epoch, updates)`` when ``line`` is fairseq-train's note that it loaded a checkpoint to resume."""
    m = _LOADED.search(line)
    return (int(m.group(2)), int(m.group(3))) if m else None


# -- attempts -------------------------------------------------------------------------------------
class Attempts:
    """``attempts.json`` of one run: one entry per fairseq-train started for it."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: List[dict] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
        for entry in self.entries:
            if entry["end"] == "running":  # its sweep died without a word (the lock says none runs)
                entry["end"] = "the sweep died"
        self._saved = 0.0

    def start(self) -> dict:
        entry = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": 0.0, "resumed_from_epoch": None}
        entry["end"] = "running"
        self.entries.append(entry)
        self.save()
        return entry

    def tick(self, seconds: float) -> None:
        self.entries[-1]["seconds"] = round(seconds, 1)
        if time.time() - self._saved >= ATTEMPT_SAVE_SECONDS:
            self.save()

    def end(self, how: str, seconds: Optional[float] = None) -> None:
        if seconds is not None:
            self.entries[-1]["seconds"] = round(seconds, 1)
        self.entries[-1]["end"] = how
        self.save()

    def save(self) -> None:
        self._saved = time.time()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.entries, indent=1) + "\n", encoding="utf-8")
        partial.replace(self.path)

    @property
    def seconds(self) -> float:
        return round(sum(e["seconds"] for e in self.entries), 1)


# -- a run's training facts -----------------------------------------------------------------------
def divergence_bound(data_bin: Path, target_lang: str) -> float:
    """``DIVERGED_OVER_UNIFORM`` times log2 of the target dictionary's size (its lines and fairseq's 4 specials)."""
    path = data_bin / f"dict.{target_lang}.txt"
    size = 4 + sum(1 for line in path.read_text(encoding="utf-8").split("\n") if line.strip())
    return round(DIVERGED_OVER_UNIFORM * math.log2(size), 2)


def _per_update_calls(train_args: Sequence[str], epoch: int) -> int:
    """Criterion calls per update (``--update-freq`` for that epoch, times ``--distributed-world-size``
    when given): fairseq sums every call's skipped count into the epoch's line."""
    values = {option_name(a): train_args[i + 1] for i, a in enumerate(train_args[:-1]) if a.startswith("--")}
    values.update(a.split("=", 1) for a in train_args if a.startswith("--") and "=" in a)
    freq = [int(x) for x in values.get("--update-freq", "1").split(",") if x.strip()] or [1]
    return freq[min(epoch, len(freq)) - 1] * int(values.get("--distributed-world-size", 1))


def _skipped_share(epochs: dict, train_args: Sequence[str]) -> Optional[float]:
    """The share of AD-DROP's criterion calls that were skipped; None when an epoch's update count is unknown."""
    calls = 0.0
    updates = epochs["num_updates"]
    for epoch, on in epochs["ad_drop_on"].items():
        if on <= 0:
            continue
        before = 0.0 if epoch == 1 else updates.get(epoch - 1)
        if epoch not in updates or before is None:
            return None
        calls += on * (updates[epoch] - before) * _per_update_calls(train_args, epoch)
    skipped = sum(epochs["ad_drop_skipped"].values())
    return round(min(1.0, skipped / calls), 4) if calls else None


def train_facts(epochs: dict, train_args: Sequence[str], bound: float, stopped: Optional[str] = None) -> dict:
    """A run's record fields from its epochs (:func:`read_train_log` over every attempt's lines);
    ``stopped``: why training diverged and ended (:func:`diverged_in`), when it did, maybe before any
    epoch was logged."""
    losses = epochs["valid_loss"]
    finite = [v for v in losses.values() if math.isfinite(v)]
    last = max(losses, default=None)
    logged = set(losses) | set(epochs["num_updates"])  # an epoch without validation (--validate-interval) ran
    bad = [(e, v) for e, v in sorted(losses.items()) if not math.isfinite(v) or v > bound]
    rates = list(epochs["ad_drop_rate"].values())
    ran = [e for e, on in epochs["ad_drop_on"].items() if on > 0]
    diverged = stopped
    if diverged is None and bad:
        diverged = (
            f"valid loss {bad[0][1]:.4g} at epoch {bad[0][0]} (bound {bound:g}: {DIVERGED_OVER_UNIFORM:g} x a "
            "uniform guess over the target dictionary)"
        )
    return {
        "valid_loss": min(finite) if finite else None,
        # JSON has no inf
        "final_valid_loss": losses[last] if last is not None and math.isfinite(losses[last]) else None,
        "epochs": max(logged, default=0),
        "missing_epochs": [e for e in range(1, max(logged, default=0) + 1) if e not in logged],
        "ad_drop_rate": round(statistics.fmean(rates), 4) if rates else None,
        "ad_drop_skipped": int(sum(epochs["ad_drop_skipped"].values())) if ran else None,
        "ad_drop_skipped_share": _skipped_share(epochs, train_args) if ran else None,
        "diverged": diverged,
    }
