"""Attribution of attention maps for AD-DROP: targets and the GA / IGA / AA / RD methods.

A *target* turns a model output into the scalar F whose gradient with respect to every
selected attention map is the attribution (paper Eq. 2/5). Each target returns the labels
it used, so integrated gradients can keep pass-1 pseudo labels fixed across its steps.
All targets are computed in float32: fp16 logits would round small per-token terms away.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.profiler import record_function

ATTRIBUTIONS = ("ga", "iga", "aa", "rd")
LABEL_SOURCES = ("pseudo", "gold")


def logit_target(logits: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Classifier: F = sum over the batch of the logit of ``labels`` (pass-1 argmax if None).

    logits: (B, C). Samples are independent, so the sum's gradient is each sample's own.
    """
    logits = logits.float()
    if labels is None:
        labels = logits.detach().argmax(dim=-1)
    return logits.gather(-1, labels.long().unsqueeze(-1)).sum(), labels


def token_loss_target(
    logits: torch.Tensor, keep: torch.Tensor, labels: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-level tasks: F = minus the cross-entropy against ``labels`` over kept tokens.

    logits: (B, T, V); keep: (B, T) bool, False for padding and ignored tokens.
    ``labels`` None -> pass-1 argmax (pseudo labels). Ignored positions contribute nothing.
    """
    logits = logits.float()
    if labels is None:
        labels = logits.detach().argmax(dim=-1)
    safe = labels.long().masked_fill(~keep, 0)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), safe.reshape(-1), reduction="none")
    return -(nll * keep.reshape(-1).to(nll.dtype)).sum(), labels


def multi_label_target(
    logits: torch.Tensor, labels: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Multi-label classifier: F = minus the summed binary cross-entropy against ``labels``.

    logits: (B, C); labels: (B, C) multi-hot, or None -> pass-1 pseudo labels (logit > 0, i.e.
    sigmoid > 0.5). The negative loss rather than the sum of the positive labels' logits: a
    sample with no positive label still has a target, and every label's evidence counts.
    """
    logits = logits.float()
    if labels is None:
        labels = (logits.detach() > 0).float()
    return -F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="sum"), labels


def regression_target(prediction: torch.Tensor, gold: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Regression: F = minus the squared error against the gold targets (no pseudo label exists)."""
    prediction = prediction.float().reshape(gold.shape)
    return -((prediction - gold.float()) ** 2).sum(), gold


class GradientScale:
    """Power-of-two scaling of fp16 attribution backwards (the loss-scaling idea, for autograd.grad).

    fp16 flushes magnitudes below 6e-8 to zero. Gradients of the target with respect to
    attention outputs are often that small (small initialisation, deep or well-trained
    models), and whole rows of attributions then tie at 0 and lose their ranking. The target
    is multiplied by ``scale`` before ``autograd.grad`` and the gradients are divided by it
    after conversion to float32. A power of two is exact in floating point and the candidate
    region only compares values within a row, so scaling changes nothing but which small
    values survive. As with mixed-precision training's loss scaler, the scale is the largest
    that does not overflow: it starts at 2**16, is halved and the backward retried (the graph
    is kept for that) when a gradient is inf/nan, and is doubled after ``growth_interval``
    clean calls. Only fp16 inputs are scaled: bf16 has float32's range.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 100, min_scale: float = 2.0**-24):
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_calls = 0

    def grad(self, target: torch.Tensor, inputs: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """float32 dF/d(input) for every input (None where the target does not depend on it)."""
        if not any(t.dtype == torch.float16 for t in inputs):
            return _float_grads(target, inputs)
        if not bool(torch.isfinite(target)):
            # The forward overflowed (fp16 training skips such a step): no ranking survives,
            # zeros keep the masks valid, and the scale is not to blame.
            return [
                None if g is None else torch.zeros_like(g, dtype=torch.float32)
                for g in torch.autograd.grad(target, inputs, allow_unused=True)
            ]
        start = self.scale
        while True:
            scale = self.scale
            grads = torch.autograd.grad(target * scale, inputs, allow_unused=True, retain_graph=True)
            present = [g for g in grads if g is not None]
            finite = not present or bool(torch.stack([torch.isfinite(g).all() for g in present]).all())
            if finite or scale <= self.min_scale:
                break
            self.scale = scale / 2
            self.clean_calls = 0
        if finite:
            self.clean_calls += 1
            if self.clean_calls % self.growth_interval == 0:
                self.scale = scale * 2
        else:  # not finite even at min_scale: an overflow inside the graph, not the scale's doing
            self.scale = start
        return [None if g is None else (g.float() / scale).nan_to_num(0.0, posinf=0.0, neginf=0.0) for g in grads]


def _float_grads(target: torch.Tensor, inputs: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    grads = torch.autograd.grad(target, inputs, allow_unused=True)
    return [None if g is None else g.float() for g in grads]


def output_gradients(
    target: torch.Tensor, outputs: List[torch.Tensor], scale: Optional[GradientScale] = None
) -> List[torch.Tensor]:
    """float32 dF/dO for every captured layer from ONE autograd call (zeros where F does not depend
    on it). Only the captured outputs are asked for, so no parameter gradient is computed or touched.
    ``scale`` keeps fp16 gradients from flushing to zero (:class:`GradientScale`); None: unscaled."""
    with record_function("ad_drop::attribution_gradient"):
        grads = scale.grad(target, outputs) if scale is not None else _float_grads(target, outputs)
    # None: the layer does not influence the target (e.g. cut off by a mask)
    return [torch.zeros_like(o, dtype=torch.float32) if g is None else g for g, o in zip(grads, outputs)]


def probs_gradient(
    target: torch.Tensor, probs: List[torch.Tensor], scale: Optional[GradientScale] = None
) -> List[torch.Tensor]:
    """dF/dA for every captured (explicit) attention map, again from one autograd call."""
    with record_function("ad_drop::attribution_gradient"):
        grads = scale.grad(target, probs) if scale is not None else _float_grads(target, probs)
    return [torch.zeros_like(p, dtype=torch.float32) if g is None else g for g, p in zip(grads, probs)]
