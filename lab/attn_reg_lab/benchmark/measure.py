"""Measuring a workload: round-robin timing, CPU/CUDA peak memory, rows, targets and derived rows."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

import torch

from .variants import DERIVED, VARIANTS, Step

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIB = 2**20


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cpu_step_peak_bytes(run: Callable[[], None]) -> int:
    """Peak bytes held at once by tensors that torch's CPU allocator handed out during ``run``.

    torch.profiler's allocation events carry the allocator's running total of bytes handed
    out and given back (a process-wide counter, so it is read relative to its value when the
    step starts); its maximum over the step is the step's own peak. Memory that oneDNN / BLAS
    allocate outside torch's allocator is not seen.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        extra = event.typed[1]
        if type(extra).__name__ == "_ExtraFields_Allocation" and extra.device.type == "cpu":
            events.append((event.start_time_ns, extra.total_allocated, extra.alloc_size))
    if not events:
        return 0
    events.sort()
    _, first_total, first_size = events[0]
    start = first_total - first_size  # the counter just before the step's first allocation
    return max(0, max(total for _, total, _ in events) - start)


def _torch_optimizers(obj, depth: int = 0) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside fairseq's optimizer wrappers (FairseqAdam, FP16Optimizer)."""
    if isinstance(obj, torch.optim.Optimizer):
        yield obj
        return
    if depth > 3 or obj is None:
        return
    for name in ("_optimizer", "fp32_optimizer", "wrapped_optimizer"):
        inner = getattr(obj, name, None) if name in getattr(obj, "__dict__", {}) else None
        if inner is not None:
            yield from _torch_optimizers(inner, depth + 1)


def held_bytes(model: torch.nn.Module, optimizer) -> int:
    """Bytes that stay allocated between steps: weights, buffers, optimizer state (unique storages)."""
    storages: Dict[int, int] = {}

    def add(t) -> None:
        if torch.is_tensor(t) and t.device.type == "cpu":
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            if t.grad is not None:
                add(t.grad)

    for t in model.state_dict(keep_vars=True).values():
        add(t)
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                add(p)
        for state in opt.state.values():
            for v in state.values():
                add(v)
    fp32 = getattr(optimizer, "fp32_params", None)
    for t in fp32.values() if isinstance(fp32, dict) else [fp32]:
        add(t)
    return sum(storages.values())


@dataclass
class Measurement:
    times: List[float] = field(default_factory=list)  # wall-clock seconds per measured step
    cpu_times: List[float] = field(default_factory=list)  # process CPU seconds per measured step (CPU runs)
    rounds: List[int] = field(default_factory=list)  # round of each time
    peak_total: List[int] = field(default_factory=list)  # bytes: held between steps + step peak
    peak_step: List[int] = field(default_factory=list)  # bytes: the step's own peak


def run_workload(
    name: str, steps: Dict[str, Step], bench, warmup: int, repeats: int, log, settle: bool = True
) -> Dict[str, Measurement]:
    """Round-robin over the workload's steps; time every step, and measure memory. ``settle``: each
    timed step follows an untimed one of its own (not for the variants that set their own warm-up)."""
    device = bench.device
    names = list(steps)
    out = {n: Measurement() for n in names}
    total_rounds = warmup + repeats
    for r in range(total_rounds):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        for n in order:
            step = steps[n]
            first = warmup - (step.warmup if step.warmup is not None else warmup)
            last = warmup + (step.repeats if step.repeats is not None else repeats)
            if not first <= r < last:
                continue
            with step.state():
                if settle and step.warmup is None and r >= warmup:
                    # One untimed step first, so that the timed one finds its own memory warm, as in a
                    # run that repeats it: otherwise the step after one that freed much memory pays for
                    # faulting pages in again (R-Drop after AttendOut's: 0.7 s of system time, 70k faults).
                    step.prepare(r)
                    step.run()
                step.prepare(r)
                if device == "cuda":
                    _sync(device)
                    before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                _sync(device)
                c0, t0 = time.process_time(), time.perf_counter()
                step.run()
                _sync(device)
                elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
                if r >= warmup:
                    m = out[n]
                    m.times.append(elapsed)
                    m.cpu_times.append(cpu)
                    m.rounds.append(r)
                    if device == "cuda":
                        peak = torch.cuda.max_memory_allocated()
                        m.peak_total.append(peak)
                        m.peak_step.append(peak - before)
            log(
                f"  {bench.framework}/{name} round {r + 1}/{total_rounds} {n}: {elapsed * 1e3:.0f} ms"
                + (f" (CPU {cpu * 1e3:.0f} ms)" if device == "cpu" else "")
                + ("" if r >= warmup else " (warm-up)")
            )
    if device == "cpu":
        # Separate, untimed profiled runs: the profiler's bookkeeping would distort the times.
        for n in names:
            step = steps[n]
            with step.state():
                step.prepare(total_rounds)
                held = bench.held_bytes() + (step.held() if step.held is not None else 0)
                peak = cpu_step_peak_bytes(step.run)
            out[n].peak_total.append(held + peak)
            out[n].peak_step.append(peak)
            log(
                f"  {bench.framework}/{name} memory {n}: {(held + peak) / MIB:.1f} MiB ({peak / MIB:.1f} MiB in the step)"
            )
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _round(x: Optional[float], digits: int = 3):
    return None if x is None or not math.isfinite(x) else round(x, digits)


