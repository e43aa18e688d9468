"""What a training step costs on the GPU route, counted on the CPU (``attn-reg-gpu-cost``).

    attn-reg-gpu-cost                                   # standard, long4k, long16k rows: minutes on 2 idle cores
    attn-reg-gpu-cost --quick                           # tiny sizes of the same code (a smoke run)
    attn-reg-gpu-cost --rows standard --out cost.json   # some rows, also written as JSON
    attn-reg-gpu-cost --pytorch-path                    # and every row on the PyTorch path (ATTN_REG_FUSED=0) too
    attn-reg-gpu-cost --rows standard --run-triton      # fp32 rows' Triton kernels run in the interpreter (slow)
    attn-reg-gpu-cost --rows standard --compile         # and the HF step's graph breaks compiled whole
    attn-reg-gpu-cost --fit-counts old.json             # the H200 times fitted on counts of the code they timed

An H200 step of these models is bound by the host: its time follows the kernels the step launches
(docs/PERFORMANCE.md, "On a GPU"). This command runs a step of each configuration on the CPU on the
code a CUDA device runs: ``ATTN_REG_PORTABLE=1`` (the portable branches of
``attn_reg_plugin/core/kernel/devices.py``) and ``TRITON_INTERPRET=1`` (Triton kernels in its interpreter).
It sets both and starts again in a fresh process if they were not set.

Routes. Every row is counted on a CUDA device's default route: the **fused route** (``ATTN_REG_FUSED=1``,
set for those rows, not left to the plugin's default, which takes the route for CUDA tensors only),
where the fused Triton kernels (``core/kernel/fused_edit.py``, ``core/kernel/fused_select.py``) take the regularized
calls they cover and the rest stay on the PyTorch path. Its Triton launches are counted and not run
(the interpreter would take half an hour for a standard HF step, hours for a long one): launches and
syncs do not depend on the kernels' values; a launch's bytes are its arguments' sizes; its FLOPs come
from a model of the kernel's products (:func:`triton_flops`, below); the tensors it writes are left zero
(:data:`TRITON_OUTPUTS`). While they are not run the plugin takes the branches it takes on a GPU, not
those it takes for the interpreter (``gpu_cost_fit.as_on_a_gpu``): 64-wide tiles, bf16 calls on the
route, half-precision attribution operands where the attribution pass ran in half precision.
``--pytorch-path`` adds every row on the **PyTorch path** (``ATTN_REG_FUSED=0``), labelled so, beside
the default route's. ``--run-triton`` runs the standard fp32 rows' Triton kernels in the interpreter
instead and counts their ``tl.dot`` FLOPs (its tiles are 16 wide; the interpreter takes no bf16 call,
and the long rows would take hours: those stay modelled). A plugin without the fused route (a checkout
before ``core/kernel/fused_edit.py``) is counted on the PyTorch path, its GPU default then. Each step runs once
uncounted, then once counted. Per step it counts:

* **launches**: each aten operation that runs a kernel on a device, and each Triton launch (not the
  torch operations the interpreter runs inside one). Views and other metadata-only or allocation-only
  operations (:data:`NO_KERNEL`) are not launches, nor are operations on host tensors (below).
* **syncs**: whatever makes the host wait for the device. That is a scalar read (``.item()``,
  ``int(t)``, ``bool(t)``: ``aten._local_scalar_dense``), an output whose size depends on the data
  (:data:`SYNC_OPS`, and indexing with a bool mask), or a copy to the host (``.cpu()``, ``.tolist()``,
  ``.numpy()``, ``.to("cpu")``). **plugin-added syncs** are those whose caller (the first frame outside
  torch and the standard library) is in ``attn_reg_plugin``. ``sync_sites`` in the JSON says where each
  sync comes from.
* **host tensors**, whose reads are not syncs. A host tensor is one made by a torch factory called
  without ``device``: torch's default device is the CPU on a GPU machine too. ``rules.call_seed``'s
  seeds, ``torch.tensor(number)`` and an optimizer's step counter are host tensors, and so is whatever
  is computed from host tensors only. ``t.to(device)`` of a host tensor is a copy to the device (one
  launch). Only the string ``"cpu"`` is taken as the host; a ``torch.device`` is taken to be the
  device (``mask.to(scores.device)``).
* **FLOPs** of each product (``mm``, ``addmm``, ``bmm``, ``baddbmm``, sdpa's forward and backward),
  at its dtype, by torch's own formulas (``torch.utils.flop_counter``), and of each Triton ``tl.dot``:
  counted as the interpreter runs it, or, for a launch counted and not run, modelled (``triton_flops`` in
  the row's JSON: "counted", "modelled", "none", or "left out for" a kernel with no model). The model (:func:`triton_flops`, :data:`TRITON_MODELS`)
  follows each kernel's own loops: per (row tile, key tile) pair the kernel visits, given T, S, its
  ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_D`` (the padded head size), its causal loop bounds and its grid, the
  products its loop body makes there, 2 BLOCK_M BLOCK_N BLOCK_D FLOPs each (the forward: q k^T and p v,
  plus the attribution score dO_attr V_attr^T under AD-DROP; dq's: q k^T, dO v^T, ds k; dk and dv's, over
  its GROUP query heads: q k^T, dO v^T, p^T dO, ds^T q; the row counts and ``_inspect_kernel``: the
  attribution score; ``_scores_kernel``: one; ``_region_kernel``: none; ``_select_kernel``: 8 levels over a
  row block's ranked keys and one more pass). tests/lab/test_gpu_cost_triton_flops.py holds it to the
  interpreter's count, kernel by kernel. A product's precision key is its operands' dtype: "bf16",
  "fp16", "fp64"; float32 operands "tf32" at the kernel's ``DOT_PRECISION`` (input precision) "tf32",
  "fp32" at "ieee" (a kernel without it: "ieee"). ``tensor_core`` FLOPs are the bf16, fp16 and tf32 ones;
  ``fp32`` FLOPs the others, float32 at full precision (FMA units). torch's own float32 products are
  counted as "fp32" (torch's default float32 matmul precision, "highest", takes no TF32).
* **plugin launches**: the launches asked for in the plugin's code, by the innermost plugin function on
  the stack (``plugin_launch_sites``): where a regularizer's launches come from. A backward that autograd
  runs for the model's own operations has no plugin frame and is not among them.
* **bytes**: for each launch, the sizes of its tensor inputs and outputs, each at most its storage (an
  expanded mask counts once). This is an upper bound of the memory the step moves.

How: a ``TorchDispatchMode`` sees each operation after autograd and after torch's composite operations
are decomposed: the operations that have a device kernel, the backward's included. It also sees
their outputs (for the bytes) and the tensor a scalar read reads (for host tensors). torch.profiler,
which is public, was the alternative. But its tree holds the CPU kernels' own inner aten calls (a CPU
``_foreach`` op's per-tensor loop, where a GPU runs one kernel), and it records no outputs.
``TorchDispatchMode`` (``torch.utils._python_dispatch``) is private torch API. The plugin never
uses it; the lab already reads ``torch._dynamo``'s counters and the profiler's
``experimental_event_tree``. A public ``TorchFunctionMode`` sees what the dispatcher does not: the
factories' ``device`` argument and the copies to the host. An optimizer picks its ``foreach``
implementation (one kernel for many tensors) on a GPU but a loop over tensors on a CPU, so while
counting, torch.optim takes the CPU for a foreach device.

What still differs from a GPU: autocast casts by the CPU's operation lists (the CUDA lists differ in
a few operations); plain attention is sdpa's CPU flash kernel (one launch, as FlashAttention); an
operation is one launch where a GPU may run several (a ``_foreach`` op, a split-K product); with
``--run-triton`` the interpreter's Triton tiles are 16 wide, not 64 (the same launches; the FLOPs of the
padded tiles differ).

The rows (``--rows``), the fit of the committed H200 times on the counts, the targets and the table
are in :mod:`.gpu_cost_fit`.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode  # private: see the module's docstring
from torch.utils._pytree import tree_flatten

ROUTE_ENV = {"ATTN_REG_PORTABLE": "1", "TRITON_INTERPRET": "1"}
ROW_SETS = ("standard", "long4k", "long16k")
# Operations that launch no kernel on a device: metadata, allocation, the sdpa back-end choice.
NO_KERNEL = frozenset(
    (
        "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_", "resize_as_", "set_",
        "_unsafe_view", "lift_fresh", "alias", "detach_", "as_strided_", "squeeze_", "unsqueeze_", "transpose_",
        "t_", "swapdims_", "swapaxes_", "_fused_sdp_choice", "record_stream", "_local_scalar_dense",
        "_has_compatible_shallow_copy_type", "is_same_size", "_assert_tensor_metadata", "is_pinned",
    )
)  # fmt: skip
# Operations whose output size depends on the data: the host reads it before it can go on.
SYNC_OPS = frozenset(
    ("nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
     "equal", "bincount")
)  # fmt: skip
MASK_INDEXING = frozenset(("index", "index_put", "index_put_", "_index_put_impl_"))  # a nonzero inside, with a mask
# Torch factories: called without ``device`` they make a host tensor.
FACTORIES = frozenset(
    getattr(torch, name)
    for name in ("tensor", "as_tensor", "asarray", "scalar_tensor", "zeros", "ones", "empty", "full", "arange",
                 "rand", "randn", "randint", "randperm", "linspace", "logspace", "eye", "empty_strided", "from_numpy")
)  # fmt: skip
HOST_COPIES = frozenset((torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy))
# Products a GPU runs on tensor cores: half operands, and float32 ones taken at TF32 (a Triton tl.dot's
# input_precision "tf32"). "fp32" is float32 at full precision (FMA units), "fp64" double.
TENSOR_CORE_DTYPES = ("bf16", "fp16", "tf32")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
_SKIPPED_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(contextlib.__file__))


@dataclass
class Cost:
    """One step's counts (see the module's docstring)."""

    launches: int = 0
    triton_launches: int = 0
    syncs: int = 0
    plugin_syncs: int = 0
    host_reads: int = 0  # reads of host tensors: not syncs
    flops: Dict[str, int] = field(default_factory=dict)  # product dtype -> FLOPs
    bytes: int = 0
    ops: Counter = field(default_factory=Counter)  # operation -> launches
    sync_sites: Counter = field(default_factory=Counter)  # "file:line function (what)" -> syncs
    # "file function" of the innermost plugin frame -> launches, of the launches the plugin's code asks for
    launch_sites: Counter = field(default_factory=Counter)
    triton_modelled: int = 0  # Triton launches counted and not run whose FLOPs are modelled (triton_flops())
    triton_unmodelled: Counter = field(default_factory=Counter)  # kernel -> launches not run, with no model

    @property
    def triton_flops(self) -> str:
        """Where the Triton launches' FLOPs come from: "counted" (the interpreter's tl.dot), "modelled"
        (:func:`triton_flops`, launches not run), both, "none" (no Triton launch), or what is left out."""
        if self.triton_unmodelled:
            return "left out for " + ", ".join(f"{n} x {k}" for k, n in sorted(self.triton_unmodelled.items()))
        if not self.triton_launches:
            return "none"
        if not self.triton_modelled:
            return "counted"
        return "modelled" if self.triton_modelled >= self.triton_launches else "counted and modelled"

    @property
    def tensor_core_flops(self) -> int:
        return sum(v for k, v in self.flops.items() if k in TENSOR_CORE_DTYPES)

    @property
    def fp32_flops(self) -> int:
        return sum(v for k, v in self.flops.items() if k not in TENSOR_CORE_DTYPES)

    def as_dict(self, top: int = 25) -> dict:
        fields = ("launches", "triton_launches", "triton_modelled", "syncs", "plugin_syncs", "host_reads", "bytes")
        return {
            **{name: getattr(self, name) for name in fields},
            "flops": dict(sorted(self.flops.items())),
            "tensor_core_flops": self.tensor_core_flops,
            "fp32_flops": self.fp32_flops,
            "top_ops": dict(self.ops.most_common(top)),
            "sync_sites": dict(self.sync_sites.most_common()),
            "plugin_launches": sum(self.launch_sites.values()),
            "plugin_launch_sites": dict(self.launch_sites.most_common(top)),
            "triton_flops": self.triton_flops,
            "triton_unmodelled": dict(sorted(self.triton_unmodelled.items())),
        }


def _nbytes(t: torch.Tensor) -> int:
    """The bytes ``t`` covers, at most its storage's (an expanded tensor reads its storage once)."""
    try:
        return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # a tensor without storage
        return 0


