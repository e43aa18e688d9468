"""Few-shot summaries: mean ± std per size and method, paired differences against the baseline (the plugin's,
:func:`attn_reg_plugin.sweep.paired.paired_difference`, with a paired t-test's p beside), markdown."""

from __future__ import annotations

import math
import statistics
from typing import Dict, Hashable, List, Optional, Sequence, Tuple


def _mean_std(values: Sequence[float]):
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, std


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast only below this point
        return 1.0 - _incomplete_beta(1.0 - x, b, a)
    front = math.exp(a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    value = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            value *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * value


def paired_t_test(diffs: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    """Student's paired t-test of mean(diffs) = 0: (t, two-sided p); (None, None) below 2 pairs.

    Identical differences have no spread: t is infinite (p = 0) unless they are all 0 (t = 0, p = 1)."""
    n = len(diffs)
    if n < 2:
        return None, None
    sd = statistics.stdev(diffs)
    mean = statistics.fmean(diffs)
    if sd == 0.0:
        return (0.0, 1.0) if mean == 0.0 else (math.copysign(math.inf, mean), 0.0)
    t = mean / (sd / math.sqrt(n))
    df = n - 1
    return t, _incomplete_beta(df / (df + t * t), df / 2.0, 0.5)


def paired_difference(values: Dict[Hashable, float], baseline: Dict[Hashable, float]) -> Optional[dict]:
    """``values`` minus ``baseline`` at the seeds both hold (dicts keyed by seed): the plugin's paired
    difference (attn-reg-mt-compare's and -cls-compare's: the number of pairs, mean and sample std of the
    differences, their 95% t-interval ``ci``), plus Student's paired t and its two-sided p; None if no
    seed is shared."""
    from attn_reg_plugin.sweep.paired import paired_difference as plugin_paired_difference

    d = plugin_paired_difference(values, baseline)
    if not d["seeds"]:
        return None
    t, p = paired_t_test(list(d["per_seed"].values()))
    return {"pairs": d["n"], "mean_diff": d["mean"], "std_diff": d["sd"], "ci": d["ci"], "t": t, "p": p}


# What each regularizer measured, per epoch (its kernel's or criterion's log keys), summarized per run.
MEASURED_KEYS = ("ad_drop_rate", "rdrop_kl", "hiddencut_js", "attn_drophead_rate", "attn_sched_dropout_rate")


def regularizer_means(epochs: Sequence[dict]) -> Dict[str, float]:
    """Mean over a run's epochs of each measured key it logged (AD-DROP's rate: over its regularized epochs)."""
    means = {}
    for key in MEASURED_KEYS:
        values = [e[key] for e in epochs if key in e and (key != "ad_drop_rate" or e.get("ad_drop_on"))]
        if values:
            means[key] = statistics.fmean(values)
    return means


def summarize(runs: List[dict], sizes: Sequence[int], methods: Sequence[str], baseline: str = "plain"):
    summary, paired = [], []
    for size in sizes:
        by_method = {m: {r["seed"]: r for r in runs if r["size"] == size and r["method"] == m} for m in methods}
        for m in methods:
            rs = list(by_method[m].values())
            if not rs:
                continue
            mean, std = _mean_std([r["test_acc"] for r in rs])
            dev_mean, _ = _mean_std([r["best_dev_acc"] for r in rs])
            row = {
                "size": size,
                "method": m,
                "seeds": len(rs),
                "test_acc_mean": mean,
                "test_acc_std": std,
                "best_dev_acc_mean": dev_mean,
                "best_epochs": [r["best_epoch"] for r in rs],
                "train_seconds_mean": statistics.fmean(r["train_seconds"] for r in rs),
            }
            measured = [regularizer_means(r["epochs"]) for r in rs]
            for key in dict.fromkeys(k for m_ in measured for k in m_):
                row[f"{key}_mean"] = statistics.fmean(m_[key] for m_ in measured if key in m_)
            probs = [r["attendout_drop_prob"] for r in rs if "attendout_drop_prob" in r]
            if probs:
                row["attendout_drop_prob_mean"] = statistics.fmean(probs)
            summary.append(row)
            if m != baseline and baseline in by_method:
                accuracy = {
                    method: {s: r["test_acc"] for s, r in by_method[method].items()} for method in (m, baseline)
                }
                d = paired_difference(accuracy[m], accuracy[baseline])
                if d is not None:
                    diffs = [accuracy[m][s] - accuracy[baseline][s] for s in accuracy[m] if s in accuracy[baseline]]
                    paired.append(
                        {
                            "size": size,
                            "method": m,
                            "baseline": baseline,
                            "seeds": d["pairs"],
                            "diff_mean": d["mean_diff"],
                            "diff_std": 0.0 if d["std_diff"] is None else d["std_diff"],  # one seed: shown as 0
                            "ci": d["ci"],
                            "wins": sum(x > 0 for x in diffs),
                            "ties": sum(x == 0 for x in diffs),
                            "losses": sum(x < 0 for x in diffs),
                            "t": d["t"],
                            "p_value": d["p"],
                        }
                    )
    return summary, paired


def markdown(summary: List[dict], paired: List[dict], sizes: Sequence[int], methods: Sequence[str]) -> str:
    cell = {(r["size"], r["method"]): r for r in summary}
    lines = [
        "Test accuracy (%), mean ± sample std over seeds, at the best dev epoch of each run.",
        "",
        "| method | " + " | ".join(f"{s}-shot" for s in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for m in methods:
        cells = []
        for s in sizes:
            r = cell.get((s, m))
            cells.append(f"{100 * r['test_acc_mean']:.2f} ± {100 * r['test_acc_std']:.2f}" if r else "-")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Dev accuracy (%) of the selected epoch, mean over seeds (what the selection saw).",
        "",
        "| method | " + " | ".join(f"{s}-shot" for s in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for m in methods:
        cells = [f"{100 * cell[(s, m)]['best_dev_acc_mean']:.2f}" if (s, m) in cell else "-" for s in sizes]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if paired:
        lines += [
            "",
            "Paired difference to the baseline on the same subset and initial weights "
            "(percentage points, mean ± sample std [95% t-interval]; wins/ties/losses over seeds; two-sided p of "
            "a paired t-test).",
            "",
            "| method | " + " | ".join(f"{s}-shot" for s in sizes) + " |",
            "|---|" + "---|" * len(sizes),
        ]
        pcell = {(r["size"], r["method"]): r for r in paired}
        for m in dict.fromkeys(r["method"] for r in paired):
            cells = []
            for s in sizes:
                r = pcell.get((s, m))
                p_text = "" if r is None or r.get("p_value") is None else f", p = {r['p_value']:.3f}"
                ci = "" if r is None or r.get("ci") is None else f" [{100 * r['ci'][0]:+.2f}, {100 * r['ci'][1]:+.2f}]"
                cells.append(
                    f"{100 * r['diff_mean']:+.2f} ± {100 * r['diff_std']:.2f}{ci} ({r['wins']}/{r['ties']}/{r['losses']}"
                    f"{p_text})"
                    if r
                    else "-"
                )
            lines.append(f"| {m} − {paired[0]['baseline']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
