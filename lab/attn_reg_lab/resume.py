"""One resumable runs file (``runs.jsonl``) for the lab's multi-run commands: a line per finished
run with the settings it ran under; a rerun with the same settings skips those runs, and one with
other settings is refused rather than mixed in."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Dict, Hashable


def finished_runs(path: Path, settings: Dict, key: Callable[[Dict], Hashable], command: str) -> Dict[Hashable, Dict]:
    """The runs already in ``path``, by ``key(run)``; exits (2) naming ``command`` if any ran under other settings."""
    done: Dict[Hashable, Dict] = {}
    if not path.exists():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row["settings"] != settings:
            print(f"{command}: {path} holds runs with other settings; use another --out-dir", file=sys.stderr)
            raise SystemExit(2)
        done[key(row["run"])] = row["run"]
    return done


def record_run(path: Path, settings: Dict, run: Dict) -> None:
    """Append one finished run (a whole line, so an interrupted write loses at most that run)."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"settings": settings, "run": run}) + "\n")