def _tensors(tree) -> List[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _flop_count(func, args, kwargs, out) -> int:
    """torch.utils.flop_counter's count of a product; sdpa's CPU flash kernels as the GPU ones."""
    from torch.utils import flop_counter

    packet = func.overloadpacket
    if packet in flop_counter.flop_registry:
        return int(flop_counter.flop_registry[packet](*args, **kwargs, out_val=out))
    shapes = [tuple(t.shape) for t in args[:4] if isinstance(t, torch.Tensor)]
    if packet.__name__ == "_scaled_dot_product_flash_attention_for_cpu":
        return int(flop_counter.sdpa_flop_count(*shapes[:3]))
    if packet.__name__ == "_scaled_dot_product_flash_attention_for_cpu_backward":
        return int(flop_counter.sdpa_backward_flop_count(*shapes))  # (grad_out, query, key, value)
    return 0


def _product_dtype(name: str, args) -> str:
    first = args[1] if name in ("addmm", "baddbmm", "addbmm") or name.endswith("_backward") else args[0]
    return _DTYPE_NAMES.get(first.dtype, str(first.dtype).replace("torch.", ""))


def _site(path: str) -> str:
    """A frame's file as a reader finds it: under the plugin, the lab, or an installed package."""
    for mark in ("attn_reg_plugin/", "attn_reg_lab/", "site-packages/"):
        if mark in path:
            return (mark if mark != "site-packages/" else "") + path.split(mark, 1)[1]
    return path


def _plugin_frame(frame) -> Optional[str]:
    """``file function`` of the innermost frame in the plugin's code, or None (the model's own code,
    torch's, or a backward autograd runs with no Python frame of the plugin's)."""
    while frame is not None:
        path = frame.f_code.co_filename
        if "attn_reg_plugin/" in path:
            return f"{_site(path)} {frame.f_code.co_name}"
        frame = frame.f_back
    return None


class CostCounter:
    """Counts a step while :meth:`counting` is entered and :attr:`recording` is on. A run outside the
    recorded step (a warm-up) still follows its host tensors."""

    def __init__(self):
        self.cost = Cost()
        self.recording = False
        self._host: Dict[int, weakref.ref] = {}
        self._host_factory = 0  # > 0: inside a factory without a device (its operations run on the host)
        self._quiet = 0  # > 0: inside a Triton launch, or a copy only the CPU needs: nothing counted
        # (operation, its tensors' shapes) -> factor: a product's FLOPs at another size (gpu_cost_fit)
        self.flop_scale: Optional[Callable[[str, list], float]] = None
        # Triton launches counted and not run (their outputs left as allocated): a long call's kernels
        # would take the interpreter hours; launches and syncs do not depend on their values.
        self.triton_not_run = False

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def mark_host(self, tree, host: bool = True) -> None:
        for t in _tensors(tree):
            if host:
                self._host[id(t)] = weakref.ref(t)
            else:
                self._host.pop(id(t), None)

    def sync(self, what: str) -> None:
        if not self.recording:
            return
        frame = sys._getframe(1)  # the caller: the first frame outside torch, the standard library and here
        while frame is not None and (
            frame.f_code.co_filename.startswith(_SKIPPED_DIRS) or frame.f_code.co_filename == __file__
        ):
            frame = frame.f_back
        site = "?" if frame is None else f"{_site(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"
        self.cost.syncs += 1
        self.cost.plugin_syncs += site.startswith("attn_reg_plugin/")
        self.cost.sync_sites[f"{site} ({what})"] += 1

    def launch(self, name: str, nbytes: int, flops: int = 0, dtype: Optional[str] = None) -> None:
        if not self.recording:
            return
        self.cost.launches += 1
        self.cost.ops[name] += 1
        plugin = _plugin_frame(sys._getframe(1))
        if plugin is not None:
            self.cost.launch_sites[plugin] += 1
        self.cost.bytes += nbytes
        if flops:
            self.cost.flops[dtype] = self.cost.flops.get(dtype, 0) + flops

    def modelled(self, kernel, args, kwargs, grid) -> None:
        """A Triton launch counted and not run: its FLOPs by :func:`triton_flops`, scaled as a counted
        tl.dot is; a kernel with no model is named in ``triton_unmodelled``."""
        name = getattr(kernel, "__name__", "kernel")
        flops = triton_flops(name, kernel_arguments(kernel, args, kwargs), grid)
        if flops is None:
            self.cost.triton_unmodelled[name] += 1
            return
        self.cost.triton_modelled += 1
        scale = self.flop_scale("triton", []) if self.flop_scale else 1.0
        for key, n in flops.items():
            self.cost.flops[key] = self.cost.flops.get(key, 0) + round(n * scale)

    def on_dispatch(self, func, args, kwargs):
        out = func(*args, **kwargs)
        if self._quiet:
            return out
        name = func.overloadpacket.__name__
        inputs = _tensors((args, kwargs))
        # The plugin's own operators that are handed a device (keyed_draws) make their output there, even
        # from a host seed: a kernel on a GPU, not a host tensor.
        on_device = func.namespace == "attn_reg" and any(isinstance(a, torch.device) for a in (*args, *kwargs.values()))
        if self._host_factory or (inputs and not on_device and all(self.is_host(t) for t in inputs)):
            self.mark_host(out)  # a host operation: no launch, and a read of it no sync
            self.cost.host_reads += self.recording and name == "_local_scalar_dense"
            return out
        if name == "_local_scalar_dense":
            self.sync("item")
        elif name in SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None and inputs):
            self.sync(name)
        elif name in MASK_INDEXING and any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1:2])):
            self.sync(f"{name} with a mask")
        outputs = _tensors(out)
        if func.is_view or name in NO_KERNEL or name.startswith("sym_"):
            return out
        if not outputs and not name.endswith("_") and "out" not in kwargs:
            return out  # a number or a flag: no kernel (a sync above where it reads the device)
        nbytes = sum(map(_nbytes, inputs)) + sum(map(_nbytes, outputs))
        flops = _flop_count(func, args, kwargs, out) if self.recording else 0
        if flops and self.flop_scale is not None:
            flops = round(flops * self.flop_scale(name, [tuple(t.shape) for t in inputs]))
        self.launch(name, nbytes, flops, _product_dtype(name, args) if flops else None)
        return out

    def on_function(self, func, args, kwargs):
        if self._quiet:
            return func(*args, **kwargs)
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in FACTORIES and kwargs.get("device") is None:
            if func in (torch.as_tensor, torch.asarray) and isinstance(args[0] if args else None, torch.Tensor):
                return func(*args, **kwargs)  # the tensor itself
            self._host_factory += 1
            try:
                out = func(*args, **kwargs)
            finally:
                self._host_factory -= 1
            self.mark_host(out)
            return out
        if func in HOST_COPIES and source is not None:
            if not self.is_host(source):
                self.sync(func.__name__)
            out = func(*args, **kwargs)
            if func is torch.Tensor.cpu:
                self.mark_host(out := self._copy(out, source))
            return out
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        if func is torch.Tensor.to and source is not None and isinstance(target, (str, torch.device)):
            return self._moved(func, args, kwargs, str(target))
        return func(*args, **kwargs)

    def _moved(self, func, args, kwargs, target: str):
        """``t.to(device)``: to the host for the string "cpu", else to the device (a copy if t is on the host)."""
        source, out = args[0], func(*args, **kwargs)
        if target.startswith("cpu") and not isinstance(args[1] if len(args) > 1 else kwargs["device"], torch.device):
            if not self.is_host(source):
                self.sync("to cpu")
                self.mark_host(out := self._copy(out, source))
        elif self.is_host(source):
            self.mark_host(out := self._copy(out, source), False)
            self.launch("copy to the device", _nbytes(out))
        return out

    def _copy(self, out, source):
        """A new tensor where the CPU made none: on a GPU a copy between the host and the device."""
        if out is not source:
            return out
        self._quiet += 1
        try:
            return source.clone()
        finally:
            self._quiet -= 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[CostCounter]:
        """The modes, torch.optim's foreach on the CPU, and Triton's launches counted, for a while."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(_foreach_on_cpu())
            stack.enter_context(_triton_counted(self))
            stack.enter_context(_Mode(self, TorchFunctionMode))
            stack.enter_context(_Mode(self, TorchDispatchMode))
            yield self

    @contextlib.contextmanager
    def recorded(self) -> Iterator[Cost]:
        self.recording = True
        try:
            yield self.cost
        finally:
            self.recording = False


def _Mode(counter: CostCounter, base):
    """A torch function or dispatch mode that hands every call to ``counter``."""

    class Mode(base):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return counter.on_function(func, args, kwargs or {})

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return counter.on_dispatch(func, args, kwargs or {})

    return Mode()


@contextlib.contextmanager
def _foreach_on_cpu():
    """torch.optim's optimizers choose their foreach implementation on the CPU too, as on a GPU."""
    from torch.optim import optimizer

    original = optimizer._get_foreach_kernels_supported_devices
    optimizer._get_foreach_kernels_supported_devices = lambda: [*original(), "cpu"]
    try:
        yield
    finally:
        optimizer._get_foreach_kernels_supported_devices = original


