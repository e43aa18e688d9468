"""What every trainer checks at construction: configurations the regularizers cannot honour.

Checked on the TrainingArguments before ``Trainer.__init__`` runs, so a bad combination stops
before any set-up or training. docs/CONFIGURATIONS.md lists every configuration and its status.
A trainer that cannot run under DeepSpeed at all says so by passing its reason
(``no_deepspeed``); the others get ZeRO-1/2 without offload.
"""

from __future__ import annotations

import json
from typing import Optional

from ..core.training.sharding import FSDP1_REASON, OFFLOAD_REASON, check_supported_sharding


def refuse_unsupported(who: str, args, model=None, no_deepspeed: Optional[str] = None) -> None:
    if model is not None:
        check_supported_sharding(model, who)
    if args is None:
        return
    # The layers' own flags, as transformers' is_activation_checkpointing reads them (its older
    # name, is_gradient_checkpointing, is deprecated).
    checkpointing = bool(
        getattr(args, "activation_checkpointing", None)
        or args.gradient_checkpointing
        or (model is not None and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()))
    )
    if args.torch_compile and checkpointing:
        raise NotImplementedError(
            f"{who} does not support torch_compile=True together with gradient checkpointing: a checkpointed "
            "layer recomputed from a compiled graph cannot be told to repeat its forward's attention masks. Use "
            "one of the two (gradient_checkpointing=True is exact without torch_compile)."
        )
    if args.deepspeed:
        refuse_unsupported_deepspeed(who, deepspeed_config(args), no_deepspeed)
    if args.fsdp:
        # The plugin arguments transformers derived from fsdp / fsdp_config: what accelerate will run
        # (e.g. fsdp_config cpu_offload="yes" or the legacy fsdp="full_shard offload" both mean offload).
        plugin = args.fsdp_plugin_args or {}
        refuse_unsupported_fsdp(
            who,
            version=int(plugin.get("fsdp_version", 2)),
            offload=bool(plugin.get("cpu_offload", False)),
            wrapper_checkpointing=bool(plugin.get("activation_checkpointing", False)),
            torch_compile=bool(args.torch_compile),
        )


def refuse_unsupported_launch(who: str, trainer, no_deepspeed: Optional[str] = None) -> None:
    """The same checks on what the Trainer's accelerator was set up with: ``accelerate launch`` can
    turn FSDP or DeepSpeed on from its own config, with the TrainingArguments' fields unset."""
    state = trainer.accelerator.state
    fsdp = getattr(state, "fsdp_plugin", None)
    if fsdp is not None:
        from torch.distributed.fsdp import CPUOffloadPolicy

        offload = fsdp.cpu_offload
        refuse_unsupported_fsdp(
            who,
            version=int(fsdp.fsdp_version),
            offload=isinstance(offload, CPUOffloadPolicy) or bool(getattr(offload, "offload_params", False)),
            wrapper_checkpointing=bool(fsdp.activation_checkpointing),
            torch_compile=bool(trainer.args.torch_compile),
        )
    deepspeed = getattr(state, "deepspeed_plugin", None)
    if deepspeed is not None:
        refuse_unsupported_deepspeed(who, deepspeed.deepspeed_config, no_deepspeed)


def deepspeed_config(args) -> dict:
    """The DeepSpeed configuration the Trainer will use (a dict, or the JSON file it names)."""
    hf_config = getattr(args, "hf_deepspeed_config", None)
    if hf_config is not None:
        return hf_config.config
    if isinstance(args.deepspeed, dict):
        return args.deepspeed
    with open(args.deepspeed) as f:
        return json.load(f)


def refuse_unsupported_deepspeed(who: str, config: dict, no_deepspeed: Optional[str] = None) -> None:
    """ZeRO stages 0-2 without offload are supported, unless the trainer gives ``no_deepspeed``, its reason."""
    if no_deepspeed is not None:
        raise NotImplementedError(f"{who} does not support DeepSpeed (TrainingArguments.deepspeed): {no_deepspeed}")
    zero = config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    if stage not in (0, 1, 2):
        raise NotImplementedError(
            f"{who} does not support DeepSpeed ZeRO stage {stage}: ZeRO-3 partitions the parameters and gathers "
            "them per forward, and it fails on a second forward in one step (upstream). Use ZeRO-1 or ZeRO-2, or "
            "FSDP2 (fsdp_config={'version': 2}), which shards the parameters too"
        )
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in (None, "none"):
            raise NotImplementedError(
                f"{who} does not support DeepSpeed zero_optimization.{key} (device {device}): offload is not "
                "verified with the regularizers' extra passes. Leave it out (ZeRO-1/2 without offload)"
            )


def refuse_unsupported_fsdp(
    who: str, version: int, offload: bool, wrapper_checkpointing: bool, torch_compile: bool
) -> None:
    """FSDP2 (transformers' default version) is supported; what is not verified is refused."""
    if version != 2:
        raise NotImplementedError(
            f"{who} does not support FSDP1 (fsdp_config version {version}): {FSDP1_REASON}. Use FSDP2: "
            "fsdp_config={'version': 2} (docs/DISTRIBUTED.md)"
        )
    if offload:
        raise NotImplementedError(
            f"{who} does not support FSDP2 with fsdp_config cpu_offload: {OFFLOAD_REASON}. Shard over more GPUs "
            "instead, with activation_checkpointing=True to save memory"
        )
    if wrapper_checkpointing:
        raise NotImplementedError(
            f"{who} does not support fsdp_config activation_checkpointing (FSDP's checkpoint wrapper): AD-DROP's "
            "attribution pass cannot pause it. Use the TrainingArguments' activation_checkpointing=True (the "
            "layers' own flag), which the regularizers keep exact under FSDP2"
        )
    if torch_compile:
        raise NotImplementedError(
            f"{who} does not support torch_compile=True with FSDP: compiled FSDP2 modules are not verified "
            "with the regularizers' extra passes. Use one of the two"
        )
