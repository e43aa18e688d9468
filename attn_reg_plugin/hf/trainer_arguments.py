"""The model and TrainingArguments a Trainer was constructed with, read from its ``(*args, **kwargs)``
before ``Trainer.__init__`` runs: the plugin installs its sites and checks its refusals first."""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional

import torch
import transformers


def training_arguments(args, kwargs) -> Optional[transformers.TrainingArguments]:
    """The TrainingArguments given to the Trainer; None: its defaults, which use none of the refused configurations."""
    return kwargs.get("args", args[1] if len(args) > 1 else None)


def model_argument(who: str, args, kwargs) -> torch.nn.Module:
    model = kwargs.get("model", args[0] if args else None)
    if model is None:
        raise ValueError(
            f"{who} needs `model` (model_init is not supported): attention sites are installed at construction"
        )
    if isinstance(model, (str, os.PathLike)):
        # TRL's SFTTrainer loads a model named by a string itself, after the plugin would have installed
        raise ValueError(
            f"{who} needs the model object, not its name ({os.fspath(model)!r}): load it first, e.g. "
            "AutoModelForCausalLM.from_pretrained(name), since attention sites are installed at construction"
        )
    return model


def checkpointing_argument(enabled: bool) -> Dict[str, bool]:
    """The TrainingArguments field that turns activation checkpointing on, under this transformers' name.

    transformers 5.23 renamed ``gradient_checkpointing`` to ``activation_checkpointing`` (the old name
    warns, FutureWarning); 5.17 has only the old one. Nothing is passed when it is off.
    """
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {name: True} if enabled else {}
