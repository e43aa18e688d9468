"""transformers adapter: route a model's attention through the core kernel, no copied modeling files.

transformers >= 4.48 calls attention through ``AttentionInterface``: each attention module
projects q/k/v itself and calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``.
This module registers one more implementation, ``"attn_reg"``:

* a module without an ``attn_reg_site``, or whose site has no hook (validation, generation,
  plain epochs), runs transformers' own ``sdpa`` function unchanged, so outputs are identical;
* with a hook, it calls :func:`attn_reg_plugin.core.attention.attend` with the module's site.

Masks for ``"attn_reg"`` are built by the same function as for ``"sdpa"`` (registered in
``AttentionMaskInterface``), so models see exactly the masks they would see with sdpa.
"""
from __future__ import annotations

import re
from typing import List, Optional, Tuple

import torch

from ..core.attention import attend
from ..core.controller import AttentionSite, RegularizationController

ATTN_IMPLEMENTATION = "attn_reg"

_LAYER_RE = re.compile(r"(?:^|\.)(?:layer|layers|block|blocks|h)\.(\d+)(?:\.|$)")


def _sdpa_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    from transformers.integrations.sdpa_attention import repeat_kv

    return repeat_kv(x, n_rep)


def attn_reg_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``AttentionInterface`` function: stock sdpa while idle, the core kernel while a hook is set.

    query: (B, H, T, d); key, value: (B, H_kv, S, d). Returns (B, T, H, d) and the weights
    (only with ``output_attentions`` while a hook is set; sdpa never returns them).
    """
    site: Optional[AttentionSite] = getattr(module, "attn_reg_site", None)
    if site is None or site.idle():
        return _sdpa_forward()(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or kwargs.get("cache") is not None:
        raise NotImplementedError("attn_reg attention supports neither position_bias, softcap nor paged caches")
    n_rep = getattr(module, "num_key_value_groups", 1) or 1
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    q_len, kv_len = query.shape[2], key.shape[2]
    bias = attention_mask
    if bias is not None and bias.dim() == 4:
        bias = bias[:, :, :, :kv_len]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    if bias is None and causal and q_len > 1:
        # transformers skips the mask when it is purely causal and lets sdpa use is_causal;
        # the core kernel needs it explicitly (aligned to the last keys, as with a cache).
        rows = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
        bias = (rows >= torch.arange(kv_len, device=query.device)[None, :]).view(1, 1, q_len, kv_len)
    out, weights = attend(
        query,
        key,
        value,
        bias=bias,
        dropout_p=dropout,
        scale=scaling,
        site=site,
        need_weights=bool(kwargs.get("output_attentions", False)),
    )
    return out.transpose(1, 2).contiguous(), weights


def register_attn_reg() -> None:
    """Register ``"attn_reg"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attn_reg_attention)
    # Same masks as sdpa: bool (True = attend), or None when sdpa would rely on is_causal / no padding.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


# -- finding the attention modules -------------------------------------------------------
_SELF_CLASS = re.compile(r"SelfAttention$")
_CROSS_CLASS = re.compile(r"CrossAttention$")


def _is_attention_module(module: torch.nn.Module) -> bool:
    """Modules that call ``AttentionInterface``: q/k/v projections plus a config (BERT family, Marian/BART)."""
    if not hasattr(module, "config"):
        return False
    names = ("query", "key", "value") if hasattr(module, "query") else ("q_proj", "k_proj", "v_proj")
    return all(isinstance(getattr(module, n, None), torch.nn.Module) for n in names) and hasattr(
        module.config, "_attn_implementation"
    )


def _layer_index(path: str) -> int:
    found = _LAYER_RE.findall(path)
    if not found:
        raise ValueError(f"cannot tell the layer index of attention module {path!r} (no layer.N / layers.N in its path)")
    return int(found[-1])


def _kind(path: str, module: torch.nn.Module) -> str:
    name = type(module).__name__
    leaf = path.rsplit(".", 1)[-1]
    cross = (
        bool(getattr(module, "is_cross_attention", False))
        or _CROSS_CLASS.search(name) is not None
        or leaf in ("encoder_attn", "crossattention", "cross_attention", "EncDecAttention")
        or ".crossattention." in f".{path}."
    )
    if cross:
        return "encoder-decoder"
    parts = path.split(".")
    if "decoder" in parts or bool(getattr(module, "is_causal", False)) or getattr(module.config, "is_decoder", False):
        # a decoder's own attention (Marian decoder, BERT as decoder)
        if "encoder" not in parts:
            return "decoder-self"
    return "encoder-self"


def install_attention_sites(model: torch.nn.Module, controller: RegularizationController) -> List[Tuple[str, AttentionSite]]:
    """Give each attention module of ``model`` a site and switch the model to ``"attn_reg"``.

    Returns ``(module path, site)`` pairs in module order. Raises if no attention module is found.
    """
    register_attn_reg()
    found = []
    for path, module in model.named_modules():
        if not _is_attention_module(module):
            continue
        site = controller.register(_kind(path, module), _layer_index(path))
        module.attn_reg_site = site
        found.append((path, site))
    if not found:
        raise ValueError(
            f"no attention module routed through transformers' AttentionInterface was found in "
            f"{type(model).__name__} (looked for modules with query/key/value or q_proj/k_proj/v_proj and a config)"
        )
    set_impl = getattr(model, "set_attn_implementation", None)
    if callable(set_impl):
        set_impl(ATTN_IMPLEMENTATION)
    configs = [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")]
    for config in configs:
        if config._attn_implementation != ATTN_IMPLEMENTATION:
            config._attn_implementation = ATTN_IMPLEMENTATION
    return found
