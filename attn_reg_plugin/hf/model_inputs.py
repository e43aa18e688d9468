"""What a transformers model does with its inputs that the regularizers must do the same way:
whether its labels are its shifted inputs (a causal LM), and the decoder inputs a seq2seq model
builds from its labels. Both AD-DROP (its target) and AttendOut (its held-out losses) ask."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _causal_lm_classes() -> frozenset:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def causal_lm(model: torch.nn.Module) -> bool:
    """A decoder-only language model (``...ForCausalLM``, also inside a peft wrapper): its labels are its
    inputs, shifted inside the loss. Asked every AD-DROP step, so the class names are gathered once.

    Read from the class's ancestry, not its own name: FSDP2 swaps a sharded model's class for a
    subclass named ``FSDPLlamaForCausalLM``, and a user's subclass of a causal LM is one too. Asked
    through torch.compile's wrapper (the Trainer's ``torch_compile=True``; accelerate's ``unwrap_model``
    keeps it by default), it answers for the model the wrapper runs."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule holds the model there
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if getattr(model.config, "is_encoder_decoder", False):
        return False
    names = _causal_lm_classes()
    return any(cls.__name__ in names for cls in type(base).__mro__)


def decoder_input_ids_from_labels(model, labels: torch.Tensor) -> torch.Tensor:
    """The decoder inputs a seq2seq model builds from ``labels`` when none are given (shifted right)."""
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return prepare(labels=labels)
    from transformers.models.bart.modeling_bart import shift_tokens_right

    return shift_tokens_right(labels, model.config.pad_token_id, model.config.decoder_start_token_id)
