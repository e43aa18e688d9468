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

from .attention import CaptureOutput, CaptureProbs

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


def regression_target(prediction: torch.Tensor, gold: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Regression: F = minus the squared error against the gold targets (no pseudo label exists)."""
    prediction = prediction.float().reshape(gold.shape)
    return -((prediction - gold.float()) ** 2).sum(), gold


def gradient_attribution(target: torch.Tensor, capture: CaptureOutput) -> List[torch.Tensor]:
    """dF/dA for every captured layer from ONE autograd call: (dF/dO) V^T.

    Only the captured outputs are asked for, so no parameter gradient is computed or touched.
    """
    with record_function("ad_drop::attribution_gradient"):
        grads = torch.autograd.grad(target, capture.outputs, allow_unused=True)
    out = []
    for g, o, v in zip(grads, capture.outputs, capture.values):
        if g is None:  # the layer does not influence the target (e.g. cut off by a mask)
            g = torch.zeros_like(o)
        out.append(torch.matmul(g.float(), v.float().transpose(-2, -1)))
    return out


def probs_gradient(target: torch.Tensor, capture: CaptureProbs) -> List[torch.Tensor]:
    """dF/dA for every captured (explicit) attention map, again from one autograd call."""
    with record_function("ad_drop::attribution_gradient"):
        grads = torch.autograd.grad(target, capture.probs, allow_unused=True)
    return [torch.zeros_like(p, dtype=torch.float32) if g is None else g.float() for g, p in zip(grads, capture.probs)]
