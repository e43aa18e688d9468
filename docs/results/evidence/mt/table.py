"""The MT demo's three methods on seeds 1-3 (docs/RESULTS.md): per-seed numbers, mean ± sample std,
paired differences against plain. ``python docs/results/evidence/mt/table.py [FOLDER]`` reads
FOLDER/seed{1,2,3}_{plain,AD-DROP,AttendOut}/results.json (default: the copies next to this file;
the seed loop in docs/RESULTS.md writes them to outputs/evidence/mt)."""

import json
import statistics as st
import sys
from pathlib import Path

folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent

methods, seeds = ["plain", "AD-DROP", "AttendOut"], [1, 2, 3]
r = {(s, m): json.loads((folder / f"seed{s}_{m}" / "results.json").read_text())[0] for s in seeds for m in methods}


def ms(xs, f):
    return f"{st.mean(xs):{f}} ± {st.stdev(xs):.{f[-2]}f}"


print(
    "| method | valid loss, seeds 1 / 2 / 3 | mean ± std | − plain, paired | BLEU, seeds 1 / 2 / 3 | mean ± std "
    "| − plain, paired | train s, seeds 1 / 2 / 3 |"
)
print("|---|---|---|---|---|---|---|---|")
for m in methods:
    vl = [r[s, m]["valid_loss"] for s in seeds]
    bl = [r[s, m]["test_bleu"] for s in seeds]
    dv = [r[s, m]["valid_loss"] - r[s, "plain"]["valid_loss"] for s in seeds]
    db = [r[s, m]["test_bleu"] - r[s, "plain"]["test_bleu"] for s in seeds]
    secs = " / ".join(str(round(r[s, m]["train_seconds"])) for s in seeds)
    print(
        f"| {m} | {' / '.join(f'{x:.3f}' for x in vl)} | {ms(vl, '.3f')} | {'-' if m == 'plain' else ms(dv, '+.3f')} "
        f"| {' / '.join(f'{x:.2f}' for x in bl)} | {ms(bl, '.2f')} | {'-' if m == 'plain' else ms(db, '+.2f')} | {secs} |"
    )
