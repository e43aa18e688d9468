"""Which transformers module gets which attention site: found by watching the calls, not by names.

transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS[...](module, query, key, ...)``,
so the attention function sees every module that attends, whatever its class or attribute
names (BERT's ``query``, GPT-2's fused ``c_attn``, ModernBERT's ``Wqkv``, T5's ``q``).
:func:`install_attention_sites` runs one probe forward on a short input (encoder and decoder
inputs of different lengths) with the recorder on, and gives each call a site:

* kind: a call whose keys are as long as the encoder input while its queries are as long as the
  decoder input is encoder-decoder attention; otherwise causal calls (and calls on the decoder
  input) are decoder-self, the rest encoder-self;
* layer: the call's rank among the calls of its kind, in forward order (the depth).

A module called at several depths in one forward (ALBERT shares one layer across the stack)
gets one site per depth; its calls are counted from the start of each forward of the model.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ..core.checkpointing import recomputing
from ..core.controller import AttentionSite, RegularizationController

logger = logging.getLogger(__name__)

# Encoder and decoder probe lengths: different, so a call's key length tells where its keys come from.
_ENCODER_LEN, _DECODER_LEN = 7, 4

_recorded: Optional[List[Tuple[torch.nn.Module, bool, int, int]]] = None  # set during the probe


def site_of_call(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 is_causal: Optional[bool]) -> Optional[AttentionSite]:
    """The site of this call of ``module`` (None: not regularized); records calls during the probe."""
    if _recorded is not None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
        _recorded.append((module, causal, query.shape[2], key.shape[2]))
        return None
    sites = getattr(module, "attn_reg_sites", None)
    if not sites:
        return None
    if len(sites) == 1:
        return sites[0]
    if recomputing():
        raise NotImplementedError(
            f"{type(module).__name__} is one attention module called at {len(sites)} depths (shared layers); "
            "activation checkpointing cannot tell which depth it recomputes. Train it without gradient checkpointing"
        )
    depth = module.attn_reg_calls
    module.attn_reg_calls = depth + 1
    return sites[depth % len(sites)]


def _probe_inputs(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    config = model.config
    device = next(model.parameters()).device
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    special = {getattr(config, n, None) for n in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")}
    tokens = [t for t in range(vocab) if t not in special][:_ENCODER_LEN]
    main = getattr(model, "main_input_name", "input_ids")
    if main == "input_features":  # speech encoders (Whisper): log-mel frames, length fixed by the config
        frames = 2 * int(config.max_source_positions)
        inputs = {main: torch.zeros(1, int(config.num_mel_bins), frames, device=device)}
    else:
        if len(tokens) < _ENCODER_LEN:
            raise ValueError(f"{type(model).__name__}: cannot build a probe input from a vocabulary of {vocab} tokens")
        ids = torch.tensor([tokens], device=device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        start = getattr(config, "decoder_start_token_id", None)
        start = tokens[0] if start is None else start
        inputs["decoder_input_ids"] = torch.tensor([[start] + tokens[1:_DECODER_LEN]], device=device)
    return inputs


@contextlib.contextmanager
def _recording() -> Iterator[List[Tuple[torch.nn.Module, bool, int, int]]]:
    global _recorded
    _recorded = []
    try:
        yield _recorded
    finally:
        _recorded = None


def _probe(model: torch.nn.Module) -> List[Tuple[torch.nn.Module, bool, int, int]]:
    was_training = model.training
    model.eval()
    try:
        with _recording() as calls, torch.no_grad():
            model(**_probe_inputs(model))
    finally:
        model.train(was_training)
    return calls


def _kind(model: torch.nn.Module, causal: bool, q_len: int, kv_len: int, encoder_len: int) -> str:
    if getattr(model.config, "is_encoder_decoder", False):
        if q_len == _DECODER_LEN and kv_len == encoder_len != _DECODER_LEN:
            return "encoder-decoder"
        return "decoder-self" if causal or q_len == _DECODER_LEN else "encoder-self"
    return "decoder-self" if causal else "encoder-self"


def _reset_call_counts(modules):
    def reset(*_args, **_kwargs):
        for module in modules:
            module.attn_reg_calls = 0

    return reset


def installed_sites(model: torch.nn.Module) -> List[Tuple[str, AttentionSite]]:
    """The ``(module path, site)`` pairs the model's modules hold now, as :func:`install_attention_sites` returned them."""
    return [(path, site) for path, module in model.named_modules() for site in module.__dict__.get("attn_reg_sites", [])]


