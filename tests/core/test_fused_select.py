"""AD-DROP's region state streamed over any number of keys (core/kernel/fused_select.py), in Triton's CPU
interpreter here (compiled on CUDA): bit for bit fused_edit.region_state over fused_edit.attribution_scores
where that one fits (S <= 1024), the PyTorch path's region beyond it, and a launch count that does not
grow with T or S."""

import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import fused_kernel_device

DEVICE = fused_kernel_device()  # CUDA, compiled; else the CPU in Triton's interpreter
from attn_reg_plugin.core.kernel import fused_edit as fe
from attn_reg_plugin.core.kernel import fused_select as fs

pytestmark = pytest.mark.gpu  # make gpu-check: compiled on CUDA; here in the interpreter

from attn_reg_plugin.core.kernel.masks import MASKED_BIAS
from attn_reg_plugin.core.kernel.rules import Block, MapScores, TopRegionRule, decimal_fraction


def inputs(b, h, h_kv, t, s, d, integer, seed=0):
    """(attribution (B, H, T, d), values (B, H_kv, S, d)): small integers (exact scores, many ties), or
    normal floats."""
    generator = torch.Generator().manual_seed(seed)
    if integer:
        attribution = torch.randint(-2, 3, (b, h, t, d), generator=generator).float()
        values = torch.randint(-2, 3, (b, h_kv, s, d), generator=generator).float()
    else:
        attribution = torch.randn((b, h, t, d), generator=generator)
        values = torch.randn((b, h_kv, s, d), generator=generator)
    return attribution.to(DEVICE), values.to(DEVICE)


def padding_bias(lengths, s):
    """(B, 1, 1, S) float bias: -inf at the padding keys (right padding; a length 0 pads every key)."""
    pad = torch.arange(s) >= torch.tensor(lengths)[:, None]
    return torch.zeros(len(lengths), 1, 1, s).masked_fill(pad.view(-1, 1, 1, s), -math.inf).to(DEVICE)


def samples_of(*chosen):
    return torch.tensor(chosen, dtype=torch.bool, device=DEVICE)


def validity(b, h, t, s, key_bias, causal):
    """(B, H, T, S) bool: the keys each query may attend."""
    valid = torch.ones((1, 1, t, s), dtype=torch.bool, device=DEVICE)
    if key_bias is not None:
        valid = valid & (key_bias if key_bias.dtype == torch.bool else key_bias > MASKED_BIAS)
    if causal:
        valid = valid & (torch.arange(s, device=DEVICE) <= torch.arange(t, device=DEVICE)[:, None] + s - t)
    return valid.expand(b, h, t, s)


def kernel_state(attribution, values, key_bias, causal, p, samples=None):
    """fused_edit's answer: its score map, then region_state over it (S <= 1024)."""
    scores = fe.attribution_scores(attribution, values)
    return fe.region_state(scores, key_bias, causal, *decimal_fraction(p), samples)


def pytorch_state(attribution, values, key_bias, causal, p, samples=None):
    """The PyTorch path's answer over the kernels' own scores:
    TopRegionRule.region, +inf and k = 0 outside ``samples``, then fused_edit.region_ties."""
    scores = fe.attribution_scores(attribution, values)
    b, h, t, s = scores.shape
    valid = validity(b, h, t, s, key_bias, causal)
    scores = scores.masked_fill(~valid, -math.inf)
    rule = TopRegionRule(MapScores(scores), p, 0.0)
    _, (threshold, k, _), _ = rule.region(Block(slice(0, t), valid, (b, h, t, s), (b, h, t, s), None), scores)
    if samples is not None:
        chosen = samples.view(-1, 1, 1, 1)
        threshold, k = torch.where(chosen, threshold, math.inf), torch.where(chosen, k, 0)
    last_tie, lowest = fe.region_ties(scores, valid, threshold, k)
    return threshold.squeeze(-1), last_tie, lowest


def assert_same(got, want):
    names = ("threshold", "last_tie", "lowest")
    for name, x, y in zip(names, got, want):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), f"{name}: {(x != y).sum().item()} rows differ\n{x}\n{y}"
    # bit for bit, not only equal as floats (+0 and -0, the sign of an infinity)
    assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))


