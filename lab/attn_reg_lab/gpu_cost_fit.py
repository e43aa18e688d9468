"""``attn-reg-gpu-cost``'s rows, the fit of the H200 times on their counts, the targets and the table.

Rows (``--rows``): ``standard`` are ``attn-reg-gpu-bench``'s standard rows: ``attn-reg-benchmark``'s
training steps at its standard sizes, fairseq and HF, fp32 and bf16, plain and
:data:`~.gpu_bench.STANDARD_VARIANTS`. ``long4k`` and ``long16k`` are its long section's Llama-shaped
decoder (plain, GA, AttendOut, HiddenCut; bf16, gradient checkpointing, the Trainers) at 4,096 and
16,384 tokens, counted at a reduced size (:data:`LONG_COUNTED`, :func:`long_cost`). There, FLOPs are
scaled to the real size (:func:`long_flop_scale`; a Triton kernel's by the query heads) and bytes are
the counted model's.

Routes (:func:`routes`, each row's ``route``, ``route_label`` and ``env``): every row set is counted on
the GPU's default route, the fused route (``ATTN_REG_FUSED=1``: :func:`on_route` sets it, and the
plugin's ``devices.FUSED``, for the rows), its Triton kernels counted and not run with the plugin on its
GPU branches (:func:`as_on_a_gpu`) and their FLOPs modelled (``gpu_cost.triton_flops``); ``fused_calls``
counts the calls the fused kernel took. ``--pytorch-path`` counts each row set on the PyTorch path
(``ATTN_REG_FUSED=0``) too, its rows beside the default route's. Each row's ratios are to the plain row of
its configuration on its route. ``--run-triton``: the standard fp32 rows' kernels run in the interpreter.

The fit pairs counted standard rows with the committed H200 rows of the same framework, variant, dtype
and route (``docs/results/gpu_bench/nvidia-h200_*.json``; an H200 row names its route in ``route``, else
it is the PyTorch path's, as every committed one is: they predate the fused route's default). A row on
the fused route whose fused kernel took no call ran the PyTorch path's code and stands for it where no
PyTorch path row was counted (:func:`_h200_pairs`). It fits the H200 step time by least squares:
``time_ms = a + b * launches + c * syncs`` and its simpler forms (:data:`FIT_MODELS`). The one whose
ratios to plain come nearest the measured ones predicts (``fit["model"]``; all in
``fit["candidates"]``, each with its R²). The long rows' H200 times (by variant and tokens) are
predicted out of the fit, as a check (``fit["checked_on"]``). Each row gets a predicted time, and a
predicted ratio to the plain row of its configuration. The H200 rows were measured at the commits their files
name: ``--fit-counts`` fits them on counts of that code. The targets (issue 80) are the bar for a
rebuild of the GPU route: judged on the default route's rows (``judged``), the PyTorch path's verdicts
beside them (:func:`targets`, :func:`format_targets`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from . import gpu_cost
from .gpu_cost import ROUTE_ENV, Cost, CostCounter
from .paths import REPO

H200_DIR = REPO / "docs" / "results" / "gpu_bench"
# (target, section, framework, variant, the row's field, bound)
TARGETS = (
    ("HF GA-all launches <= 1.6x plain", "standard", "hf", "ad-drop-ga-all", "launches_ratio", 1.6),
    ("fairseq GA-all launches <= 1.4x plain", "standard", "fairseq", "ad-drop-ga-all", "launches_ratio", 1.4),
    ("HF AttendOut launches <= 2.5x plain", "standard", "hf", "attendout", "launches_ratio", 2.5),
    ("GA FLOPs at 16,384 tokens <= 2.2x plain", "long", "hf", "ad-drop-ga-all", "flops_ratio", 2.2),
)  # fmt: skip
ADDED_LAUNCHES_BOUND = 1.1
# The fit is on the standard rows: 43 steps of 15 to 170 ms, where the host's launches set the time. The
# long rows (a 16,384-token plain step is bound by its attention's FLOPs) are predicted out of it.
FIT_SECTION = "standard"  # GA's launches over plain's at 16,384 tokens <= 1.1x those at 4,096

# The long model counted narrower: 4 query and 2 key/value heads of the real head size 64 (width 256,
# intermediate 704, vocabulary 1,000), where the real one has 16 and 4 heads (width 1,024, intermediate
# 2,816, vocabulary 32,000). The plugin's blocks of query rows (64 at both lengths:
# blockwise.query_block_rows) and its choice to keep or remake the drops (bits against q's bytes: the same
# head size and dtype) are the real model's, and so are its launches per block.
LONG_COUNTED = dict(long_width=256, long_heads=4, long_kv_heads=2, long_vocab=1000)
LONG_METHODS = ("plain", "ga", "attendout", "hiddencut")  # the long rows the H200 measured, on each route
# Every decoder layer runs the same operations: a step is counted at 1 and 2 layers and extrapolated
# to the real 8 (each further layer adds what the second added).
LONG_LENGTHS = {"long4k": 4096, "long16k": 16384}
QUICK_LONG_LENGTHS = {"long4k": 192, "long16k": 384}
WARMUP_TOKENS = 128  # the uncounted first step of a long count: its state (Adam's, AttendOut's) made cheaply


def count_step(step, counter: Optional[CostCounter] = None) -> Cost:
    """One run of a benchmark :class:`~.benchmark.variants.Step` (its lazy state made, its host tensors
    followed), then one counted run: what ``attn-reg-benchmark`` times, nothing around it."""
    counter = counter or CostCounter()
    with step.state(), counter.counting():
        step.prepare(0)
        step.run()
        step.prepare(1)
        with counter.recorded():
            step.run()
    return counter.cost


def _wanted(variant: str, variants: Optional[List[str]]) -> bool:
    return variants is None or variant == "plain" or variant.split("+")[0] in variants


# The routes a CUDA device takes for a regularized call: (ATTN_REG_FUSED, the label of its rows).
ROUTES = {
    "fused": ("1", "fused route (CUDA default)"),
    "pytorch": ("0", "PyTorch path (ATTN_REG_FUSED=0)"),
}
NO_FUSED_ROUTE = "PyTorch path (no fused route in this code)"  # a checkout from before core/kernel/fused_edit.py


def plugin_module(name: str):
    """The core module ``name`` of the plugin counted, in its own layout: core/kernel/ since core's three
    floors, core/ before (a checkout such as 04d1e36, whose counts the fit takes)."""
    try:
        return importlib.import_module(f"attn_reg_plugin.core.kernel.{name}")
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("attn_reg_plugin.core.kernel"):
            raise
        return importlib.import_module(f"attn_reg_plugin.core.{name}")


def has_fused_route() -> bool:
    """Whether the plugin counted has the fused Triton route (core/kernel/fused_edit.py; not at 04d1e36, say)."""
    try:
        devices = plugin_module("devices")
        plugin_module("fused_edit")
    except ImportError:
        return False
    return hasattr(devices, "FUSED")


def routes(opts) -> List[str]:
    """The routes whose rows are counted: the GPU's default (the fused route, where the code has one),
    and the PyTorch path too with ``--pytorch-path``."""
    if not has_fused_route():
        return ["pytorch"]
    return ["fused", *(["pytorch"] if getattr(opts, "pytorch_path", False) else [])]


def route_label(route: str) -> str:
    return ROUTES[route][1] if route == "fused" or has_fused_route() else NO_FUSED_ROUTE


@contextlib.contextmanager
def on_route(route: str) -> Iterator[List[int]]:
    """The plugin on ``route`` for a while: ATTN_REG_FUSED set to "1" or "0" (``devices.FUSED`` True or
    False, which the plugin read from it once), never left to its default (which turns the fused route on
    for a CUDA tensor only); yields [the calls the fused kernel took]."""
    if not has_fused_route():
        yield [0]
        return
    devices, fused_edit = plugin_module("devices"), plugin_module("fused_edit")
    calls, original = [0], fused_edit.fused_edit_attention
    before = devices.FUSED, os.environ.get(devices.FUSED_ENV)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    os.environ[devices.FUSED_ENV] = ROUTES[route][0]
    devices.FUSED, fused_edit.fused_edit_attention = route == "fused", counted
    try:
        yield calls
    finally:
        devices.FUSED, fused_edit.fused_edit_attention = before[0], original
        if before[1] is None:
            os.environ.pop(devices.FUSED_ENV, None)
        else:
            os.environ[devices.FUSED_ENV] = before[1]


@contextlib.contextmanager
def gpu_route() -> Iterator[dict]:
    """The portable branches forced (devices.PORTABLE) for a while; yields what the route is here."""
    devices = plugin_module("devices")

    before, devices.PORTABLE = devices.PORTABLE, True
    try:
        try:
            import triton

            interpreting = bool(triton.knobs.runtime.interpret)
        except ImportError:
            interpreting = None
        env = {k: os.environ.get(k) for k in (*ROUTE_ENV, "ATTN_REG_FUSED")}
        yield {"portable": True, "triton_interpret": interpreting, "env": env}
    finally:
        devices.PORTABLE = before


def count_rows(opts, log) -> Tuple[List[dict], dict]:
    """The rows of ``opts.rows`` counted on the GPU route, and what the route was."""
    rows: List[dict] = []
    with gpu_route() as route:
        if route["triton_interpret"] is False:
            log("note: Triton is not in its interpreter (TRITON_INTERPRET=1 before Triton is imported): no fused call")
        route["routes"] = {r: route_label(r) for r in routes(opts)}
        route["default"] = routes(opts)[0]
        route["triton"] = "run in the interpreter (fp32 rows)" if getattr(opts, "run_triton", False) else "modelled"
        for row_set in opts.rows:
            rows += standard_rows(opts, log) if row_set == "standard" else long_rows(row_set, opts, log)
    return rows, route


def standard_bench(framework: str, dtype: str, opts, log):
    """``attn-reg-benchmark``'s bench of ``framework`` in ``dtype`` at its standard sizes (``--quick``:
    tiny), with the command's ``--hf-model`` and ``--work-dir``."""
    from .benchmark.cli import BENCHES
    from .benchmark.cli import parse_args as benchmark_args
    from .gpu_bench import STANDARD_VARIANTS

    argv = ["--device", "cpu", "--dtype", dtype, "--frameworks", framework]
    argv += ["--variants", ",".join(STANDARD_VARIANTS), *(["--quick"] if opts.quick else [])]
    argv += ["--hf-model", opts.hf_model] if opts.hf_model else []
    argv += ["--work-dir", str(opts.work_dir)] if opts.work_dir else []
    return BENCHES[framework](benchmark_args(argv), log)


