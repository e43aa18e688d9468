"""``attn-reg-gpu-cost``'s rows, the fit of the H200 times on their counts, the targets and the table.

Rows (``--rows``): ``standard`` are ``attn-reg-gpu-bench``'s standard rows: ``attn-reg-benchmark``'s
training steps at its standard sizes, fairseq and HF, fp32 and bf16, plain and
:data:`~.gpu_bench.STANDARD_VARIANTS`. ``long4k`` and ``long16k`` are its long section's Llama-shaped
decoder (plain, GA, AttendOut, HiddenCut; bf16, gradient checkpointing, the Trainers) at 4,096 and
16,384 tokens, counted at a reduced size (:data:`LONG_COUNTED`, :func:`long_cost`). There, FLOPs are
scaled to the real size (:func:`long_flop_scale`) and bytes are the counted model's.

The fit pairs each counted standard row with the committed H200 row of the same framework, variant and
dtype (``docs/results/gpu_bench/nvidia-h200_*.json``), and fits the H200 step time by least squares:
``time_ms = a + b * launches + c * syncs`` and its simpler forms (:data:`FIT_MODELS`). The one whose
ratios to plain come nearest the measured ones predicts (``fit["model"]``; all in
``fit["candidates"]``, each with its R²). The long rows' H200 times (by variant and tokens) are
predicted out of the fit, as a check (``fit["checked_on"]``). Each row gets a predicted time, and a
predicted ratio to the plain row of its configuration. The H200 rows were measured at the commits their files
name: ``--fit-counts`` fits them on counts of that code. The targets (issue 80) are the bar for a
rebuild of the GPU route.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

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
LONG_METHODS = ("plain", "ga", "attendout", "hiddencut")  # the long rows the H200 measured
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


@contextlib.contextmanager
def gpu_route() -> Iterator[dict]:
    """The portable branches forced (devices.PORTABLE) for a while; yields what the route is here."""
    from attn_reg_plugin.core.kernel import devices

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
    """``attn-reg-gpu-bench``'s standard rows, with ``+fused`` rows (``--fused``) in fp32 only: Triton's
    interpreter gets a bf16 dot wrong, and so the plugin does not route bf16 calls there."""
    from .gpu_bench import STANDARD_VARIANTS

    fused_kernel = long_section().fused_kernel

    names = [v for v in ("plain", *STANDARD_VARIANTS) if _wanted(v, opts.variants)]
    fused = [f"{v}+fused" for v in ("ad-drop-ga-all", "dropkey") if opts.fused and _wanted(v, opts.variants)]
    rows = []
    for framework in getattr(opts, "frameworks", ("fairseq", "hf")):
        for dtype in ("fp32", "bf16"):
            bench = standard_bench(framework, dtype, opts, log)
            not_run = getattr(opts, "triton_not_run", False)  # bf16 then too: the interpreter runs no kernel
            for name in names + (fused if dtype == "fp32" or not_run else []):
                variant = name.split("+")[0]
                row = {"section": "standard", "framework": framework, "variant": name, "dtype": dtype}
                row.update(tokens=bench.tokens["train"], configuration=f"{framework} {dtype}")
                row["description"] = bench.batch_descriptions["train"]
                step = standard_step(bench, framework, variant)
                if step is None:
                    rows.append({**row, "status": f"not counted: the benchmark has no {variant} step in {dtype}"})
                    continue
                started = time.time()
                # (the plain path's rows ask nothing of fused_edit: the fit's counts of older code have none)
                fused_context = fused_kernel(True) if name.endswith("+fused") else contextlib.nullcontext([0])
                counter = CostCounter()
                counter.triton_not_run = name.endswith("+fused") and not_run
                with fused_context as fused_calls, _bf16_routed(counter.triton_not_run):
                    cost = count_step(step, counter)
                row.update(cost.as_dict(), status="ok", seconds=round(time.time() - started, 1))
                if name.endswith("+fused"):
                    row["fused_calls"] = fused_calls[0]
                if counter.triton_not_run:
                    row["note"] = FUSED_NOT_RUN
                log(f"{framework} {dtype} {name}: {cost.launches} launches, {cost.syncs} syncs ({row['seconds']} s)")
                rows.append(row)
            del bench
    return rows


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
    for name in ("launches", "triton_launches", "syncs", "plugin_syncs", "host_reads", "bytes"):
        setattr(out, name, round(sum(c * getattr(cost, name) for c, cost in terms)))
    for name in ("flops", "ops", "sync_sites"):
        keys = {k for _, cost in terms for k in getattr(cost, name)}
        values = {k: round(sum(c * getattr(cost, name).get(k, 0) for c, cost in terms)) for k in keys}
        values = {k: v for k, v in values.items() if v}
        setattr(out, name, values if name == "flops" else type(out.ops)(values))
    return out


def long_section() -> argparse.Namespace:
    """gpu_bench_long's trainer(method, opts, tokens, steps), fused_kernel, fused_methods and variant_names.
    Before the long section had a module of its own (04d1e36, whose code the H200's standard rows
    measured), gpu_bench's: these two modules copied into such a checkout count its code."""
    from . import gpu_bench

    if hasattr(gpu_bench, "_long_trainer"):  # the long section still in gpu_bench

        def trainer(method, opts, tokens, steps):
            return gpu_bench._long_trainer(method, argparse.Namespace(**vars(opts), long_steps=steps), tokens, None)

        fused = lambda on: contextlib.nullcontext([0])
        return argparse.Namespace(
            trainer=trainer, fused_kernel=fused, fused_methods={}, variant_names=gpu_bench.LONG_VARIANT_NAMES
        )
    from . import gpu_bench_long as long

    return argparse.Namespace(
        trainer=long._long_trainer, fused_kernel=long.fused_kernel, fused_methods=long.FUSED_METHODS,
        variant_names=long.LONG_VARIANT_NAMES,
    )  # fmt: skip


