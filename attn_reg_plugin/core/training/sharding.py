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
are refused by :func:`check_supported_sharding`: the HF trainers call it at construction, and
``ADDrop`` on the model of its first step, before that step trains anything.
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
    """Whether FSDP2 shards some of ``model``'s parameters (it then reduces their gradients itself).
    Stops at the first sharded module (the root, when it is sharded): cheap enough for every step."""
    fsdp_module, _ = _fsdp2()
    return fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules())


def reshard(model: nn.Module) -> None:
    """Every FSDP2 module of ``model`` back on its sharded parameters (no-op when none is unsharded)."""
    for module in fully_sharded_modules(model):
        module.reshard()


def initialize(model: nn.Module) -> None:
    """Run FSDP2's lazy initialisation now, if the model's first forward has not. It fixes the
    dtype gradients are reduced in from the parameters that require grad at that moment: were
    AD-DROP's frozen pass the first forward, a MixedPrecisionPolicy's reduce_dtype would be lost
    and the first backward would fail. Every outermost sharded module is a root of its own (only
    the layers may be sharded). Idempotent; the FSDP2 call is private, hence here alone."""
    fsdp_module, _ = _fsdp2()
    covered = set()
    for module in model.modules():  # parents before children
        if id(module) in covered or fsdp_module is None or not isinstance(module, fsdp_module):
            continue
        module._get_fsdp_state()._lazy_init()
        covered.update(id(m) for m in module.modules())


def _param_groups(module: nn.Module):
    # FSDP2's per-module settings are not public: only this module reads them (tests/test_fsdp.py checks it).
    return _groups_of(module._get_fsdp_state())


def _groups_of(state) -> list:
    """An FSDP2 state's parameter groups: a list in torch 2.13, one group or None in torch 2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


# Why each sharded configuration is refused: one wording for the core check (on the wrapped model)
# and the HF trainers' check (on their arguments, before anything is wrapped).
FSDP1_REASON = (
    "its flat parameters are gathered once per forward-backward pair, and the regularizers run extra forwards"
)
OFFLOAD_REASON = "it is not verified with the regularizers' extra passes"


def check_supported_sharding(model: nn.Module, who: str) -> None:
    """Refuse, before training, the sharded configurations the regularizers are not verified on."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise NotImplementedError(
            f"{who} does not support FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel): {FSDP1_REASON}. "
            "Use FSDP2 (torch.distributed.fsdp.fully_shard; HF: fsdp_config={'version': 2}), docs/DISTRIBUTED.md"
        )
    from torch.distributed.fsdp import CPUOffloadPolicy

    for module in fully_sharded_modules(model):
        for group in _param_groups(module):
            if isinstance(group.offload_policy, CPUOffloadPolicy):
                raise NotImplementedError(
                    f"{who} does not support FSDP2 CPU offload (offload_policy=CPUOffloadPolicy; HF: "
                    f"fsdp_config cpu_offload): {OFFLOAD_REASON}. Shard over more ranks instead, with activation "
                    "checkpointing to save memory"
                )
            post = group.post_forward_mesh_info
            if post is not None and post is not group.mesh_info:
                raise NotImplementedError(
                    f"{who} does not support FSDP2 reshard_after_forward=<int> (a post-forward reshard to a "
                    f"smaller mesh, on {type(module).__name__}): it is not verified with the regularizers' extra "
                    "passes. Use reshard_after_forward=True or False"
                )


def shard_like(source: nn.Module, destination: nn.Module) -> None:
    """Apply ``fully_shard`` to ``destination`` as it was applied to ``source``: the same calls on the
    same module paths (several modules sharded together, as accelerate shards a tied head with the
    final norm, stay one call), with the same mesh, ``reshard_after_forward``, mixed-precision policy
    and parameters left out of sharding. ``destination`` is an unsharded copy of ``source``'s
    architecture (the AttendOut Attacker); on the meta device, ``destination.to_empty(device=...)``
    then allocates only this rank's shards."""
    from torch.distributed.tensor import DTensor, Shard

    _, fully_shard = _fsdp2()
    reshard(source)  # a gathered module lists plain tensors, which would read as parameters left out
    targets = dict(destination.named_modules())
    paths = {id(m): p for p, m in source.named_modules()}
    states = []  # one per fully_shard call, children before parents
    for module in fully_sharded_modules(source):
        state = module._get_fsdp_state()
        if all(state is not seen for seen in states):
            states.append(state)
    meshes = []  # equal meshes, not one object: torch 2.11 gives each fully_shard call its own
    for mesh in (g.mesh_info.mesh for st in states for g in _groups_of(st)):
        if all(mesh != seen for seen in meshes):
            meshes.append(mesh)
    if len(meshes) != 1:
        raise NotImplementedError(
            f"shard_like: the model is sharded over {len(meshes)} meshes; shard the Attacker yourself, as the Defender"
        )
    (mesh,) = meshes
    for state in states:
        for group in _groups_of(state):
            if any(p.fsdp_placement != Shard(0) for p in group.fsdp_params):
                raise NotImplementedError(
                    "shard_like: the model was sharded with a shard_placement_fn; shard the Attacker yourself, as the "
                    "Defender"
                )
    copies = dict(destination.named_parameters(remove_duplicate=False))
    ignored = {copies[name] for name, p in source.named_parameters() if not isinstance(p, DTensor)}
    for state in states:
        try:
            modules = [targets[paths[id(m)]] for m in state._modules]
        except KeyError:
            raise ValueError(
                "shard_like: the copy lacks a sharded module of the model; it is not a copy of it"
            ) from None
        groups = _groups_of(state)
        # None: fully_shard's own default (the root keeps its parameters gathered after forward).
        reshard_after_forward = None
        if not state._auto_reshard_after_forward and groups:
            reshard_after_forward = groups[0].post_forward_mesh_info is not None
        fully_shard(
            modules if len(modules) > 1 else modules[0],
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=state._mp_policy,
            ignored_params=ignored or None,
        )


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on the meta device (no memory):
    the Attacker's skeleton, taken before the Defender is sharded. Tied weights stay tied."""
    from .module_copy import deepcopy_module

    memo = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in memo:
            continue
        meta = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    return deepcopy_module(model, memo)


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