def standard_step(bench, framework: str, variant: str):
    """The benchmark's training step of ``variant`` on ``bench`` (plain: its reference step), or None
    where the benchmark has none."""
    from .benchmark.variants import VARIANTS

    if variant == "plain":
        return bench.reference("train")
    return next(v.builders for v in VARIANTS if v.name == variant)[framework](bench, "train")


def standard_rows(opts, log) -> List[dict]:
    """``attn-reg-gpu-bench``'s standard rows, on each of :func:`routes` (the PyTorch path's beside the
    default route's, per configuration). On the fused route the Triton kernels are counted and not run
    (:func:`as_on_a_gpu`), unless ``--run-triton`` runs an fp32 row's in the interpreter (it takes no bf16
    call: its bf16 tl.dot comes out wrong)."""
    from .gpu_bench import STANDARD_VARIANTS

    names = [v for v in ("plain", *STANDARD_VARIANTS) if _wanted(v, opts.variants)]
    rows = []
    for framework in getattr(opts, "frameworks", ("fairseq", "hf")):
        for dtype in ("fp32", "bf16"):
            bench = standard_bench(framework, dtype, opts, log)
            for route in routes(opts):
                not_run = route == "fused" and not (getattr(opts, "run_triton", False) and dtype == "fp32")
                for name in names:
                    row = {"section": "standard", "framework": framework, "variant": name, "dtype": dtype}
                    row.update(tokens=bench.tokens["train"], configuration=f"{framework} {dtype}")
                    row.update(route=route, route_label=route_label(route))
                    row["description"] = bench.batch_descriptions["train"]
                    step = standard_step(bench, framework, name)
                    if step is None:
                        rows.append({**row, "status": f"not counted: the benchmark has no {name} step in {dtype}"})
                        continue
                    started = time.time()
                    counter = CostCounter()
                    counter.triton_not_run = not_run
                    with on_route(route) as fused_calls, as_on_a_gpu(not_run):
                        cost = count_step(step, counter)
                    row.update(cost.as_dict(), status="ok", seconds=round(time.time() - started, 1))
                    _mark_route(row, route, fused_calls[0], not_run)
                    log(
                        f"{framework} {dtype} {name}, {row['route_label']}: {cost.launches} launches, {cost.syncs} "
                        f"syncs ({row['seconds']} s)"
                    )
                    rows.append(row)
            del bench
    return rows


