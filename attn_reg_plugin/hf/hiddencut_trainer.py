"""HiddenCut for transformers' Trainer / Seq2SeqTrainer (``core.hiddencut``): the Trainer's own loss on a
clean pass and on a cut pass, plus alpha times the JS divergence of their output distributions.

    loss = loss(clean) + loss(cut) + alpha * JS

``loss`` is what the Trainer computes for the model (its CE, label smoothing included); JS is summed
over the positions the CE covers and divided by what the model's loss is divided by, as R-Drop's KL
(:mod:`.own_passes_trainer`). The step is ``core.hiddencut.hiddencut_step``; this module builds where
it ranks and cuts (:class:`TrainerCutSites`). Evaluation and generation run one pass, unchanged.

Where the cut is: the feed-forward output of each selected transformer layer (the modules transformers
checkpoints, ``GradientCheckpointingLayer``; the encoder's for an encoder-decoder model), before the
residual, in place of the dropout there where the family has one, as the official code
(:mod:`.feed_forward_cut`). A layer where none is found has its output cut, residual included, with a
warning.

The span's start comes from the clean pass's attention: what each real token receives, the softmax
before attention dropout (the official code's BERT ranks its ``ori_attention_probs``, as the fairseq
criterion does) averaged over heads and real queries. It is made inside the model's own attention
call, one block of query rows at a time without gradient (``core.hiddencut.attention_received_by_blocks``),
so no (T, T) map is held or returned: the trainer switches the model's "eager" or "sdpa" attention to a
twin that runs it unchanged (the same outputs and dropout draws, to the bit) and, in the clean pass,
records the ranking that travels as the keyword ``hiddencut_ranking``. Other attention implementations
are refused at construction, naming the fix. The cut pass's masks travel with its call as the layers'
keyword ``hiddencut_plan`` (nothing is held between calls: evaluation and generation never cut). With
gradient checkpointing, transformers 5.x checkpoints a layer's ``forward`` with its keywords, so a
recompute holds the same plan and its feed-forward hook cuts the same tokens; the clean pass's ranking
is closed by then, so its recompute ranks nothing again.
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
import transformers

from ..core.regularizers.combinations import HIDDENCUT
from ..core.regularizers.hiddencut import CutPlan, HiddenCutConfig, SpanCut, attention_received_by_blocks
from ..core.regularizers.options import named_by_field
from .attention import register_attention
from .combinations import check_trainer_combination, turns_on
from .feed_forward_cut import cut_feed_forward, feed_forward_output, hold_the_plan
from .own_passes_trainer import OwnPassesTrainerMixin, refuse_data_parallel
from .sites import attention_configs

PLAN_KWARG = "hiddencut_plan"
# The clean pass's Ranking travels as this keyword of the model's call, down to its attention calls.
RANKING_KWARG = "hiddencut_ranking"
RANKED = {"eager": "attn_reg_hiddencut_eager", "sdpa": "attn_reg_hiddencut_sdpa"}  # implementation -> its ranked twin


class Ranking:
    """The clean pass's attention received per selected layer (``core.hiddencut.attention_received_by_blocks``),
    recorded by the layers' attention calls: ``layers`` {index: layer}, ``valid`` (B, T) the real tokens
    (None without an attention_mask: every position of the first ranked call, a vision model's patches too).
    The first call of each layer counts; once :meth:`close` is called (the masks are made), nothing is
    recorded, so an activation checkpoint's recompute of the clean pass adds no work."""

    def __init__(
        self,
        layers: Dict[int, torch.nn.Module],
        valid: Optional[torch.Tensor],
        model_name: Callable[[], str] = lambda: "the model",
    ) -> None:
        self.order = list(layers)
        self.model_name = model_name  # called only for an error: no unwrap on every step
        self.index = {id(m): i for i, layer in layers.items() for m in layer.modules()}
        self.valid = valid
        self.received: Dict[int, torch.Tensor] = {}
        self.open = True

    def record(self, module, query, key, attention_mask, kwargs, eager: bool) -> None:
        index = self.index.get(id(module))
        if not self.open or index is None or index in self.received or key.shape[2] != query.shape[2]:
            return  # closed, not a ranked layer, its first call already counted, or not a self-attention
        if self.valid is None:
            self.valid = torch.ones(query.shape[0], query.shape[2], dtype=torch.bool, device=query.device)
        if tuple(self.valid.shape) != (query.shape[0], query.shape[2]):
            raise ValueError(
                f"HiddenCut: layer {index}'s attention covers {query.shape[2]} positions of {query.shape[0]} "
                f"sequences, the batch's attention_mask {tuple(self.valid.shape)}: the cut needs one real-token "
                "mask per position of the layers it ranks"
            )
        mask = attention_mask
        if kwargs.get("position_bias") is not None:  # T5-style relative bias, added to the scores
            # Detached: with the gradient, a masked_fill here would save the mask for a backward in the
            # forward only, and a checkpoint's recompute (which ranks nothing) saves fewer tensors.
            bias = kwargs["position_bias"].detach()
            mask = (
                bias
                if mask is None
                else (bias + mask if mask.dtype != torch.bool else bias.masked_fill(~mask, -math.inf))
            )
        # sdpa without a mask is causal where the module is (transformers' sdpa_attention_forward); eager never is
        causal = (
            not eager
            and attention_mask is None
            and query.shape[2] > 1
            and bool(
                kwargs.get("is_causal") if kwargs.get("is_causal") is not None else getattr(module, "is_causal", True)
            )
        )
        self.received[index] = attention_received_by_blocks(
            query, key, self.valid, kwargs.get("scaling"), mask, causal, kwargs.get("softcap")
        )

    def close(self) -> Dict[int, torch.Tensor]:
        self.open = False
        return self.received

    @property
    def extra(self) -> Dict[str, Any]:
        """The model call's keyword that carries this ranking to the attention calls."""
        return {RANKING_KWARG: self}

    def ranked(self) -> Dict[int, tuple]:
        """{layer: (received, valid)} of every selected layer, in their order (``core.hiddencut.Ranking``);
        closes the ranking (no gradient reaches it). Refused when a layer made no ranked call."""
        received = self.close()
        missed = sorted(set(self.order) - set(received))
        if missed:
            raise ValueError(
                f"HiddenCut: layers {missed} of {self.model_name()} made no attention call through transformers' "
                f"AttentionInterface with the model's keyword arguments in the clean pass ({RANKING_KWARG!r} "
                "travels there), so their attention cannot be ranked"
            )
        return {index: (received[index], self.valid) for index in self.order}


def _ranked(implementation: str):
    """The ``AttentionInterface`` function that runs ``implementation`` ("eager": the module's family's own;
    "sdpa": transformers') unchanged, and in the clean pass records what each layer's keys receive."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        ranking = kwargs.pop(RANKING_KWARG, None)
        if implementation == "eager":
            inner = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if inner is None:
                raise ValueError(f"HiddenCut: {type(module).__module__} has no eager_attention_forward")
        else:
            inner = sdpa_attention_forward
        out = inner(module, query, key, value, attention_mask, **kwargs)
        if ranking is not None:
            ranking.record(module, query, key, attention_mask, kwargs, implementation == "eager")
        return out

    attention.__name__ = RANKED[implementation]
    return attention


def rank_in_the_attention(model) -> None:
    """Switch the model's "eager" or "sdpa" attention to its ranked twin (outputs unchanged; see
    :func:`_ranked`). For good, not per pass: an activation checkpoint's recompute runs the same function.
    Another implementation is refused, naming the fix."""
    if getattr(model.config, "reorder_and_upcast_attn", False):
        raise ValueError(
            f"HiddenCut: {type(model).__name__} has reorder_and_upcast_attn=True, whose attention bypasses "
            "transformers' AttentionInterface, so its attention cannot be ranked: set reorder_and_upcast_attn=False"
        )
    for config in attention_configs(model).values():
        implementation = config._attn_implementation or "eager"
        if implementation in RANKED.values():
            continue
        if implementation not in RANKED:
            raise ValueError(
                f"HiddenCut ranks each layer's attention inside transformers' 'eager' or 'sdpa' attention; this "
                f"model uses {implementation!r}: load it with attn_implementation='sdpa'"
            )
        register_attention(RANKED[implementation], _ranked(implementation), implementation)
        config._attn_implementation = RANKED[implementation]


def hiddencut_layers(model) -> List[torch.nn.Module]:
    """The transformer layers whose outputs HiddenCut cuts, in order: the encoder's of an encoder-decoder
    model, else every ``GradientCheckpointingLayer``."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    base = model.get_encoder() if getattr(model.config, "is_encoder_decoder", False) else model
    return [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]


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


