"""The core's device-specific choices, each one named helper; everything else runs the same code on
every device.

Each helper has a portable branch, the code an accelerator runs. Setting ``ATTN_REG_PORTABLE=1``
forces that branch on the CPU too: ``make test`` runs the kernel's tests and a step of every
regularizer once more that way, so the code a GPU runs is code CI runs. Why each one exists, and
what it gains, is the table in docs/design.md ("Device helpers").
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

PORTABLE_ENV = "ATTN_REG_PORTABLE"
# ATTN_REG_PORTABLE=1: the portable branches on the CPU too (read once; a test sets PORTABLE itself).
PORTABLE = os.environ.get(PORTABLE_ENV, "") == "1"
FUSED_ENV = "ATTN_REG_FUSED"


def fused_switch() -> Optional[bool]:
    """ATTN_REG_FUSED as :data:`FUSED`: unset -> None, "1" -> True, "0" -> False; anything else refused."""
    value = os.environ.get(FUSED_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{FUSED_ENV}: 1 (the fused route wherever Triton runs, its CPU interpreter too), 0 (never) or unset "
            f"(on a CUDA device, checked against the PyTorch path at first use); got {value!r}"
        )
    return None if value == "" else value == "1"


# The fused Triton route (core/kernel/fused_route.py) for the regularized calls it covers: None (ATTN_REG_FUSED
# unset) on a CUDA device, True (=1) wherever Triton runs, False (=0) never. Read once; a test sets it.
FUSED: Optional[bool] = fused_switch()


def fused_route_asked(q: torch.Tensor) -> bool:
    """Whether a regularized call on ``q`` asks the fused route (:data:`FUSED`): by default a call on a
    GPU (CUDA or ROCm) does; elsewhere the PyTorch path (on the CPU measured fastest) serves it."""
    return FUSED if FUSED is not None else q.device.type == "cuda"


def _is_cpu(device: torch.device) -> bool:
    """Whether ``device`` is the CPU: the one test on_host, has_cpu_softmax_stats and random_stream share."""
    return device.type == "cpu"


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` may be read on the host: numpy's selection and bit packing, and a look at a flag
    that spares an edit. True on a CPU outside torch.compile; elsewhere a read would synchronise the
    stream (an accelerator) or break the graph (compiling), and the portable torch ops run."""
    return _is_cpu(t.device) and not PORTABLE and not torch.compiler.is_compiling()


def same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors live on one device (a tensor kept between steps, as AD-DROP's probes, may
    meet a model moved since)."""
    return a.device == b.device


# sdpa's own CPU flash kernel, called directly so that a blockwise forward keeps each row's
# log-sum-exp and its backward need not run the block's forward again.
FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def has_cpu_softmax_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether sdpa's CPU flash op (which returns the rows' log-sum-exp) serves this call: on a CPU, with
    one head size for q, k and v (the op refuses a value head of another size, as multi-head latent
    attention has, where sdpa's math path serves it); elsewhere a blockwise backward recomputes each
    block through sdpa."""
    if FLASH_CPU is None or FLASH_CPU_BACKWARD is None or not _is_cpu(q.device) or PORTABLE:
        return False
    return q.shape[-1] == k.shape[-1] == v.shape[-1]


def random_stream(device: torch.device) -> Tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]:
    """(get state, set state) of ``device``'s global random stream (the CPU's generator and a device's
    are reached by different calls)."""
    device = torch.device(device)
    if _is_cpu(device):
        return torch.get_rng_state, torch.set_rng_state
    module = torch.get_device_module(device)
    return (lambda: module.get_rng_state(device)), (lambda state: module.set_rng_state(state, device))


def rng_state(devices: Optional[Sequence[torch.device]] = None) -> Dict[torch.device, torch.Tensor]:
    """The global random streams of ``devices`` (default: the CPU and every initialized CUDA device),
    {device: state}, for :func:`set_rng_state`: AD-DROP's attribution pass restores them."""
    if devices is None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        devices = [torch.device("cpu")] + [
            torch.device("cuda", i) for i in range(torch.cuda.device_count() if cuda else 0)
        ]
    return {torch.device(d): random_stream(d)[0]() for d in devices}


def set_rng_state(states: Dict[torch.device, torch.Tensor]) -> None:
    for device, state in states.items():
        random_stream(device)[1](state)
