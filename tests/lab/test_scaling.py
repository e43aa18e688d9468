"""attn-reg-scaling: the table, JSON, PNG and verdict of a tiny grid, its refusals, and the property
the blockwise kernel exists for: AD-DROP's extra step memory grows linearly with length."""

import json

import pytest
import torch

from attn_reg_lab import scaling, scaling_worker
from attn_reg_lab.benchmark.measure import cpu_step_peak_bytes


def _extra_memory(length: int, attribution: str) -> float:
    """AD-DROP's step peak above plain's, in bytes, on model (a) at ``length`` tokens (this process)."""
    peaks = {}
    for method in ("plain", attribution):
        spec = dict(model="a", method=method, length=length, seed=1, iga_steps=3)
        step, _ = scaling_worker._core_step(spec)
        step()  # optimizer state and allocator caches exist before the measured step
        peaks[method] = cpu_step_peak_bytes(step)
    return peaks[attribution] - peaks["plain"]


@pytest.mark.parametrize("attribution", ["ga", "iga"])
def test_ad_drop_extra_memory_is_linear_in_length(attribution):
    """At 1,024 and 2,048 tokens the maps are several blocks of the kernel: doubling the length at most
    about doubles what AD-DROP holds beyond plain (dense maps would quadruple it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        at_t, at_2t = _extra_memory(1024, attribution), _extra_memory(2048, attribution)
    finally:
        torch.set_num_threads(threads)
    assert at_t > 0
    assert at_2t <= 2.3 * at_t, (at_t / 2**20, at_2t / 2**20)


def test_a_tiny_grid_writes_table_json_png_and_verdict(tmp_path, capsys):
    out = tmp_path / "scaling"
    assert scaling.main(["--models", "a", "--methods", "ga", "--lengths", "32", "--repeats", "1",
                         "--warmup", "0", "--profile", "--out-dir", str(out)]) == 0  # fmt: skip
    result = json.loads((out / "scaling.json").read_text())
    runs = {r["method"]: r for r in result["runs"]}
    assert set(runs) == {"plain", "ga"}  # plain is always run: every ratio is against it
    assert all(r["status"] == "ok" for r in runs.values()), runs
    ga, plain = runs["ga"], runs["plain"]
    assert ga["memory_mib"] > 0 and plain["cpu_s"] > 0
    assert ga["mem_ratio"] == round(ga["memory_mib"] / plain["memory_mib"], 3)
    assert ga["time_ratio"] == round(ga["cpu_s"] / plain["cpu_s"], 3)
    assert 0 < ga["drop_rate"] < 0.3  # p = q = 0.3: at most p q of a row's keys, fewer on short rows
    assert ga["torch_threads"] == 1
    # --profile: the step's operators by self CPU time, the attribution pass among them
    times = [op["self_cpu_ms"] for op in ga["profile"]]
    assert times == sorted(times, reverse=True) and any(op["op"] == "ad_drop::attribution_pass" for op in ga["profile"])
    # lengths that were not run are "not measured", never met or missed
    assert all(v["met"] is None for v in result["verdicts"]), result["verdicts"]
    assert (out / "scaling.png").stat().st_size > 0
    md = (out / "results.md").read_text()
    assert "attn-reg-scaling --models a" in md and "| 32 | ga |" in md and "not measured" in md


def test_verdicts_compare_with_the_targets():
    runs = [
        {"model": "a", "method": "plain", "length": 4096, "status": "ok", "memory_mib": 40.0, "cpu_s": 1.0},
        {"model": "a", "method": "ga", "length": 4096, "status": "ok", "memory_mib": 50.0, "cpu_s": 6.0},
    ]
    runs.append({"model": "a", "method": "attendout", "length": 4096, "status": "ok", "memory_mib": 64.0, "cpu_s": 2.9})
    scaling.add_ratios(runs)
    checks = {(c["model"], c["method"], c["length"], c["metric"]): c for c in scaling.verdicts(runs, ["a"], [4096])}
    assert checks[("a", "ga", 4096, "mem_ratio")]["met"] is True  # 1.25 <= 1.5
    assert checks[("a", "ga", 4096, "time_ratio")]["met"] is False  # 6 > 5
    assert checks[("a", "ga", 8192, "runs")]["met"] is None  # 8192 not in the grid
    assert checks[("b", "ga", 2048, "mem_ratio")]["met"] is None  # model b not run
    assert checks[("a", "attendout", 4096, "mem_ratio")]["met"] is False  # 1.6 > 1.5
    assert checks[("a", "attendout", 4096, "time_ratio")]["met"] is True  # 2.9 <= 3


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--models", "a,z"], ["--models", "z"]),
        (["--methods", "ga,xx"], ["--methods", "xx"]),
        (["--lengths", "64,abc"], ["--lengths"]),
        (["--lengths", "1"], ["--lengths", ">= 2"]),
        (["--threads", "0"], ["--threads"]),
        (["--timeout", "0"], ["--timeout"]),
    ],
)
def test_bad_options_are_refused_before_anything_runs(argv, names, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        scaling.main([*argv, "--out-dir", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err.split("error: ", 1)[1]
    assert all(n in err for n in names), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model", ["c", "d"])
def test_the_trainer_models_train_with_checkpointing_only_on_d(model):
    """(d) is the checkpointing case: the stock Trainer and ADDropTrainer both run it with gradient
    checkpointing on, (c) without."""
    spec = dict(model=model, method="ga", length=24, seed=1, hf_steps=2, iga_steps=2)
    result = scaling_worker.measure_hf(spec)
    assert result["gradient_checkpointing"] is (model == "d")
    assert result["cpu_s"] > 0
