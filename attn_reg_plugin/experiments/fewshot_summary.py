"""Few-shot summaries: mean ± std per size and method, paired differences against the baseline, markdown."""
from __future__ import annotations

import statistics
from typing import List, Sequence


def _mean_std(values: Sequence[float]):
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, std


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
            row = {"size": size, "method": m, "seeds": len(rs), "test_acc_mean": mean, "test_acc_std": std,
                   "best_dev_acc_mean": dev_mean, "best_epochs": [r["best_epoch"] for r in rs],
                   "train_seconds_mean": statistics.fmean(r["train_seconds"] for r in rs)}
            rates = [e["ad_drop_rate"] for r in rs for e in r["epochs"] if e.get("ad_drop_on")]
            if rates:
                row["ad_drop_rate_mean"] = statistics.fmean(rates)
            probs = [r["attendout_drop_prob"] for r in rs if "attendout_drop_prob" in r]
            if probs:
                row["attendout_drop_prob_mean"] = statistics.fmean(probs)
            summary.append(row)
            if m != baseline and baseline in by_method:
                common = sorted(set(by_method[m]) & set(by_method[baseline]))
                if common:
                    diffs = [by_method[m][s]["test_acc"] - by_method[baseline][s]["test_acc"] for s in common]
                    d_mean, d_std = _mean_std(diffs)
                    paired.append({"size": size, "method": m, "baseline": baseline, "seeds": len(common),
                                   "diff_mean": d_mean, "diff_std": d_std, "wins": sum(d > 0 for d in diffs),
                                   "ties": sum(d == 0 for d in diffs), "losses": sum(d < 0 for d in diffs)})
    return summary, paired


def markdown(summary: List[dict], paired: List[dict], sizes: Sequence[int], methods: Sequence[str]) -> str:
    cell = {(r["size"], r["method"]): r for r in summary}
    lines = ["Test accuracy (%), mean ± sample std over seeds, at the best dev epoch of each run.", "",
             "| method | " + " | ".join(f"{s}-shot" for s in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for m in methods:
        cells = []
        for s in sizes:
            r = cell.get((s, m))
            cells.append(f"{100 * r['test_acc_mean']:.2f} ± {100 * r['test_acc_std']:.2f}" if r else "-")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "Dev accuracy (%) of the selected epoch, mean over seeds (what the selection saw).", "",
              "| method | " + " | ".join(f"{s}-shot" for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for m in methods:
        cells = [f"{100 * cell[(s, m)]['best_dev_acc_mean']:.2f}" if (s, m) in cell else "-" for s in sizes]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if paired:
        lines += ["", "Paired difference to the baseline on the same subset and initial weights "
                  "(percentage points, mean ± sample std; wins/ties/losses over seeds).", "",
                  "| method | " + " | ".join(f"{s}-shot" for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
        pcell = {(r["size"], r["method"]): r for r in paired}
        for m in dict.fromkeys(r["method"] for r in paired):
            cells = []
            for s in sizes:
                r = pcell.get((s, m))
                cells.append(f"{100 * r['diff_mean']:+.2f} ± {100 * r['diff_std']:.2f} ({r['wins']}/{r['ties']}/{r['losses']})"
                             if r else "-")
            lines.append(f"| {m} − {paired[0]['baseline']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


