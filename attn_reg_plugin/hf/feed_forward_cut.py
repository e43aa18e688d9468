"""Where HiddenCut's cut lands in a transformers layer: its feed-forward output, before the residual.

The official code (SALT-NLP/HiddenCut, ``BertOutput.forward``) cuts the feed-forward block's output in
place of the dropout that follows it: the cut pass zeroes the span there and applies no dropout at that
point, then adds the residual and normalizes. :func:`feed_forward_output` finds that point in a
family's layer from its structure:

* a dropout module applied last to the feed-forward output (BERT-family ``output.dropout``, DistilBERT
  ``ffn.dropout``, GPT-2 ``mlp.dropout``, T5 ``layer[-1].dropout``): the cut replaces it, as officially;
* a feed-forward module followed by the residual (Llama-family ``mlp``, ModernBERT ``mlp``): its output
  is cut;
* a feed-forward module followed by a functional dropout (BART-family ``fc2``): its output is cut, and
  that dropout call, which no module hook reaches, returns its input (a torch function mode held by the
  layer's call while the cut pass runs), so the cut replaces it there too.

A layer whose feed-forward output is none of these gets None: the trainer then cuts the layer's output
and says so.

The cut pass's plan is a keyword of the layer's call, which transformers hands to the attention but
not to the feed-forward modules. So the layer's forward (the function gradient checkpointing runs
again in the backward, with the same keywords) holds it in a context variable while it runs
(:func:`hold_the_plan`), and the feed-forward hook reads it there: nothing outlives the call. A block
run in chunks of the sequence (``chunk_size_feed_forward``) is cut chunk by chunk.
"""

from __future__ import annotations

import contextlib
import contextvars
import copyreg
import functools
from typing import Any, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

_DROPOUT = torch.nn.functional.dropout  # what a functional dropout call dispatches as
_LAYER_CALL: contextvars.ContextVar = contextvars.ContextVar("hiddencut_layer_call", default=None)


def _children(module: torch.nn.Module) -> set:
    return {name for name, _ in module.named_children()}


# How the cut lands on the module feed_forward_output finds.
REPLACES_IT = "replaces it"  # a dropout module: its input, cut, is its output
CUTS_ITS_OUTPUT = "cuts its output"
REPLACES_THE_NEXT_DROPOUT = "cuts its output, and replaces the functional dropout after it"


def feed_forward_output(layer: torch.nn.Module) -> Optional[Tuple[torch.nn.Module, str]]:
    """(module, how the cut lands on it) at the layer's feed-forward output before the residual; None
    when not recognized."""
    names = _children(layer)
    output, mlp, ffn = (getattr(layer, n, None) if n in names else None for n in ("output", "mlp", "ffn"))
    if output is not None and {"dense", "dropout", "LayerNorm"} <= _children(output):  # BERT-family
        return output.dropout, REPLACES_IT
    if ffn is not None and {"lin2", "dropout"} <= _children(ffn):  # DistilBERT
        return ffn.dropout, REPLACES_IT
    if mlp is not None:  # GPT-2's ends in its dropout; Llama's and ModernBERT's go to the residual
        return (mlp.dropout, REPLACES_IT) if {"c_proj", "dropout"} <= _children(mlp) else (mlp, CUTS_ITS_OUTPUT)
    blocks = getattr(layer, "layer", None) if "layer" in names else None
    if isinstance(blocks, torch.nn.ModuleList) and {"DenseReluDense", "dropout"} <= _children(blocks[-1]):  # T5
        return blocks[-1].dropout, REPLACES_IT
    if "fc2" in names:  # BART-family: a functional dropout, then the residual
        return layer.fc2, REPLACES_THE_NEXT_DROPOUT
    return None


class _LayerCall:
    """The plan of one layer call and which positions the feed-forward hook cut last: a family that runs
    the block in chunks of the sequence (``chunk_size_feed_forward``) calls the hooked module once per
    chunk, in order, each on an input of its own; hooks left by an earlier trainer on the same module
    see the same input, and cut the same positions again (zeroing twice changes nothing)."""

    def __init__(self, plan) -> None:
        self.plan, self.last_input, self.positions = plan, None, slice(0, 0)
        self.dropout_replaced = False  # set by the cut of a block a functional dropout follows

    def positions_of(self, module_input: torch.Tensor, length: int) -> slice:
        if module_input is not self.last_input:
            self.last_input, self.positions = module_input, slice(self.positions.stop, self.positions.stop + length)
        return self.positions


class _CutReplacesFunctionalDropout(TorchFunctionMode):
    """The first ``F.dropout`` after a cut that replaces it returns its input (no draw)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        call = _LAYER_CALL.get()
        if func is _DROPOUT and call is not None and call.dropout_replaced:
            call.dropout_replaced = False
            return args[0]
        return func(*args, **(kwargs or {}))


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
        call = _LayerCall(kwargs.get(kwarg))
        token = _LAYER_CALL.set(call)
        replacing = call.plan is not None and getattr(self, "attn_reg_cut_replaces_functional_dropout", False)
        try:
            with _CutReplacesFunctionalDropout() if replacing else contextlib.nullcontext():
                return super(holding, self).forward(*args, **kwargs)
        finally:
            _LAYER_CALL.reset(token)

    def __reduce_ex__(self, protocol):
        # Made at run time, the subclass has no importable name, so pickle (torch.save, multiprocessing)
        # could not find it: pickled or copied, a layer is its model's own class again (holding no plan,
        # so never cut); a HiddenCut trainer built on the copy makes it hold the plan again.
        return (copyreg._reconstructor, (base, object, None), *super(holding, self).__reduce_ex__(protocol)[2:])

    namespace = {"forward": forward, "__reduce_ex__": __reduce_ex__, "attn_reg_holds_plan": True}
    namespace["__module__"] = base.__module__
    holding = type(base.__name__, (base,), {**namespace, "__qualname__": base.__qualname__})
    return holding


def cut_feed_forward(layer: torch.nn.Module, key: Any, found: Tuple[torch.nn.Module, str]) -> Any:
    """Hook the module :func:`feed_forward_output` ``found`` in ``layer`` to cut layer ``key``'s tokens
    as the plan its layer holds says; returns the hook's handle."""
    module, how = found
    if how == REPLACES_THE_NEXT_DROPOUT:
        layer.attn_reg_cut_replaces_functional_dropout = True  # read by the layer's forward (hold_the_plan)
    return module.register_forward_hook(_CutHook(key, how))


class _CutHook:
    """The forward hook of a layer's feed-forward output: cuts layer ``key``'s tokens as the plan its
    layer holds says. A class at module level, not a closure, so a hooked model still pickles."""

    def __init__(self, key: Any, how: str) -> None:
        self.key, self.how = key, how

    def __call__(self, mod, args, output):
        call = _LAYER_CALL.get()
        if call is None or call.plan is None or not call.plan.cuts(self.key):
            return None
        cut = args[0] if self.how == REPLACES_IT else output
        hidden = cut[0] if isinstance(cut, tuple) else cut  # a mixture of experts' (hidden, router scores)
        out = call.plan.apply(self.key, cut, positions=call.positions_of(args[0], hidden.shape[1]))
        call.dropout_replaced = self.how == REPLACES_THE_NEXT_DROPOUT
        return out
