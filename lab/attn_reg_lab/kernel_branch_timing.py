"""Time the attention kernel's CPU-only special cases against the plain ops they replace.

The kernel (attn_reg_plugin/core) keeps three branches that run only on the CPU, outside
torch.compile; each is worth keeping only if it beats the plain op on the CPU:

* keyless rows    ``_keyless_rows``: look on the host whether any query row has no valid key
                  (``bool(rows.any())``) and skip zeroing the output, vs always ``out.masked_fill(rows, 0)``;
* all_last        ``_all_last``: ``mask.view(torch.uint8).amin(-1)`` vs ``mask.all(-1)``;
* emptied rows    ``EditScores.resolve``: look on the host whether a drop mask empties a row
                  (``bool(emptied.any())``) and skip the repair, vs always ``drop & ~emptied`` plus the
                  uniform-row edit it then implies (``q.masked_fill(emptied, 0)``).

A fourth row times an idle call's mask preparation: what it was (finite fill, validity, keyless
rows looked for on the host) against the fast path's (finite "masked" values set to -inf).

Inputs are AD-DROP-like: right-padded sequences (no keyless row, the common case), a drop mask
with 10% of keys dropped (no emptied row). Torch only; run on an otherwise idle machine::

    python -m attn_reg_lab.kernel_branch_timing --threads 1 --reps 200
    python -m attn_reg_lab.kernel_branch_timing --threads 8 --shapes 32x12x128x128 --head-dim 64

Prints a markdown table of medians over ``--reps`` repetitions (after ``--warmup``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, List, Tuple

import torch

MASKED_BIAS = -1e4  # as attn_reg_plugin.core.masks


def median_ms(fn: Callable[[], object], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def cases(B: int, H: int, T: int, S: int, d: int, seed: int) -> List[Tuple[str, Callable, Callable]]:
    """(branch, special-cased, plain) for one shape."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, S // 2), S + 1, (B,), generator=g)
    valid = (torch.arange(S)[None, :] < lengths[:, None]).view(B, 1, 1, S)  # padding mask, every row has a key
    out = torch.randn(B, H, T, d, generator=g)
    q = torch.randn(B, H, T, d, generator=g)
    drop = (torch.rand(B, H, T, S, generator=g) < 0.1) & valid
    fill = torch.finfo(torch.float32).min / 4
    bias = torch.zeros(B, 1, 1, S).masked_fill(~valid, float("-inf"))

    def keyless_special():
        rows = ~valid.any(dim=-1, keepdim=True)
        return out if not bool(rows.any()) else out.masked_fill(rows, 0.0)

    def keyless_plain():
        rows = ~valid.any(dim=-1, keepdim=True)
        return out.masked_fill(rows, 0.0)

    def all_last_special():
        return (drop | ~valid).view(torch.uint8).amin(dim=-1, keepdim=True).bool()

    def all_last_plain():
        return (drop | ~valid).all(dim=-1, keepdim=True)

    def emptied(all_last):
        return all_last() & valid.any(dim=-1, keepdim=True)

    def emptied_special():
        rows = emptied(all_last_special)
        if bool(rows.any()):
            return drop & ~rows, q.masked_fill(rows, 0.0)
        return drop, q

    def emptied_plain():
        rows = emptied(all_last_special)
        return drop & ~rows, q.masked_fill(rows, 0.0)

    def idle_prepared():  # what an idle call did before the fast path
        ok = bias > MASKED_BIAS
        prepared = bias.clamp(min=fill)
        rows = ~ok.any(dim=-1, keepdim=True)
        return prepared if not bool(rows.any()) else (prepared, rows)

    def idle_fast():
        return torch.where(bias > MASKED_BIAS, bias, float("-inf"))

    return [
        ("keyless rows (host check)", keyless_special, keyless_plain),
        ("all_last (uint8 view)", all_last_special, all_last_plain),
        ("emptied rows (host check)", emptied_special, emptied_plain),
        ("idle mask prep (fast path / before)", idle_fast, idle_prepared),
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes",
        default="32x4x54x54,32x12x128x128",
        help="comma-separated BxHxTxS (batch, heads, queries, keys); default: demo-like, BERT-like",
    )
    parser.add_argument("--head-dim", type=int, default=64, help="d of q and the output (default 64)")
    parser.add_argument("--reps", type=int, default=100, help="timed repetitions per op; the median is shown")
    parser.add_argument("--warmup", type=int, default=5, help="untimed repetitions first")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, median of {args.reps}\n"
    )
    print("| branch | shape | special-cased (ms) | plain (ms) | plain / special |")
    print("|---|---|---:|---:|---:|")
    for spec in args.shapes.split(","):
        B, H, T, S = (int(x) for x in spec.lower().split("x"))
        for name, special, plain in cases(B, H, T, S, args.head_dim, args.seed):
            a = median_ms(special, args.reps, args.warmup)
            b = median_ms(plain, args.reps, args.warmup)
            print(f"| {name} | {spec} | {a:.3f} | {b:.3f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
