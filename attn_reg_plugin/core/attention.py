"""The one attention kernel every adapter calls.

Adapters (fairseq, transformers, custom models) project queries, keys and values themselves
and hand them here together with the attention's additive bias (padding / causal masks) and
the module's :class:`~attn_reg_plugin.core.controller.AttentionSite`. What the kernel does on
top of ordinary scaled dot-product attention is decided by the site's current *hook*, set by
the controller for one forward pass:

* no hook                  ordinary attention (fused ``scaled_dot_product_attention``);
* :class:`CaptureOutput`   AD-DROP gradient attribution: keep the fused kernel, remember the
                           per-head output ``O = A V`` and ``V``; since ``dF/dA = (dF/dO) V^T``
                           the attribution is exact without materialising ``A``;
* :class:`CaptureProbs`    materialise ``A`` (attention-weight attribution, integrated
                           gradients with the map scaled by ``alpha``);
* :class:`EditScores`      drop keys (additive mask on the scores) and/or make whole rows
                           uniform over their valid keys (AD-DROP pass 2, AttendOut,
                           scheduled dropout, attention LayerDrop).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .checkpointing import recomputing
from .masks import additive_mask, mask_fill_value, valid_keys_from_bias


@dataclass
class CaptureOutput:
    """Record what gradient attribution needs; attention dropout is off for this pass.

    Entries are appended in call order; ``sites[i]`` says whose entry ``i`` is.
    """

    sites: List[object] = field(default_factory=list)
    outputs: List[torch.Tensor] = field(default_factory=list)
    values: List[torch.Tensor] = field(default_factory=list)
    valid: List[torch.Tensor] = field(default_factory=list)


@dataclass
class CaptureProbs:
    """Materialise the attention map, scaled by ``alpha`` (integrated gradients); keep it."""

    alpha: float = 1.0
    requires_grad: bool = True
    sites: List[object] = field(default_factory=list)
    probs: List[torch.Tensor] = field(default_factory=list)
    valid: List[torch.Tensor] = field(default_factory=list)


@dataclass
class EditScores:
    """Edits applied to the scores before softmax.

    ``drop``: bool, True where a key is removed from a row (broadcastable to (B, H, T, S)), or
    a callable ``(valid) -> drop`` evaluated inside the kernel when the mask depends only on
    shapes and validity (random-region AD-DROP, scheduled dropout).
    ``uniform_rows``: True (every row) or bool broadcastable to (B, H, T, 1), e.g. a (1, 1, 1, 1)
    per-pass flag; such rows attend uniformly to their valid keys (attention LayerDrop). A row whose every valid key is in ``drop`` is made
    uniform the same way (AttendOut Eq. 4), never left all-masked.
    ``stats``: when given, ``[dropped, valid]`` counts of this pass are added to it.
    ``calls``: when given, ``[calls whose uniform_rows flag was set, calls]`` are added to it.
    Both are counted by the kernel from what it applied, so a hook that never reaches the kernel
    (a module not routed through it) counts nothing.
    """

    drop: Optional[object] = None
    uniform_rows: Optional[object] = None
    stats: Optional[List[torch.Tensor]] = None
    calls: Optional[List[torch.Tensor]] = None


def zero_counts() -> List[torch.Tensor]:
    """A fresh ``[dropped, valid]`` (or ``[skipped, total]``) pair for ``EditScores.stats`` / ``.calls``."""
    return [torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)]


def _combined_bias(
    bias: Optional[torch.Tensor], shape: Tuple[int, int, int, int], dtype: torch.dtype, device
) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """Bias as a float tensor in ``dtype`` plus the boolean validity it implies."""
    if bias is None:
        return None, torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device).expand(shape)
    valid = valid_keys_from_bias(bias)
    if bias.dtype == torch.bool:
        bias = torch.zeros((), dtype=dtype, device=device).masked_fill(~bias, mask_fill_value(dtype))
    else:
        # Clamp -inf to a finite negative: a padding mask plus a drop mask stays finite.
        bias = bias.to(dtype).clamp(min=mask_fill_value(dtype))
    return bias, valid


def _keyless_rows(bias: Optional[torch.Tensor], valid: torch.Tensor) -> Optional[torch.Tensor]:
    """(…, T, 1) True for query rows with no valid key (a padding query under left-padded causal
    attention); None when there are none.

    Such a row attends to nothing: its output is 0, as stock sdpa gives with a boolean mask. With
    the finite fill instead, softmax would spread it over padding keys, and torch's fused CPU
    backward gets those rows' gradients wrong (it differs from the math backend by O(1)); zeroed
    rows send no gradient back, so both backends agree with the explicit softmax path.
    """
    if bias is None:
        return None
    rows = ~valid.any(dim=-1, keepdim=True)
    # On the host, looking is cheaper than editing; on an accelerator it would synchronise.
    if rows.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(rows.any()):
        return None
    return rows


def _broadcast_count(mask: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
    """Number of True entries of ``mask`` broadcast to ``shape``, without materialising it."""
    if mask.numel() == 0:
        return mask.sum()
    return mask.sum() * (math.prod(shape) // mask.numel())


def _all_last(mask: torch.Tensor) -> torch.Tensor:
    """``mask.all(dim=-1, keepdim=True)``, 5x faster on CPU: a bool is a byte, and the byte
    minimum is vectorised where the boolean reduction is not (2.9 vs 0.6 ms on 32x12x54x54)."""
    # Inductor cannot lower a bool->uint8 view (it asks iinfo for bool's width), and off the CPU
    # the plain reduction is as fast.
    if mask.shape[-1] == 0 or mask.device.type != "cpu" or torch.compiler.is_compiling():
        return mask.all(dim=-1, keepdim=True)
    return mask.view(torch.uint8).amin(dim=-1, keepdim=True).bool()


@dataclass
class _Replay:
    """What one forward call of a site did, kept on the site for an activation-checkpoint recompute.

    It holds no captured tensor (those would keep an attribution pass's graph alive): only the
    resolved edit, and for capture hooks an empty hook of the same kind.
    """

    hook: object  # what the recompute does again: the resolved edit below, or an empty capture
    drop: Optional[torch.Tensor] = None  # resolved: random draws are not used again
    uniform: Optional[torch.Tensor] = None
    redraw: Optional[Callable] = None  # the edit's in-kernel draw, repeated to keep the random stream in step
    owner: Optional[weakref.ref] = None  # the pass's hook object: a second call under it is ambiguous
    calls: int = 1


def _resolve_edit(hook: EditScores, valid: torch.Tensor, shape, device):
    """The edit's final (drop, uniform rows), random draws made and emptied rows made uniform."""
    uniform = hook.uniform_rows
    if uniform is True:  # every row (attention LayerDrop); made on q's device, no copy
        uniform = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
    elif isinstance(uniform, torch.Tensor) and uniform.device != device:
        uniform = uniform.to(device)  # a per-pass flag drawn on the host (LayerDrop)
    drop = hook.drop(valid.expand(shape)) if callable(hook.drop) else hook.drop
    if drop is not None:
        # A row that would lose every real key attends uniformly to them instead (AttendOut
        # Eq. 4): softmax over an all-masked row is NaN or padding-weighted otherwise.
        emptied = _all_last(drop | ~valid) & valid.any(dim=-1, keepdim=True)
        # On CPU, looking is cheaper than editing every row; on GPU it would synchronise, and
        # in a compiled graph it would break the graph.
        if emptied.device.type != "cpu" or torch.compiler.is_compiling() or bool(emptied.any()):
            drop = drop & ~emptied
            uniform = emptied if uniform is None else (uniform | emptied)
    return drop, uniform


def _empty_like(hook):
    if isinstance(hook, CaptureOutput):
        return CaptureOutput()
    if isinstance(hook, CaptureProbs):
        return CaptureProbs(alpha=hook.alpha, requires_grad=hook.requires_grad)
    return EditScores(stats=None)


def _this_call(site, valid: torch.Tensor, shape, device):
    """(hook, drop, uniform, fresh) of this call; ``fresh`` is False in a recompute.

    A forward call resolves the site's hook and records it on the site; a call made while
    autograd runs a backward is a checkpointed layer's recompute and repeats that record, so
    the gradient is that of the loss's own forward. The record lives until the site's next
    forward call, so a checkpointed forward must be back-propagated before the same sites run
    another forward.
    """
    if site is None:
        return None, None, None, True
    if torch.compiler.is_compiling():
        # Traced: no record is kept (a Python object per call would be a guard per step), and
        # none is needed, since a compiled region recomputes from its own graph.
        hook = site.hook
        if isinstance(hook, EditScores):
            return (hook, *_resolve_edit(hook, valid, shape, device), True)
        return hook, None, None, True
    if recomputing():
        record = site.replay
        if record is None:
            return None, None, None, False
        if record.calls > 1:
            raise RuntimeError(
                f"attention site {site} was called {record.calls} times in one regularized pass, and a "
                "checkpointed layer recomputed in backward cannot tell which call it repeats: register one "
                "site per call (or train without activation checkpointing)"
            )
        if record.redraw is not None:
            # Draw again and discard: the recompute must leave the random stream where the
            # forward left it, or the dropout after this attention would draw other masks.
            record.redraw(valid.expand(shape))
        return record.hook, record.drop, record.uniform, False
    hook = site.hook
    if hook is None:
        site.replay = None
        return None, None, None, True
    drop = uniform = None
    if isinstance(hook, EditScores):
        drop, uniform = _resolve_edit(hook, valid, shape, device)
    previous = site.replay
    calls = previous.calls + 1 if previous is not None and previous.owner() is hook else 1
    redraw = hook.drop if isinstance(hook, EditScores) and callable(hook.drop) else None
    site.replay = _Replay(_empty_like(hook), drop, uniform, redraw, weakref.ref(hook), calls)
    return hook, drop, uniform, True


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
    site=None,
    need_weights: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Scaled dot-product attention with the site's regularization hook applied.

    q: (B, H, T, d); k, v: (B, H, S, d); bias: additive float (``-inf`` / very negative where
    disallowed) or bool (True where allowed), broadcastable to (B, H, T, S).
    ``dropout_p`` is the attention-probability dropout, already zero outside training.
    Returns the per-head output (B, H, T, d) and, if ``need_weights``, the attention map.
    A query row with no valid key attends to nothing: its output (and map row) is 0.
    """
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    bias, valid = _combined_bias(bias, shape, q.dtype, q.device)
    keyless = _keyless_rows(bias, valid)
    hook, drop, uniform, fresh = _this_call(site, valid, shape, q.device)

    if isinstance(hook, EditScores):
        if hook.calls is not None and fresh:
            skipped = torch.as_tensor(hook.uniform_rows).any()  # stays where the flag is: no host sync
            hook.calls[0] = hook.calls[0] + skipped.long()
            hook.calls[1] = hook.calls[1] + 1
        if uniform is not None:
            # A zero query row scores every key 0, so softmax is uniform over the valid keys
            # (the bias still removes padding); the row's query receives no gradient, as it
            # has no influence on a uniform row.
            q = q.masked_fill(uniform, 0.0)
        if drop is not None:
            if bias is None:
                bias = additive_mask(drop, q.dtype)
            else:
                # bias + drop * fill in one pass: the same values as bias + additive_mask(drop).
                bias = torch.add(bias, drop, alpha=mask_fill_value(q.dtype))
            if hook.stats is not None and fresh:
                # Count over the full (B, H, T, S): a mask shared by heads drops in each head.
                dropped = (drop & valid).expand(shape).sum()
                hook.stats[0] = hook.stats[0] + dropped
                hook.stats[1] = hook.stats[1] + _broadcast_count(valid, shape)
        hook = None

    if isinstance(hook, CaptureOutput):
        if fresh:
            _check_grad_mode()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.0, scale=scale)
        if not out.requires_grad:
            # Layers below the first captured one may carry no graph (parameters frozen for
            # the attribution pass): make this output the leaf the attribution is taken of.
            out.requires_grad_(True)
        if fresh:
            hook.sites.append(site)
            hook.outputs.append(out)
            hook.values.append(v.detach())
            hook.valid.append(valid)
        return _zero_rows(out, keyless), None

    if isinstance(hook, CaptureProbs) or need_weights:
        scale_ = scale if scale is not None else q.shape[-1] ** -0.5
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale_
        if bias is not None:
            scores = scores + bias
        # Softmax in at least float32: half-precision exponentials lose the small weights.
        probs = torch.softmax(scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores, dim=-1).to(q.dtype)
        probs = _zero_rows(probs, keyless)
        used = probs
        if isinstance(hook, CaptureProbs):
            if fresh and hook.requires_grad:
                _check_grad_mode()
            used = probs * hook.alpha if hook.alpha != 1.0 else probs
            if hook.requires_grad and not used.requires_grad:
                used.requires_grad_(True)
            if fresh:
                hook.sites.append(site)
                hook.probs.append(used)
                hook.valid.append(valid)
            dropout_p = 0.0
        out = torch.matmul(F.dropout(used, p=dropout_p) if dropout_p > 0 else used, v)
        return out, probs

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    return _zero_rows(out, keyless), None


def _zero_rows(x: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    return x if rows is None else x.masked_fill(rows, 0.0)
