"""The p x q heatmap: one panel per attribution, layers and schedule.

With a ``center`` (the MT sweep: each cell's valid BLEU minus plain's, centred on 0) the colours
are a diverging scale symmetric about it, at least ``min_span`` wide each way, so a difference of
0.01 BLEU stays pale instead of filling the scale; without one, brighter is better.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import List, Optional, Tuple

from .options import number_text


def color_limits(values: List[float], center: Optional[float], min_span: float = 0.0) -> Tuple[float, float]:
    """``(vmin, vmax)``: symmetric about ``center`` when given, else the values' range."""
    if center is not None:
        span = max([abs(v - center) for v in values] + [min_span]) or 1.0
        return center - span, center + span
    low, high = min(values), max(values)
    return low, high if high > low else low + 1


def heatmap(
    points: List[dict],
    path: Path,
    title: str,
    subtitle: str,
    higher_is_better: bool,
    fmt: str = "{:.2f}",
    center: Optional[float] = None,
    min_span: float = 0.0,
    colorbar_label: str = "",
) -> Path:
    """p down, q across, one panel per distinct ``point["panel"]``; each point is
    ``{"panel", "p", "q", "value", "best": bool, "note": optional second line}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(pt["panel"] for pt in points))
    ps = sorted({pt["p"] for pt in points})
    qs = sorted({pt["q"] for pt in points})
    vmin, vmax = color_limits([pt["value"] for pt in points], center, min_span)
    if center is not None:
        cmap = "RdBu" if higher_is_better else "RdBu_r"  # blue: better than the centre
    else:
        cmap = "viridis" if higher_is_better else "viridis_r"
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(max(5.0, 1.4 + 1.3 * len(qs) * len(panels) + 1.0 * len(panels)), max(3.8, 2.2 + 0.9 * len(ps))),
        squeeze=False,
    )
    for ax, panel in zip(axes[0], panels):
        mine = [pt for pt in points if pt["panel"] == panel]
        image = _panel(ax, mine, ps, qs, cmap, (vmin, vmax), fmt, center, higher_is_better)
        ax.set_title(panel, fontsize=9)
        bar = fig.colorbar(image, ax=ax, shrink=0.8)
        if colorbar_label:
            bar.set_label(colorbar_label, fontsize=8)
    width = int(fig.get_size_inches()[0] * 13)  # characters that fit at fontsize 9
    fig.suptitle(
        textwrap.fill(title, width, break_on_hyphens=False) + "\n" + textwrap.fill(subtitle, width), fontsize=9
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _panel(ax, points: List[dict], ps: list, qs: list, cmap: str, limits, fmt: str, center, higher_is_better: bool):
    """One panel's image, its cells labelled; returns the image (for the colour bar)."""
    shown = [[float("nan")] * len(qs) for _ in ps]
    for pt in points:
        shown[ps.index(pt["p"])][qs.index(pt["q"])] = pt["value"]
    image = ax.imshow(shown, cmap=cmap, vmin=limits[0], vmax=limits[1])
    for pt in points:
        dark = _dark(pt["value"], *limits, center, higher_is_better)
        _label(ax, pt, qs.index(pt["q"]), ps.index(pt["p"]), fmt, dark)
    ax.set_xticks(range(len(qs)), [number_text(q) for q in qs])
    ax.set_yticks(range(len(ps)), [number_text(p) for p in ps])
    ax.set_xlabel("q (drop probability)")
    ax.set_ylabel("p (candidate share)")
    return image


def _dark(value: float, vmin: float, vmax: float, center: Optional[float], higher_is_better: bool) -> bool:
    """Whether the cell's colour is dark (white text on it)."""
    if center is not None:  # a diverging scale is dark at both ends
        return abs(value - center) > 0.6 * (vmax - center)
    goodness = (value - vmin) / ((vmax - vmin) or 1.0)
    return (goodness if higher_is_better else 1.0 - goodness) < 0.5


def _label(ax, pt: dict, x: int, y: int, fmt: str, dark: bool) -> None:
    text = fmt.format(pt["value"]) + (f"\n{pt['note']}" if pt.get("note") else "")
    ax.text(
        x, y, text + ("\nbest" if pt.get("best") else ""), ha="center", va="center", fontsize=7,
        color="white" if dark else "black",
    )  # fmt: skip