def assign_sites(model: torch.nn.Module, pairs: List[Tuple[str, AttentionSite]]) -> None:
    """Give the modules named in ``pairs`` (from an install on this model) those sites, in order."""
    modules = dict(model.named_modules())
    grouped: Dict[str, List[AttentionSite]] = {}
    for path, site in pairs:
        grouped.setdefault(path, []).append(site)
    for path, sites in grouped.items():
        modules[path].attn_reg_sites = sites


@contextlib.contextmanager
def sites_in_use(model: torch.nn.Module, pairs: List[Tuple[str, AttentionSite]]) -> Iterator[None]:
    """:func:`assign_sites` for a while: several controllers can share one model, each in turn."""
    before = installed_sites(model)
    assign_sites(model, pairs)
    try:
        yield
    finally:
        assign_sites(model, before)


def install_attention_sites(model: torch.nn.Module, controller: RegularizationController,
                            implementation: str = "attn_reg") -> List[Tuple[str, AttentionSite]]:
    """Give each attention call of ``model`` a site and switch the model to ``implementation``.

    Returns ``(module path, site)`` pairs in forward order. Raises, naming the model, when no call
    reaches transformers' AttentionInterface.
    """
    from .attention import register_attn_reg

    register_attn_reg()
    name = type(model).__name__
    if not hasattr(getattr(model, "config", None), "_attn_implementation"):
        raise ValueError(f"no attention module routed through transformers' AttentionInterface was found in {name}: "
                         "it is not a transformers model (no config)")
    if getattr(model.config, "model_type", "").startswith("deberta"):
        raise ValueError(f"{name}: DeBERTa's disentangled attention does not go through transformers' "
                         "AttentionInterface, so the regularizers cannot reach it")
    set_impl = getattr(model, "set_attn_implementation", None)
    try:
        if callable(set_impl):
            set_impl(implementation)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"{name} does not accept a custom attention implementation: {e}") from None
    for config in {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")}.values():
        config._attn_implementation = implementation
    for module in model.modules():  # a second install (the AttendOut Attacker is a copy) starts afresh
        module.__dict__.pop("attn_reg_sites", None)
    calls = _probe(model)
    if not calls:
        raise ValueError(
            f"no attention module routed through transformers' AttentionInterface was found in {name}: a probe "
            "forward made no call to the attention function"
        )
    paths = {id(m): p for p, m in model.named_modules()}
    # the encoder's own calls (not causal, queries as long as keys) give its input length
    encoder_len = max((kv for _, causal, q, kv in calls if q == kv and not causal), default=_ENCODER_LEN)
    depth: Dict[str, int] = {}
    found = []
    for module, causal, q_len, kv_len in calls:
        kind = _kind(model, causal, q_len, kv_len, encoder_len)
        site = controller.register(kind, depth.get(kind, 0))
        depth[kind] = depth.get(kind, 0) + 1
        module.__dict__.setdefault("attn_reg_sites", []).append(site)
        found.append((paths.get(id(module), type(module).__name__), site))
    shared = [m for m in {id(m): m for m, *_ in calls}.values() if len(m.attn_reg_sites) > 1]
    if shared:
        for module in shared:
            module.attn_reg_calls = 0
        model.register_forward_pre_hook(_reset_call_counts(shared))
    logger.info("attn_reg: %s attention sites: %s", name,
                ", ".join(f"{k} x{n}" for k, n in depth.items()))
    return found
