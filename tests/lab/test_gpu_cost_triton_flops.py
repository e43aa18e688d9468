"""attn-reg-gpu-cost's model of the fused route's Triton kernels (gpu_cost.triton_flops), which gives the
FLOPs of a launch counted and not run, held to the interpreter's count of the same launch: each kernel
run for real in Triton's interpreter on tiny shapes, its counted tl.dot FLOPs per precision against the
model's for the launch's own arguments and grid."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# One worker runs this module and the interpreted check is made once a session (about 25 s): module-scoped
# and spread over the workers, it was made twice.
pytestmark = pytest.mark.xdist_group("triton_flops")

CHECK = """
    import inspect, json, math, torch, triton
    from triton.runtime import interpreter
    from attn_reg_lab.gpu_cost import CostCounter, kernel_arguments, triton_flops
    from attn_reg_plugin.core.kernel import fused_edit as fe
    from attn_reg_plugin.core.kernel import fused_policy
    from attn_reg_plugin.core.kernel.fused_select import region_state_streamed
    from attn_reg_plugin.core.kernel.rules import SampledLogits

    launches = []  # (case, kernel, counted, modelled)

    def counted(case, run, scale=None, not_run=False):
        counter = CostCounter()
        counter.flop_scale, counter.triton_not_run = scale, not_run
        with counter.counting(), counter.recorded() as cost:
            inner = interpreter.InterpretedFunction.run  # the counter's: each launch checked around it

            def checked(self, *args, grid, warmup, **kwargs):
                counter._quiet += 1  # the model reads the select's samples: no sync of the step
                try:
                    model = triton_flops(self.__name__, kernel_arguments(self, args, kwargs), grid)
                finally:
                    counter._quiet -= 1
                before = dict(cost.flops)
                out = inner(self, *args, grid=grid, warmup=warmup, **kwargs)
                after = {k: v - before.get(k, 0) for k, v in cost.flops.items() if v != before.get(k, 0)}
                launches.append((case, self.__name__, after, {k: v for k, v in (model or {}).items() if v}))
                return out

            interpreter.InterpretedFunction.run = checked
            try:
                run()
            finally:
                interpreter.InterpretedFunction.run = inner
        return cost

    def tensors(b, h, h_kv, t, s, d=8, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn((b, h, t, d), generator=g).to(dtype)
        k, v = (torch.randn((b, h_kv, s, d), generator=g).to(dtype) for _ in range(2))
        attribution, values = torch.randn((b, h, t, d), generator=g), torch.randn((b, h_kv, s, d), generator=g)
        return q, k, v, attribution.to(dtype), values.to(dtype)

    def drops(rule, q, attribution, values, dropout_p):
        b, h, t, _ = q.shape
        extra = dict(dropout_p=dropout_p, dropout_seed=11)
        if rule == "NONE":
            return fe.EditDrops(fe.NONE, 0.0, 3, **extra)
        if rule == "BERNOULLI":
            return fe.EditDrops(fe.BERNOULLI, 0.3, 3, **extra)
        if rule == "GENERATOR":
            return fe.EditDrops(fe.GENERATOR, 0.0, 3, policy=sampled(b, t, values.shape[2], True), **extra)
        state = (torch.zeros(b, h, t), torch.full((b, h, t), -1, dtype=torch.int32), torch.zeros(b, h, t, dtype=torch.int32))
        return fe.EditDrops(fe.AD_DROP, 0.3, 3, attribution, values, *state, **extra)

    def sampled(b, t, s, causal, g=20):
        gen = torch.Generator().manual_seed(4)
        real = torch.ones(b, max(t, s), dtype=torch.bool)
        real[0, -3:] = False
        return SampledLogits(torch.randn(b, t, g, generator=gen), torch.randn(b, s, g, generator=gen), torch.tensor(0.1),
                             real[:, :t], real[:, :s], causal, False, 9)

    def attention(rule, causal, b, h, h_kv, t, s, dropout_p=0.0, dtype=torch.float32, padded=False):
        q, k, v, attribution, values = tensors(b, h, h_kv, t, s, dtype=dtype)
        bias = None
        if padded:  # a key-padding row: the last 5 keys of the first sample
            bias = torch.zeros(b, 1, 1, s)
            bias[0, ..., -5:] = -math.inf
        spec = drops(rule, q, attribution, values, dropout_p)  # values: the attribution pass's v, v's shape

        def run():
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out, _, _ = fe.fused_edit_attention(*leaves, spec, key_bias=bias, causal=causal)
            out.float().sum().backward()
            if rule != "NONE":
                fe.inspect(q, k, v, spec, key_bias=bias, causal=causal)  # its row counts and its map

        return run

    cases = {
        "none, T < S, GQA": attention("NONE", False, 1, 2, 1, 20, 37),
        "bernoulli, causal, dropout": attention("BERNOULLI", True, 1, 2, 2, 40, 50, dropout_p=0.1),
        "ad-drop, causal, T > S, GQA": attention("AD_DROP", True, 1, 4, 2, 37, 20),
        "ad-drop, dropout, padded": attention("AD_DROP", False, 2, 2, 2, 20, 37, dropout_p=0.2, padded=True),
        "ad-drop, causal, T < S, fp16": attention("AD_DROP", True, 1, 2, 1, 20, 37, dtype=torch.float16),
        "none, causal, fp64": attention("NONE", True, 1, 1, 1, 17, 33, dtype=torch.float64),
        "generator, causal, T < S, GQA, dropout": attention("GENERATOR", True, 2, 2, 1, 20, 37, dropout_p=0.1),
    }

    def policy(causal):
        p = sampled(2, 37, 20, causal)
        leaves = [x.clone().requires_grad_() for x in (p.query, p.key, p.offset)]

        def run():
            sums, _, _ = fused_policy.policy_log_prob(p.with_factors(*leaves))
            sums.sum().backward()
            fused_policy.policy_drops(p, slice(16, 37), 19)

        return run

    cases["policy, causal"] = policy(True)
    cases["policy"] = policy(False)

    def region(causal, samples):
        _, _, _, attribution, values = tensors(2, 2, 1, 20, 37)

        def run():
            scores = fe.attribution_scores(attribution, values)
            fe.region_state(scores, None, causal, 1, 3, samples)
            region_state_streamed(attribution, values, None, causal, 1, 3, samples)

        return run

    cases["region, causal, one sample"] = region(True, torch.tensor([True, False]))
    cases["region, all samples"] = region(False, None)
    for case, run in cases.items():
        counted(case, run)
    torch.set_float32_matmul_precision("high")  # the fused route's fp32 products at TF32 (DOT_PRECISION)
    counted("ad-drop at tf32", attention("AD_DROP", True, 1, 2, 1, 20, 37))
    counted("region at tf32", region(True, None))
    # counted and not run: the model's FLOPs, scaled as the counted ones are
    torch.set_float32_matmul_precision("highest")
    scale = lambda name, shapes: 4.0 if name == "triton" else 1.0
    ran = counted("scaled, run", attention("AD_DROP", True, 1, 4, 2, 37, 20), scale)
    modelled = counted("scaled, not run", attention("AD_DROP", True, 1, 4, 2, 37, 20), scale, not_run=True)
    precision = "DOT_PRECISION" in inspect.signature(fe._forward_kernel.fn).parameters  # the kernels take it
    print(json.dumps({"launches": launches, "ran": ran.as_dict(), "modelled": modelled.as_dict(), "precision": precision}))
"""

KERNELS = {
    "_forward_kernel", "_backward_q_kernel", "_backward_kv_kernel", "_row_counts_kernel", "_inspect_kernel",
    "_scores_kernel", "_region_kernel", "_select_kernel", "_log_prob_kernel", "_grad_query_kernel", "_grad_key_kernel",
    "_drops_kernel",
}  # fmt: skip


@pytest.fixture(scope="session")
def checked(tmp_path_factory):
    pytest.importorskip("triton")
    folder = tmp_path_factory.mktemp("triton_flops")
    (folder / "check.py").write_text(textwrap.dedent(CHECK))
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # before Triton is imported: a fresh process
    proc = subprocess.run(
        [sys.executable, "check.py"], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_model_of_each_kernel_is_the_interpreters_count(checked):
    launches = [x for x in checked["launches"] if not x[0].startswith("scaled")]
    assert {name for _, name, _, _ in launches} == KERNELS
    wrong = [(case, name, counted, modelled) for case, name, counted, modelled in launches if counted != modelled]
    assert not wrong, wrong
    keys = {key for _, _, counted, _ in launches for key in counted}
    assert {"fp32", "fp16", "fp64"} <= keys  # the precisions the cases make


def test_tf32_products_count_as_tf32_where_the_kernels_take_them(checked):
    tf32 = [x for x in checked["launches"] if x[0].endswith("at tf32")]
    assert tf32 and all(counted == modelled for _, _, counted, modelled in tf32), tf32
    keys = {key for _, _, counted, _ in tf32 for key in counted}
    # the kernels' DOT_PRECISION follows torch's float32 matmul precision; kernels without it take "ieee"
    assert keys == ({"tf32"} if checked["precision"] else {"fp32"}), keys


def test_a_launch_not_run_gets_the_models_flops_scaled(checked):
    ran, modelled = checked["ran"], checked["modelled"]
    assert ran["flops"] == modelled["flops"] and sum(ran["flops"].values()) > 0
    assert (ran["triton_flops"], modelled["triton_flops"]) == ("counted", "modelled")
    assert ran["triton_launches"] == modelled["triton_launches"] == modelled["triton_modelled"] > 0
