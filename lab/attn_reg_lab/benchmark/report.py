"""Output: the table and the machine description."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import List

import torch


def _fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(rows: List[dict]) -> str:
    head = (
        "| framework | variant | plain ms | variant ms | time × | CPU time × | peak mem × | step mem × | "
        "round ratios | target (time / mem) | meets |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        target = (
            "-"
            if r.get("time_target") is None and r.get("mem_target") is None and r.get("step_mem_target") is None
            else f"≤ {_fmt(r.get('time_target'))} / ≤ {_fmt(r.get('mem_target'))}".replace("≤ -", "-")
        )
        if r.get("step_mem_target") is not None:
            target += f" (step ≤ {_fmt(r['step_mem_target'])})"
        spread = "-" if r.get("round_ratio_min") is None else f"{r['round_ratio_min']:.2f}–{r['round_ratio_max']:.2f}"
        meets = {None: "", True: "yes", False: "**no**"}[r.get("meets_target")]
        lines.append(
            f"| {r['framework']} | {r['variant']} | {_fmt(r['plain_step_ms'], 1)} | {_fmt(r['step_ms'], 1)} | "
            f"{_fmt(r['time_ratio'])} | {_fmt(r.get('cpu_time_ratio'))} | {_fmt(r['peak_mem_ratio'], 3)} | {_fmt(r['step_mem_ratio'], 2)} | "
            f"{spread} | {target} | {meets} |"
        )
    return "\n".join(lines)


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        cpu = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), cpu)
    except (OSError, subprocess.SubprocessError):
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
