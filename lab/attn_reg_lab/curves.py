"""Per-epoch curves over seeds, as attn-reg-fig2 and attn-reg-regime draw them: the mean with a
band from the lowest to the highest seed, and a zoomed panel of the late epochs for long runs."""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence


def band(runs: Sequence[Dict], key: str, epochs: int) -> Dict[str, List[float]]:
    """Of ``run["epochs"][e][key]`` over the runs (seeds), at each of the first ``epochs`` epochs: mean, lowest, highest."""
    columns = [[run["epochs"][e][key] for run in runs] for e in range(epochs)]
    return {
        "mean": [statistics.fmean(c) for c in columns],
        "low": [min(c) for c in columns],
        "high": [max(c) for c in columns],
    }


def zoom_start(epochs: int) -> Optional[int]:
    """The first epoch of the late-epochs panel (the last two thirds) for runs of 30 epochs or more.

    Trained from scratch, the loss falls by several units in the first epochs and then moves by a
    few tenths once the model overfits; on one axis that rise is flat. None for shorter runs."""
    return epochs // 3 + 1 if epochs >= 30 else None


def draw_band(ax, mean: Sequence[float], low: Sequence[float], high: Sequence[float], first: int = 1, **style):
    """Plot epochs ``first``.. of ``mean`` with its band; markers only where they can be told apart."""
    xs = range(first, len(mean) + 1)
    cut = slice(first - 1, None)
    line = ax.plot(xs, mean[cut], marker="o" if len(xs) <= 20 else None, **style)[0]
    ax.fill_between(xs, low[cut], high[cut], color=line.get_color(), alpha=0.15)
    return line


def seeds_label(name: str, seeds: int) -> str:
    return f"{name} ({seeds} seed{'' if seeds == 1 else 's'})"
