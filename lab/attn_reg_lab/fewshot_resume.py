"""The finished runs of an interrupted ``attn-reg-fewshot`` experiment that ``--resume`` reuses:
what two runs must share to belong to one experiment, and reading ``runs.jsonl`` back."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, Tuple

from .fewshot_data import DataError


def comparable_settings(config: dict) -> dict:
    """What two runs must share to be parts of one experiment (not which sizes, seeds or methods)."""
    return {
        k: config[k] for k in ("model", "num_labels", "max_length", "training", "method_settings", "dev_subset")
    } | {"files": {name: f["sha256"] for name, f in config["files"].items()}}


def resumable_runs(out: Path, config: dict) -> Dict[Tuple[int, int, str], dict]:
    """The finished runs of an interrupted experiment in ``out`` that belong to this one's grid.

    ``settings.json`` (written when a run starts) must match this run's settings; a folder
    without it (written by an older fewshot.py) is reused as is, with a warning.
    """
    runs_path, settings_path = out / "runs.jsonl", out / "settings.json"
    if not runs_path.exists():
        return {}
    wanted = comparable_settings(config)
    if settings_path.exists():
        saved = json.loads(settings_path.read_text(encoding="utf-8"))
        differ = sorted(k for k in wanted.keys() | saved.keys() if wanted.get(k) != saved.get(k))
        if differ:
            raise DataError(
                f"--resume: {settings_path} was written with other settings ({', '.join(differ)}); "
                f"use another --out-dir"
            )
    else:
        print(
            f"warning: --resume: {out} has no settings.json (an older fewshot.py); its runs are trusted to "
            f"come from these settings",
            file=sys.stderr,
        )
    finished = {}
    grid = {(s, d, m) for s in config["sizes"] for d in config["seeds"] for m in config["methods"]}
    for number, line in enumerate(runs_path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            run = json.loads(line)
            key = (run["size"], run["seed"], run["method"])
        except (ValueError, KeyError) as e:
            raise DataError(f"--resume: {runs_path}:{number}: not a finished run ({e})") from None
        if key in grid:
            finished[key] = run
    return finished
