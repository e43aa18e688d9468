"""What every trainer checks at construction: configurations the regularizers cannot honour.

Checked on the TrainingArguments before ``Trainer.__init__`` runs, so a bad combination stops
before any set-up or training. docs/CONFIGURATIONS.md lists every configuration and its status.
Also the trainers' shared constructor helper for the model argument.
"""

from __future__ import annotations

import json
from typing import Optional

import torch
import transformers

from ..core.sharding import check_supported_sharding


def training_arguments(args, kwargs) -> Optional[transformers.TrainingArguments]:
    """The TrainingArguments given to the Trainer; None: its defaults, which use none of the below."""
    return kwargs.get("args", args[1] if len(args) > 1 else None)


def refuse_unsupported(who: str, args, model=None) -> None:
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
        refuse_unsupported_deepspeed(who, deepspeed_config(args))
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


def refuse_unsupported_launch(who: str, trainer) -> None:
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
        refuse_unsupported_deepspeed(who, deepspeed.deepspeed_config)


def deepspeed_config(args) -> dict:
    """The DeepSpeed configuration the Trainer will use (a dict, or the JSON file it names)."""
    hf_config = getattr(args, "hf_deepspeed_config", None)
    if hf_config is not None:
        return hf_config.config
    if isinstance(args.deepspeed, dict):
        return args.deepspeed
    with open(args.deepspeed) as f:
        return json.load(f)


def refuse_unsupported_deepspeed(who: str, config: dict) -> None:
    """ZeRO stages 0-2 without offload are supported for AD-DROP and the no-extra-cost regularizers."""
    if who.startswith("AttendOut"):
        raise NotImplementedError(
            f"{who} does not support DeepSpeed (TrainingArguments.deepspeed): the engine owns the Defender's "
            "backward and optimizer step, and the Attacker's backward would run through it. Use FSDP2 "
            "(fsdp_config={'version': 2}) or DDP (torchrun)"
        )
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
            f"{who} does not support FSDP1 (fsdp_config version {version}): its flat parameters are gathered once "
            "per forward-backward pair, and the regularizers run extra forwards. Use FSDP2: fsdp_config={'version': "
            "2} (docs/DISTRIBUTED.md)"
        )
    if offload:
        raise NotImplementedError(
            f"{who} does not support FSDP2 with fsdp_config cpu_offload: it is not verified with the regularizers' "
            "extra passes. Shard over more GPUs instead, with activation_checkpointing=True to save memory"
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


def model_argument(who: str, args, kwargs) -> torch.nn.Module:
    model = kwargs.get("model", args[0] if args else None)
    if model is None:
        raise ValueError(
            f"{who} needs `model` (model_init is not supported): attention sites are installed at construction"
        )
    return model
