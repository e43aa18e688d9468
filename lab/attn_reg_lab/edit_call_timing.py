"""CPU time of one regularized attention call, forward and backward, at the standard benchmark's
shapes: the kernel alone, without the model around it, so that two versions of the kernel can be
compared in short back-to-back processes (a step's ratio moves with everything else in the step).

    OMP_NUM_THREADS=1 python -m attn_reg_lab.edit_call_timing            # this checkout's kernel
    (cd OLD_WORKTREE && PYTHONPATH=.:lab OMP_NUM_THREADS=1 python -m attn_reg_lab.edit_call_timing)

Prints one JSON line: {case: median milliseconds of --reps calls after 3 warm-up calls}. Cases: GA's
region with the model's attention dropout 0.1 (HF's MiniLM/BERT batch, fairseq's encoder batch), GA
without dropout, RD-like Bernoulli coins, and a 700-token call that runs block by block. Padded
batches (lengths from half to all of the keys), one torch thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import AttentionSite, EditScores, Plan, Record
from attn_reg_plugin.core.kernel.rules import BernoulliRule, GradientScores, TopRegionRule

# name: (batch, heads, tokens, head size, the model's attention dropout, rule)
CASES = {
    "hf-ga-dropout0.1 32x12x54x32": (32, 12, 54, 32, 0.1, "ga"),
    "fairseq-ga-dropout0.1 48x8x18x64": (48, 8, 18, 64, 0.1, "ga"),
    "hf-ga 32x12x54x32": (32, 12, 54, 32, 0.0, "ga"),
    "coins 32x12x54x32": (32, 12, 54, 32, 0.0, "coins"),
    "long-ga 1x12x700x32": (1, 12, 700, 32, 0.0, "ga"),
}


def call_ms(b: int, h: int, t: int, d: int, dropout_p: float, rule_kind: str, reps: int) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    lengths[0] = t
    bias = (torch.arange(t)[None, :] < lengths[:, None])[:, None, None, :]
    if rule_kind == "ga":
        rule = TopRegionRule(GradientScores(torch.randn(b, h, t, d, generator=g), v), 0.5, 0.5)
    else:
        rule = BernoulliRule(torch.tensor(0.1))
    times = []
    for i in range(reps + 3):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        site, record = AttentionSite("encoder-self", 0), Record()
        plan = Plan.asking({site: EditScores(drop=rule, counted=True)}, record)
        torch.manual_seed(i)
        start = time.process_time()
        out, _ = attend(*leaves, bias, dropout_p=dropout_p, site=site, plan=plan)
        out.sum().backward()
        times.append(time.process_time() - start)
    return statistics.median(times[3:]) * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--reps", type=int, default=60, help="measured calls per case (default 60)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    torch.set_num_threads(1)
    rows = {name: round(call_ms(*shape, args.reps), 3) for name, shape in CASES.items()}
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