class TrainerCutSites:
    """Where one training step ranks and cuts (``core.hiddencut.CutSites``): the clean pass's
    :class:`Ranking` and the cut pass's plan travel as keywords of the model's call."""

    def __init__(self, trainer, model, inputs: Dict[str, Any]) -> None:
        self.trainer, self.model = trainer, model
        valid = inputs.get("attention_mask")
        self.valid = None if valid is None else valid.bool()

    @contextlib.contextmanager
    def ranking(self):
        yield Ranking(self.trainer._hiddencut_ranked, self.valid, self._model_name)

    def _model_name(self) -> str:
        return type(self.trainer.accelerator.unwrap_model(self.model)).__name__

    @contextlib.contextmanager
    def cutting(self, plan: CutPlan):
        yield {PLAN_KWARG: plan}
        _check_all_cut(self.trainer.accelerator.unwrap_model(self.model), plan)


class HiddenCutTrainerMixin(OwnPassesTrainerMixin):
    """Shared by :class:`HiddenCutTrainer` and :class:`HiddenCutSeq2SeqTrainer`."""

    own_passes = "hiddencut"
    attn_reg_regularizers = turns_on(HIDDENCUT, "hiddencut=HiddenCutConfig")

    def __init__(self, *args, hiddencut: HiddenCutConfig, **kwargs):
        if not isinstance(hiddencut, HiddenCutConfig):
            raise TypeError(f"hiddencut must be a HiddenCutConfig, got {type(hiddencut).__name__}")
        self.hiddencut = named_by_field(hiddencut).validate()
        check_trainer_combination(self, kwargs)
        super().__init__(*args, **kwargs)
        layers = hiddencut_layers(self.model)
        if not layers:
            raise ValueError(f"HiddenCut: {type(self.model).__name__} has no transformer layer to cut")
        self._hiddencut_layers = self.hiddencut.selected_layers(len(layers))
        refuse_data_parallel(self, "HiddenCut")
        _check_no_layerdrop(self.model, [layers[index] for index in self._hiddencut_layers])
        rank_in_the_attention(self.model)
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
        self._hiddencut_ranked = {index: layers[index] for index in self._hiddencut_layers}

    def own_pass_sites(self, model, inputs: Dict[str, Any]) -> TrainerCutSites:
        return TrainerCutSites(self, model, inputs)

    def hiddencut_stats(self) -> Dict[str, float]:
        """Since the last log, over all processes: mean JS per position (nats), tokens cut, real tokens of
        the cut layers."""
        return self.own_pass_stats()


class HiddenCutTrainer(HiddenCutTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with HiddenCut; extra keyword ``hiddencut: HiddenCutConfig``."""


class HiddenCutSeq2SeqTrainer(HiddenCutTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with HiddenCut; extra keyword ``hiddencut: HiddenCutConfig``."""
