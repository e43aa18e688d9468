"""Compile core/kernel/fused_edit.py's and fused_policy.py's kernels for a CUDA GPU on a machine without one.

    .venv/bin/python tools/fused_edit_compile.py [--arch 90] [--quick]

Triton's interpreter (the CPU tests) runs the kernels as Python and lets through what only the
compiler refuses: a global that is not a tl.constexpr, a loop-carried variable that changes type.
This runs Triton's whole pipeline (TTIR, TTGIR, LLVM IR, PTX, and a cubin from the wheel's ptxas)
for every rule in bf16 and fp32, causal, in two settings: a float32 key-padding row without the
model's attention dropout, IEEE float32 products, and a bool (B, T, S) mask with it, TF32 products; then the region kernel (whole rows of
1,024 keys, with samples) and AttendOut's policy kernels (causal real units, both precisions).
``--quick``: AD-DROP and the Generator in bf16 only. Exits 1 on the first kernel that does
not compile. Nothing runs: its speed needs a GPU.
"""

import argparse
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attn_reg_plugin.core.kernel import fused_edit, fused_policy

KERNELS = (
    "_forward_kernel", "_backward_kv_kernel", "_backward_q_kernel", "_row_counts_kernel", "_inspect_kernel", "_scores_kernel",
)  # fmt: skip
SCALARS = dict(seed="i64", limit="i32", dseed="i64", dlimit="i32", dscale="fp32", scale="fp32", T="i32", S="i32",
               H="i32", GROUP="i32", D="i32", G="i32", NUM="i64", DEN="i64", row_start="i32", ROWS="i32",
               KEYS="i32")  # fmt: skip
POLICY_KERNELS = ("_log_prob_kernel", "_grad_query_kernel", "_grad_key_kernel", "_drops_kernel")
# Pointers that are not q, k, v, the output, a gradient or the attribution operands (those take the inputs'
# dtype: fused_edit.attribution_operands gives a half-precision call's attribution in its dtype).
POINTERS = dict(THR="*fp32", TIE="*i32", KEEP="*i32", LOWEST="*i32", LSE="*fp32",
                DELTA="*fp32", COUNTS="*i64", CODES="*i8", SCORES="*fp32", SAMPLES="*i1", THRESHOLD="*fp32",
                LAST_TIE="*i32", GQ="*fp32", GK="*fp32", GOFF="*fp32", QREAL="*i1", KREAL="*i1", LOG_PROB="*fp32",
                UNIT_COUNT="*i32", PROBABILITY="*fp32", GRAD_SUMS="*fp32", DGQ="*fp32", DOFFSET="*fp32", DGK="*fp32",
                DROPS="*i8", LOGITS="*fp32", UNIFORMS="*fp32", UNITS_OUT="*i8")  # fmt: skip
# (BIAS_KIND, ROW_BIAS, DROPOUT, DOT_PRECISION): a float32 key-padding row, no attention dropout, IEEE float32
# products; a bool mask of rows, dropout, TF32 products (torch's float32 matmul precision "high").
SETTINGS = ((fused_edit.FLOAT_BIAS, False, False, "ieee"), (fused_edit.BOOL_BIAS, True, True, "tf32"))


def compile_kernel(kernel, dtype: str, options: dict, arch: int):
    """One kernel compiled to a cubin for ``arch`` with ``options`` (its constexprs)."""
    options = {name: value for name, value in options.items() if name in kernel.arg_names}
    bias = "*i1" if options.get("BIAS_KIND") == fused_edit.BOOL_BIAS else "*fp32"
    signature = {
        name: "constexpr"
        if name in options
        else SCALARS.get(name) or POINTERS.get(name, bias if name == "BIAS" else "*" + dtype)
        for name in kernel.arg_names
    }
    constexprs = {(kernel.arg_names.index(name),): value for name, value in options.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--quick", action="store_true", help="AD-DROP in bf16 only")
    args = parser.parse_args(argv)
    rules = (fused_edit.AD_DROP, fused_edit.GENERATOR)
    if not args.quick:
        rules = (fused_edit.NONE, fused_edit.BERNOULLI, *rules)
    jobs = [
        (name, dtype, dict(RULE=rule, CAUSAL=True, BIAS_KIND=kind, ROW_BIAS=rows, DROPOUT=dropout, ACC=tl.float32,
                           UNITS=fused_edit.REAL_CAUSAL_UNITS, DOT_PRECISION=precision, BLOCK_M=64, BLOCK_N=64,
                           BLOCK_D=128, BLOCK_G=64))
        for rule in rules
        for dtype in (("bf16",) if args.quick else ("bf16", "fp32"))
        for kind, rows, dropout, precision in SETTINGS
        for name in KERNELS
    ]  # fmt: skip
    jobs += [
        ("_region_kernel", "fp32", dict(CAUSAL=True, BIAS_KIND=kind, ROW_BIAS=rows, HAS_SAMPLES=True, BLOCK_M=16,
                                        BLOCK_S=fused_edit.MAX_REGION_KEYS))
        for kind, rows, _, _ in SETTINGS
    ]  # fmt: skip
    jobs += [
        (name, "fp32", dict(UNITS=fused_edit.REAL_CAUSAL_UNITS, INSPECT=True, DOT_PRECISION=precision, BLOCK_M=64,
                            BLOCK_N=64, BLOCK_G=64))
        for precision in ("ieee", "tf32")
        for name in POLICY_KERNELS
    ]  # fmt: skip
    for name, dtype, options in jobs:
        module = fused_policy if name in POLICY_KERNELS else fused_edit
        try:
            compile_kernel(getattr(module, name), dtype, options, args.arch)
        except Exception as error:  # the compiler's own message says where
            print(f"{name} ({dtype}, {options}): {error}", file=sys.stderr)
            return 1
        print(f"{name} {dtype} {options}: compiled for sm_{args.arch}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
