"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``): what the regularizers need to know about it.

FSDP2 shards each wrapped module's parameters across the ranks and all-gathers them in the
module's pre-forward hook, so a model runs any number of forwards per step, and
``torch.autograd.grad`` of pass 1 w.r.t. the attention maps only creates no parameter gradients
and reduces nothing. Three things still need care, each handled here in one place:

* FSDP2 initialises itself at the first forward from the parameters that require grad then:
  :func:`initialize` runs that first, so AD-DROP's frozen pass may come first;
* between forwards a module may hold its *unsharded* parameters (the root keeps them after its
  forward by default). Those are separate tensors whose ``requires_grad`` FSDP2 copies from the
  sharded ones only when it unshards again, and which ``module.parameters()`` returns while they
  are registered. :func:`reshard` puts every module back on its sharded parameters: before and
  after AD-DROP's frozen pass (else the root stays frozen for pass 2), and before the AttendOut
  re-sync copies weights and optimizer state (else it writes into tensors about to be freed);
* a sharded module cannot be deep-copied (FSDP2 refuses): the AttendOut Attacker is copied from
  the unsharded model and sharded like the Defender by :func:`shard_like`;
* gradients of a sharded module are reduce-scattered by FSDP2 itself: the adapters must not
  all-reduce them again (:func:`is_fully_sharded`).

FSDP1 (``FullyShardedDataParallel``), CPU offload and a post-forward reshard to a smaller mesh
are refused by :func:`check_supported_sharding` before any training.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn


def _fsdp2():
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:  # torch built without distributed
        return None, None
    return FSDPModule, fully_shard


def fully_sharded_modules(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to, children before parents."""
    fsdp_module, _ = _fsdp2()
    if fsdp_module is None:
        return []
    return [m for m in reversed(list(model.modules())) if isinstance(m, fsdp_module)]


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards some of ``model``'s parameters (it then reduces their gradients itself)."""
    return bool(fully_sharded_modules(model))


def reshard(model: nn.Module) -> None:
    """Every FSDP2 module of ``model`` back on its sharded parameters (no-op when none is unsharded)."""
    for module in fully_sharded_modules(model):
        module.reshard()


def initialize(model: nn.Module) -> None:
    """Run FSDP2's lazy initialisation now, if the model's first forward has not. It fixes the
    dtype gradients are reduced in from the parameters that require grad at that moment: were
    AD-DROP's frozen pass the first forward, a MixedPrecisionPolicy's reduce_dtype would be lost
    and the first backward would fail. Idempotent; the FSDP2 call is private, hence here alone."""
    modules = fully_sharded_modules(model)
    if modules:
        modules[-1]._get_fsdp_state()._lazy_init()  # the outermost: the root


def _param_groups(module: nn.Module):
    # FSDP2's per-module settings are not public; read in this one place (checked by tests/test_fsdp.py).
    return list(module._get_fsdp_state()._fsdp_param_groups)


def check_supported_sharding(model: nn.Module, who: str) -> None:
    """Refuse, before training, the sharded configurations the regularizers are not verified on."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise NotImplementedError(
            f"{who} does not support FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel): its flat parameters "
            "are gathered once per forward-backward pair, and AD-DROP and AttendOut run extra forwards. Use FSDP2 "
            "(torch.distributed.fsdp.fully_shard; HF: fsdp_config={'version': 2}), docs/DISTRIBUTED.md"
        )
    from torch.distributed.fsdp import CPUOffloadPolicy

    for module in fully_sharded_modules(model):
        for group in _param_groups(module):
            if isinstance(group.offload_policy, CPUOffloadPolicy):
                raise NotImplementedError(
                    f"{who} does not support FSDP2 CPU offload (offload_policy=CPUOffloadPolicy; HF: "
                    "fsdp_config cpu_offload): it is not verified with the regularizers' extra passes. Shard over "
                    "more ranks instead, with activation checkpointing to save memory"
                )
            post = group.post_forward_mesh_info
            if post is not None and post is not group.mesh_info:
                raise NotImplementedError(
                    f"{who} does not support FSDP2 reshard_after_forward=<int> (a post-forward reshard to a "
                    f"smaller mesh, on {type(module).__name__}): it is not verified with the regularizers' extra "
                    "passes. Use reshard_after_forward=True or False"
                )


def shard_like(source: nn.Module, destination: nn.Module) -> None:
    """Apply ``fully_shard`` to ``destination`` as it was applied to ``source``: same module paths,
    mesh, ``reshard_after_forward`` and mixed-precision policy. ``destination`` is an unsharded copy
    of ``source``'s architecture (the AttendOut Attacker); it may be on the meta device, in which
    case ``destination.to_empty(device=...)`` then allocates only this rank's shards."""
    fsdp_module, fully_shard = _fsdp2()
    modules = dict(destination.named_modules())
    # fully_shard goes bottom-up: a parent's shard leaves out the parameters its sharded children own.
    for path, module in reversed(list(source.named_modules())):
        if not isinstance(module, fsdp_module):
            continue
        groups = _param_groups(module)
        if not groups:
            raise NotImplementedError(
                f"shard_like: {path or 'the root'} is sharded but holds no parameters of its own; shard the "
                "Attacker yourself, as you shard the Defender"
            )
        group = groups[0]
        target = modules.get(path)
        if target is None:
            raise ValueError(f"shard_like: the copy has no module {path!r}; it is not a copy of the sharded model")
        fully_shard(
            target,
            mesh=group.mesh_info.mesh,
            reshard_after_forward=group.post_forward_mesh_info is not None,
            mp_policy=group.mp_policy,
        )


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on the meta device (no memory):
    the Attacker's skeleton, taken before the Defender is sharded. Tied weights stay tied."""
    import copy

    memo = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in memo:
            continue
        meta = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    return copy.deepcopy(model, memo)


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer):
    """A sharded model's and its optimizer's state gathered into full CPU tensors, keyed by parameter
    name (torch.distributed.checkpoint's format; a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_state, optimizer_state) -> None:
    """Load :func:`full_state_dicts`' output into a model sharded any way (each rank keeps its shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
