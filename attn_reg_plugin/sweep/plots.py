"""The comparisons' plots (compare.png of attn-reg-mt-compare and attn-reg-cls-compare): one forest plot
of each row's difference to plain with its 95% interval, drawn by the same function for both, and the
classifier's dev score per epoch. matplotlib is imported by :func:`draw_comparison` only (Agg backend):
the commands' option checks never wait for it."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Callable, List, Optional

# A panel title's line, in characters: a third of compare.png's width at matplotlib's default font.
PANEL_TITLE_CHARACTERS = 40


def wrapped(title: str, width: int = PANEL_TITLE_CHARACTERS) -> str:
    return "\n".join(textwrap.fill(line, width) for line in title.split("\n"))


def pyplot(log, name: str = "compare.png"):
    """matplotlib's pyplot on the Agg backend, or None (said in ``log``) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"{name} skipped: matplotlib is not installed (pip install 'attn_reg_plugin[plots]')")
        return None
    return plt


def forest_row(name: str, difference: Optional[dict], why: str = "no seed in common") -> dict:
    """One row of :func:`forest` from a paired difference (:func:`paired.paired_difference`, its ``ci``
    None without an interval); ``difference`` None or its mean None: nothing to draw, ``why`` said."""
    if difference is None or difference.get("mean") is None:
        return {"name": name, "mean": None, "ci": None, "per_seed": {}, "why": why}
    return {
        "name": name,
        "mean": difference["mean"],
        "ci": difference.get("ci"),
        "per_seed": difference.get("per_seed", {}),
        "why": None,
    }


def forest(ax, rows: List[dict], label: str) -> None:
    """A forest plot on ``ax``: one line per row (``rows`` from :func:`forest_row`, the first at the top),
    its difference to plain as a point with its 95% interval (none drawn when it has none: one seed, or
    zero width), each seed's difference as a grey dot, and a line at 0; a row with nothing to draw says
    why (``diverged``, ``learned nothing``, ...) in red where its point would be."""
    n = len(rows)
    if not n:
        ax.set_axis_off()
        ax.set_title(wrapped(f"{label}\n(no row to compare)"))
        return
    for i, row in enumerate(rows):
        y = n - 1 - i
        seeds = list(row["per_seed"].values())
        ax.scatter(seeds, [y] * len(seeds), color="gray", s=14, zorder=2)
        if row["mean"] is None:
            ax.annotate(
                row["why"], (0.5, y), xycoords=("axes fraction", "data"), ha="center", va="center", color="C3",
                bbox={"facecolor": "white", "edgecolor": "none"},
            )  # fmt: skip
            continue
        low, high = row["ci"] if row["ci"] else (row["mean"], row["mean"])
        ax.errorbar(
            [row["mean"]], [y], xerr=[[row["mean"] - low], [high - row["mean"]]], fmt="o", color="C0", capsize=5
        )
    ax.axvline(0.0, color="black", lw=0.8)
    low, high = ax.get_xlim()
    ax.set_xticks([t for t in ax.get_xticks() if low <= t <= high])  # none outside the panel, where none is drawn
    ax.set_yticks(range(n), [row["name"] for row in reversed(rows)])
    ax.set_ylim(-0.5, n - 0.5)  # half a slot each side: the edge rows' marks and notes in view
    ax.set_title(wrapped(f"{label}\n(95% CI; dots: seeds)"))


def draw_comparison(path: Path, title: str, panels: Callable, log) -> Optional[str]:
    """compare.png: three panels side by side, drawn by ``panels(axes)`` (the command's own), under
    ``title``; its path, or None without matplotlib."""
    plt = pyplot(log)
    if plt is None:
        return None
    # Constrained layout makes room for every title and rotated row name inside the figure; the panels'
    # titles are wrapped so that none is wider than its panel.
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5), layout="constrained")
    panels(axes)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
