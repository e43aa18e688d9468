"""The lab commands' comma-separated options (--seeds 1,2,3, --methods plain,rd), read one way."""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence, Union


def comma_list(
    option: str, text: str, accepted: Optional[Sequence[str]] = None, minimum: Optional[int] = None
) -> Union[List[str], List[int]]:
    """The items of ``text``: names from ``accepted`` or, without it, integers >= ``minimum``; none repeated.
    Raises ``argparse.ArgumentTypeError`` naming ``option``."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{option} must name at least one value")
    if accepted is not None:
        bad = [t for t in items if t not in accepted]
        if bad:
            raise argparse.ArgumentTypeError(f"{option}: unknown {bad[0]!r}; accepted: {', '.join(accepted)}")
        values = items
    else:
        try:
            values = [int(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{option} must be a comma-separated list of integers, got {text!r}"
            ) from None
        bad = [v for v in values if minimum is not None and v < minimum]
        if bad:
            raise argparse.ArgumentTypeError(f"{option}: every value must be >= {minimum}, got {bad[0]}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{option}: repeated value in {text!r}")
    return values