def _mark_route(row: dict, route: str, fused_calls: int, not_run: bool) -> None:
    """A counted row's route fields: the calls the fused kernel took, and how its Triton FLOPs were had."""
    if route == "fused":
        row["fused_calls"] = fused_calls
        row["env"] = {"ATTN_REG_FUSED": ROUTES[route][0]}
    elif has_fused_route():
        row["env"] = {"ATTN_REG_FUSED": ROUTES[route][0]}
    if not_run and row.get("triton_launches"):
        row["note"] = FUSED_NOT_RUN


def long_flop_scale(real: dict) -> Callable[[str, list], float]:
    """A product's FLOPs at :data:`LONG_COUNTED` -> at ``real`` (gpu_bench's GPU_DEFAULTS).

    A batched product (bmm, sdpa) of the model's attention has a batch of query or key/value heads, so it
    scales with the heads (the head size is the real one); a batch of 1 (AttendOut's one-head Generator,
    the rotary embedding) does not scale. A 2-D product (a projection) has one token dimension and two
    feature dimensions: the width, the key/value width, the intermediate size and the vocabulary each
    scale to the real one, and the Generator's own 64 stays. Token counts must differ from these sizes."""
    counted = LONG_COUNTED
    head = counted["long_width"] // counted["long_heads"]
    features = {
        counted["long_width"]: real["long_width"],
        head * counted["long_kv_heads"]: real["long_width"] // real["long_heads"] * real["long_kv_heads"],
        int(2.75 * counted["long_width"]) // 64 * 64: int(2.75 * real["long_width"]) // 64 * 64,
        counted["long_vocab"]: real["long_vocab"],
    }
    heads = {counted[k]: real[k] / counted[k] for k in ("long_heads", "long_kv_heads")}
    if real["long_width"] // real["long_heads"] != head or len(features) != 4 or head in features:
        raise ValueError("the counted long model must keep the real head size and distinct feature sizes")

    def scale(name: str, shapes: list) -> float:
        if name == "triton":  # the fused kernel's tl.dot products: per query head
            return heads[counted["long_heads"]]
        if name.startswith("_scaled_dot_product"):
            return heads.get(shapes[0][1], 1.0)  # the query or its gradient, (B, H, T, d)
        if name in ("bmm", "baddbmm"):
            return heads.get(shapes[-1][0], 1.0)
        if name in ("mm", "addmm"):
            (m, k), n = shapes[-2], shapes[-1][1]
            return (features.get(m, m) / m) * (features.get(k, k) / k) * (features.get(n, n) / n)
        return 1.0

    return scale


