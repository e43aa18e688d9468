"""What every results JSON of the lab records about the environment that produced it.

The numbers move with package versions (docs/DEMO.md: a rebuilt venv moved the demo's rows), so
a result names the lock it was made under and says whether the venv matched it exactly.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import platform
import re
from typing import Dict, List

from .paths import REPO

LOCK = REPO / "requirements.lock"
# The packages whose versions shape the numbers, recorded by name even when they match the lock.
KEY_PACKAGES = (
    "torch",
    "fairseq-fixed",
    "fairseq",
    "transformers",
    "accelerate",
    "datasets",
    "peft",
    "sentencepiece",
    "sacrebleu",
    "numpy",
)


def _installed(name: str):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _base(version: str) -> str:
    return version.split("+", 1)[0]  # torch's +cpu / +cu12x build tag: the lock records the release


def lock_differences() -> List[str]:
    """``name lock-version -> installed-version`` for every locked package the venv holds otherwise."""
    differences = []
    for line in LOCK.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line)
        if not match:
            continue
        name, locked = match.groups()
        installed = _installed(name)
        if installed is None or _base(installed) != locked:
            differences.append(f"{name} {locked} -> {installed or 'missing'}")
    return differences


def environment() -> Dict[str, object]:
    """Python, the key packages' versions, torch's threads, the lock's hash and any difference from it."""
    import torch

    record: Dict[str, object] = {
        "python": platform.python_version(),
        "packages": {name: version for name in KEY_PACKAGES if (version := _installed(name)) is not None},
        "torch_threads": torch.get_num_threads(),
    }
    if LOCK.exists():
        record["lock_sha256"] = hashlib.sha256(LOCK.read_bytes()).hexdigest()[:16]
        record["lock_differences"] = lock_differences()  # [] = the venv is exactly the lock
    else:
        record["lock_sha256"] = None  # a wheel install: no lock beside the package
    return record
