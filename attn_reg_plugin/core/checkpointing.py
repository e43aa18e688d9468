"""Activation (gradient) checkpointing: what the regularizers need to know about it.

A checkpointed layer keeps no activations in its forward and runs its forward again inside
backward. Two consequences, handled here and in the kernel:

* the recompute must apply exactly the masks and score edits of the forward it replays,
  although the pass that set them has ended by then: :func:`begin_call` keeps each site's last
  forward call on the site and, in a recompute, repeats it;
* a *reentrant* checkpoint (``use_reentrant=True``, fairseq's ``--checkpoint-activations``)
  runs the layer's forward without autograd and refuses ``torch.autograd.grad``, so AD-DROP's
  attribution pass could not see inside it. That pass therefore runs with checkpointing paused
  (:func:`activation_checkpointing_paused`): its attributions are exact, and it holds the
  activations an input gradient needs (parameters are frozen for it) until the attribution
  is taken, before the checkpointed training forward starts.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from .block_rules import call_seed
from .controller import AttentionSite, CaptureOutput, CaptureProbs, EditScores, Hook, Replay, ResolvedEdit


def recomputing() -> bool:
    """True while autograd runs a backward: a layer forward then is an activation-checkpoint
    recompute (torch.utils.checkpoint, reentrant or not; HF gradient checkpointing; fairseq
    ``--checkpoint-activations``), which must repeat what the original forward did.

    False while torch.compile traces: a compiled region recomputes from its own graph, where
    the masks are inputs (the trainers refuse torch.compile together with checkpointing, where
    a region could be re-entered from Python)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def activation_checkpointing_paused(model: Optional[torch.nn.Module]) -> Iterator[None]:
    """Run ``model``'s checkpointed layers as ordinary layers for the duration of the block.

    Recognises the two conventions in use, by attribute (no framework import): a boolean
    ``gradient_checkpointing`` flag that the layer reads in its forward (transformers'
    ``GradientCheckpointingLayer`` and many custom models), and the ``precheckpoint_forward``
    that fairseq's ``checkpoint_wrapper`` keeps beside its checkpointed ``forward``.
    """
    if model is None:
        yield
        return
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
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


@dataclass(frozen=True)
class SiteCall:
    """What one attention call does, read once from its site when the call starts.

    ``hook``: None for ordinary attention; in a recompute, the recorded hook (an empty capture, or an
    edit without counters whose masks are in ``record``). ``fresh``: False in a recompute, which
    repeats ``record`` and neither captures nor counts.
    """

    hook: Optional[Hook] = None
    fresh: bool = True
    record: Optional[Replay] = None  # fresh: where this call's edit is kept (None while traced)
    site: Optional[AttentionSite] = None

    def block_seed(self) -> int:
        """The seed of a blockwise edit (:mod:`.blockwise`): drawn by a forward and kept, so that a
        recompute regenerates the same drops; a recompute draws too, discarding the draw, so that
        the random stream is left where the forward left it."""
        seed = call_seed()
        if not self.fresh and self.record is not None and self.record.seed is not None:
            return self.record.seed
        if self.record is not None:
            self.record.seed = seed
        return seed

    def edit(self, valid: torch.Tensor, shape: Tuple[int, int, int, int], device) -> ResolvedEdit:
        """The masks of an :class:`EditScores` call. A forward resolves them (its random draws made)
        and keeps them for the recompute; a recompute draws again, discarding the draw, so that it
        leaves the random stream where the forward left it (or the dropout after this attention
        would draw other masks), and applies the kept masks."""
        assert isinstance(self.hook, EditScores)
        if not self.fresh:
            if self.record.redraw is not None:
                self.record.redraw(valid.expand(shape))
            return self.record.edit
        edit = self.hook.resolve(valid, shape, device)
        if self.record is not None:
            self.record.edit = edit
        return edit


ORDINARY_CALL = SiteCall()


def begin_call(site: Optional[AttentionSite], recompute: bool) -> SiteCall:
    """What this call of ``site`` does: its hook in a forward, what its last forward call did in a
    recompute (``recompute``: :func:`recomputing`, evaluated by the caller).

    A forward keeps what it does on the site (``site.replay``) until the site's next forward call,
    so a checkpointed forward must be back-propagated before the same sites run another forward. A
    forward with no hook forgets the site's last edit (:func:`record_ordinary_call`).
    """
    if site is None:
        return ORDINARY_CALL
    if torch.compiler.is_compiling():
        # Traced: no record is kept (a Python object per call would be a guard per step), and
        # none is needed, since a compiled region recomputes from its own graph.
        return ORDINARY_CALL if site.hook is None else SiteCall(site.hook, site=site)
    if recompute:
        record = site.replay
        if record is None:
            return SiteCall(fresh=False, site=site)
        if record.calls > 1:
            raise RuntimeError(
                f"attention site {site} was called {record.calls} times in one regularized pass, and a "
                "checkpointed layer recomputed in backward cannot tell which call it repeats: register one "
                "site per call (or train without activation checkpointing)"
            )
        return SiteCall(record.hook, fresh=False, record=record, site=site)
    hook = site.hook
    if hook is None:
        site.replay = None
        return ORDINARY_CALL
    previous = site.replay
    calls = previous.calls + 1 if previous is not None and previous.owner() is hook else 1
    redraw = hook.drop if isinstance(hook, EditScores) and callable(hook.drop) else None
    site.replay = Replay(_emptied(hook), weakref.ref(hook), calls, redraw=redraw)
    return SiteCall(hook, record=site.replay, site=site)


def _emptied(hook: Hook) -> Hook:
    """A hook of ``hook``'s kind that holds nothing and counts nothing: what a recompute applies."""
    if isinstance(hook, CaptureOutput):
        return CaptureOutput()
    if isinstance(hook, CaptureProbs):
        return CaptureProbs(alpha=hook.alpha, requires_grad=hook.requires_grad, inputs_when_long=hook.inputs_when_long)
    return EditScores()


def is_ordinary_call(site: AttentionSite) -> bool:
    """Whether this call of ``site`` is ordinary attention, so an adapter may run its stock attention:
    in a forward, no hook is set; in a recompute, the forward it repeats was ordinary. No side effect:
    an adapter that takes its stock path then calls :func:`record_ordinary_call`."""
    if torch.compiler.is_compiling():
        return site.hook is None  # traced: no record (see begin_call)
    if recomputing():
        return site.replay is None
    return site.hook is None


def record_ordinary_call(site: AttentionSite) -> None:
    """Note that this forward call of ``site`` ran ordinary attention: the site forgets its last edit,
    so that a checkpoint recompute of this call repeats no older pass's edit. Nothing to do in a
    recompute (it repeats, it does not record) or while traced (no record is kept)."""
    if not torch.compiler.is_compiling() and not recomputing():
        site.replay = None
