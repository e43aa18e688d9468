"""The probe forward's inputs: a short input per model (encoder and decoder lengths differ, so a
call's key length tells where its keys come from), a left-padded copy for the keyless-row check,
and which of them a module's forward takes."""

from __future__ import annotations

import contextlib
import inspect
from typing import Dict, Iterator, List, Optional

import torch

# Encoder and decoder probe lengths: different, so a call's key length tells where its keys come from.
ENCODER_LEN, DECODER_LEN = 7, 4
# Padding tokens in front of the left-padded probe row (decoder-only models, own attention not sdpa).
LEFT_PADDING = 3


def probe_inputs(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    config = model.config
    device = next(model.parameters()).device
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    special = {
        getattr(config, n, None) for n in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
    }
    tokens = [t for t in range(vocab) if t not in special][:ENCODER_LEN]
    main = getattr(model, "main_input_name", "input_ids")
    if main == "input_features":  # speech encoders (Whisper): log-mel frames, length fixed by the config
        frames = 2 * int(config.max_source_positions)
        inputs = {main: torch.zeros(1, int(config.num_mel_bins), frames, device=device)}
    else:
        if len(tokens) < ENCODER_LEN:
            raise ValueError(f"{type(model).__name__}: cannot build a probe input from a vocabulary of {vocab} tokens")
        ids = torch.tensor([tokens], device=device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        start = getattr(config, "decoder_start_token_id", None)
        start = tokens[0] if start is None else start
        inputs["decoder_input_ids"] = torch.tensor([[start] + tokens[1:DECODER_LEN]], device=device)
    return inputs


def left_padded(model: torch.nn.Module, inputs: Dict[str, torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
    """The probe input plus a left-padded copy of its row (None: the input has no padding mask).

    In causal attention a left-padding query sees only padding keys: a query row with no valid
    key. Its output is the logits at the last padding position, which predict the first real token.
    """
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    if ids is None or mask is None or ids.shape[0] != 1 or ids.shape[1] <= LEFT_PADDING:
        return None
    pad, vocab = getattr(model.config, "pad_token_id", None), int(getattr(model.config, "vocab_size", 0) or 0)
    if not (isinstance(pad, int) and 0 <= pad < vocab):  # no pad token (GPT-2): any token, it is masked
        pad = int(ids[0, 0])
    row = torch.cat([ids.new_full((1, LEFT_PADDING), pad), ids[:, : ids.shape[1] - LEFT_PADDING]], dim=1)
    row_mask = torch.cat([mask.new_zeros(1, LEFT_PADDING), mask[:, : mask.shape[1] - LEFT_PADDING]], dim=1)
    return {**inputs, "input_ids": torch.cat([ids, row]), "attention_mask": torch.cat([mask, row_mask])}


def accepted_inputs(module: torch.nn.Module, inputs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The probe inputs ``module.forward`` takes (a backbone may take fewer than its head model)."""
    params = inspect.signature(module.forward).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return inputs
    return {k: v for k, v in inputs.items() if k in params}


def probe_candidates(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model, then the backbone its head wraps: every attention module is in the backbone,
    and some heads reject a one-sequence probe (multiple choice wants (B, choices, T); an
    encoder-decoder classifier wants decoder inputs as long as its encoder inputs)."""
    base = getattr(model, "base_model", None)
    return [model] + ([base] if isinstance(base, torch.nn.Module) and base is not model else [])


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