@contextlib.contextmanager
def _triton_counted(counter: CostCounter):
    """Each Triton launch counted once (its torch operations not), and its FLOPs: the interpreter's
    tl.dot products as they run, or, for a launch counted and not run, :func:`triton_flops`' model."""
    try:
        from triton.runtime import interpreter, jit
    except ImportError:
        yield
        return
    patched = []

    def launches(cls):
        original = cls.run

        def run(self, *args, grid, warmup, **kwargs):
            counted = not warmup and not counter._quiet
            if counted:
                counter.launch(
                    f"triton:{getattr(self, '__name__', 'kernel')}", sum(map(_nbytes, _tensors((args, kwargs))))
                )
                counter.cost.triton_launches += counter.recording
            counter._quiet += 1  # the model reads a tensor (the select's samples), the outputs are zeroed: quietly
            try:
                if counter.triton_not_run and not warmup:
                    if counted and counter.recording:
                        counter.modelled(self, args, kwargs, grid)
                    _zero_outputs(self, args, kwargs)
                    return None
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                counter._quiet -= 1

        patched.append((cls, "run", original))
        cls.run = run

    def create_dot(self, a, b, d, input_precision, *rest, **kwargs):
        if counter.recording:
            key, passes = dot_key(str(a.dtype.scalar), getattr(input_precision, "name", str(input_precision)))
            flops = passes * 2 * a.data.shape[-2] * a.data.shape[-1] * b.data.shape[-1]
            flops = round(flops * counter.flop_scale("triton", [])) if counter.flop_scale else flops
            counter.cost.flops[key] = counter.cost.flops.get(key, 0) + flops
        return original_dot(self, a, b, d, input_precision, *rest, **kwargs)

    launches(jit.JITFunction)
    launches(interpreter.InterpretedFunction)
    original_dot = interpreter.InterpreterBuilder.create_dot
    patched.append((interpreter.InterpreterBuilder, "create_dot", original_dot))
    interpreter.InterpreterBuilder.create_dot = create_dot
    try:
        yield
    finally:
        for cls, name, original in reversed(patched):
            setattr(cls, name, original)