def make_rows(framework: str, workload: str, batch: str, results: Dict[str, Measurement], bench) -> List[dict]:
    plain = results["plain"]
    plain_t = statistics.median(plain.times)
    plain_total = statistics.median(plain.peak_total)
    plain_step = statistics.median(plain.peak_step)
    plain_by_round = dict(zip(plain.rounds, plain.times))
    rows = []
    for name, m in results.items():
        t = statistics.median(m.times)
        paired = [tv / plain_by_round[r] for r, tv in zip(m.rounds, m.times) if r in plain_by_round]
        rows.append(
            {
                "framework": framework,
                "variant": name,
                "workload": workload,
                "batch": batch,
                "tokens": bench.tokens[workload],
                "time_ratio": _round(_ratio(t, plain_t)),
                "cpu_time_ratio": (
                    _round(_ratio(statistics.median(m.cpu_times), statistics.median(plain.cpu_times)))
                    if bench.device == "cpu"
                    else None
                ),
                "peak_mem_ratio": _round(_ratio(statistics.median(m.peak_total), plain_total)),
                "step_mem_ratio": _round(_ratio(statistics.median(m.peak_step), plain_step)),
                "plain_step_ms": _round(plain_t * 1e3, 1),
                "step_ms": _round(t * 1e3, 1),
                "round_ratio_min": _round(min(paired)) if paired else None,
                "round_ratio_max": _round(max(paired)) if paired else None,
                "repeats": len(m.times),
                "peak_mem_mib": _round(statistics.median(m.peak_total) / MIB, 1),
                "plain_peak_mem_mib": _round(plain_total / MIB, 1),
                "step_peak_mem_mib": _round(statistics.median(m.peak_step) / MIB, 1),
                "device": bench.device,
                "dtype": bench.opts.dtype,
            }
        )
    return rows


def add_targets(rows: List[dict], single_thread_cpu: bool) -> None:
    """Attach targets and the verdict.

    The time verdict uses the wall-clock ratio, except on CPU with one torch thread, where it
    uses the process CPU-time ratio: with one thread that is exactly the work the step did,
    while wall time also counts whatever other processes took from the shared cores.
    """
    targets = {v.name: (v.time_target, v.mem_target, v.step_mem_target, v.description) for v in VARIANTS}
    targets.update({d.name: (d.time_target, d.mem_target, None, d.description) for d in DERIVED})
    targets["plain"] = (None, None, None, "plain: stock attention, the framework's own loss (the reference)")
    for row in rows:
        time_target, mem_target, step_mem_target, description = targets[row["variant"]]
        row["description"] = description
        row["time_target"] = time_target
        row["mem_target"] = mem_target
        row["step_mem_target"] = step_mem_target
        checks = []
        judged = "cpu_time_ratio" if single_thread_cpu and row.get("cpu_time_ratio") is not None else "time_ratio"
        row["time_verdict_on"] = judged
        if time_target is not None:
            checks.append(row[judged] is not None and row[judged] <= time_target)
        if mem_target is not None:
            checks.append(row["peak_mem_ratio"] is not None and row["peak_mem_ratio"] <= mem_target)
        if step_mem_target is not None:
            checks.append(row["step_mem_ratio"] is not None and row["step_mem_ratio"] <= step_mem_target)
        row["meets_target"] = all(checks) if checks else None


def derived_rows(rows: List[dict]) -> List[dict]:
    """Cross-tuned cost from the measured steps: the run's updates split equally among ``parts``."""
    out = []
    for d in DERIVED:
        for framework in sorted({r["framework"] for r in rows}):
            parts = [r for r in rows if r["framework"] == framework and r["variant"] in d.parts]
            if len(parts) != len(d.parts) or len({r["workload"] for r in parts}) != 1:
                continue
            time_ratio = sum(r["time_ratio"] for r in parts) / len(parts)
            cpu_ratios = [r["cpu_time_ratio"] for r in parts]
            cpu_ratio = None if None in cpu_ratios else sum(cpu_ratios) / len(cpu_ratios)
            mem_ratio = max(r["peak_mem_ratio"] for r in parts)
            step_ratio = max(r["step_mem_ratio"] for r in parts)
            out.append(
                {
                    **{
                        k: parts[0][k]
                        for k in (
                            "framework",
                            "workload",
                            "batch",
                            "plain_step_ms",
                            "plain_peak_mem_mib",
                            "device",
                            "dtype",
                        )
                    },
                    "variant": d.name,
                    "time_ratio": _round(time_ratio),
                    "cpu_time_ratio": _round(cpu_ratio),
                    "peak_mem_ratio": _round(mem_ratio),
                    "step_mem_ratio": _round(step_ratio),
                    "step_ms": _round(sum(r["step_ms"] for r in parts) / len(parts), 1),
                    "round_ratio_min": None,
                    "round_ratio_max": None,
                    "repeats": min(r["repeats"] for r in parts),
                    "peak_mem_mib": max(r["peak_mem_mib"] for r in parts),
                    "step_peak_mem_mib": max(r["step_peak_mem_mib"] for r in parts),
                    "derived_from": list(d.parts),
                }
            )
    return out
