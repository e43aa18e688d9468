"""fairseq's MultiheadAttention routed through the core kernel, without new parameters.

:func:`install_attention_sites` swaps the class of every ``MultiheadAttention`` of a built
model to :class:`RegularizedMultiheadAttention` (``module.__class__``: no parameter is added
or renamed, so checkpoints stay plain fairseq checkpoints) and registers one
:class:`~attn_reg_plugin.core.kernel.attention_call.AttentionSite` per module. While no pass in progress
asks a hook of its site, the module runs fairseq's own forward unchanged (validation,
generation, incremental decoding).
"""

from __future__ import annotations

import functools
import re
from typing import List, Optional, Tuple

import torch
from fairseq.modules.multihead_attention import MultiheadAttention
from torch import Tensor

from ..core.kernel.attention import attend
from ..core.kernel.attention_call import AttentionSite, applied, call_of, plan_of
from ..core.kernel.controller import RegularizationController
from ..core.kernel.masks import finite_bias

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RegularizedMultiheadAttention(MultiheadAttention):
    """A MultiheadAttention whose training forward can be regularized through its site."""

    attn_reg_site: Optional[AttentionSite] = None

    def __prepare_scriptable__(self):
        # torch.jit.script puts what this returns into the caller's model in place: returning a
        # plain copy would silently stop regularizing a model that goes on training.
        raise RuntimeError(
            "attn_reg_plugin: this fairseq model's attention is routed through the plugin's kernel, which "
            "TorchScript cannot compile. To script it for export, call "
            "attn_reg_plugin.fairseq_plugin.attention.plain_fairseq_attention(model) first (in place; the "
            "model is then plain fairseq), or load the checkpoint with --task translation: checkpoints are "
            "plain fairseq checkpoints"
        )

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state=None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        call = call_of(self.attn_reg_site)
        if call.hook is None or incremental_state is not None or before_softmax:
            return super().forward(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                incremental_state=incremental_state,
                need_weights=need_weights,
                static_kv=static_kv,
                attn_mask=attn_mask,
                before_softmax=before_softmax,
                need_head_weights=need_head_weights,
            )
        return self._regularized_forward(
            call, query, key, value, key_padding_mask, need_weights or need_head_weights, attn_mask, need_head_weights
        )

    def _regularized_forward(
        self, call, query, key, value, key_padding_mask, need_weights, attn_mask, need_head_weights
    ):
        tgt_len, bsz, embed_dim = query.shape
        if self.self_attention:
            key = value = query
        src_len = key.shape[0]
        heads, head_dim = self.num_heads, self.head_dim

        def heads_first(x: Tensor, length: int) -> Tensor:  # (L, B, E) -> (B, H, L, d)
            return x.view(length, bsz, heads, head_dim).permute(1, 2, 0, 3)

        q = heads_first(self.q_proj(query), tgt_len)
        k = heads_first(self.k_proj(key), src_len)
        v = heads_first(self.v_proj(value), src_len)

        bias = None
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:  # fairseq's bool masks mark *disallowed* positions
                attn_mask = finite_bias(~attn_mask, q.dtype)
            bias = (
                attn_mask.view(1, 1, tgt_len, src_len)
                if attn_mask.dim() == 2
                else attn_mask.view(bsz, heads, tgt_len, src_len)
            )
        if key_padding_mask is not None:
            pad = finite_bias(~key_padding_mask.bool().view(bsz, 1, 1, src_len), q.dtype)
            # -inf + pad stays -inf; the kernel clamps every bias to a finite fill value.
            bias = pad if bias is None else bias.to(q.dtype) + pad

        dropout_p = self.dropout_module.p if (self.training or self.dropout_module.apply_during_inference) else 0.0
        out, probs = attend(
            q,
            k,
            v,
            bias=bias,
            dropout_p=dropout_p,
            scale=self.scaling,
            site=self.attn_reg_site,
            need_weights=need_weights,
            call=call,
        )
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim))
        weights = None
        if need_weights and probs is not None:
            weights = probs.transpose(0, 1)  # (H, B, T, S), as fairseq returns head weights
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return out, weights