def combine(terms: Sequence[Tuple[float, Cost]]) -> Cost:
    """sum(coefficient * cost) over ``terms``, field by field, rounded."""
    out = Cost()
    for name in ("launches", "triton_launches", "triton_modelled", "syncs", "plugin_syncs", "host_reads", "bytes"):
        setattr(out, name, round(sum(c * getattr(cost, name) for c, cost in terms)))
    for name in ("flops", "ops", "sync_sites", "triton_unmodelled"):
        keys = {k for _, cost in terms for k in getattr(cost, name)}
        values = {k: round(sum(c * getattr(cost, name).get(k, 0) for c, cost in terms)) for k in keys}
        values = {k: v for k, v in values.items() if v}
        setattr(out, name, values if name == "flops" else type(out.ops)(values))
    return out


def long_section() -> argparse.Namespace:
    """gpu_bench_long's trainer(method, opts, tokens, steps) and variant_names. Before the long section
    had a module of its own (04d1e36, whose code the H200's standard rows measured), gpu_bench's: these
    two modules copied into such a checkout count its code."""
    from . import gpu_bench

    if hasattr(gpu_bench, "_long_trainer"):  # the long section still in gpu_bench

        def trainer(method, opts, tokens, steps):
            return gpu_bench._long_trainer(method, argparse.Namespace(**vars(opts), long_steps=steps), tokens, None)

        return argparse.Namespace(trainer=trainer, variant_names=gpu_bench.LONG_VARIANT_NAMES)
    from . import gpu_bench_long as long

    return argparse.Namespace(trainer=long._long_trainer, variant_names=long.LONG_VARIANT_NAMES)


def long_cost(method: str, tokens: int, scale, layers: int, log, route: str = "pytorch") -> Tuple[Cost, dict]:
    """The step at ``layers`` layers from the steps counted at 1 and 2 on ``route``, and how it was counted."""
    counted, calls = [], 0
    for n in (1, 2):
        started = time.time()
        with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its metrics
            cost, fused_calls = _count_long(method, tokens, n, scale, route)
        counted.append(cost)
        calls += fused_calls
        log(f"  long {method}: {tokens} tokens, {n} layer(s) counted in {time.time() - started:.0f} s")
    one, two = counted
    how = {"counted_layers": {"1": one.launches, "2": two.launches}, "fused_calls": calls}
    return combine([(2 - layers, one), (layers - 1, two)]), how


