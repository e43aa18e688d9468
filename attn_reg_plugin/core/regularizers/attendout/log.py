"""AttendOut's JSONL log: one line per dropout step (the data of the paper's Fig. 3)."""

from __future__ import annotations

import json
from typing import Dict, Optional


class DropProbabilityLog:
    """Appends one JSON line per dropout step: update, per-layer mean drop probability, reward."""

    def __init__(self, path: Optional[str]):
        self.path = path

    def write(self, update: int, stats: Dict[str, object]) -> None:
        if not self.path:
            return
        record = {"update": int(update), **{k: v for k, v in stats.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