# (b, h, h_kv, t, s, d, integer, lengths or None, causal, samples or None, the p taken)
CASES = {
    "plain floats": (1, 2, 2, 20, 40, 8, False, None, False, None, (0.1, 0.5)),
    "integers, padding": (2, 1, 1, 16, 33, 4, True, [33, 12], False, None, (0.1, 0.3, 0.5, 0.9, 1.0)),
    "causal T < S, GQA": (1, 4, 2, 19, 37, 8, True, [37], True, None, (0.3, 0.9)),
    "causal T > S: keyless rows": (1, 2, 1, 24, 9, 4, True, None, True, None, (0.5, 1.0)),
    "a sample all padding, samples": (3, 1, 1, 9, 21, 4, True, [21, 0, 5], False, (True, True, False), (0.3, 1.0)),
    "floats, causal, samples, GQA": (2, 2, 1, 16, 48, 16, False, [48, 20], True, (False, True), (0.1, 0.9)),
    "odd head size, p > 1": (1, 1, 1, 5, 26, 3, True, None, False, None, (0.5, 1.5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_equals_region_state_over_the_score_map(case):
    b, h, h_kv, t, s, d, integer, lengths, causal, chosen, ps = CASES[case]
    attribution, values = inputs(b, h, h_kv, t, s, d, integer, seed=len(case))
    bias = None if lengths is None else padding_bias(lengths, s)
    samples = None if chosen is None else samples_of(*chosen)
    scores = fe.attribution_scores(attribution, values)
    for p in ps:
        got = fs.region_state_streamed(attribution, values, bias, causal, *decimal_fraction(p), samples)
        assert_same(got, fe.region_state(scores, bias, causal, *decimal_fraction(p), samples))


def test_many_ties_and_a_row_of_one_score():
    """Integers in {-1, 0, 1}: scores of a few values, every threshold tied; one head's values all 0 (every
    score 0: the threshold 0, k ties taken from key 0, the lowest key 0)."""
    attribution, values = inputs(2, 1, 1, 16, 50, 2, True, seed=3)
    attribution, values = attribution.clamp(-1, 1), values.clamp(-1, 1)
    values[1, 0] = 0.0
    bias = padding_bias([50, 41], 50)
    for p in (0.1, 0.9):
        got = fs.region_state_streamed(attribution, values, bias, False, *decimal_fraction(p))
        assert_same(got, kernel_state(attribution, values, bias, False, p))
        assert (got[1] >= 0).all()  # every row took a tie
    assert (got[0][1, 0] == 0).all() and (got[2][1, 0] == 0).all() and (got[1][1, 0] >= 0).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")  # the interpreter's numpy
def test_nan_and_infinities_in_the_attribution():
    """NaN scores rank as 0, +-inf ones as the largest finite float32 values (tied with each other)."""
    attribution, values = inputs(1, 2, 2, 20, 30, 4, False, seed=5)
    attribution[0, 0, 1, 0] = math.nan
    attribution[0, 0, 2, :] = math.inf
    attribution[0, 1, 3, 1] = -math.inf
    attribution[0, 1, 4, 0], attribution[0, 1, 4, 1] = math.inf, -math.inf  # inf - inf: NaN scores
    values[0, 0, 7] = math.inf
    values[0, 1, 11, 2] = math.nan
    bias = padding_bias([26], 30)
    for p in (0.1, 0.5, 1.0):
        got = fs.region_state_streamed(attribution, values, bias, True, *decimal_fraction(p))
        assert_same(got, kernel_state(attribution, values, bias, True, p))
    top = torch.finfo(torch.float32).max
    assert (got[0].abs() == top).any()  # some threshold is a clamped infinity


def test_a_bool_bias_and_a_mask_whose_rows_differ():
    """A bool key row (True = may attend), and a (B, 1, T, S) float mask whose rows differ, one row all
    masked: against the PyTorch region."""
    b, h, t, s = 2, 2, 13, 29
    attribution, values = inputs(b, h, 1, t, s, 4, True, seed=7)
    keep = torch.rand((b, 1, 1, s), generator=torch.Generator().manual_seed(1)) < 0.7
    taken = torch.rand((b, 1, t, s), generator=torch.Generator().manual_seed(2)) < 0.4
    taken[1, 0, 4] = True
    mask = torch.zeros((b, 1, t, s)).masked_fill(taken, -math.inf)
    for bias in (keep.to(DEVICE), mask.to(DEVICE), ~taken.to(DEVICE)):
        for causal in (False, True):
            got = fs.region_state_streamed(attribution, values, bias, causal, *decimal_fraction(0.3))
            assert_same(got, pytorch_state(attribution, values, bias, causal, 0.3))


def test_digit_by_digit_counts_give_the_same_answer():
    """The compiled kernels' per-digit counting (``wide=False``), here in the interpreter too."""
    attribution, values = inputs(2, 1, 1, 16, 35, 4, True, seed=9)
    bias = padding_bias([35, 20], 35)
    samples = samples_of(True, True)
    for wide in (True, False):
        got = fs.region_state_streamed(attribution, values, bias, True, 3, 10, samples, wide=wide)
        assert_same(got, kernel_state(attribution, values, bias, True, 0.3, samples))


@pytest.mark.parametrize(
    "b, s, t, integer, lengths, causal, chosen, p",
    [
        (2, 1100, 3, True, [1100, 700], False, (True, False), 0.3),
        (1, 1100, 5, False, [1030], True, None, 0.1),
        (1, 1100, 3, False, None, False, None, 0.9),
        (1, 2100, 4, True, [1500], True, None, 0.5),
    ],
)
def test_beyond_region_state_equals_the_pytorch_region(b, s, t, integer, lengths, causal, chosen, p):
    """More keys than region_state ranks: the PyTorch path's region, as the route takes it today."""
    assert not fe.region_fits(s, *decimal_fraction(p))
    attribution, values = inputs(b, 1, 1, t, s, 4, integer, seed=s + t)
    bias = None if lengths is None else padding_bias(lengths, s)
    samples = None if chosen is None else samples_of(*chosen)
    got = fs.region_state_streamed(attribution, values, bias, causal, *decimal_fraction(p), samples)
    assert_same(got, pytorch_state(attribution, values, bias, causal, p, samples))


def test_empty_calls_and_bad_arguments():
    attribution, values = inputs(1, 2, 1, 0, 5, 4, True)
    assert all(x.shape == (1, 2, 0) for x in fs.region_state_streamed(attribution, values, None, False, 1, 2))
    attribution, values = inputs(1, 3, 2, 4, 5, 4, True)
    with pytest.raises(ValueError, match="cannot read"):
        fs.region_state_streamed(attribution, values, None, False, 1, 2)
    attribution, values = inputs(1, 2, 1, 4, 5, 4, True)
    with pytest.raises(ValueError, match="overflows"):
        fs.region_state_streamed(attribution, values, None, False, 2**62, 2**62 + 1)


# -- launches --------------------------------------------------------------------------------------
class _Launches(TorchDispatchMode):
    """Counts Triton launches (every JIT function's run, compiled or interpreted) and the torch operators
    dispatched outside them."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.launches, self.ops, self._inside = Counter(), Counter(), 0
        import triton.runtime.interpreter as interpreter
        import triton.runtime.jit as jit

        for cls in {jit.JITFunction, getattr(interpreter, "InterpretedFunction", jit.JITFunction)}:
            monkeypatch.setattr(cls, "run", self._counted(cls.run))

    def _counted(self, run):
        def counted(kernel, *args, **kwargs):
            self.launches[getattr(kernel, "__name__", repr(kernel))] += 1
            self._inside += 1
            try:
                return run(kernel, *args, **kwargs)
            finally:
                self._inside -= 1

        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def launches_of(monkeypatch, b, h, h_kv, t, s, lengths, causal, chosen):
    attribution, values = inputs(b, h, h_kv, t, s, 4, False)
    bias = None if lengths is None else padding_bias(lengths, s)
    samples = None if chosen is None else samples_of(*chosen)
    with monkeypatch.context() as patch, _Launches(patch) as seen:
        state = fs.region_state_streamed(attribution, values, bias, causal, 1, 2, samples)
    assert_same(state, pytorch_state(attribution, values, bias, causal, 0.5, samples))
    return seen


def test_one_launch_whatever_t_and_s_and_no_host_read(monkeypatch):
    small = launches_of(monkeypatch, 2, 1, 1, 3, 20, [20, 7], True, (True, False))
    large = launches_of(monkeypatch, 2, 1, 1, 40, 300, [300, 250], True, (True, False))
    assert small.launches == large.launches == Counter({"_select_kernel": 1})
    assert small.ops == large.ops  # the same few allocations and copies, whatever the sizes
    host_reads = {"_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero", "equal", "allclose"}
    assert not host_reads & set(large.ops)
    assert sum(large.ops.values()) <= 12, large.ops


# -- compiled --------------------------------------------------------------------------------------
COMPILE = """
import itertools, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attn_reg_plugin.core.kernel import fused_edit as fe
from attn_reg_plugin.core.kernel import fused_select as fs

scalars = dict.fromkeys(("T", "S", "H", "GROUP", "D", "NUM", "DEN"), "i32")
flags = ("CAUSAL", "BIAS_KIND", "ROW_BIAS", "HAS_SAMPLES", "WIDE", "DOT_PRECISION", "BLOCK_M", "BLOCK_N", "BLOCK_D")
# (causal, bias kind, row bias, samples, wide, operands, float32 product precision, the product's instruction)
variants = [(1, 1, 0, 1, 0, "fp32", "ieee", "fma.rn.f32"), (0, 0, 0, 0, 0, "fp32", "tf32", "mma"),
            (1, 2, 1, 0, 0, "bf16", "ieee", "mma"), (0, 1, 1, 1, 1, "fp16", "ieee", "mma")]
for causal, kind, row, samples, wide, operands, precision, instruction in variants:
    pointers = dict(ATTR=f"*{operands}", AV=f"*{operands}", SAMPLES="*i1", THRESHOLD="*fp32", LAST_TIE="*i32",
                    LOWEST="*i32")
    bias = "*i1" if kind == fe.BOOL_BIAS else "*fp32"
    signature = dict(pointers, BIAS=bias, **scalars, **dict.fromkeys(flags, "constexpr"))
    options = dict(CAUSAL=bool(causal), BIAS_KIND=kind, ROW_BIAS=bool(row), HAS_SAMPLES=bool(samples),
                   WIDE=bool(wide), DOT_PRECISION=precision, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64)
    source = ASTSource(fn=fs._select_kernel, signature=signature, constexprs=options)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": fs.NUM_WARPS}).asm["ptx"]
    assert instruction in ptx, (operands, precision, instruction)
    if instruction != "mma":
        assert "mma" not in ptx, "IEEE float32: no tensor core"
print("compiled")
"""


def test_the_kernel_compiles_for_a_cuda_gpu(tmp_path):
    """Compiled Triton, not only the interpreter's: every variant lowers to PTX for sm_90 (no GPU
    needed: Triton's CUDA backend and its ptxas), its product float32 FMA for float32 operands at IEEE
    precision, on tensor cores (mma) at TF32 and for bf16 and fp16 operands."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_the_fused_route_takes_a_call_of_more_than_1024_keys_to_the_streamed_region():
    """fused_route._ad_drop on a call of 1,100 keys (past fused_edit.MAX_REGION_KEYS): the streamed
    region, the PyTorch path's state exactly, in one Triton launch."""
    from attn_reg_plugin.core.kernel import fused_route
    from attn_reg_plugin.core.kernel.blockwise import BlockCall
    from attn_reg_plugin.core.kernel.rules import GradientScores

    attribution, values = inputs(2, 2, 1, 3, 1100, 4, integer=True, seed=7)
    q = torch.zeros_like(attribution)
    k = values.repeat_interleave(2, 1)
    bias = padding_bias([1100, 900], 1100)
    key_bias = fused_route.kernel_bias(bias, 2, 3)
    rule = TopRegionRule(GradientScores(attribution, values), 0.3, 0.5)
    call = BlockCall(rule, None, None, 64, torch.tensor(3), 0.0, None, True, causal=True)
    launched = []
    original = fs._select_kernel.run
    fs._select_kernel.run = lambda *a, **kw: launched.append(1) or original(*a, **kw)
    try:
        drops = fused_route.fused_drops(q, k, k, bias, call).drops
    finally:
        fs._select_kernel.run = original
    assert launched == [1] and not fe.region_fits(1100, 3, 10)
    want = pytorch_state(attribution, values, key_bias, True, 0.3)
    assert_same((drops.threshold, drops.last_tie, drops.lowest_key), want)
