"""Time the kernel's device helpers (attn_reg_plugin/core/kernel/devices.py): each CPU branch against the
portable branch an accelerator runs, on the CPU.

* keyless rows / all_last / emptied rows   ``on_host``'s host looks: look whether any row needs the
                  edit (``bool(rows.any())``) and skip it, vs always editing; ``all_last`` as a byte
                  minimum vs ``mask.all(-1)``;
* k-th largest    ``on_host``: numpy's selection vs ``torch.topk`` (each row's threshold);
* pack bits       ``on_host``: numpy's ``packbits`` vs shifts on 64-bit words (kept drops);
* softmax stats   ``has_cpu_softmax_stats``: a blockwise call with Bernoulli drops, forward and
                  backward, the backward from the rows' log-sum-exp vs recomputing each block;
* ordinary masked call   not a helper: the one path every device runs (finite fill, keyless rows
                  zeroed) vs stock sdpa given ``-inf`` (what the CPU alone ran before).

Inputs are AD-DROP-like: right-padded sequences (no keyless row, the common case), a drop mask
with 10% of keys dropped (no emptied row). Run on an otherwise idle machine::

    python -m attn_reg_lab.kernel_branch_timing --threads 1 --reps 100

Prints a markdown table of medians over ``--reps`` repetitions (after ``--warmup``); the blockwise
row over ``--reps // 20`` (at least 3).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, List, Tuple

import torch

from attn_reg_plugin.core.kernel import devices
from attn_reg_plugin.core.kernel.masks import pack_bits
from attn_reg_plugin.core.kernel.rules import kth_largest


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

    k_rows = torch.randint(1, S + 1, (B, H, T, 1), generator=g)
    scores = torch.randn(B, H, T, S, generator=g)

    def ordinary_one_path():  # attend() without a site: the kernel's ordinary call
        from attn_reg_plugin.core.kernel.attention import attend

        return attend(q, q[:, :, :S], q[:, :, :S], bias)[0]

    def ordinary_stock():
        return torch.nn.functional.scaled_dot_product_attention(q, q[:, :, :S], q[:, :, :S], attn_mask=bias)

    return [
        ("keyless rows (host check)", keyless_special, keyless_plain),
        ("all_last (uint8 view)", all_last_special, all_last_plain),
        ("emptied rows (host check)", emptied_special, emptied_plain),
        ("k-th largest (numpy / topk)", *both_ways(lambda: kth_largest(scores, k_rows))),
        ("pack bits (numpy / shifts)", *both_ways(lambda: pack_bits(drop))),
        ("ordinary masked call (stock -inf / one path)", ordinary_stock, ordinary_one_path),
    ]


def both_ways(fn: Callable[[], object]) -> Tuple[Callable, Callable]:
    """``fn`` on the CPU branches, and with ATTN_REG_PORTABLE=1 on the portable ones."""

    def portable():
        devices.PORTABLE = True
        try:
            return fn()
        finally:
            devices.PORTABLE = False

    return fn, portable


def blockwise_call(T: int, d: int, seed: int) -> Tuple[str, Callable, Callable]:
    """A (1, 12, T, T) call with Bernoulli(0.1) drops, block by block, forward and backward."""
    from attn_reg_plugin.core.kernel.attention import attend
    from attn_reg_plugin.core.kernel.attention_call import EditScores
    from attn_reg_plugin.core.kernel.controller import RegularizationController
    from attn_reg_plugin.core.kernel.rules import BernoulliRule

    controller = RegularizationController()
    site = controller.register("encoder-self", 0)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 12, T, d, generator=g).requires_grad_() for _ in range(3))

    def run():
        with controller.hooks({site: EditScores(drop=BernoulliRule(torch.tensor(0.1)))}):
            out, _ = attend(q, k, v, None, site=site)
        out.sum().backward()

    return (f"softmax stats: blockwise call, fwd+bwd (1x12x{T}x{T})", *both_ways(run))


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
    parser.add_argument("--blockwise-tokens", type=int, default=2048, help="T of the blockwise row (default 2048)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, median of {args.reps}\n"
    )
    print("| branch | shape | CPU branch (ms) | portable (ms) | portable / CPU |")
    print("|---|---|---:|---:|---:|")
    for spec in args.shapes.split(","):
        B, H, T, S = (int(x) for x in spec.lower().split("x"))
        for name, special, plain in cases(B, H, T, S, args.head_dim, args.seed):
            a = median_ms(special, args.reps, args.warmup)
            b = median_ms(plain, args.reps, args.warmup)
            print(f"| {name} | {spec} | {a:.3f} | {b:.3f} | {b / a:.2f} |")
    name, special, plain = blockwise_call(args.blockwise_tokens, args.head_dim, args.seed)
    reps = max(3, args.reps // 20)
    a, b = median_ms(special, reps, 1), median_ms(plain, reps, 1)
    print(f"| {name} | - | {a:.3f} | {b:.3f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