# -- the fused route's Triton kernels, modelled -----------------------------------------------------
# A launch counted and not run (CostCounter.triton_not_run: the interpreter would take hours at the long
# rows' lengths) gets the FLOPs of the products its kernel makes: per (row tile, key tile) pair the kernel
# visits, the tl.dot products the kernel's loop body makes there, each 2 BLOCK_M BLOCK_N BLOCK_D FLOPs
# (the padded head dim, as the interpreter's count; BLOCK_G, the Generator's padded width, for AttendOut's
# policy products, whose operand is "GQ"), at its operands' precision. The tiles are the
# kernel's own loop bounds over its grid (causal ones included); tests/lab/test_gpu_cost_triton_flops.py
# holds the model to the interpreter's count, kernel by kernel.
def dot_key(dtype: str, precision: str = "ieee") -> Tuple[str, int]:
    """(FLOPs key, passes) of a tl.dot with operands of ``dtype`` ("fp32", "bf16", ...) at
    ``precision`` (its input_precision, "ieee", "tf32", "tf32x3", ...): float32 operands give "fp32"
    at "ieee", "tf32" at "tf32" (tensor cores), and a "<kind>x<n>" precision n passes of <kind>; half or
    double operands their own dtype whatever the precision."""
    precision = str(getattr(precision, "value", precision)).lower()
    if dtype != "fp32" or precision == "ieee":
        return dtype, 1
    kind, _, passes = precision.partition("x")
    return kind, int(passes) if passes.isdigit() else 1