def _count_long(method: str, tokens: int, layers: int, scale, route: str = "pytorch") -> Tuple[Cost, int]:
    """(the cost of one Trainer step of the long model at ``layers`` layers and ``tokens`` tokens on
    ``route``, after an uncounted one of WARMUP_TOKENS; the fused kernel's calls in both steps). On the
    fused route its Triton kernels are counted and not run (the interpreter would take hours at these
    lengths; FUSED_NOT_RUN)."""
    import shutil

    import transformers

    opts = argparse.Namespace(long_layers=layers, device="cpu", **LONG_COUNTED)
    trainer = long_section().trainer(method, opts, tokens, 2)
    warm = {k: v[:WARMUP_TOKENS] for k, v in trainer.train_dataset[0].items()}
    trainer.train_dataset = [warm, trainer.train_dataset[1]]
    trainer.args.train_sampling_strategy = "sequential"  # the short step first
    counter = CostCounter()
    counter.flop_scale = scale
    counter.triton_not_run = route == "fused"

    class Recorded(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            counter.recording = state.global_step == 1

        def on_step_end(self, args, state, control, **kwargs):
            counter.recording = False

    trainer.add_callback(Recorded())
    try:
        with on_route(route) as fused_calls, as_on_a_gpu(counter.triton_not_run), counter.counting():
            trainer.train()
    finally:
        shutil.rmtree(trainer.args.output_dir, ignore_errors=True)
    return counter.cost, fused_calls[0]


@contextlib.contextmanager
def as_on_a_gpu(on: bool) -> Iterator[None]:
    """While on (the fused route's Triton kernels counted and not run), the plugin takes the choices it
    takes on a GPU, not those it takes for Triton's interpreter: Triton's ``interpret`` knob off (the
    kernels stay the interpreter's, launched and not run), so the fused route's tiles are the compiled 64
    wide (``fused_edit._grid_sizes``), its attribution operands half precision where the attribution pass
    was (``fused_edit.attribution_operands``), and ``fused_edit.available`` takes every call, bf16 too (in
    the interpreter it refuses them: a bf16 tl.dot comes out wrong there, which does not matter to
    kernels not run)."""
    if not on or not has_fused_route():
        yield
        return
    import triton

    fused_edit = plugin_module("fused_edit")
    original, interpreting = fused_edit.available, triton.knobs.runtime.interpret
    fused_edit.available = lambda q: True
    triton.knobs.runtime.interpret = False
    try:
        yield
    finally:
        fused_edit.available = original
        triton.knobs.runtime.interpret = interpreting


# What a fused row's numbers are (its "note") when its Triton kernels were counted and not run.
FUSED_NOT_RUN = (
    "fused route, its Triton kernels counted and not run (the tensors they write left zero), the plugin on its "
    "GPU branches (64-wide tiles): launches and syncs as on a GPU; the kernels' FLOPs modelled from the tiles "
    "they visit (gpu_cost.triton_flops), their bytes their arguments' sizes"
)


def long_rows(row_set: str, opts, log) -> List[dict]:
    from .gpu_bench import GPU_DEFAULTS as real

    tokens, c = (QUICK_LONG_LENGTHS if opts.quick else LONG_LENGTHS)[row_set], LONG_COUNTED
    names = long_section().variant_names
    methods = [m for m in LONG_METHODS if _wanted(names[m], opts.variants)]
    how = (
        f"Llama-shaped decoder, bf16, gradient checkpointing, batch 1; counted at {c['long_heads']}/"
        f"{c['long_kv_heads']} heads x 64 (width {c['long_width']}, vocabulary {c['long_vocab']}) and "
        f"extrapolated to {real['long_layers']} layers; FLOPs scaled to {real['long_heads']}/{real['long_kv_heads']} "
        f"heads, width {real['long_width']}, vocabulary {real['long_vocab']}; bytes of the counted width"
    )
    rows = []
    for route in routes(opts):
        for method in methods:
            row = {"section": "long", "framework": "hf", "variant": names[method], "dtype": "bf16"}
            row.update(tokens=tokens, configuration=f"{row_set} (hf bf16, {tokens} tokens)", description=how)
            row.update(route=route, route_label=route_label(route))
            started = time.time()
            try:
                cost, counted = long_cost(method, tokens, long_flop_scale(real), real["long_layers"], log, route)
            except Exception as error:  # one method's failure is its row's
                rows.append({**row, "status": f"error: {type(error).__name__}: {error}"})
                log(f"{row_set} {method}, {row['route_label']}: {rows[-1]['status']}")
                continue
            fused_calls = counted.pop("fused_calls")
            row.update({**cost.as_dict(), **counted}, status="ok", seconds=round(time.time() - started, 1))
            _mark_route(row, route, fused_calls, route == "fused")
            log(
                f"{row_set} {method}, {row['route_label']}: {cost.launches} launches, {cost.syncs} syncs "
                f"({row['seconds']} s)"
            )
            rows.append(row)
    return rows


# -- the fit --------------------------------------------------------------------------------------
def h200_rows(folder: Optional[Path] = None) -> List[dict]:
    """The committed H200 rows that measured a time (``source``: their file)."""
    rows = []
    for path in sorted(Path(folder or H200_DIR).glob("nvidia-h200_*.json")):
        if not path.name.endswith(".meta.json"):
            rows += [{**r, "source": path.name} for r in json.loads(path.read_text()) if r.get("time_ms") is not None]
    return rows


def row_route(row: dict) -> str:
    """The route a row counts or measured: its ``route``; a row without one (an H200 row, a count of older
    code) the PyTorch path, unless its variant names the fused route (``+fused``, ``-fused``: GA with
    ATTN_REG_FUSED=1). Every committed H200 row predates the fused route's default: an H200 row measured
    since must say its route."""
    if row.get("route"):
        return row["route"]
    return "fused" if row["variant"].endswith(("+fused", "-fused")) else "pytorch"


def row_method(row: dict) -> str:
    """The row's method, without a route's suffix."""
    variant = row["variant"]
    return variant[: -len("+fused")] if variant.endswith(("+fused", "-fused")) else variant


def row_key(row: dict) -> Tuple:
    """One configuration, method and route: standard by framework, variant and dtype; long by variant and
    tokens; then the route (:func:`row_route`)."""
    if row["section"] == "standard":
        return ("standard", row["framework"], row_method(row), row["dtype"], row_route(row))
    return ("long", row_method(row), row["tokens"], row_route(row))


def config_key(row: dict) -> Tuple:
    """The rows one plain row is the reference of: its configuration on its route."""
    return row_key({**row, "variant": "plain", "route": row_route(row)})


def _h200_pairs(rows: List[dict], measured: dict) -> List[Tuple[dict, dict]]:
    """(counted row, H200 row) pairs, at most one counted row an H200 row: the H200 row of the counted
    row's configuration, method and route, or else, for a row on the fused route whose fused kernel took
    no call (it ran the PyTorch path's code), the PyTorch path's."""
    pairs = {row_key(r): (r, measured[row_key(r)]) for r in rows if row_key(r) in measured}
    for r in rows:
        key = row_key({**r, "route": "pytorch"})
        if row_route(r) == "fused" and r.get("fused_calls") == 0 and key in measured and key not in pairs:
            pairs[key] = (r, measured[key])
    return list(pairs.values())


def least_squares(x: Sequence[Sequence[float]], y: Sequence[float]) -> Tuple[List[float], float]:
    """(coefficients, R²) of y ≈ x @ coefficients."""
    import numpy as np

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    total = float(((y - y.mean()) ** 2).sum())
    return [float(c) for c in coef], 1.0 - float(((y - x @ coef) ** 2).sum()) / total if total > 0 else 1.0


FIT_MODELS = (
    ("time_ms = a + b*launches + c*syncs", ("a", "b", "c"), lambda p: [1.0, p["launches"], p["syncs"]]),
    ("time_ms = a + b*launches", ("a", "b"), lambda p: [1.0, p["launches"]]),
    ("time_ms = b*launches + c*syncs", ("b", "c"), lambda p: [p["launches"], p["syncs"]]),
    ("time_ms = b*launches", ("b",), lambda p: [p["launches"]]),
)


def fit(pairs: List[dict]) -> dict:
    """Each of :data:`FIT_MODELS` that ``pairs`` ({launches, syncs, time_ms, row, config}) determine (more
    rows than parameters, columns that differ independently), by least squares; the one whose ratios to
    plain are nearest the measured ones (``ratio_error``, their mean distance) predicts, the first on a tie.
    The others are its ``candidates``."""
    import numpy as np

    def solve(formula, names, columns):
        x = [columns(p) for p in pairs]
        if len(pairs) <= len(names) or np.linalg.matrix_rank(np.asarray(x, dtype=float)) < len(names):
            return None
        coef, r2 = least_squares(x, [p["time_ms"] for p in pairs])
        model = {"model": formula, "coefficients": dict(zip(names, coef)), "r2": r2, "rows": len(pairs)}
        plain = {p.get("config"): p for p in pairs if "config" in p and p["row"] == p["config"]}
        errors = [
            abs(predict(model, **_counts(p)) / predict(model, **_counts(q)) - p["time_ms"] / q["time_ms"])
            for p in pairs
            if (q := plain.get(p.get("config"))) is not None and q is not p
        ]
        model["ratio_error"] = sum(errors) / len(errors) if errors else None
        return model

    solved = [m for m in (solve(*f) for f in FIT_MODELS) if m]
    if not solved:
        return {"model": None, "coefficients": {}, "r2": None, "rows": len(pairs), "why": "too few rows to fit"}
    best = min(solved, key=lambda m: m["ratio_error"] or 0.0)
    best["candidates"] = [{k: m[k] for k in ("model", "coefficients", "r2", "ratio_error")} for m in solved]
    return best


def _counts(pair: dict) -> dict:
    return {"launches": pair["launches"], "syncs": pair["syncs"]}


def predict(model: dict, launches: float, syncs: float) -> Optional[float]:
    c = model.get("coefficients")
    return c.get("a", 0.0) + c.get("b", 0.0) * launches + c.get("c", 0.0) * syncs if c else None


def _ratio(a, b) -> Optional[float]:
    return round(a / b, 3) if a is not None and b else None


def fit_and_predict(rows: List[dict], h200_dir: Optional[Path] = None, quick: bool = False, fit_counts=None) -> dict:
    """The rows with their ratios to plain and their predicted H200 ratio; the fit; the targets.
    ``fit_counts``: (its file, its JSON) of counts made earlier (of the code the H200 ran, say) that the
    fit pairs with the H200 rows instead of ``rows``."""
    counted = [r for r in rows if r.get("status") == "ok"]
    plain = {config_key(r): r for r in counted if r["variant"] == "plain"}
    measured = {row_key(h): h for h in h200_rows(h200_dir)}
    for r in counted:
        p = plain.get(config_key(r))
        r["flops_total"] = sum(r["flops"].values())
        if p is not None:
            r["launches_ratio"] = _ratio(r["launches"], p["launches"])
            r["flops_ratio"] = _ratio(r["flops_total"], sum(p["flops"].values()))
            r["bytes_ratio"] = _ratio(r["bytes"], p["bytes"])
    for r in counted:  # every row of the code an H200 row measured shows it (the fit takes one row each)
        h = measured.get(row_key(r))
        if h is None and row_route(r) == "fused" and r.get("fused_calls") == 0:
            h = measured.get(row_key({**r, "route": "pytorch"}))
        if h is not None:
            r.update(h200_time_ms=h["time_ms"], h200_ratio=h.get("time_ratio"), h200_source=h["source"])
    fitted = counted if fit_counts is None else [r for r in fit_counts[1]["rows"] if r.get("status") == "ok"]
    paired = [(r, h["time_ms"], h["source"]) for r, h in _h200_pairs(fitted, measured)]
    pairs = [
        {"launches": r["launches"], "syncs": r["syncs"], "time_ms": t, "row": row_key(r), "config": config_key(r)}
        for r, t, _ in paired
        if r["section"] == FIT_SECTION
    ]
    model = fit(pairs)
    model["fitted_on"] = [list(p["row"]) for p in pairs]
    model["sources"] = sorted({source for r, _, source in paired if r["section"] == FIT_SECTION})
    model["counts"] = "this run's" if fit_counts is None else f"{fit_counts[0]} (at {fit_counts[1].get('commit')})"
    model["note"] = "each H200 row was measured at the commit its file names; the counts are of the code counted"
    model["note"] += "; --quick counts tiny sizes, not the H200 rows' configurations: a smoke test" if quick else ""
    model["checked_on"] = [  # the other H200 rows, predicted out of the fit
        {"row": list(row_key(r)), "measured_ms": t, "predicted_ms": predict(model, r["launches"], r["syncs"])}
        for r, t, _ in paired
        if r["section"] != FIT_SECTION
    ]
    for r in counted:
        r["predicted_ms"] = predict(model, r["launches"], r["syncs"])
    for r in counted:
        p = plain.get(config_key(r))
        r["predicted_h200_ratio"] = _ratio(r["predicted_ms"], p["predicted_ms"] if p else None)
    return {"rows": rows, "fit": model, "targets": targets(counted)}


COMPILE_BREAKS_BOUND = 3  # issue 80: the GA training step under torch.compile


def compile_rows(opts, log) -> List[dict]:
    """The standard HF fp32 plain and GA-all steps on the default route, each compiled whole
    (:mod:`.gpu_cost_compile`): their dynamo graphs and graph breaks, and the target's verdict on GA's. The
    fused route steps aside while compiling; its Triton kernels, which the eager step and a compiled step's
    eager parts launch, are not run (the interpreter would take half an hour)."""
    from .gpu_cost_compile import graph_breaks

    bench = standard_bench("hf", "fp32", opts, log)
    rows = []
    route = routes(opts)[0]
    counter = CostCounter()  # counts nothing here (never recording): it keeps the Triton kernels from running
    counter.triton_not_run = True
    with gpu_route(), on_route(route) as fused_calls, gpu_cost._triton_counted(counter):
        for variant in ("plain", "ad-drop-ga-all"):
            step = standard_step(bench, "hf", variant)
            row = {"section": "compile", "framework": "hf", "variant": variant, "dtype": "fp32"}
            row.update(route=route, route_label=route_label(route))
            calls = fused_calls[0]
            row.update(graph_breaks(step))
            if route == "fused":
                row["fused_calls"] = fused_calls[0] - calls  # the eager step's, and a compiled step's eager parts
            log(f"hf fp32 {variant} compiled whole: {row['graphs']} graphs, {row['breaks']} graph breaks")
            rows.append(row)
    ga = rows[-1]
    met = ga["breaks"] <= COMPILE_BREAKS_BOUND
    what = f"GA training step under torch.compile: graph breaks <= {COMPILE_BREAKS_BOUND}"
    ga["targets"] = [{"target": what, "value": ga["breaks"], "met": met}]
    ga["verdict"] = {
        "target": what,
        "row": ["compile", "hf", ga["variant"], "fp32", ga["route"]],
        "value": ga["breaks"],
        "bound": COMPILE_BREAKS_BOUND,
        "met": met,
        "route": ga["route_label"],
        "judged": True,
    }
    return rows


def default_route(rows: List[dict]) -> str:
    """The route the targets are judged on: the fused route where rows counted it (the GPU's default),
    else the PyTorch path."""
    return "fused" if any(row_route(r) == "fused" for r in rows) else "pytorch"


def targets(counted: List[dict]) -> List[dict]:
    """Each target on each row it concerns (also written on the row: ``targets``), on each route: judged
    (``judged``) on the default route's rows (:func:`default_route`), the other route's beside them."""
    out = []
    default = default_route(counted)
    order = sorted(counted, key=lambda r: row_route(r) != default)  # the default route's verdicts first
    longest = max((r["tokens"] for r in counted if r["section"] == "long"), default=None)
    for what, section, framework, variant, field, bound in TARGETS:
        for r in order:
            if (r["section"], r["framework"], row_method(r)) == (section, framework, variant):
                if section == "standard" or r["tokens"] == longest:
                    out.append(_verdict(what, r, r.get(field), bound, default))
    plain = {
        (row_route(r), r["tokens"]): r["launches"]
        for r in counted
        if r["section"] == "long" and r["variant"] == "plain"
    }
    for route in sorted({row_route(r) for r in counted}, key=lambda route: route != default):
        ga = [
            r for r in counted if r["section"] == "long" and row_method(r) == "ad-drop-ga-all" and row_route(r) == route
        ]
        ga = sorted(ga, key=row_key)
        if len(ga) >= 2 and all((route, r["tokens"]) in plain for r in ga):
            added = [r["launches"] - plain[route, r["tokens"]] for r in (ga[0], ga[-1])]
            what = (
                f"GA's added launches at {ga[-1]['tokens']:,} tokens <= {ADDED_LAUNCHES_BOUND}x at {ga[0]['tokens']:,}"
            )
            out.append(_verdict(what, ga[-1], _ratio(added[1], added[0]), ADDED_LAUNCHES_BOUND, default))
    out += [
        _verdict("plugin-added syncs = 0", r, r["plugin_syncs"], 0, default) for r in order if r["variant"] != "plain"
    ]
    return out


def _verdict(what: str, row: dict, value, bound, default: str = "pytorch") -> dict:
    met = value is not None and value <= bound
    row.setdefault("targets", []).append({"target": what, "value": value, "met": met})
    label = row.get("route_label") or row_route(row)
    return {
        "target": what, "row": list(row_key(row)), "value": value, "bound": bound, "met": met, "route": label,
        "judged": row_route(row) == default,
    }  # fmt: skip


# -- the table ------------------------------------------------------------------------------------
def _si(x, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".strip()


def _fmt(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def format_table(result: dict) -> str:
    lines = [
        "| configuration | route | method | launches | × plain | syncs | plugin-added syncs | FLOPs tensor-core / fp32 "
        "| FLOPs × plain | bytes | predicted H200 × plain | measured H200 × plain | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        route = r.get("route_label") or row_route(r)
        if r.get("status") != "ok":
            lines.append(f"| {r['configuration']} | {route} | {r['variant']} | {r.get('status')} |" + " |" * 9)
            continue
        bars = [
            f"{t['target']}: {t['value']} ({'met' if t['met'] else '**missed**'})"
            for t in r.get("targets", [])
            if t["target"] != "plugin-added syncs = 0"
        ]
        cells = [
            r["configuration"], route, r["variant"], f"{r['launches']:,}", _fmt(r.get("launches_ratio")), r["syncs"],
            r["plugin_syncs"], f"{_si(r['tensor_core_flops'])} / {_si(r['fp32_flops'])}", _fmt(r.get("flops_ratio")),
            _si(r["bytes"], "B"), _fmt(r.get("predicted_h200_ratio")), _fmt(r.get("h200_ratio")), "; ".join(bars),
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    notes = [f"Note: {n}" for n in (_triton_note(result["rows"]),) if n]
    return "\n".join([*lines, "", *notes, format_targets(result["targets"]), "", format_fit(result["fit"])])


def _triton_note(rows: List[dict]) -> str:
    """Where the table's Triton FLOPs come from (the rows' ``triton_flops``)."""
    how = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("triton_flops", "none") != "none":
            how.setdefault(r["triton_flops"], []).append(r)
    words = {
        "modelled": "modelled from the tiles each kernel visits (gpu_cost.triton_flops; its kernels counted and not "
        "run, as on a GPU: 64-wide tiles)",
        "counted": "counted from the interpreter's tl.dot (--run-triton: 16-wide tiles)",
    }
    parts = [f"{len(rs)} rows {words.get(k, k)}" for k, rs in how.items()]
    if not parts:
        return ""
    flops = "FLOPs tensor-core: bf16, fp16 and tf32 products; fp32: float32 at full precision"
    return f"the fused route's Triton FLOPs: {'; '.join(parts)}. {flops}."


def format_targets(verdicts: List[dict]) -> str:
    """The targets, each judged on the default route, the other route's verdicts beside."""
    if not verdicts:
        return ""
    by = {}
    for v in verdicts:
        by.setdefault(v["target"], {}).setdefault((not v.get("judged", True), v.get("route", "")), []).append(v)
    lines = []
    for what, per_route in by.items():
        parts = []
        for (beside, route), vs in sorted(per_route.items()):
            if len(vs) > 3 and all(v["met"] for v in vs):
                found = f"met in all {len(vs)} rows"
            else:
                found = ", ".join(
                    f"{' '.join(map(str, v['row'][1:-1]))} {v['value']} ({'met' if v['met'] else '**missed**'})"
                    for v in vs
                )
            parts.append(f"{route}{' (beside)' if beside else ''}: {found}")
        lines.append(f"- {what}: " + "; ".join(parts))
    return "targets (issue 80), judged on the default route's rows:\n" + "\n".join(lines)


def format_fit(model: dict) -> str:
    if not model.get("model"):
        return f"fit: none ({model.get('why')}: {model['rows']} rows paired with an H200 row)"
    c, units = model["coefficients"], {"a": ("ms", 1), "b": ("µs per launch", 1e3), "c": ("µs per sync", 1e3)}
    terms = ", ".join(f"{k} = {v * units[k][1]:.2f} {units[k][0]}" for k, v in c.items())
    rows = "; ".join(" ".join(map(str, k[1:])) for k in model["fitted_on"])
    checked = "; ".join(
        f"{' '.join(map(str, c['row'][1:]))}: {c['predicted_ms']:.0f} ms predicted, {c['measured_ms']:.0f} measured"
        for c in model["checked_on"]
    )
    others = "; ".join(
        f"{m['model']}: R² {m['r2']:.3f}, ratio error {_fmt(m['ratio_error'], 3)}"
        for m in model["candidates"]
        if m["model"] != model["model"]
    )
    return (
        f"fit: {model['model']} on {model['rows']} H200 rows ({', '.join(model['sources'])}) and the counts of "
        f"{model['counts']}: {terms}; R² = {model['r2']:.3f}; its ratios to plain are off by "
        f"{_fmt(model['ratio_error'], 3)} on average, the least of the fits ({others}). Rows: {rows}. "
        + (f"Out of the fit: {checked}. " if checked else "")
        + f"Note: {model['note']}."
    )
