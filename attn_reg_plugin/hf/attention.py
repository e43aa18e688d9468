"""transformers adapter: route a model's attention through the core kernel, no copied modeling files.

transformers >= 4.48 calls attention through ``AttentionInterface``: each attention module
projects q/k/v itself and calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``.
This module registers one more implementation, ``"attn_reg"``:

* a module without a site, or whose site has no hook (validation, generation, plain epochs),
  runs transformers' own ``sdpa`` function unchanged, so outputs are identical;
* with a hook, it calls :func:`attn_reg_plugin.core.kernel.attention.attend` with the module's site.

What a pass does reaches the function as a model kwarg, ``attn_reg_plan`` (a
:class:`~attn_reg_plugin.core.kernel.attention_call.Plan` that :mod:`.sites` adds to the model's call while a pass
is set), as flash-attention's ``cu_seq_lens`` travel: transformers keeps a checkpointed layer's kwargs
for its recompute, so a layer recomputed in the backward repeats the pass of its forward.

Which module gets which site is found by watching the calls (:mod:`.sites`), not by names.

Masks for ``"attn_reg"`` are built by the same function as for ``"sdpa"`` (registered in
``AttentionMaskInterface``), so models see exactly the masks they would see with sdpa.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..core.kernel.attention import attend
from ..core.kernel.attention_call import AttentionSite, call_of
from ..core.kernel.controller import RegularizationController
from ..core.kernel.masks import causal_allowed, mask_fill_value
from .sites import PLAN_KWARG, UnsupportedAttention, route_attention_calls

ATTN_IMPLEMENTATION = "attn_reg"


def _sdpa_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def site_of_call(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, is_causal: Optional[bool]
) -> Optional[AttentionSite]:
    """The site of this call of ``module`` (None: not regularized); records calls during the probe."""
    probe = module.__dict__.get("attn_reg_probe")
    if probe is not None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
        probe.append((module, causal, query.shape[2], key.shape[2]))
        return None
    sites = module.__dict__.get("attn_reg_sites")
    if not sites:
        return None
    if len(sites) == 1:
        return sites[0]
    depth = module.attn_reg_calls
    module.attn_reg_calls = depth + 1
    return sites[depth % len(sites)]


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
    site: Optional[AttentionSite] = site_of_call(module, query, key, is_causal)
    plan = kwargs.pop(PLAN_KWARG, None)
    if kwargs.get("softcap") is not None:  # Gemma-2: sdpa would raise its own error, naming neither model nor fix
        raise UnsupportedAttention(
            f"its attention caps the scores ({type(module).__name__}: attention logit soft-capping, "
            f"softcap * tanh(scores / softcap) with softcap={kwargs['softcap']})"
        )
    call = call_of(site, plan)
    if call.hook is None:
        # transformers' own sdpa, not the kernel's ordinary path: the equivalence checks compare against it
        return _sdpa_forward()(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # A sliding window (Mistral) is already in the mask sdpa's mask function built; a paged cache is not.
    if kwargs.get("cache") is not None:
        raise NotImplementedError(f"{type(module).__name__}: attn_reg attention does not support paged caches")
    # Grouped-query key/value heads go to the kernel unrepeated (it repeats them as repeat_kv does).
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    bias, causal = _score_bias(attention_mask, kwargs.get("position_bias"), query, key.shape[2], causal)
    out, weights = attend(
        query,
        key,
        value,
        bias=bias,
        dropout_p=dropout,
        scale=scaling,
        site=site,
        need_weights=bool(kwargs.get("output_attentions", False)),
        is_causal=causal,
        call=call,
    )
    return out.transpose(1, 2).contiguous(), weights


def _score_bias(attention_mask, position_bias, query: torch.Tensor, kv_len: int, causal: bool):
    """(bias, is_causal) for the kernel: the model's mask cut to the keys, and T5's relative position
    bias; ``is_causal`` where transformers left a purely causal mask to sdpa's ``is_causal``."""
    q_len = query.shape[2]
    bias = attention_mask
    if bias is not None and bias.dim() == 4:
        bias = bias[:, :, :, :kv_len]
    # transformers skips the mask when it is purely causal and lets sdpa use is_causal; so does the
    # kernel, which builds a causal mask only for the paths that need one (aligned to the last keys).
    causal = bias is None and causal and q_len > 1
    if position_bias is None:
        return bias, causal
    if causal:
        bias = causal_allowed(slice(0, q_len), kv_len, q_len, kv_len, query.device)
    # T5's relative position bias is a float bias on the scores: added before any mask, and masked
    # positions keep the fill, so the candidate region still excludes them.
    position_bias = position_bias[:, :, -q_len:, :kv_len].to(query.dtype)
    if bias is None:
        return position_bias, False
    if bias.dtype == torch.bool:
        return position_bias.masked_fill(~bias, mask_fill_value(query.dtype)), False
    return position_bias + bias, False


def register_attention(name: str, function, masks_like: str) -> None:
    """Register ``function`` as transformers' attention implementation ``name``, its masks built as
    for the implementation ``masks_like`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[masks_like])


def register_attn_reg() -> None:
    """Register ``"attn_reg"`` with transformers (idempotent), with sdpa's masks: bool (True =
    attend), or None when sdpa would rely on is_causal / no padding."""
    register_attention(ATTN_IMPLEMENTATION, attn_reg_attention, "sdpa")


def install_attention_sites(model, controller: RegularizationController) -> List[Tuple[str, AttentionSite]]:
    """Route every attention call of the transformers ``model`` through the kernel, one site each.

    Sites are found by watching one probe forward (:mod:`.sites`); the model is switched to
    ``attn_implementation="attn_reg"`` only if that leaves its outputs unchanged with nothing
    dropped. Returns ``(module path, site)`` pairs in forward order.
    """
    register_attn_reg()
    return route_attention_calls(model, controller, ATTN_IMPLEMENTATION)