def kernel_arguments(kernel, args, kwargs) -> dict:
    """A Triton launch's arguments by the kernel's parameter names (defaults filled in; launch options
    such as ``num_warps`` left out)."""
    fn = getattr(kernel, "fn", kernel)
    signature = inspect.signature(fn)
    bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
    bound.apply_defaults()
    return {k: getattr(v, "value", v) for k, v in bound.arguments.items()}  # a tl.constexpr as its value


def _key_tiles(a: dict, start_m: int, end: Optional[int] = None) -> int:
    """The key tiles ``range(0, end, BLOCK_N)`` visits for the row block at ``start_m``; ``end`` by default
    the kernels' ``_causal_end``: S, or with CAUSAL min(S, start_m + BLOCK_M + S - T)."""
    if end is None:
        end = min(a["S"], start_m + a["BLOCK_M"] + a["S"] - a["T"]) if a["CAUSAL"] else a["S"]
    return max(0, -(-end // a["BLOCK_N"]))


def _row_tiles(a: dict, start_n: int) -> int:
    """The row tiles the dk, dv kernel visits for the key block at ``start_n``: ``range(first, T,
    BLOCK_M)``, ``first`` the first row block that may attend one of its keys (0 unless CAUSAL)."""
    first = max(0, start_n - (a["S"] - a["T"])) // a["BLOCK_M"] * a["BLOCK_M"] if a["CAUSAL"] else 0
    return max(0, -(-(a["T"] - first) // a["BLOCK_M"]))


def _row_blocks(a: dict, grid) -> int:
    """Tile pairs of a kernel whose programs are (row block, head) and loop over key tiles."""
    return grid[1] * sum(_key_tiles(a, pid * a["BLOCK_M"]) for pid in range(grid[0]))


def _ad_drop(a: dict) -> int:
    """1 where the kernel's rule is AD-DROP's (its tiles also make the attribution product), else 0."""
    from attn_reg_plugin.core.kernel.fused_edit import AD_DROP

    return int(a["RULE"] == AD_DROP)


def _generator(a: dict) -> int:
    """1 where the kernel's rule is AttendOut's Generator (its tiles also make the policy's logits), else 0."""
    from attn_reg_plugin.core.kernel.fused_edit import GENERATOR

    return int(a["RULE"] == GENERATOR)


def _forward_products(a, grid):
    tiles = _row_blocks(a, grid)  # q k^T, p v, and the attribution score under AD_DROP or the logits under GENERATOR
    return {"Q": tiles, "V": tiles, "ATTR": tiles * _ad_drop(a), "GQ": tiles * _generator(a)}


def _backward_q_products(a, grid):
    tiles = _row_blocks(a, grid)  # q k^T, dO v^T, ds k, and the rule's product
    return {"Q": tiles, "DO": tiles, "K": tiles, "ATTR": tiles * _ad_drop(a), "GQ": tiles * _generator(a)}


def _backward_kv_products(a, grid):
    # programs (key block, key/value head), each over the GROUP query heads of its head and their row tiles:
    # q k^T and ds^T q, dO v^T and p^T dO, and the rule's product (the attribution score, the policy's logits)
    tiles = grid[1] * a["GROUP"] * sum(_row_tiles(a, pid * a["BLOCK_N"]) for pid in range(grid[0]))
    return {"Q": 2 * tiles, "DO": 2 * tiles, "ATTR": tiles * _ad_drop(a), "GQ": tiles * _generator(a)}


def _row_counts_products(a, grid):
    tiles = _row_blocks(a, grid)  # the drops' own product: the attribution score or the policy's logits
    return {"ATTR": tiles * _ad_drop(a), "GQ": tiles * _generator(a)}


def _inspect_products(a, grid):
    # one tile a program: the stored attribution score, and the drops' own product under AD_DROP or GENERATOR
    programs = grid[0] * grid[1] * grid[2]
    return {"ATTR": programs * (1 + _ad_drop(a)), "GQ": programs * _generator(a)}


def _policy_bounds(a: dict) -> dict:
    """A policy kernel's arguments with the attention kernels' loop-bound names: its units causal or not."""
    from attn_reg_plugin.core.kernel.fused_edit import REAL_CAUSAL_UNITS

    return dict(a, CAUSAL=a["UNITS"] == REAL_CAUSAL_UNITS, BLOCK_D=a["BLOCK_G"])


def _log_prob_products(a, grid):
    return {"GQ": _row_blocks(_policy_bounds(a), grid)}  # the logits of each (row tile, key tile)


def _grad_query_products(a, grid):
    return {"GQ": 2 * _row_blocks(_policy_bounds(a), grid)}  # the logits, and dlogit gk


def _grad_key_products(a, grid):
    bounds = _policy_bounds(a)  # programs (key block, sample) over the row tiles reaching them: logits, dlogit^T gq
    return {"GQ": 2 * grid[1] * sum(_row_tiles(bounds, pid * a["BLOCK_N"]) for pid in range(grid[0]))}


def _scores_products(a, grid):
    return {"ATTR": grid[0] * grid[1] * grid[2]}  # one attribution score tile a program


def _select_products(a, grid):
    """fused_select's radix select: per program 8 levels over its ranked keys (none in a sample
    ``SAMPLES`` leaves out) and one pass over all it may attend, an attribution score a key tile."""
    chosen = a["SAMPLES"].tolist() if a["HAS_SAMPLES"] else None
    tiles = 0
    for bh in range(grid[1]):
        taken = chosen is None or bool(chosen[bh // a["H"]])
        for pid in range(grid[0]):
            end = _key_tiles(a, pid * a["BLOCK_M"])
            tiles += 8 * (end if taken else 0) + end
    return {"ATTR": tiles}


# kernel name -> (its arguments, its grid) -> {operand argument: tile products whose operands it holds}
TRITON_MODELS: Dict[str, Callable[[dict, tuple], Dict[str, int]]] = {
    "_forward_kernel": _forward_products,
    "_backward_q_kernel": _backward_q_products,
    "_backward_kv_kernel": _backward_kv_products,
    "_row_counts_kernel": _row_counts_products,
    "_inspect_kernel": _inspect_products,
    "_scores_kernel": _scores_products,
    "_region_kernel": lambda a, grid: {},  # sorts whole rows of stored scores: no product
    "_select_kernel": _select_products,
    "_log_prob_kernel": _log_prob_products,
    "_grad_query_kernel": _grad_query_products,
    "_grad_key_kernel": _grad_key_products,
    "_drops_kernel": lambda a, grid: {"GQ": grid[0] * grid[1] * grid[2]},  # one tile's logits a program
}


# kernel name -> the arguments it writes: a launch not run leaves them zero (as allocated they may hold
# anything, NaN too, which would reach the loss, the gradients and the benchmark's shared model)
TRITON_OUTPUTS: Dict[str, Tuple[str, ...]] = {
    "_forward_kernel": ("OUT", "LSE"),
    "_backward_q_kernel": ("DELTA", "DQ"),
    "_backward_kv_kernel": ("DK", "DV"),
    "_row_counts_kernel": ("KEEP",),  # COUNTS is added to, from the zeros it was made with
    "_inspect_kernel": ("CODES", "SCORES"),
    "_scores_kernel": ("SCORES",),
    "_region_kernel": ("THRESHOLD", "LAST_TIE", "LOWEST"),
    "_select_kernel": ("THRESHOLD", "LAST_TIE", "LOWEST"),
    "_log_prob_kernel": ("LOG_PROB", "UNIT_COUNT", "PROBABILITY"),
    "_grad_query_kernel": ("DGQ", "DOFFSET"),
    "_grad_key_kernel": ("DGK",),
    "_drops_kernel": ("DROPS", "LOGITS", "UNIFORMS", "UNITS_OUT"),
}


def _zero_outputs(kernel, args, kwargs) -> None:
    """A launch not run: the arguments its kernel writes (:data:`TRITON_OUTPUTS`) set to zero."""
    names = TRITON_OUTPUTS.get(getattr(kernel, "__name__", ""), ())
    if names:
        arguments = kernel_arguments(kernel, args, kwargs)
        for name in names:
            if isinstance(arguments.get(name), torch.Tensor):
                arguments[name].zero_()


def triton_flops(name: str, arguments: dict, grid) -> Optional[Dict[str, int]]:
    """{FLOPs key: FLOPs} of one launch of the fused route's kernel ``name`` (:data:`TRITON_MODELS`) with
    ``arguments`` (:func:`kernel_arguments`) over ``grid``, at each product's precision
    (:func:`dot_key`: its operands' dtype, and the kernel's ``DOT_PRECISION``, "ieee" where it has none);
    None for a kernel with no model."""
    model = TRITON_MODELS.get(name)
    if model is None:
        return None
    grid = grid(arguments) if callable(grid) else grid
    grid = (*grid, 1, 1, 1)[:3]
    out: Dict[str, int] = {}
    for operand, products in model(arguments, grid).items():
        depth = arguments.get("BLOCK_G" if operand == "GQ" else "BLOCK_D", 0)  # the policy's width, or the head's
        tile = 2 * arguments.get("BLOCK_M", 0) * arguments.get("BLOCK_N", 0) * depth
        if products:
            dtype = _DTYPE_NAMES.get(arguments[operand].dtype, str(arguments[operand].dtype).replace("torch.", ""))
            key, passes = dot_key(dtype, arguments.get("DOT_PRECISION", "ieee"))
            out[key] = out.get(key, 0) + passes * products * tile
    return out


# -- the command ----------------------------------------------------------------------------------
class _Replaced(argparse.Action):
    """An option of earlier versions: refused, with what replaced it."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(
            f"{option_string} is gone: {self.default} (--pytorch-path adds the PyTorch path's rows, --run-triton "
            "runs the Triton kernels in the interpreter instead of modelling their FLOPs)"
        )


def parse_args(argv=None):
    from .gpu_bench import STANDARD_VARIANTS
    from .gpu_cost_fit import long_section

    parser = argparse.ArgumentParser(
        prog="attn-reg-gpu-cost",
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes of the same code (a smoke run)")
    parser.add_argument("--out", type=Path, help="write the rows, the fit and the targets as JSON here")
    parser.add_argument("--rows", default=",".join(ROW_SETS), help=f"comma list of {', '.join(ROW_SETS)}")
    parser.add_argument("--variants", help="comma list of the methods counted besides plain (default: all)")
    parser.add_argument(
        "--frameworks",
        default="fairseq,hf",
        help="comma list of fairseq, hf: the standard rows' frameworks (default: both)",
    )
    parser.add_argument(
        "--pytorch-path",
        action="store_true",
        help="also every row on the PyTorch path (ATTN_REG_FUSED=0), beside the default route's (the fused route, "
        "ATTN_REG_FUSED=1: a CUDA device's default)",
    )
    parser.add_argument(
        "--run-triton",
        action="store_true",
        help="run the fused route's Triton kernels in the interpreter in the standard fp32 rows and count their "
        "tl.dot FLOPs, instead of modelling them (slow: half an hour and more a row at the standard sizes; the "
        "interpreter takes no bf16 call, and the long rows' would take hours: those stay modelled)",
    )
    for old, new in (("--fused", "the fused route's rows are the default now"), ("--triton-not-run", "the default")):
        parser.add_argument(old, action=_Replaced, nargs=0, dest=argparse.SUPPRESS, default=new, help=argparse.SUPPRESS)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also the HF fp32 plain and GA-all steps compiled whole: their graphs and graph breaks",
    )
    parser.add_argument("--hf-model", help="the MiniLM folder of the standard HF rows (default: the offline package)")
    parser.add_argument("--work-dir", type=Path, help="the fairseq corpus cache (default: attn-reg-benchmark's)")
    parser.add_argument("--h200-dir", type=Path, help="the committed H200 rows (default: docs/results/gpu_bench)")
    parser.add_argument(
        "--fit-counts",
        type=Path,
        help="fit the H200 rows on the counts of this earlier --out (of the code the H200 ran) instead of this run's",
    )
    opts = parser.parse_args(argv)
    opts.rows = [r.strip() for r in opts.rows.split(",") if r.strip()]
    if not opts.rows or any(r not in ROW_SETS for r in opts.rows):
        parser.error(f"--rows: a comma list of {', '.join(ROW_SETS)}; got {','.join(opts.rows) or 'nothing'}")
    opts.frameworks = [f.strip() for f in opts.frameworks.split(",") if f.strip()]
    if not opts.frameworks or any(f not in ("fairseq", "hf") for f in opts.frameworks):
        parser.error(f"--frameworks: a comma list of fairseq, hf; got {','.join(opts.frameworks) or 'nothing'}")
    if opts.variants is not None:
        known = {*STANDARD_VARIANTS, *long_section().variant_names.values()}
        opts.variants = [v.strip() for v in opts.variants.split(",") if v.strip()]
        unknown = [v for v in opts.variants if v not in known]
        if not opts.variants or unknown:
            parser.error(f"--variants: unknown {unknown or 'nothing'}; accepted: {', '.join(sorted(known))}")
    return opts


def main(argv=None) -> dict:
    opts = parse_args(argv)
    from . import gpu_cost_fit
    from .benchmark.report import machine
    from .gpu_bench import _git_commit, log, quiet_libraries
    from .provenance import environment

    quiet_libraries()
    started = time.time()
    commit = _git_commit() or os.environ.get("ATTN_REG_COMMIT") or "unknown"  # before the run: what was counted
    rows, route = gpu_cost_fit.count_rows(opts, log)
    fit_counts = (opts.fit_counts, json.loads(opts.fit_counts.read_text())) if opts.fit_counts else None
    result = gpu_cost_fit.fit_and_predict(rows, opts.h200_dir, quick=opts.quick, fit_counts=fit_counts)
    result.update(
        command=" ".join(["attn-reg-gpu-cost", *(argv if argv is not None else sys.argv[1:])]),
        commit=commit,
        cpu=machine()["cpu"],
        route=route,
        environment=environment(),
        seconds=round(time.time() - started, 1),
    )
    if opts.compile:
        result["compile"] = gpu_cost_fit.compile_rows(opts, log)
        result["targets"] += [r["verdict"] for r in result["compile"] if "verdict" in r]
    print(gpu_cost_fit.format_table(result))
    for r in result.get("compile", []):
        reasons = "; ".join(f"{n} x {why}" for why, n in r["reasons"].items()) or "none"
        print(
            f"\ncompiled whole, hf fp32 {r['variant']} ({r['route_label']}): {r['graphs']} graphs, so {r['breaks']} "
            f"breaks; dynamo's reasons: {reasons}"
        )
    print(f"\n{len(rows)} rows in {result['seconds']:.0f} s on {result['cpu']} at {result['commit']}")
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def command(argv=None) -> int:
    """``attn-reg-gpu-cost``: in a process started with the GPU route's switches set (again, if they were not)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(os.environ.get(k) != v for k, v in ROUTE_ENV.items()):
        os.execve(sys.executable, [sys.executable, "-m", "attn_reg_lab.gpu_cost", *argv], {**os.environ, **ROUTE_ENV})
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(command())
