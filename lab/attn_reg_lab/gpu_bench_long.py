"""The long section of ``attn-reg-gpu-bench`` (:mod:`.gpu_bench`): a Llama-shaped decoder trained as
a causal LM at each length, plain and each method, in bf16 with gradient checkpointing; the run's
budget (:class:`Clock`); and the switch that runs AD-DROP GA on the fused Triton kernel for one row."""

from __future__ import annotations

import contextlib
import gc
import shutil
import statistics
import time
from typing import Dict, List, Optional

LONG_METHODS = ("plain", "ga-fused", "ga", "attendout", "hiddencut")
LONG_VARIANT_NAMES = {
    "plain": "plain", "ga-fused": "ad-drop-ga-all-fused", "ga": "ad-drop-ga-all", "attendout": "attendout",
    "hiddencut": "hiddencut",
}  # fmt: skip
# ga-fused: AD-DROP GA with ATTN_REG_FUSED on (the fused Triton kernel where it covers a call).
FUSED_METHODS = {"ga-fused": "ga"}


class Clock:
    """The run's budget: the seconds left of it."""

    def __init__(self, budget_s: float):
        self.deadline = time.monotonic() + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _long_trainer(method: str, opts, length: int, steps: int):
    """A fresh Llama-shaped decoder and the Trainer that trains it with ``method``."""
    import tempfile

    import torch
    import transformers

    from attn_reg_plugin.hf.trainer_arguments import checkpointing_argument

    from .scaling_worker import method_trainer

    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        hidden_size=opts.long_width, intermediate_size=int(2.75 * opts.long_width) // 64 * 64 or 64,
        num_hidden_layers=opts.long_layers, num_attention_heads=opts.long_heads,
        num_key_value_heads=opts.long_kv_heads, vocab_size=opts.long_vocab, max_position_embeddings=length,
        pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(steps):
        ids = torch.randint(3, opts.long_vocab, (length,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    tmp = tempfile.mkdtemp(prefix="attn_reg_gpu_bench_")
    args = transformers.TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=1, max_steps=steps, learning_rate=1e-4,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, bf16=True,
        use_cpu=opts.device == "cpu", seed=1, dataloader_num_workers=0, **checkpointing_argument(True),
    )  # fmt: skip
    return method_trainer(method, dict(model=model, args=args, train_dataset=rows), length)


def _measure_long(method: str, opts, length: int, clock: Clock, log) -> dict:
    import torch
    import transformers

    cuda = opts.device == "cuda"
    times: List[float] = []
    profiled = f"{LONG_VARIANT_NAMES[method]}@{length}" in opts.profile
    found: Dict[str, object] = {}

    class StepTimes(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            if state.global_step == opts.long_steps:  # the timed steps are done: this one is profiled
                found["peak"] = torch.cuda.max_memory_allocated() if cuda else None
                activities = [torch.profiler.ProfilerActivity.CPU]
                activities += [torch.profiler.ProfilerActivity.CUDA] if cuda else []
                self.profile = torch.profiler.profile(activities=activities)
                self.profile.__enter__()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            if state.global_step > opts.long_steps:
                self.profile.__exit__(None, None, None)
                order = "self_cuda_time_total" if cuda else "self_cpu_time_total"
                found["profile"] = self.profile.key_averages().table(sort_by=order, row_limit=30)
                return
            times.append(time.perf_counter() - self.start)
            log(f"  long {method} {length}: step {len(times)} {times[-1] * 1e3:.0f} ms")
            if clock.left() < 0:
                control.should_training_stop = True  # the budget is spent: the rows so far still count

    trainer = _long_trainer(FUSED_METHODS.get(method, method), opts, length, opts.long_steps + profiled)
    trainer.add_callback(StepTimes())
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    try:
        with fused_kernel(method in FUSED_METHODS) as fused_calls:
            trainer.train()
        peak = found.get("peak", torch.cuda.max_memory_allocated() if cuda else None)
        checkpointed = bool(trainer.model.is_gradient_checkpointing)
    finally:
        shutil.rmtree(trainer.args.output_dir, ignore_errors=True)  # nothing saved there; the folder goes
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    measured = times[1:]
    row = {
        "time_ms": round(statistics.median(measured) * 1e3, 1) if measured else None,
        "peak_mem_mib": round(peak / 2**20, 1) if peak is not None else None,
        "step_ms_all": [round(t * 1e3, 1) for t in times],
        "gradient_checkpointing": checkpointed,
        "status": "ok" if measured else "not run: budget spent after the warm-up step",
    }
    if method in FUSED_METHODS:
        row["fused_calls"] = fused_calls[0]
        if not fused_calls[0]:
            row["status"] = "the fused kernel took no call: every call ran on the PyTorch path"
    if "profile" in found:
        row["profile"] = found["profile"]
    return row


@contextlib.contextmanager
def fused_kernel(on: bool):
    """The plugin's ATTN_REG_FUSED switch (devices.FUSED) forced on or off (``on``) for one run, and a count of
    the calls the fused kernel took, made where blockwise.edit_attention calls it."""
    from attn_reg_plugin.core.kernel import devices, fused_edit

    calls, original, before = [0], fused_edit.fused_edit_attention, devices.FUSED

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    devices.FUSED, fused_edit.fused_edit_attention = on, counted
    try:
        yield calls
    finally:
        devices.FUSED, fused_edit.fused_edit_attention = before, original


def fused_kernel_missing(device: str) -> Optional[str]:
    """Why the fused Triton kernel cannot run on ``device`` (no Triton, no GPU its driver sees, a Triton
    the kernel cannot use), or None."""
    import torch

    try:
        from attn_reg_plugin.core.kernel import fused_edit

        if fused_edit.available(torch.empty(0, device=device)):
            return None
    except Exception as error:  # an older Triton without the API the kernel uses: said, not fatal
        return f"not run: the fused Triton kernel cannot load ({type(error).__name__}: {error})"
    return f"not run: the fused Triton kernel does not run on {device} here"


def long_rows(opts, clock: Clock, log) -> List[dict]:
    """Each length ascending, plain first; a method out of memory or out of time is not tried longer."""
    import torch

    from .gpu_cost_fit import ROUTES  # each row's route, as attn-reg-gpu-cost labels its rows

    rows: List[dict] = []
    given_up: Dict[str, str] = {}
    last_run_s: Dict[str, tuple] = {}  # method -> (length, seconds of its run): the next length's estimate
    model = (
        f"Llama-shaped decoder, {opts.long_layers} layers x {opts.long_width} wide, {opts.long_heads} query / "
        f"{opts.long_kv_heads} key-value heads, vocabulary {opts.long_vocab}, batch 1, bf16, gradient checkpointing"
    )
    for length in opts.long_lengths:
        for method in LONG_METHODS:
            row = {
                "section": "long", "framework": "hf", "variant": LONG_VARIANT_NAMES[method], "tokens": length,
                "dtype": "bf16", "model": model, "route": ROUTES["fused" if method in FUSED_METHODS else "pytorch"][1],
            }  # fmt: skip
            missing = fused_kernel_missing(opts.device) if method in FUSED_METHODS else None
            if missing:
                given_up[method] = missing
            if method in given_up:
                row["status"] = given_up[method]
                rows.append(row)
                continue
            if method in last_run_s:  # attention grows as length squared at worst
                before_length, before_s = last_run_s[method]
                estimate = before_s * (length / before_length) ** 2
                if estimate > clock.left():
                    row["status"] = (
                        f"not run: about {estimate:.0f} s estimated, {clock.left():.0f} s of the budget left"
                    )
                    log(f"long {method} {length}: {row['status']}")
                    rows.append(row)
                    continue
            elif clock.left() < 10:
                row["status"] = "not run: budget spent"
                rows.append(row)
                continue
            try:
                row.update(_measure_long(method, opts, length, clock, log))
            except torch.cuda.OutOfMemoryError as error:
                row["status"] = "oom"
                row["error"] = str(error).splitlines()[0]
                given_up[method] = f"not run: out of GPU memory at {length} tokens"
                gc.collect()
                torch.cuda.empty_cache()
            except Exception as error:  # one method's failure is its row's, not the whole device run's
                row["status"] = f"error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                given_up[method] = f"not run: failed at {length} tokens"
                log(f"long {method} {length}: {row['status']}")
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            if row.get("time_ms"):  # the whole run, its first step included (7x the others on an H200 for GA)
                last_run_s[method] = (length, sum(row["step_ms_all"]) / 1e3)
            log(f"long {method} {length}: {row.get('status')} {row.get('time_ms')} ms, {row.get('peak_mem_mib')} MiB")
            rows.append(row)
    for length in opts.long_lengths:  # ratios against plain at the same length
        plain = next((r for r in rows if r["tokens"] == length and r["variant"] == "plain"), {})
        for row in rows:
            if row["tokens"] == length:
                for key, ratio in (("time_ms", "time_ratio"), ("peak_mem_mib", "peak_mem_ratio")):
                    ok = row.get(key) is not None and plain.get(key)
                    row[ratio] = round(row[key] / plain[key], 3) if ok else None
    return rows
