"""HiddenCut for transformers' Trainer / Seq2SeqTrainer (``core.hiddencut``): the Trainer's own loss on a
clean pass and on a cut pass, plus alpha times the JS divergence of their output distributions.

    loss = loss(clean) + loss(cut) + alpha * JS

``loss`` is what the Trainer computes for the model (its CE, label smoothing included); JS is summed
over the positions the CE covers (every sample of a classifier, each label that is not -100 of a
token-level model, shifted for a causal LM) and divided by what the model's loss is divided by, as
R-Drop's KL (``hf.rdrop_trainer``). Evaluation and generation run one pass, unchanged.

Where the cut is: the feed-forward output of each selected transformer layer (the modules transformers
checkpoints, ``GradientCheckpointingLayer``; the encoder's for an encoder-decoder model), before the
residual, in place of the dropout there where the family has one, as the official code
(:mod:`.feed_forward_cut`). A layer where none is found has its output cut, residual included, with a
warning.

The span's start comes from the clean pass's attention maps (``output_attentions=True``), which
transformers returns only for eager attention: a model with another attention implementation is
refused at construction, naming the fix. Eager attention returns them after its attention dropout;
the official code's BERT ranks its ``ori_attention_probs``, the softmax before it, as the fairseq
criterion does. So the trainer switches the model's eager attention to
:func:`eager_maps_before_dropout`: the family's own eager attention, its weights taken without
dropout and the same dropout applied to the output (eager's outputs, to the bit). The cut pass's masks travel with its call as the layers' keyword
``hiddencut_plan`` (nothing is held between calls: evaluation and generation never cut). With gradient
checkpointing, transformers 5.x checkpoints a layer's ``forward`` with its keywords, so a recompute
holds the same plan and its feed-forward hook cuts the same tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import warnings
from typing import Any, Dict, Iterator, List

import torch
import transformers
from transformers.integrations.sdpa_attention import repeat_kv

from ..core.combinations import HIDDENCUT
from ..core.distributed import all_reduce_sum_
from ..core.hiddencut import (
    CutPlan,
    HiddenCutConfig,
    SpanCut,
    attention_received,
    hiddencut_objective,
    hiddencut_spans,
    js_consistency,
)
from ..core.options import named_by_field
from .attention import register_attention
from .combinations import check_trainer_combination, turns_on
from .feed_forward_cut import cut_feed_forward, feed_forward_output, hold_the_plan
from .rdrop_trainer import _logits, compared_positions, loss_divisor, refuse_data_parallel
from .sites import attention_configs

PLAN_KWARG = "hiddencut_plan"
# The clean pass's attention: the family's own eager attention, returning its weights before attention dropout.
MAPS_BEFORE_DROPOUT = "attn_reg_eager_maps_before_dropout"
# While the clean pass runs, the ids of the modules that called it (one that bypasses the interface makes no call).
_CALLERS_BEFORE_DROPOUT: contextvars.ContextVar = contextvars.ContextVar("hiddencut_callers", default=None)


def eager_maps_before_dropout(module, query, key, value, attention_mask, dropout: float = 0.0, **kwargs):
    """``AttentionInterface`` function: the module's family's ``eager_attention_forward`` run without
    dropout for its weights (the softmax HiddenCut ranks, as the official code's ``ori_attention_probs``),
    the output then made from them with the dropout eager would apply: the same draws, the same values.
    The first call on each module checks that eager's output is its weights times the values."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"HiddenCut: {type(module).__module__} has no eager_attention_forward to rank the maps of")
    out, weights = eager(module, query, key, value, attention_mask, dropout=0.0, **kwargs)
    callers = _CALLERS_BEFORE_DROPOUT.get()
    if callers is not None:
        callers.add(id(module))
    values = repeat_kv(value, query.shape[1] // value.shape[1])
    if not module.__dict__.get("attn_reg_eager_checked"):
        with torch.no_grad():  # nothing saved for a backward: a checkpoint's recompute saves the same tensors
            same = torch.allclose(torch.matmul(weights, values).transpose(1, 2), out, rtol=1e-3, atol=1e-5)
        if not same:
            raise ValueError(
                f"HiddenCut: {type(module).__name__}'s eager attention output is not its weights times the "
                "values, so its maps before dropout cannot be taken apart from it"
            )
        module.__dict__["attn_reg_eager_checked"] = True
    if dropout > 0.0 and module.training:
        dropped = torch.nn.functional.dropout(weights, p=dropout, training=True)
        out = torch.matmul(dropped, values).transpose(1, 2).contiguous()
    return out, weights


def use_maps_before_dropout(model) -> None:
    """Switch the model's eager attention to :func:`eager_maps_before_dropout` (its outputs unchanged).
    For good, not per pass: an activation checkpoint's recompute must run the very same function."""
    register_attention(MAPS_BEFORE_DROPOUT, eager_maps_before_dropout, "eager")
    if getattr(model.config, "reorder_and_upcast_attn", False):  # GPT-2 takes that path only under "eager"
        warnings.warn(
            f"HiddenCut: {type(model).__name__} has reorder_and_upcast_attn=True, whose attention runs only "
            "under attn_implementation='eager': its spans are ranked on the maps after attention dropout",
            stacklevel=3,
        )
        return
    for config in attention_configs(model).values():
        if config._attn_implementation == "eager":
            config._attn_implementation = MAPS_BEFORE_DROPOUT


@contextlib.contextmanager
def counting_maps_before_dropout(model, layers: Dict[int, torch.nn.Module]) -> Iterator[None]:
    """Warns, once per model, naming the ``layers`` ({index: layer} whose maps are ranked) none of whose
    modules called :func:`eager_maps_before_dropout` inside (attention that bypasses transformers'
    AttentionInterface): their maps are then those after dropout."""
    called: set = set()
    token = _CALLERS_BEFORE_DROPOUT.set(called)
    try:
        yield
    finally:
        _CALLERS_BEFORE_DROPOUT.reset(token)
    missed = [i for i, layer in layers.items() if not any(id(m) in called for m in layer.modules())]
    if missed and not model.__dict__.get("attn_reg_maps_warned"):
        model.__dict__["attn_reg_maps_warned"] = True
        warnings.warn(
            f"HiddenCut: the attention of layers {missed} of {type(model).__name__} does not go through "
            "transformers' AttentionInterface, so their spans are ranked on the attention maps after attention dropout",
            stacklevel=3,
        )


def hiddencut_layers(model) -> List[torch.nn.Module]:
    """The transformer layers whose outputs HiddenCut cuts, in order: the encoder's of an encoder-decoder
    model, else every ``GradientCheckpointingLayer``."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    base = model.get_encoder() if getattr(model.config, "is_encoder_decoder", False) else model
    return [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]


def _check_eager(model) -> None:
    impl = getattr(model.config, "_attn_implementation", "eager")
    if impl not in ("eager", MAPS_BEFORE_DROPOUT):
        raise ValueError(
            f"HiddenCut draws each span's start from the layer's attention map, which transformers returns "
            f"only with eager attention; this model uses {impl!r}: load it with attn_implementation='eager'"
        )


def _check_no_layerdrop(model, layers: List[torch.nn.Module]) -> None:
    """Refuses a model that skips its cut layers at random in training (LayerDrop): a skipped layer has
    no map in the clean pass, or takes no cut in the cut pass. Read where the forward reads it: the
    ``layerdrop`` of the module that runs the layers (BART, Whisper, OPT copy the config's value there),
    else the config's ``layerdrop`` (wav2vec2-style encoders read it in the forward)."""
    ids = {id(layer) for layer in layers}
    copies = [(path, module) for path, module in model.named_modules() if "layerdrop" in module.__dict__]
    for path, module in copies:
        value = module.layerdrop
        if isinstance(value, (int, float)) and value > 0 and any(id(m) in ids for m in module.modules()):
            _refuse_layerdrop(model, path or "model", value)
    value = getattr(model.config, "layerdrop", None)
    if not copies and isinstance(value, (int, float)) and value > 0:
        _refuse_layerdrop(model, "config", value)


def _refuse_layerdrop(model, holder: str, value) -> None:
    raise ValueError(
        f"HiddenCut ranks each selected layer's attention in the clean pass and cuts the layer in the cut pass, "
        f"but {type(model).__name__}'s {holder} skips its layers at random in training (LayerDrop, layerdrop={value}): "
        f"set its layerdrop to 0 ({holder}.layerdrop = 0, or load the model with its config's LayerDrop at 0, e.g. "
        "encoder_layerdrop=0)"
    )


def _check_all_cut(model, plan: CutPlan) -> None:
    """Refuses a cut pass that left a selected layer uncut: the model called it without the keyword
    arguments that carry the plan (transformers' families of docs/HF.md's table pass them on)."""
    missed = sorted(set(plan.masks) - plan.applied)
    if missed:
        raise ValueError(
            f"HiddenCut: the cut pass did not reach layers {missed} of {type(model).__name__}: the model calls "
            f"them without its keyword arguments, where the cut travels ({PLAN_KWARG!r}), so nothing was cut"
        )


class HiddenCutTrainerMixin:
    """Shared by :class:`HiddenCutTrainer` and :class:`HiddenCutSeq2SeqTrainer`."""

    attn_reg_regularizers = turns_on(HIDDENCUT, "hiddencut=HiddenCutConfig")

    def __init__(self, *args, hiddencut: HiddenCutConfig, **kwargs):
        if not isinstance(hiddencut, HiddenCutConfig):
            raise TypeError(f"hiddencut must be a HiddenCutConfig, got {type(hiddencut).__name__}")
        self.hiddencut = named_by_field(hiddencut).validate()
        check_trainer_combination(self, kwargs)
        self._hiddencut_reset()
        super().__init__(*args, **kwargs)
        layers = hiddencut_layers(self.model)
        if not layers:
            raise ValueError(f"HiddenCut: {type(self.model).__name__} has no transformer layer to cut")
        self._hiddencut_layers = self.hiddencut.selected_layers(len(layers))
        refuse_data_parallel(self, "HiddenCut")
        _check_eager(self.model)
        _check_no_layerdrop(self.model, [layers[index] for index in self._hiddencut_layers])
        use_maps_before_dropout(self.model)
        self._hiddencut_cut = SpanCut()
        hold_the_plan(self.model, layers, PLAN_KWARG)
        unfound = set()
        for index in self._hiddencut_layers:
            found = feed_forward_output(layers[index])
            if found is None:  # the layer's output instead, residual included
                self._hiddencut_cut.attach(layers[index], index, kwarg=PLAN_KWARG)
                unfound.add(type(layers[index]).__name__)
            else:
                self._hiddencut_cut.handles.append(cut_feed_forward(layers[index], index, found))
        if unfound:
            warnings.warn(
                f"HiddenCut: no feed-forward output found in {', '.join(sorted(unfound))}; the cut zeroes those "
                "layers' outputs (residual included), not the feed-forward output the paper cuts",
                stacklevel=2,
            )
        self._hiddencut_count = len(layers)
        self._hiddencut_ranked = {index: layers[index] for index in self._hiddencut_layers}

    def _hiddencut_reset(self) -> None:
        # sums since the last log, tensors once a step ran: no host sync per step
        self._hc_js: Any = 0.0
        self._hc_positions: Any = 0
        self._hc_cut: Any = 0
        self._hc_tokens: Any = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (model.training and torch.is_grad_enabled()):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        # copies: the Trainer's compute_loss may pop labels, and the caller's inputs are never changed
        with counting_maps_before_dropout(self.accelerator.unwrap_model(model), self._hiddencut_ranked):
            loss_clean, out_clean = super().compute_loss(
                model, {**inputs, "output_attentions": True}, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
        plan = CutPlan(self._hiddencut_masks(model, inputs, out_clean))
        loss_cut, out_cut = super().compute_loss(
            model, {**inputs, PLAN_KWARG: plan}, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        _check_all_cut(self.accelerator.unwrap_model(model), plan)
        first, second, labels, keep = compared_positions(
            self, model, inputs, _logits(out_clean), _logits(out_cut), "HiddenCut's JS"
        )
        js_sum, positions = js_consistency(first, second, keep)
        pair_loss = loss_clean + loss_cut
        divisor = loss_divisor(self, pair_loss, (first, second), labels, keep, positions, num_items_in_batch)
        loss = hiddencut_objective(loss_clean, loss_cut, js_sum / divisor, self.hiddencut.alpha)
        self._hc_js = self._hc_js + js_sum.detach()
        self._hc_positions = self._hc_positions + positions
        self._hc_cut = self._hc_cut + plan.cut
        self._hc_tokens = self._hc_tokens + plan.tokens
        return (loss, out_clean) if return_outputs else loss

    def _hiddencut_masks(self, model, inputs: Dict[str, Any], outputs) -> Dict[int, Any]:
        """{layer: (cut, valid)} from the clean pass's attention maps (no gradient reaches them)."""
        encoder_decoder = getattr(self.accelerator.unwrap_model(model).config, "is_encoder_decoder", False)
        maps = outputs.get("encoder_attentions" if encoder_decoder else "attentions")
        if not maps or len(maps) != self._hiddencut_count or any(m is None for m in maps):
            raise ValueError(
                f"HiddenCut needs one attention map per layer from the clean pass ({self._hiddencut_count} "
                f"layers), got {0 if not maps else len(maps)}: use attn_implementation='eager'"
            )
        batch, _, length, _ = maps[0].shape
        valid = inputs.get("attention_mask")
        valid = torch.ones(batch, length, dtype=torch.bool, device=maps[0].device) if valid is None else valid.bool()
        masks = {}
        for index in self._hiddencut_layers:
            received = attention_received(maps[index].detach(), valid)
            masks[index] = (hiddencut_spans(valid, received, self.hiddencut.ratio, self.hiddencut.top), valid)
        return masks

    def hiddencut_stats(self) -> Dict[str, float]:
        """Since the last log, over all processes: mean JS per position (nats), tokens cut, real tokens of
        the cut layers."""
        device = self.args.device
        sums = [self._hc_js, self._hc_positions, self._hc_cut, self._hc_tokens]
        js, positions, cut, tokens = all_reduce_sum_(
            torch.stack([torch.as_tensor(v, device=device) for v in sums]).double()
        ).tolist()
        return {"hiddencut_js": js / positions if positions else 0.0, "hiddencut_cut": cut, "hiddencut_tokens": tokens}

    def log(self, logs: Dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:  # a training log; every process logs at the same steps
            stats = self.hiddencut_stats()
            logs.update(hiddencut_js=round(stats["hiddencut_js"], 6), hiddencut_cut=int(stats["hiddencut_cut"]))
            logs["hiddencut_tokens"] = int(stats["hiddencut_tokens"])
            self._hiddencut_reset()
        return super().log(logs, *args, **kwargs)


class HiddenCutTrainer(HiddenCutTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with HiddenCut; extra keyword ``hiddencut: HiddenCutConfig``."""


class HiddenCutSeq2SeqTrainer(HiddenCutTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with HiddenCut; extra keyword ``hiddencut: HiddenCutConfig``."""
