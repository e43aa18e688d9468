"""Where HiddenCut's cut lands in a transformers layer: its feed-forward output, before the residual.

The official code (SALT-NLP/HiddenCut, ``BertOutput.forward``) cuts the feed-forward block's output in
place of the dropout that follows it: the cut pass zeroes the span there and applies no dropout at that
point, then adds the residual and normalizes. :func:`feed_forward_output` finds that point in a
family's layer from its structure:

* a dropout module applied last to the feed-forward output (BERT-family ``output.dropout``, DistilBERT
  ``ffn.dropout``, GPT-2 ``mlp.dropout``, T5 ``layer[-1].dropout``): the cut replaces it, as officially;
* a feed-forward module followed by the residual (Llama-family ``mlp``, ModernBERT ``mlp``), or by a
  functional dropout (BART-family ``fc2``): its output is cut, and the functional dropout after it
  (which no hook reaches) still applies to the tokens left.

A layer whose feed-forward output is none of these gets None: the trainer then cuts the layer's output
and says so.

The cut pass's plan is a keyword of the layer's call, which transformers hands to the attention but
not to the feed-forward modules. So the layer's forward (the function gradient checkpointing runs
again in the backward, with the same keywords) holds it in a context variable while it runs
(:func:`hold_the_plan`), and the feed-forward hook reads it there: nothing outlives the call. A block
run in chunks of the sequence (``chunk_size_feed_forward``) is cut chunk by chunk.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Optional, Tuple

import torch

_LAYER_CALL: contextvars.ContextVar = contextvars.ContextVar("hiddencut_layer_call", default=None)


def _children(module: torch.nn.Module) -> set:
    return {name for name, _ in module.named_children()}


def feed_forward_output(layer: torch.nn.Module) -> Optional[Tuple[torch.nn.Module, bool]]:
    """(module, whether the cut replaces it) at the layer's feed-forward output before the residual: a
    dropout module the cut replaces, or a module whose output is cut; None when not recognized."""
    names = _children(layer)
    output, mlp, ffn = (getattr(layer, n, None) if n in names else None for n in ("output", "mlp", "ffn"))
    if output is not None and {"dense", "dropout", "LayerNorm"} <= _children(output):  # BERT-family
        return output.dropout, True
    if ffn is not None and {"lin2", "dropout"} <= _children(ffn):  # DistilBERT
        return ffn.dropout, True
    if mlp is not None:  # GPT-2's ends in its dropout; Llama's and ModernBERT's go to the residual
        return (mlp.dropout, True) if {"c_proj", "dropout"} <= _children(mlp) else (mlp, False)
    blocks = getattr(layer, "layer", None) if "layer" in names else None
    if isinstance(blocks, torch.nn.ModuleList) and {"DenseReluDense", "dropout"} <= _children(blocks[-1]):  # T5
        return blocks[-1].dropout, True
    if "fc2" in names:  # BART-family: a functional dropout, then the residual
        return layer.fc2, False
    return None


class _LayerCall:
    """The plan of one layer call and which positions the feed-forward hook cut last: a family that runs
    the block in chunks of the sequence (``chunk_size_feed_forward``) calls the hooked module once per
    chunk, in order, each on an input of its own; hooks left by an earlier trainer on the same module
    see the same input, and cut the same positions again (zeroing twice changes nothing)."""

    def __init__(self, plan) -> None:
        self.plan, self.last_input, self.positions = plan, None, slice(0, 0)

    def positions_of(self, module_input: torch.Tensor, length: int) -> slice:
        if module_input is not self.last_input:
            self.last_input, self.positions = module_input, slice(self.positions.stop, self.positions.stop + length)
        return self.positions


def hold_the_plan(model: torch.nn.Module, layers, kwarg: str) -> None:
    """Make each layer's forward hold its call's ``kwarg`` (the cut pass's plan, or None) in a context
    variable while it runs. Every module of the model whose class is a layer's gets one subclass of that
    class (its name kept): transformers checkpoints that forward, so a recompute holds the same plan,
    and wrapping by class name (FSDP's auto-wrap policy) still finds every layer of it."""
    for base in {type(layer) for layer in layers}:
        holding = _holding_class(base, kwarg)
        for module in model.modules():
            if type(module) is base:
                module.__class__ = holding


@functools.cache
def _holding_class(base: type, kwarg: str) -> type:
    if getattr(base, "attn_reg_holds_plan", False):
        return base

    def forward(self, *args, **kwargs):
        token = _LAYER_CALL.set(_LayerCall(kwargs.get(kwarg)))
        try:
            return super(holding, self).forward(*args, **kwargs)
        finally:
            _LAYER_CALL.reset(token)

    namespace = {"forward": forward, "attn_reg_holds_plan": True, "__module__": base.__module__}
    holding = type(base.__name__, (base,), {**namespace, "__qualname__": base.__qualname__})
    return holding


def cut_feed_forward(module: torch.nn.Module, key: Any, replaces: bool) -> Any:
    """Hook ``module`` (found by :func:`feed_forward_output`) to cut layer ``key``'s tokens as the plan
    its layer holds says; returns the hook's handle."""

    def hook(mod, args, output):
        call = _LAYER_CALL.get()
        if call is None or call.plan is None:
            return None
        cut = args[0] if replaces else output  # a mixture of experts' block may return (hidden, router scores)
        hidden = cut[0] if isinstance(cut, tuple) else cut
        return call.plan.apply(key, cut, positions=call.positions_of(args[0], hidden.shape[1]))

    return module.register_forward_hook(hook)
