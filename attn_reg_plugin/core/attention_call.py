"""What one attention call does, fixed before the kernel runs, and where what it captured goes.

:func:`call_of` reads a site once into an immutable :class:`AttentionCall`;
:func:`~attn_reg_plugin.core.attention.attention_kernel` computes from it alone and returns what it
captured and counted as a :class:`Captured`, which :func:`hand_over` gives to the pass. Only the
controller writes sites (:mod:`.controller`); nothing here or in the kernel does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .block_rules import AttentionScores
from .checkpointing import recomputing
from .controller import AttentionSite, CaptureOutput, CaptureProbs, EditScores, Hook, PassLedger, changes_output


@dataclass(frozen=True)
class AttentionCall:
    """What one call of the kernel does, fixed before it starts: the pass's ``hook`` for the site,
    whether the call is an activation-checkpoint ``recompute`` (the same drops, nothing captured or
    counted), and the site's ``seed`` for the pass, which keys every random drop decision."""

    hook: Optional[Hook] = None
    recompute: bool = False
    seed: Optional[int] = None
    ledger: Optional[PassLedger] = None  # the pass's counts (attend's, not the kernel's)


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


def call_of(site: Optional[AttentionSite]) -> AttentionCall:
    """What this call of ``site`` does: in a forward, the hook and seed of the pass set on it; in an
    activation-checkpoint recompute, the same, or after the pass ended (inside a training step) the
    hook and seed it ended with. Adapters ask it too: an ordinary call may take their stock path."""
    if site is None:
        return ORDINARY
    if torch.compiler.is_compiling():
        # Traced: a compiled region recomputes from its own graph and draws from torch's stream;
        # reading the per-pass seed would be a guard on its value, a recompile every step.
        return ORDINARY if site.hook is None else AttentionCall(site.hook)
    if site.hook is not None:
        return AttentionCall(site.hook, recomputing(), site.seed, site.ledger)
    if site.ended_pass is not None:
        if recomputing():
            hook, seed, ledger = site.ended_pass
            return AttentionCall(hook, True, seed, ledger)
        if checkpointed_forward():
            raise RuntimeError(
                f"attention site {site} ran an ordinary forward inside an activation checkpoint after a pass "
                "ended in the same training step: its recompute could not tell it from the pass's forwards. "
                "End the training step (`controller.training_step()`) before the next step's forward"
            )
    return ORDINARY


def checkpointed_forward() -> bool:
    """Whether this forward runs inside an activation checkpoint that will recompute it: a
    non-reentrant one (torch's saved-tensor hooks of a checkpoint; offloading hooks such as
    ``save_on_cpu`` are not one) or a reentrant one (without autograd, inside a ``CheckpointFunction``:
    torch's, fairseq's and DeepSpeed's are named so)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and "checkpoint" in getattr(hooks[0], "__qualname__", ""):
        return True
    if torch.is_grad_enabled():
        return False
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if getattr(code, "co_qualname", "").endswith("CheckpointFunction.forward") or (
            code.co_name == "forward" and "checkpoint" in code.co_filename.rsplit("/", 1)[-1]
        ):
            return True
        frame = frame.f_back
    return False


def hand_over(hook: Hook, site: AttentionSite, captured: Captured) -> None:
    """Give the pass what one call of ``site`` captured and counted: appended to a capture's lists
    in call order, added to an edit's counters."""
    if isinstance(hook, CaptureOutput):
        hook.sites.append(site)
        hook.outputs.append(captured.output)
        hook.values.append(captured.values)
        hook.valid.append(captured.valid)
        if hook.keeps_weights:
            hook.weights.append(captured.probs)
    elif isinstance(hook, CaptureProbs):
        hook.sites.append(site)
        hook.probs.append(captured.probs)
        hook.valid.append(captured.valid)
    elif isinstance(hook, EditScores):
        if hook.stats is not None and captured.dropped is not None:
            hook.stats[0] = hook.stats[0] + captured.dropped
            hook.stats[1] = hook.stats[1] + captured.droppable
        if hook.calls is not None and captured.uniform_call is not None:
            hook.calls[0] = hook.calls[0] + captured.uniform_call
            hook.calls[1] = hook.calls[1] + 1


def refuse_unrecomputable(site: AttentionSite) -> None:
    """Refuse a checkpointed regularized forward outside a training step: its pass may end before
    the backward that recomputes it, which would then run ordinary attention."""
    raise RuntimeError(
        f"attention site {site} ran a regularized forward inside an activation checkpoint outside a "
        "training step, so its pass may end before the backward that recomputes it: run the forward and "
        "its backward inside `with controller.training_step():` (the plugin's trainers do)"
    )


def count_for_the_pass(call: AttentionCall, site: AttentionSite) -> None:
    """A regularized call's part in its pass's ledger: a recompute, or a forward that a checkpoint will
    recompute (refused outside a training step, where the pass may end before its backward)."""
    if torch.compiler.is_compiling() or call.ledger is None:
        return
    if call.recompute:
        call.ledger.recomputed += 1
    elif changes_output(call.hook) and checkpointed_forward():
        if not site.through_backward:
            refuse_unrecomputable(site)
        call.ledger.checkpointed += 1
