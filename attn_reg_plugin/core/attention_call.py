"""What one attention call does, fixed before the kernel runs, and where what it captured goes.

:func:`call_of` reads the call's site, or the :class:`~.controller.Plan` the call carried, once into
an immutable :class:`AttentionCall`;
:func:`~attn_reg_plugin.core.attention.attention_kernel` computes from it alone and returns what it
captured and counted as a :class:`Captured`, which :func:`~.attention.attend` adds to the pass's record. Only the
controller writes sites (:mod:`.controller`); nothing here or in the kernel does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from .block_rules import AttentionScores
from .checkpointing import recomputing
from .controller import AttentionSite, Hook
from .passes import Plan


@dataclass(frozen=True)
class AttentionCall:
    """What one call of the kernel does, fixed before it starts: the pass's ``hook`` for the site,
    whether the call is an activation-checkpoint ``recompute`` (the same drops, nothing captured or
    counted), and the site's ``seed`` for the pass, which keys every random drop decision."""

    hook: Optional[Hook] = None
    recompute: bool = False
    seed: Optional[torch.Tensor] = None


ORDINARY = AttentionCall()


@dataclass(frozen=True)
class Captured:
    """What a call hands back to its pass besides its output: GA's ``output`` (the leaf of the
    attribution) and ``values``; AA's or IGA's ``probs`` (a map, or for a long map the
    :class:`AttentionScores` it is recomputed from); the keys' ``valid``ity; an edit's ``dropped`` /
    ``droppable`` counts and ``uniform_call`` (1 when its rows-made-uniform flag was set)."""

    output: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    probs: Optional[Union[torch.Tensor, AttentionScores]] = None
    valid: Optional[torch.Tensor] = None
    dropped: Optional[torch.Tensor] = None
    droppable: Optional[torch.Tensor] = None
    uniform_call: Optional[torch.Tensor] = None


def call_of(site: Optional[AttentionSite], plan: Optional[Plan] = None) -> AttentionCall:
    """What this call of ``site`` does: the hook and seed of the pass, read from the ``plan`` the call
    carried (transformers' model kwargs; a checkpointed layer's arguments, also in its recompute), or
    else from the site's slot. Adapters ask it too: an ordinary call may take their stock path."""
    if site is None:
        return ORDINARY
    if torch.compiler.is_compiling():
        # Traced: a compiled region recomputes from its own graph; the seed, a tensor, is an input
        # of that graph (no guard on its value, so a new pass compiles nothing).
        return ORDINARY if site.hook is None else AttentionCall(site.hook, False, site.seed)
    hook, seed = plan.calls.get(site, (None, None)) if plan is not None else (site.hook, site.seed)
    if hook is None:
        return ORDINARY
    return AttentionCall(hook, recomputing(), seed)
