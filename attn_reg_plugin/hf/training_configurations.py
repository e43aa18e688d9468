"""What every trainer checks at construction: configurations the regularizers cannot honour.

Checked on the TrainingArguments before ``Trainer.__init__`` runs, so a bad combination stops
before any set-up or training. docs/CONFIGURATIONS.md lists every configuration and its status.
Also the trainers' shared constructor helper for the model argument.
"""

from __future__ import annotations

from typing import Optional

import torch
import transformers


def training_arguments(args, kwargs) -> Optional[transformers.TrainingArguments]:
    """The TrainingArguments given to the Trainer; None: its defaults, which use none of the below."""
    return kwargs.get("args", args[1] if len(args) > 1 else None)


def refuse_unsupported(who: str, args, model=None) -> None:
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
        raise NotImplementedError(
            f"{who} does not support DeepSpeed (TrainingArguments.deepspeed): its engine owns the model's forward "
            "and backward, around which the regularizers run extra passes. Use DDP instead (torchrun, no deepspeed)."
        )
    if args.fsdp:
        raise NotImplementedError(
            f"{who} does not support FSDP (TrainingArguments.fsdp): sharded parameters are gathered per forward, "
            "and the attribution pass and the Attacker copy are not sharded with them. Use DDP instead "
            "(torchrun, fsdp unset), with gradient_checkpointing=True to save memory."
        )


def model_argument(who: str, args, kwargs) -> torch.nn.Module:
    model = kwargs.get("model", args[0] if args else None)
    if model is None:
        raise ValueError(
            f"{who} needs `model` (model_init is not supported): attention sites are installed at construction"
        )
    return model
