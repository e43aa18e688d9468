"""What AD-DROP's attribution pass (pass 1) runs under: the model without its DDP-style wrapper,
parameters frozen, the attribution precision, and the random streams put back for pass 2."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, List, Optional

import torch

from ..training.sharding import initialize, is_fully_sharded, reshard


def bare_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model under DDP-style wrappers (anything exposing ``.module``).

    The attribution pass runs it directly: it needs no gradient synchronisation.
    """
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether oneDNN has a bf16 path on this CPU (it asks for AVX-512; AVX-512 BF16 and AMX do it in
    hardware, plain AVX-512 by conversion). Asked once: bf16 attribution on CPU looks at every step.

    Without it torch falls back to a reference bf16 matmul, tens of times slower than fp32
    (docs/PERFORMANCE.md measures it), so bf16 attribution would cost, not save."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _autocast_devices() -> List[str]:
    """The device types a forward may run on: the CPU and the current accelerator, if any."""
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    return devices


@contextlib.contextmanager
def attribution_precision(precision: str) -> Iterator[None]:
    """The autocast state of the attribution pass. The backward of ``autograd.grad`` runs each op
    in its forward's precision, so the whole pass is in that precision; pass 2 is outside."""
    if precision == "auto":  # whatever the training step runs under
        yield
        return
    with contextlib.ExitStack() as stack:
        for device in _autocast_devices():
            if precision == "bf16":
                stack.enter_context(torch.autocast(device, dtype=torch.bfloat16))
            else:  # fp32
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def frozen_parameters(module: Optional[torch.nn.Module]) -> Iterator[None]:
    """Parameters stop requiring grad for the attribution pass.

    The pass then builds autograd graph only from the first captured attention output up,
    which saves the activations parameter gradients would need; nothing reaches ``.grad``.
    An FSDP2 model is initialised first and resharded on both sides (core.sharding): its modules
    then unshard with the flags of the moment, and none keeps frozen unsharded parameters into pass 2.
    """
    if module is None:
        yield
        return
    # An unsharded model costs one walk over its modules (every AD-DROP step runs this).
    sharded = is_fully_sharded(module)
    if sharded:
        initialize(module)
        reshard(module)
    params = [p for p in module.parameters() if p.requires_grad]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        if sharded:
            reshard(module)
        for p in params:
            p.requires_grad_(True)