def _kind_of(name: str, module: MultiheadAttention) -> str:
    if module.encoder_decoder_attention:
        return "encoder-decoder"
    return "decoder-self" if re.search(r"(^|\.)decoder\.", name) else "encoder-self"


def install_attention_sites(model: torch.nn.Module, controller: RegularizationController) -> RegularizationController:
    """Route every MultiheadAttention of ``model`` through the kernel and register its site.

    The kind comes from the module's role (encoder-decoder attention) and its place in the
    model (``decoder.`` in the path: decoder self-attention, otherwise encoder
    self-attention); the layer index is the ``layers.N`` in its path.
    """
    for name, module in model.named_modules():
        if not isinstance(module, MultiheadAttention):
            continue
        if module.bias_k is not None or module.add_zero_attn or getattr(module, "rotary_embeds", None) is not None:
            raise ValueError(
                f"attn_reg_plugin: attention {name} uses add_bias_kv / add_zero_attn / rotary embeddings, "
                f"which the regularized attention does not support"
            )
        match = _LAYER_INDEX.search(name + ".")
        if match is None:
            continue  # not a per-layer attention (none in fairseq's transformer family)
        if type(module) is MultiheadAttention:
            module.__class__ = RegularizedMultiheadAttention
        elif not isinstance(module, RegularizedMultiheadAttention):
            raise ValueError(f"attn_reg_plugin: cannot route {name} ({type(module).__name__}) through the kernel")
        module.attn_reg_site = controller.register(_kind_of(name, module), int(match.group(1)))
    for module in model.modules():
        if "precheckpoint_forward" in vars(module) and "attn_reg_carries_the_pass" not in vars(module):
            _carry_the_pass(module)
    return controller


def _layer_sites(layer: torch.nn.Module) -> List[AttentionSite]:
    return [m.attn_reg_site for m in layer.modules() if getattr(m, "attn_reg_site", None) is not None]


def _carry_the_pass(layer: torch.nn.Module) -> None:
    """A layer of ``--checkpoint-activations`` (fairseq's ``checkpoint_wrapper``: ``forward`` checkpoints
    ``precheckpoint_forward``) is recomputed in the backward, after the pass ended: its call carries
    the pass as one more argument, which the checkpoint keeps, and its function runs under it."""
    checkpointed = layer.forward  # partial(_checkpointed_forward, original forward, offload)
    if not isinstance(checkpointed, functools.partial) or not checkpointed.args:
        raise ValueError(f"attn_reg_plugin: cannot carry a pass through {type(layer).__name__}'s checkpoint wrapper")
    under_the_pass = functools.partial(_under_the_pass, layer)
    inner = functools.partial(checkpointed.func, under_the_pass, *checkpointed.args[1:], **checkpointed.keywords)
    layer.forward = functools.partial(_carrying_the_pass, layer, inner)
    layer.__dict__["attn_reg_carries_the_pass"] = True


def _carrying_the_pass(layer, checkpointed, *args, **kwargs):
    return checkpointed(*args, attn_reg_plan=plan_of(_layer_sites(layer)), **kwargs)


def _under_the_pass(layer, *args, attn_reg_plan=None, **kwargs):
    with applied(attn_reg_plan, _layer_sites(layer)):
        return layer.precheckpoint_forward(*args, **kwargs)


def plain_fairseq_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`install_attention_sites` on ``model`` in place: every routed attention is fairseq's
    own MultiheadAttention again (same parameters), e.g. before ``torch.jit.script``. Returns ``model``."""
    for module in model.modules():
        if isinstance(module, RegularizedMultiheadAttention):
            module.__class__ = MultiheadAttention
            module.__dict__.pop("attn_reg_site", None)
    return model