def long_cost(method: str, tokens: int, scale, layers: int, log) -> Tuple[Cost, dict]:
    """The step at ``layers`` layers from the steps counted at 1 and 2, and how it was counted."""
    counted = []
    for n in (1, 2):
        started = time.time()
        with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its metrics
            counted.append(_count_long(method, tokens, n, scale))
        log(f"  long {method}: {tokens} tokens, {n} layer(s) counted in {time.time() - started:.0f} s")
    one, two = counted
    how = {"counted_layers": {"1": one.launches, "2": two.launches}}
    return combine([(2 - layers, one), (layers - 1, two)]), how


def _count_long(method: str, tokens: int, layers: int, scale) -> Cost:
    """One Trainer step of the long model at ``layers`` layers and ``tokens`` tokens, after an uncounted
    one of WARMUP_TOKENS."""
    import shutil

    import transformers

    opts = argparse.Namespace(long_layers=layers, device="cpu", **LONG_COUNTED)
    long = long_section()
    trainer = long.trainer(long.fused_methods.get(method, method), opts, tokens, 2)
    warm = {k: v[:WARMUP_TOKENS] for k, v in trainer.train_dataset[0].items()}
    trainer.train_dataset = [warm, trainer.train_dataset[1]]
    trainer.args.train_sampling_strategy = "sequential"  # the short step first
    counter = CostCounter()
    counter.flop_scale = scale
    fused = method in long.fused_methods
    counter.triton_not_run = fused  # the interpreter would take hours at these lengths (FUSED_NOT_RUN)

    class Recorded(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            counter.recording = state.global_step == 1

        def on_step_end(self, args, state, control, **kwargs):
            counter.recording = False

    trainer.add_callback(Recorded())
    try:
        with long.fused_kernel(fused), _bf16_routed(fused), counter.counting():
            trainer.train()
    finally:
        shutil.rmtree(trainer.args.output_dir, ignore_errors=True)
    return counter.cost


@contextlib.contextmanager
def _bf16_routed(on: bool) -> Iterator[None]:
    """The fused route takes bf16 calls while on, as on a GPU: in the interpreter it refuses them (a bf16
    tl.dot comes out wrong there), which does not matter to kernels counted and not run."""
    from attn_reg_plugin.core.kernel import fused_edit

    original = fused_edit.available
    if on:
        fused_edit.available = lambda q: True
    try:
        yield
    finally:
        fused_edit.available = original


# What a long fused row's numbers are (its "note").
FUSED_NOT_RUN = (
    "fused route, its Triton kernels counted and not run (their outputs left as allocated): launches and "
    "syncs as on a GPU; the kernels' FLOPs and bytes not counted"
)


def long_rows(row_set: str, opts, log) -> List[dict]:
    from .gpu_bench import GPU_DEFAULTS as real

    tokens, c = (QUICK_LONG_LENGTHS if opts.quick else LONG_LENGTHS)[row_set], LONG_COUNTED
    names = long_section().variant_names
    methods = [m for m in LONG_METHODS if _wanted(names[m], opts.variants)]
    if opts.fused and "ga" in methods:  # the GPU route with ATTN_REG_FUSED=1
        methods.append("ga-fused")
    how = (
        f"Llama-shaped decoder, bf16, gradient checkpointing, batch 1; counted at {c['long_heads']}/"
        f"{c['long_kv_heads']} heads x 64 (width {c['long_width']}, vocabulary {c['long_vocab']}) and "
        f"extrapolated to {real['long_layers']} layers; FLOPs scaled to {real['long_heads']}/{real['long_kv_heads']} "
        f"heads, width {real['long_width']}, vocabulary {real['long_vocab']}; bytes of the counted width"
    )
    rows = []
    for method in methods:
        row = {"section": "long", "framework": "hf", "variant": names[method], "dtype": "bf16"}
        row.update(tokens=tokens, configuration=f"{row_set} (hf bf16, {tokens} tokens)", description=how)
        started = time.time()
        try:
            cost, counted = long_cost(method, tokens, long_flop_scale(real), real["long_layers"], log)
        except Exception as error:  # one method's failure is its row's
            rows.append({**row, "status": f"error: {type(error).__name__}: {error}"})
            log(f"{row_set} {method}: {rows[-1]['status']}")
            continue
        row.update({**cost.as_dict(), **counted}, status="ok", seconds=round(time.time() - started, 1))
        if method in long_section().fused_methods:
            row["note"] = FUSED_NOT_RUN
        log(f"{row_set} {method}: {cost.launches} launches, {cost.syncs} syncs ({row['seconds']} s)")
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


def row_key(row: dict) -> Tuple:
    """One configuration and method: standard by framework, variant and dtype; long by variant and tokens."""
    if row["section"] == "standard":
        return ("standard", row["framework"], row["variant"], row["dtype"])
    return ("long", row["variant"], row["tokens"])


def config_key(row: dict) -> Tuple:
    """The rows one plain row is the reference of."""
    return row_key({**row, "variant": "plain"})


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
        p, h = plain.get(config_key(r)), measured.get(row_key(r))
        r["flops_total"] = sum(r["flops"].values())
        if p is not None:
            r["launches_ratio"] = _ratio(r["launches"], p["launches"])
            r["flops_ratio"] = _ratio(r["flops_total"], sum(p["flops"].values()))
            r["bytes_ratio"] = _ratio(r["bytes"], p["bytes"])
        if h is not None:
            r.update(h200_time_ms=h["time_ms"], h200_ratio=h.get("time_ratio"), h200_source=h["source"])
    fitted = counted if fit_counts is None else [r for r in fit_counts[1]["rows"] if r.get("status") == "ok"]
    paired = [(r, measured[row_key(r)]["time_ms"]) for r in fitted if row_key(r) in measured]
    pairs = [
        {"launches": r["launches"], "syncs": r["syncs"], "time_ms": t, "row": row_key(r), "config": config_key(r)}
        for r, t in paired
        if r["section"] == FIT_SECTION
    ]
    model = fit(pairs)
    model["fitted_on"] = [list(p["row"]) for p in pairs]
    model["sources"] = sorted({measured[p["row"]]["source"] for p in pairs})
    model["counts"] = "this run's" if fit_counts is None else f"{fit_counts[0]} (at {fit_counts[1].get('commit')})"
    model["note"] = "each H200 row was measured at the commit its file names; the counts are of the code counted"
    model["note"] += "; --quick counts tiny sizes, not the H200 rows' configurations: a smoke test" if quick else ""
    model["checked_on"] = [  # the other H200 rows, predicted out of the fit
        {"row": list(row_key(r)), "measured_ms": t, "predicted_ms": predict(model, r["launches"], r["syncs"])}
        for r, t in paired
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
    """The standard HF fp32 plain and GA-all steps, each compiled whole (:mod:`.gpu_cost_compile`):
    their dynamo graphs and graph breaks, and the target's verdict on GA's."""
    from .gpu_cost_compile import graph_breaks

    bench = standard_bench("hf", "fp32", opts, log)
    rows = []
    with gpu_route():
        for variant in ("plain", "ad-drop-ga-all"):
            step = standard_step(bench, "hf", variant)
            row = {"section": "compile", "framework": "hf", "variant": variant, "dtype": "fp32"}
            row.update(graph_breaks(step))
            log(f"hf fp32 {variant} compiled whole: {row['graphs']} graphs, {row['breaks']} graph breaks")
            rows.append(row)
    ga = rows[-1]
    met = ga["breaks"] <= COMPILE_BREAKS_BOUND
    what = f"GA training step under torch.compile: graph breaks <= {COMPILE_BREAKS_BOUND}"
    ga["targets"] = [{"target": what, "value": ga["breaks"], "met": met}]
    ga["verdict"] = {
        "target": what,
        "row": ["compile", "hf", ga["variant"], "fp32"],
        "value": ga["breaks"],
        "bound": COMPILE_BREAKS_BOUND,
        "met": met,
    }
    return rows


def targets(counted: List[dict]) -> List[dict]:
    """Each target on each row it concerns (also written on the row: ``targets``)."""
    out = []
    longest = max((r["tokens"] for r in counted if r["section"] == "long"), default=None)
    for what, section, framework, variant, field, bound in TARGETS:
        for r in counted:
            if (r["section"], r["framework"], r["variant"]) == (section, framework, variant):
                if section == "standard" or r["tokens"] == longest:
                    out.append(_verdict(what, r, r.get(field), bound))
    plain = {r["tokens"]: r["launches"] for r in counted if r["section"] == "long" and r["variant"] == "plain"}
    for variant, route in (("ad-drop-ga-all", ""), ("ad-drop-ga-all-fused", ", fused route")):
        ga = sorted((r for r in counted if r["section"] == "long" and r["variant"] == variant), key=row_key)
        if len(ga) >= 2 and all(r["tokens"] in plain for r in ga):
            added = [r["launches"] - plain[r["tokens"]] for r in (ga[0], ga[-1])]
            what = (
                f"GA's added launches at {ga[-1]['tokens']:,} tokens <= {ADDED_LAUNCHES_BOUND}x at "
                f"{ga[0]['tokens']:,}{route}"
            )
            out.append(_verdict(what, ga[-1], _ratio(added[1], added[0]), ADDED_LAUNCHES_BOUND))
    out += [_verdict("plugin-added syncs = 0", r, r["plugin_syncs"], 0) for r in counted if r["variant"] != "plain"]
    return out


def _verdict(what: str, row: dict, value, bound) -> dict:
    met = value is not None and value <= bound
    row.setdefault("targets", []).append({"target": what, "value": value, "met": met})
    return {"target": what, "row": list(row_key(row)), "value": value, "bound": bound, "met": met}


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
        "| configuration | method | launches | × plain | syncs | plugin-added syncs | FLOPs tensor-core / fp32 | FLOPs × plain "
        "| bytes | predicted H200 × plain | measured H200 × plain | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['configuration']} | {r['variant']} | {r.get('status')} |" + " |" * 9)
            continue
        bars = [
            f"{t['target']}: {t['value']} ({'met' if t['met'] else '**missed**'})"
            for t in r.get("targets", [])
            if t["target"] != "plugin-added syncs = 0"
        ]
        cells = [
            r["configuration"], r["variant"], f"{r['launches']:,}", _fmt(r.get("launches_ratio")), r["syncs"],
            r["plugin_syncs"], f"{_si(r['tensor_core_flops'])} / {_si(r['fp32_flops'])}", _fmt(r.get("flops_ratio")),
            _si(r["bytes"], "B"), _fmt(r.get("predicted_h200_ratio")), _fmt(r.get("h200_ratio")), "; ".join(bars),
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join([*lines, "", format_fit(result["fit"])])


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
