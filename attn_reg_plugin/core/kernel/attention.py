"""The one attention kernel every adapter calls.

Adapters (fairseq, transformers, custom models) project queries, keys and values themselves
and hand them here together with the attention's additive bias (padding / causal masks) and
the module's :class:`~attn_reg_plugin.core.kernel.controller.AttentionSite`. :func:`attend` reads what the
current pass does on the site once, as an immutable :class:`~.attention_call.AttentionCall`, runs the
pure kernel :func:`attention_kernel` with it, and adds what the kernel captured and counted to the
pass's :class:`~attn_reg_plugin.core.kernel.attention_call.Record`. What the kernel does on top of ordinary
scaled dot-product attention is decided by the call's *hook* (defined in :mod:`.attention_call`),
which the pass's plan asks of the site:

* no hook                  ordinary attention: ``scaled_dot_product_attention`` and nothing else
                           (the first thing :func:`attend` checks, so an idle model pays nothing);
* :class:`CaptureOutput`   AD-DROP gradient attribution: keep the fused kernel, remember the
                           per-head output ``O = A V`` and ``V``; since ``dF/dA = (dF/dO) V^T``
                           the attribution is exact without materialising ``A``;
* :class:`CaptureProbs`    materialise ``A`` (attention-weight attribution, integrated
                           gradients with the map scaled by ``alpha``);
* :class:`EditScores`      the score edit: drop keys (additive mask on the scores) and/or make
                           whole rows uniform over their valid keys (AD-DROP pass 2, AttendOut,
                           scheduled dropout, attention LayerDrop);
* :class:`EditOutputs`     the output edit: ordinary attention, then (sample, head) outputs dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .attention_call import (
    ORDINARY,
    AttentionCall,
    AttentionSite,
    Captured,
    CaptureOutput,
    CaptureProbs,
    EditOutputs,
    EditScores,
    Plan,
    call_of,
)
from .blockwise import BlockCall, blockwise_rows, edit_attention
from .devices import same_device
from .masks import causal_bias, explicit_weights, finite_bias, keyless_rows, valid_keys_from_bias, zero_rows
from .rules import AttentionScores, call_seed, keyed_draws


def _ordinary_attention(q, k, v, bias, dropout_p: float, scale: Optional[float], is_causal: bool = False):
    """Plain sdpa, a query row without a valid key giving 0 as :func:`attend` promises, one way on
    every device.

    A causal call without a bias and with as many queries as keys is sdpa's own ``is_causal`` (at
    4,096 tokens on a CPU about half the time of an explicit mask, which it also does not build);
    any other causal call has its mask made and combined with the bias.

    A mask goes to sdpa with its disallowed scores at ``-inf`` (which lets sdpa's CPU kernel skip
    them: 2.05 ms against a finite fill's 2.35 ms on a padded 32x4x54x54 batch), except in a row with no valid key,
    whose bias is made 0; such rows are zeroed after. No backend ever sees a row of ``-inf``, so none
    can return NaN for it (CUDA's half-precision kernels leave such a row of a bool mask nonzero, and
    its memory-efficient kernel has returned NaN, pytorch#110213), and a zeroed row sends no gradient
    back. On a CPU these are the bits sdpa gives the mask as given (tests/core/test_attention.py).
    """
    if is_causal:
        if bias is None and q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, is_causal=True)
        bias = _causal_bias(bias, q, k)
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
    valid = valid_keys_from_bias(bias)
    if bias.dtype == torch.bool:  # -inf filled with 0 where valid: torch.where's values in two ops, not three
        mask = torch.full(valid.shape, float("-inf"), dtype=q.dtype, device=valid.device).masked_fill_(valid, 0.0)
    else:
        mask = torch.where(valid, bias.to(q.dtype), float("-inf"))
    keyless = keyless_rows(bias, valid)
    if keyless is not None:
        mask = mask.masked_fill(keyless, 0.0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), dropout_p=dropout_p, scale=scale)
    return zero_rows(out, keyless)


def _combined_bias(
    bias: Optional[torch.Tensor], shape: Tuple[int, int, int, int], dtype: torch.dtype, device
) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """Bias as a float tensor in ``dtype`` plus the boolean validity it implies."""
    if bias is None:
        return None, torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device).expand(shape)
    return finite_bias(bias, dtype), valid_keys_from_bias(bias)


def _check_grad_mode() -> None:
    if not torch.is_grad_enabled():
        raise RuntimeError(
            "AD-DROP attribution reached an attention layer whose forward runs without autograd: a reentrant "
            "activation checkpoint (use_reentrant=True, fairseq --checkpoint-activations) hides the layer from "
            "the attribution gradient. ADDrop pauses checkpointing for the attribution pass on modules with a "
            "`gradient_checkpointing` flag or a fairseq checkpoint wrapper; pause yours likewise, or checkpoint "
            "with use_reentrant=False"
        )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    site: Optional[AttentionSite] = None,
    need_weights: bool = False,
    is_causal: bool = False,
    plan: Optional[Plan] = None,
    call: Optional[AttentionCall] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Scaled dot-product attention with the site's regularization hook applied.

    q: (B, H, T, d); k, v: (B, H, S, d), or (B, H_kv, S, d) with H_kv dividing H (grouped-query
    attention: query head h reads key/value head h // (H / H_kv), as transformers' ``repeat_kv``;
    GA then keeps the values unrepeated between its passes); bias: additive float (``-inf`` / very negative where
    disallowed) or bool (True where allowed), broadcastable to (B, H, T, S).
    ``dropout_p`` is the attention-probability dropout, already zero outside training.
    ``is_causal``: query i may also not attend a key j > i + S - T (aligned to the last keys, as
    with a cache; sdpa's ``is_causal`` when T = S), on top of ``bias``. Prefer it to a causal mask:
    the kernel then never builds a (T, S) one where sdpa or a block of queries can do without.
    ``plan``: the pass, when the model's call carries it (transformers' model kwargs); else the
    innermost pass in progress on the site says what the call does. A checkpointed layer must
    carry it to its recompute (:meth:`~.controller.RegularizationController.checkpoint`).
    ``call``: ``call_of(site, plan)`` when the adapter read it already (to take its stock path on
    an ordinary call), so that a call is read once.
    Returns the per-head output (B, H, T, d) and, if ``need_weights``, the attention map.
    A query row with no valid key attends to nothing: its output (and map row) is 0.
    """
    if call is None:
        call = call_of(site, plan)
    elif plan is not None:
        raise ValueError("attend: give the plan (read here) or the call read from it (call_of), not both")
    if isinstance(call.hook, EditScores) and call.hook.replaces_weight_dropout:
        dropout_p = 0.0  # DropKey: the drops on the keys are this call's attention dropout
    value_heads = v
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
            raise ValueError(f"attend: {q.shape[1]} query heads need key/value heads dividing them, got {k.shape[1]}")
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out, weights, captured = attention_kernel(q, k, v, bias, dropout_p, scale, need_weights, call, is_causal)
    if captured is not None and captured.values is not None and value_heads is not v:
        captured = dataclasses.replace(captured, values=value_heads.detach())  # kept unrepeated
    if captured is not None and call.record is not None:  # its pass collects it (a hook set by hand: nowhere)
        call.record.add(site, captured)
    return out, weights


def attention_kernel(
    q,
    k,
    v,
    bias,
    dropout_p: float,
    scale: Optional[float],
    need_weights: bool,
    call: AttentionCall,
    is_causal: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[Captured]]:
    """(output, attention map if ``need_weights``, what the call captured) of one call described by
    ``call``. Reads its arguments, changes none of them: the same call gives the same drops."""
    hook = call.hook
    if isinstance(hook, EditOutputs):  # the output edit: attention, then heads dropped
        out, weights, _ = attention_kernel(q, k, v, bias, dropout_p, scale, need_weights, ORDINARY, is_causal)
        out, captured = _dropped_heads(out, hook, call)
        return out, weights, captured
    if isinstance(hook, EditScores):
        return _edit(call, q, k, v, bias, dropout_p, scale, need_weights, is_causal)
    if _keeps_inputs(hook) and not need_weights:
        # AA: the ordinary output (sdpa's at every length), and q, k and the model's own mask kept, from
        # which pass 2 recomputes the weights per block (nothing (T, S) kept between the passes).
        out = attention_kernel(q, k, v, bias, 0.0, scale, False, ORDINARY, is_causal)[0]
        if call.recompute:
            return out, None, None
        weights = _weights_source(q, k, bias, scale, is_causal)
        return out, None, Captured(probs=weights, valid=_validity(bias, q, k, is_causal))
    if isinstance(hook, CaptureOutput):  # GA: sdpa's output kept, attention dropout off (no map returned)
        out = _ordinary_attention(q, k, v, bias, 0.0, scale, is_causal)
        out, captured = _captured(call, out, q, k, v, bias, scale, is_causal)
        return out, None, captured
    if isinstance(hook, CaptureProbs) or need_weights:  # the map is materialised
        if is_causal:
            bias = _causal_bias(bias, q, k)
        bias, valid = _combined_bias(bias, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.dtype, q.device)
        return _with_weights(call, hook, q, k, v, bias, valid, keyless_rows(bias, valid), dropout_p, scale)
    return _ordinary_attention(q, k, v, bias, dropout_p, scale, is_causal), None, None


def _dropped_heads(out: torch.Tensor, hook: EditOutputs, call: AttentionCall):
    """The output edit on a call's (B, H, T, d) output: each (sample, head) dropped with the hook's
    probability p (keyed draws of the call's seed, made again identically by a recompute), a sample's
    kept heads scaled by H / kept. A sample drawn to lose every head keeps the one of largest draw, a
    head uniformly at random (no rescaling by H / 0), so the rate is p - p**H / H, rising with p.
    The attention itself is the ordinary call's. Returns the output and the counts, [dropped, pairs]."""
    b, h = out.shape[:2]
    draws = keyed_draws(_seed(call), -4, [b, h, 1, 1], 0, 1, 1, True, out.device).view(b, h)
    drop = draws < hook.probability.to(out.device)
    drop &= ~(drop.all(-1, keepdim=True) & (draws == draws.amax(-1, keepdim=True)))
    scale = (~drop).to(out.dtype) * (h / (h - drop.sum(-1, keepdim=True))).to(out.dtype)
    out = out * scale.view(b, h, 1, 1)
    if call.recompute or not hook.counted:
        return out, None
    return out, Captured(dropped=drop.sum(), droppable=torch.tensor(b * h, device=out.device))


def _causal_bias(bias, q, k):
    """The (T, S) bias of a causal call: ``bias`` with future keys disallowed too."""
    t, s = q.shape[2], k.shape[2]
    return causal_bias(bias, slice(0, t), s, t, s, q.device)


def _with_weights(call: AttentionCall, hook, q, k, v, bias, valid, keyless, dropout_p: float, scale):
    """The explicit softmax path outside an edit: the map is materialised (CaptureProbs, or the caller
    wants it); the model's attention dropout is torch's, as the stock model draws it."""
    probs = zero_rows(explicit_weights(q, k, bias, scale), keyless)
    used, captured = probs, None
    if isinstance(hook, CaptureProbs):
        if not call.recompute and hook.requires_grad:
            _check_grad_mode()
        used = probs * hook.alpha if hook.alpha != 1.0 else probs
        if hook.requires_grad and not used.requires_grad:
            used.requires_grad_(True)
        if not call.recompute:
            captured = Captured(probs=used, valid=valid)
        dropout_p = 0.0
    if dropout_p > 0:
        used = F.dropout(used, p=dropout_p)
    return torch.matmul(used, v), probs, captured


def _captured(call: AttentionCall, out, q, k, v, bias, scale, is_causal: bool, valid=None):
    """(output, captured) of a gradient capture: its output (the leaf the attribution is taken of),
    V and validity, and with ``keeps_weights`` what the weights are recomputed from. A map scaled by
    alpha (integrated gradients) gives alpha A V, so dF/d(alpha A) = (dF/dO) V^T as for GA."""
    hook = call.hook
    if hook.alpha != 1.0:
        out = out * hook.alpha
    if not call.recompute:
        _check_grad_mode()
    leaf, compiled = out, torch.compiler.is_compiling()
    if compiled and _fits(hook.probe, out):
        out = out + hook.probe  # the probe is the leaf: no requires_grad_ to break the graph
        leaf = hook.probe
    elif not out.requires_grad and torch.is_grad_enabled():
        # Layers below the first captured one may carry no graph (parameters frozen for the
        # attribution pass): this output is the leaf the attribution is taken of, in a checkpoint's
        # recompute too (which must save what the forward saved).
        out.requires_grad_(True)
    if call.recompute:
        return out, None
    weights = _weights_source(q, k, bias, scale, is_causal) if hook.keeps_weights else None
    if valid is None:
        valid = _validity(bias, q, k, is_causal, hook.keeps_long_causal_valid)
    return out, Captured(output=leaf, values=v.detach(), valid=valid, probs=weights, compiled=compiled)


def _fits(probe: Optional[torch.Tensor], out: torch.Tensor) -> bool:
    """Whether a GA probe (:class:`CaptureOutput`) can stand for this output: its shape, dtype and device."""
    return probe is not None and probe.shape == out.shape and probe.dtype == out.dtype and same_device(probe, out)


def _weights_source(q, k, bias, scale: Optional[float], is_causal: bool) -> AttentionScores:
    """What a call's attention weights are recomputed from per block (AA's long map, IGA's)."""
    scale_ = scale if scale is not None else q.shape[-1] ** -0.5
    return AttentionScores(q.detach(), k.detach(), bias, scale_, is_causal)


def _validity(bias, q: torch.Tensor, k: torch.Tensor, is_causal: bool = False, long_causal: bool = False):
    """Valid keys of a call from the model's mask; with none, every key (the key dimension is kept,
    since counts are taken along it). A causal map longer than one block gets None unless
    ``long_causal``: only dense attributions read it, and blocks make their rows' validity themselves."""
    if is_causal:
        if not long_causal and blockwise_rows(q, k) is not None:
            return None
        return valid_keys_from_bias(_causal_bias(bias, q, k))
    if bias is None:
        return torch.ones((1, 1, 1, k.shape[2]), dtype=torch.bool, device=k.device)
    return valid_keys_from_bias(bias)


def _keeps_inputs(hook) -> bool:
    """Whether this call (one that returns no weights) is AA's training capture."""
    return isinstance(hook, CaptureProbs) and hook.keeps_inputs and not hook.requires_grad and hook.alpha == 1.0


def _edit(call: AttentionCall, q, k, v, bias, dropout_p: float, scale, need_weights: bool, is_causal: bool):
    """(output, map if ``need_weights``, counts) of an :class:`EditScores` call, through the one
    Function of every length (:mod:`.blockwise`: a map larger than a block runs block by block, its
    drops made again in the backward, no mask saved; a call that returns its map is one block)."""
    hook = call.hook
    count = not call.recompute and hook.counted and hook.drop is not None
    # The model's dropout draws a seed of its own per call (torch's stream, which a checkpoint restores
    # for its recompute): the pass's seed is the site's, the same for each call of the site in the pass.
    dropout_seed = call_seed() if dropout_p > 0 else None
    rows = q.shape[2] if need_weights else blockwise_rows(q, k) or q.shape[2]
    block = BlockCall(
        hook.rule, hook.uniform_rows_on(q.device), hook.droppable, rows, _seed(call), dropout_p, scale, count,
        is_causal, dropout_seed, need_weights,
    )  # fmt: skip
    out, weights, dropped, droppable = edit_attention(q, k, v, bias, block)
    if call.recompute:
        return out, weights, None
    counts = (dropped, droppable) if count else (None, None)
    # 1 when the rows-made-uniform flag is set (a LayerDrop'd call), else 0: stays where the flag is (no sync)
    flagged = None if not hook.counted or hook.uniform_rows is None else torch.as_tensor(hook.uniform_rows).any().long()
    return out, weights, Captured(dropped=counts[0], droppable=counts[1], uniform_call=flagged)


def _seed(call: AttentionCall) -> Optional[torch.Tensor]:
    """The seed keying an edit's random drops: the site's for the pass; else (a hook set by hand) one
    drawn from torch's stream now, which a checkpoint restores for its recompute."""
    if call.seed is not None or not call.hook.draws:
        return call.seed
    return call_seed()
