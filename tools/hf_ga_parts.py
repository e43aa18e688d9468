#!/usr/bin/env python
"""Where an HF AD-DROP GA step's time goes, against the plain step, on the benchmark's own batch.

``attn-reg-benchmark`` gives the GA step as one ratio to plain (issue 41 asks at most 1.72x). This
splits it, in one process, the plain and the GA step alternating: the attribution pass
(``ADDrop.attributions``: pass 1's forward and ``autograd.grad``), the forward the Trainer's
``compute_loss`` runs (plain's, and pass 2's with its drops), and the rest of each step (backward,
optimizer step). Process CPU time, medians over the rounds after the first two.

    .venv/bin/python tools/hf_ga_parts.py            # MiniLM, 32 x 54 tokens, one thread, 10 rounds
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
import transformers

from attn_reg_lab.benchmark import variants
from attn_reg_lab.benchmark.cli import parse_args
from attn_reg_lab.benchmark.hf_bench import HFBench
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench = HFBench(parse_args(["--threads", "1"]), lambda line: None)
    ga_variant = next(v for v in variants.VARIANTS if v.name == "ad-drop-ga-all")
    steps = {"plain": bench.reference("train"), "ga": ga_variant.builders["hf"](bench, "train")}
    times = defaultdict(list)
    running = [""]

    def timed(owner, name, part):
        inner = getattr(owner, name)

        def wrapper(*a, **kw):
            start = time.process_time()
            try:
                return inner(*a, **kw)
            finally:
                times[f"{running[0]} {part}"].append(time.process_time() - start)

        setattr(owner, name, wrapper)

    timed(ADDrop, "attributions", "attribution pass")
    # ADDropTrainer's pass 2 is the Trainer's own compute_loss under the drops; plain calls it directly.
    timed(transformers.Trainer, "compute_loss", "forward")
    for _ in range(args.rounds):
        for name, step in steps.items():
            running[0] = name
            with step.state():
                step.prepare(0)
                start = time.process_time()
                step.run()
                times[f"{name} step"].append(time.process_time() - start)
    ms = {key: 1000 * statistics.median(values[2:]) for key, values in times.items()}
    plain = ms["plain step"]
    parts = [
        ("plain step", ms["plain step"]),
        ("  forward", ms["plain forward"]),
        ("  backward + optimizer", ms["plain step"] - ms["plain forward"]),
        ("GA step", ms["ga step"]),
        ("  attribution pass", ms["ga attribution pass"]),
        ("  pass-2 forward", ms["ga forward"]),
        ("  backward + optimizer", ms["ga step"] - ms["ga attribution pass"] - ms["ga forward"]),
    ]
    print("| part | CPU ms | x plain step |\n|---|---:|---:|")
    for label, value in parts:
        print(f"| {label} | {value:.0f} | {value / plain:.2f} |")


if __name__ == "__main__":
    main()
