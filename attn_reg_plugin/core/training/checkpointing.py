"""Activation (gradient) checkpointing: what the regularizers need to know about it.

A checkpointed layer keeps no activations in its forward and runs its forward again inside
backward. Two consequences, handled here and in the kernel:

* the recompute must apply exactly the masks and score edits of the forward it repeats, although
  the pass may have ended. The checkpointed call carries the pass (a
  :class:`~..kernel.attention_call.Plan`: transformers' model kwargs, fairseq's wrapped layers,
  :meth:`~..kernel.controller.RegularizationController.checkpoint`), and the same hook and seed give the
  same drops (a hook set by hand outside a pass draws its call's seed from torch's stream, which
  the checkpoint restores): nothing of a call is recorded, and no step scope is needed;
* a *reentrant* checkpoint (``use_reentrant=True``, fairseq's ``--checkpoint-activations``)
  runs the layer's forward without autograd and refuses ``torch.autograd.grad``, so AD-DROP's
  attribution pass could not see inside it. That pass therefore runs with such checkpointing
  paused (:func:`activation_checkpointing_paused`; a custom model's
  :meth:`~..kernel.controller.RegularizationController.checkpoint` pauses itself): its attributions are exact, and it holds the
  activations an input gradient needs (parameters are frozen for it) until the attribution
  is taken, before the checkpointed training forward starts. A non-reentrant checkpoint
  (transformers' default) is left on: ``autograd.grad`` recomputes its layers inside the pass,
  which then holds no more activations than the checkpointed training step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


def _non_reentrant(module: torch.nn.Module) -> bool:
    """Whether a flagged layer checkpoints with torch's non-reentrant checkpoint, as transformers'
    ``GradientCheckpointingLayer`` does by default (its function: a partial with use_reentrant=False)."""
    function = getattr(module, "_gradient_checkpointing_func", None)
    return getattr(function, "keywords", {}).get("use_reentrant") is False


@contextlib.contextmanager
def activation_checkpointing_paused(model: Optional[torch.nn.Module]) -> Iterator[None]:
    """Run ``model``'s checkpointed layers as ordinary layers for the duration of the block.

    Recognises the two conventions in use, by attribute (no framework import): a boolean
    ``gradient_checkpointing`` flag that the layer reads in its forward (transformers'
    ``GradientCheckpointingLayer`` and many custom models), and the ``precheckpoint_forward``
    that fairseq's ``checkpoint_wrapper`` keeps beside its checkpointed ``forward``. A flagged layer
    whose checkpoint is known to be non-reentrant keeps it (:func:`_non_reentrant`).
    """
    if model is None:
        yield
        return
    flagged = [
        m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True and not _non_reentrant(m)
    ]
    wrapped = [m for m in model.modules() if "precheckpoint_forward" in vars(m) and "forward" in vars(m)]
    forwards = [m.forward for m in wrapped]
    try:
        for m in flagged:
            m.gradient_checkpointing = False
        for m in wrapped:
            m.forward = m.precheckpoint_forward
        yield
    finally:
        for m in flagged:
            m.gradient_checkpointing = True
        for m, forward in zip(wrapped, forwards):
            m.forward = forward
