"""Step memory and CPU time of each attention regularizer against sequence length (``attn-reg-scaling``).

    attn-reg-scaling                                      # 3 models, 128 .. 8192 tokens, one thread
    attn-reg-scaling --models a --lengths 512,1024,2048 --methods plain,ga
    attn-reg-scaling --quick --out-dir outputs/scaling_quick   # lengths 32 and 64, a smoke run

Models (``--models``, batch 1, random tokens, one fixed label):

* ``a``: an encoder written with the plugin's porting API (``attn_reg_plugin.core``: sites
  registered with a ``RegularizationController``, ``attend(q, k, v, bias=key_padding, site=...)``),
  width 64, 2 heads, 2 layers, FFN 4x, a 2-class head on the mean state (``logit_target``);
* ``b``: the same encoder at BERT-base width (768, 12 heads), 2 layers;
* ``c``: a tiny Llama (hidden 64, 4 heads, 2 layers; ``transformers.LlamaConfig``, sdpa, no
  download) trained as a causal LM through the Trainers: the stock ``transformers.Trainer`` for
  plain, ``ADDropTrainer`` for AD-DROP, ``AttnRegTrainer`` for scheduled dropout,
  ``AttendOutTrainer`` for AttendOut;
* ``d``: a wider tiny Llama (hidden 128, 4 heads, 2 key/value heads, 4 layers) through the same
  Trainers with ``gradient_checkpointing=True`` for plain and regularized runs alike.

Methods (``--methods``): ``plain``; AD-DROP (all layers, p = q = 0.3, schedule ``always``) with
gradient (``ga``), attention-weight (``aa``), random (``rd``) and integrated-gradient (``iga``,
by default only up to ``--iga-max-length`` 512 tokens) attribution; ``sched-dropout`` (scheduled
Bernoulli attention dropout, 0.3 falling to 0.1 by update 10,000); ``attendout`` (Defender +
Attacker + Generator, one update of the duel: the held-out evaluation every T updates is not in it);
``attendout-update`` (every update ends a dropout step: one update of the duel and the Generator's
REINFORCE update; on models a and b the batch's losses stand for the held-out ones, on c and d the
Trainer scores its one held-out row); ``hiddencut`` (``HiddenCutTrainer``, the paper's settings; models
c and d only).

Every (model, method, length) runs in a fresh subprocess with ``--threads`` torch threads
(``OMP_NUM_THREADS`` too), so no peak or resident memory leaks from one run into the next. What it
measures:

* models a and b: ``--warmup`` training steps, then ``--repeats`` timed steps (the median process
  CPU time per step; with one thread, the step's own work), then one more step under
  torch.profiler for the **step memory**: the peak of the bytes torch's CPU allocator holds during
  the step above what it held before it (:func:`attn_reg_lab.benchmark.measure.cpu_step_peak_bytes`,
  as ``attn-reg-benchmark`` measures it). The process's resident-set growth over the timed steps
  is recorded too (``rss_growth_mib``);
* models c and d: ``Trainer.train()`` for ``--hf-steps`` steps; the memory is the **process RSS growth**
  (peak resident set during ``train()``, Linux VmHWM reset before it, minus the resident set
  before it, in a run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the
  resident set); the time is the median CPU time of the steps after the first, in a second run
  with the default allocator (that threshold makes every large allocation a fresh mapping whose
  pages fault in, which slows code that allocates per block far more than the stock Trainer).

A run that exceeds ``--timeout`` seconds, or runs out of memory (each run's data segment is capped
at ``--max-memory-gib``, so an allocation that would exceed it fails inside torch), is recorded with
that status; longer lengths of the same model and method are then skipped, not run.

Written to ``--out-dir``: ``scaling.json`` (settings, environment, every run), ``scaling.png``
(per model, step memory and CPU time against length, log-log, one line per method) and
``results.md`` (the command line, the table, the verdict against the targets).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from .paths import REPO
from .scaling_worker import (
    AD_DROP_P,
    AD_DROP_Q,
    DEFAULT_LENGTHS,
    METHODS,
    MODELS,
    RESULT_MARK,
    TRAINER_ONLY_METHODS,
    default_iga_steps,
    worker,
)

# The targets (CPU, one thread): (model, method, length, metric, bound, what); issue 32's, issue 41's
# for gradient checkpointing (d), issue 58's for AttendOut, then issue 60's for HiddenCut.
TARGETS = (
    ("a", "ga", 4096, "mem_ratio", 1.5, "AD-DROP GA step memory <= 1.5x plain at 4096 tokens on (a)"),
    ("a", "ga", 4096, "time_ratio", 5.0, "AD-DROP GA CPU time <= 5x plain at 4096 tokens on (a)"),
    ("a", "ga", 8192, "runs", None, "every length up to 8192 runs on (a) (AD-DROP GA)"),
    ("b", "ga", 2048, "mem_ratio", 1.3, "AD-DROP GA step memory <= 1.3x plain at 2048 tokens on (b)"),
    ("b", "ga", 2048, "time_ratio", 2.5, "AD-DROP GA CPU time <= 2.5x plain at 2048 tokens on (b)"),
    ("c", "ga", 4096, "mem_ratio", 2.0, "ADDropTrainer GA process memory growth <= 2x the stock Trainer's at 4096 on (c)"),
    ("c", "ga", 4096, "time_ratio", 6.0, "ADDropTrainer GA CPU time <= 6x the stock Trainer's at 4096 on (c)"),
    (
        "d", "ga", 4096, "mem_ratio", 1.3,
        "ADDropTrainer GA RSS growth <= 1.3x the stock Trainer's, both with gradient checkpointing, at 4096 on (d)",
    ),
    ("a", "attendout", 4096, "mem_ratio", 1.5, "AttendOut step memory <= 1.5x plain at 4096 tokens on (a)"),
    ("a", "attendout", 4096, "time_ratio", 3.0, "AttendOut CPU time <= 3x plain at 4096 tokens on (a)"),
    ("a", "attendout", 8192, "mem_ratio", 1.6, "AttendOut step memory <= 1.6x plain at 8192 tokens on (a)"),
    ("c", "attendout", 4096, "mem_ratio", 2.5, "AttendOutTrainer RSS growth <= 2.5x the stock Trainer's at 4096 on (c)"),
    (
        "d", "attendout", 4096, "mem_ratio", 2.5,
        "AttendOutTrainer RSS growth <= 2.5x the stock Trainer's, both with gradient checkpointing, at 4096 on (d)",
    ),
    ("c", "hiddencut", 4096, "mem_ratio", 2.2, "HiddenCutTrainer RSS growth <= 2.2x the stock Trainer's at 4096 on (c)"),
)  # fmt: skip


# ===================================================================== the parent: the grid
def _memory_limit_bytes(gib: Optional[float]) -> Optional[int]:
    if gib is not None:
        return int(gib * 2**30) if gib > 0 else None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * 0.75)
    except OSError:
        pass
    return None


def run_one(spec: dict, opts) -> dict:
    """Run ``spec`` in a fresh interpreter; its result, or a status (timeout, oom, killed, error).
    Models c and d run twice: for its resident-set growth (small allocations returned to the system) and
    for its time (the default allocator)."""
    if MODELS[spec["model"]]["kind"] != "hf":
        return _run_worker(spec, opts, {})
    memory = _run_worker(spec, opts, {"MALLOC_MMAP_THRESHOLD_": "65536"})
    if memory.get("status") != "ok":
        return memory
    timing = _run_worker(spec, opts, {})
    if timing.get("status") != "ok":
        return timing
    keys = ("cpu_s", "wall_s", "cpu_s_all")
    seconds = round(memory["seconds"] + timing["seconds"], 2)
    return {**memory, **{k: timing[k] for k in keys}, "seconds": seconds}


def _run_worker(spec: dict, opts, extra_env: Dict[str, str]) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(opts.threads),
        "MKL_NUM_THREADS": str(opts.threads),
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "lab"), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    env.update(extra_env)
    limit = opts.memory_limit

    def cap_memory():
        if limit:
            import resource

            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    cmd = [sys.executable, "-m", "attn_reg_lab.scaling", "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(
            cmd, env=env, text=True, capture_output=True,
            timeout=opts.timeout, preexec_fn=cap_memory, cwd=str(REPO),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"over --timeout {opts.timeout:g} s", "seconds": opts.timeout}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    if proc.returncode < 0 and -proc.returncode == 9:
        return {"status": "oom", "reason": "killed by SIGKILL (the kernel's out-of-memory killer?)"}
    tail = (proc.stderr or proc.stdout)[-2000:]
    oom = any(s in tail.lower() for s in ("can't allocate memory", "cannot allocate memory", "memoryerror"))
    return {"status": "oom" if oom else "error", "reason": f"exit status {proc.returncode}: {tail}"}


def _ratio(a, b) -> Optional[float]:
    if a is None or b is None or not b:
        return None
    return round(a / b, 3)


def add_ratios(runs: List[dict]) -> None:
    plain = {(r["model"], r["length"]): r for r in runs if r["method"] == "plain" and r["status"] == "ok"}
    for r in runs:
        p = plain.get((r["model"], r["length"]))
        ok = r["status"] == "ok" and p is not None
        r["mem_ratio"] = _ratio(r.get("memory_mib"), p.get("memory_mib")) if ok else None
        r["time_ratio"] = _ratio(r.get("cpu_s"), p.get("cpu_s")) if ok else None
        extra = r.get("memory_mib") - p.get("memory_mib") if ok and r.get("memory_mib") is not None else None
        r["extra_memory_mib"] = None if extra is None else round(extra, 2)


def verdicts(runs: List[dict], models: List[str], lengths: List[int]) -> List[dict]:
    """The targets: met (True), missed (False) or not measured (None) in this run."""
    by_key = {(r["model"], r["method"], r["length"]): r for r in runs}
    out = []
    for model, method, length, metric, bound, what in TARGETS:
        value, met = None, None
        if model in models:
            if metric == "runs":
                wanted = [n for n in lengths if n <= length]
                rows = [by_key.get((model, method, n)) for n in wanted]
                if length in lengths and all(rows):
                    failed = [n for n, r in zip(wanted, rows) if r["status"] != "ok"]
                    value = "all ran" if not failed else f"failed at {', '.join(map(str, failed))}"
                    met = not failed
            else:
                r = by_key.get((model, method, length))
                if r is not None and r["status"] != "ok":
                    value, met = r["status"], False
                elif r is not None and r.get(metric) is not None:
                    value = r[metric]
                    met = value <= bound
        out.append({"target": what, "model": model, "method": method, "length": length, "metric": metric,
                    "bound": bound, "value": value, "met": met})  # fmt: skip
    return out


def _fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_tables(runs: List[dict], models: List[str]) -> str:
    lines = []
    for model in models:
        rows = [r for r in runs if r["model"] == model]
        if not rows:
            continue
        metric = next((r["memory_metric"] for r in rows if r.get("memory_metric")), "memory")
        lines += [
            f"### ({model}) {MODELS[model]['description']}",
            "",
            f"| length | method | memory MiB ({metric}) | × plain | CPU time s / step | × plain | status |",
            "|---:|---|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            status = r["status"] if r["status"] == "ok" else f"**{r['status']}**"
            lines.append(
                f"| {r['length']} | {r['method']} | {_fmt(r.get('memory_mib'), 1)} | {_fmt(r.get('mem_ratio'))} | "
                f"{_fmt(r.get('cpu_s'), 3)} | {_fmt(r.get('time_ratio'))} | {status} |"
            )
        lines.append("")
    return "\n".join(lines)


def format_verdicts(checks: List[dict]) -> str:
    lines = ["| target (CPU, one thread) | measured | verdict |", "|---|---:|---|"]
    for c in checks:
        value = c["value"]
        shown = f"{value:.2f}×" if isinstance(value, float) else ("-" if value is None else str(value))
        verdict = {True: "met", False: "**missed**", None: "not measured"}[c["met"]]
        lines.append(f"| {c['target']} | {shown} | {verdict} |")
    return "\n".join(lines)


def plot(runs: List[dict], models: List[str], methods: List[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in models if any(r["model"] == m for r in runs)]
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.8 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        for method in methods:
            pts = [r for r in runs if r["model"] == model and r["method"] == method and r["status"] == "ok"]
            for ax, key in zip(row, ("memory_mib", "cpu_s")):
                xy = [(r["length"], r[key]) for r in pts if r.get(key)]
                if xy:
                    ax.plot(*zip(*xy), marker="o", label=method)
        metric = next((r["memory_metric"] for r in runs if r["model"] == model and r.get("memory_metric")), "memory")
        for ax, label in zip(row, (f"{metric} (MiB)", "CPU time per step (s)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length (tokens)")
            ax.set_ylabel(label)
            ax.set_title(f"({model}) {MODELS[model]['description']}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _csv(text: str) -> List[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="attn-reg-scaling",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", default="a,b,c,d", help="comma list of a, b, c, d (see the module docstring)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--lengths", help="comma list of sequence lengths (default 128,...,8192; quick 32,64)")
    parser.add_argument("--iga-max-length", type=int, default=512, help="IGA runs only up to this length (512)")
    parser.add_argument("--iga-steps", type=int, help="m of integrated gradients (default ADDropConfig's, quick 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads and OMP_NUM_THREADS of each run (1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before measuring (1)")
    parser.add_argument(
        "--repeats", type=int, help="timed steps of models a, b; the median is taken (default 2, quick 1)"
    )
    parser.add_argument(
        "--hf-steps", type=int, help="Trainer steps of models c, d; the first is not timed (default 3, quick 2)"
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per run before it is recorded as a timeout"
    )
    parser.add_argument(
        "--max-memory-gib", type=float,
        help="cap of each run's data segment (RLIMIT_DATA; default 75%% of the memory available at start; 0: none)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke run: lengths 32,64, 1 timed step, IGA m = 3")
    parser.add_argument(
        "--profile", action="store_true",
        help="models a, b: one more step under torch.profiler; its top operators by self CPU time are printed",
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=Path("outputs") / "scaling")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        return opts
    models = _csv(opts.models)
    bad = [m for m in models if m not in MODELS]
    if not models or bad:
        parser.error(f"--models: unknown {bad[0] if bad else opts.models!r}; accepted: a comma list of a, b, c, d")
    methods = _csv(opts.methods)
    bad = [m for m in methods if m not in METHODS]
    if not methods or bad:
        parser.error(f"--methods: unknown {bad[0] if bad else opts.methods!r}; accepted: {', '.join(METHODS)}")
    if "plain" not in methods:
        methods.insert(0, "plain")  # the reference of every ratio
    methods = [m for m in METHODS if m in methods]
    try:
        lengths = sorted({int(x) for x in _csv(opts.lengths)}) if opts.lengths else None
    except ValueError:
        parser.error(f"--lengths must be a comma list of integers, got {opts.lengths!r}")
    if lengths is None:
        lengths = [32, 64] if opts.quick else list(DEFAULT_LENGTHS)
    if not lengths or lengths[0] < 2:
        parser.error(f"--lengths must be integers >= 2, got {opts.lengths!r}")
    if opts.iga_steps is None:  # IGA's m: ADDropConfig's default, read, not repeated (3 is quick's own)
        opts.iga_steps = 3 if opts.quick else default_iga_steps()
    defaults = dict(repeats=1 if opts.quick else 2, hf_steps=2 if opts.quick else 3)
    for key, value in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    for key, low in (("iga_steps", 1), ("threads", 1), ("warmup", 0), ("repeats", 0), ("hf_steps", 1)):
        if getattr(opts, key) < low:
            parser.error(f"--{key.replace('_', '-')} must be an integer >= {low}, got {getattr(opts, key)}")
    if opts.timeout <= 0:
        parser.error(f"--timeout must be > 0, got {opts.timeout}")
    opts.models, opts.methods, opts.lengths = models, methods, lengths
    opts.memory_limit = _memory_limit_bytes(opts.max_memory_gib)
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.worker:
        result = worker(json.loads(opts.worker))
        print(RESULT_MARK + json.dumps(result), flush=True)
        return 0
    from .provenance import environment

    opts.out_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["attn-reg-scaling", *map(shlex.quote, argv if argv is not None else sys.argv[1:])])
    load_before = os.getloadavg()
    started = time.time()
    runs: List[dict] = []
    failed_at: Dict[tuple, int] = {}
    for model in opts.models:
        for length in opts.lengths:
            for method in opts.methods:
                base = {"model": model, "method": method, "length": length}
                if method == "iga" and length > opts.iga_max_length:
                    runs.append(
                        {
                            **base,
                            "status": "skipped",
                            "reason": f"IGA only up to --iga-max-length {opts.iga_max_length}",
                        }
                    )
                    continue
                if method in TRAINER_ONLY_METHODS and MODELS[model]["kind"] != "hf":
                    runs.append({**base, "status": "skipped", "reason": "runs through its Trainer: models c and d"})
                    continue
                if (model, method) in failed_at:
                    first = failed_at[(model, method)]
                    runs.append({**base, "status": "skipped", "reason": f"did not complete at {first} tokens"})
                    continue
                spec = {
                    **base, "seed": opts.seed, "threads": opts.threads, "warmup": opts.warmup,
                    "repeats": opts.repeats, "hf_steps": opts.hf_steps, "iga_steps": opts.iga_steps,
                    "profile": opts.profile,
                }  # fmt: skip
                result = run_one(spec, opts)
                run = {**base, **result}
                runs.append(run)
                if run["status"] in ("oom", "timeout", "error"):
                    failed_at[(model, method)] = length
                shown = (
                    f"{_fmt(run.get('memory_mib'), 1)} MiB, {_fmt(run.get('cpu_s'), 3)} s CPU/step"
                    if run["status"] == "ok"
                    else f"{run['status']}: {run.get('reason', '')[:300]}"
                )
                print(f"({model}) {length:>5} {method:<13} {shown}  [{run.get('seconds', '-')} s]", flush=True)
                for op in run.get("profile") or []:
                    print(f"        {op['self_cpu_ms']:>9.1f} ms  {op['calls']:>5} calls  {op['op']}")
    add_ratios(runs)
    checks = verdicts(runs, opts.models, opts.lengths)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items() if k != "worker"}
    result = {
        "command": command,
        "settings": settings,
        "models": {m: MODELS[m] for m in opts.models},
        "ad_drop": {"p": AD_DROP_P, "q": AD_DROP_Q, "layers": "all", "schedule": "always"},
        "environment": environment(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.time() - started, 1),
        "runs": runs,
        "verdicts": checks,
    }
    (opts.out_dir / "scaling.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(runs, opts.models, opts.methods, opts.out_dir / "scaling.png")
    tables, verdict = format_tables(runs, opts.models), format_verdicts(checks)
    note = (
        f"Memory: (a), (b) torch's CPU allocator peak during one training step; (c), (d) process RSS growth over "
        f"{opts.hf_steps} Trainer steps. CPU time: median process CPU time per step, {opts.threads} thread(s). "
        f"Load average before {result['load_average_before']}, after {result['load_average_after']}; "
        f"{result['seconds']} s."
    )
    md = f"# attn-reg-scaling\n\n```\n{command}\n```\n\n{note}\n\n{tables}\n## Verdict (the targets)\n\n{verdict}\n"
    (opts.out_dir / "results.md").write_text(md)
    print()
    print(tables)
    print("Verdict (the targets, CPU, one thread):")
    print(verdict)
    print(f"\n{note}\nwrote {opts.out_dir / 'scaling.json'}, scaling.png, results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
