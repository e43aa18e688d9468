"""``--criterion hiddencut_label_smoothed_cross_entropy``: label-smoothed cross-entropy with HiddenCut
(``--hiddencut-ratio``, ``--hiddencut-top``, ``--hiddencut-alpha``, ``--hiddencut-layers``), with
``--task translation`` or ``attn_reg_translation``; the science is ``core.hiddencut``.

Training: a clean pass, then a cut pass in which each selected **encoder** layer zeroes one contiguous
span of its feed-forward output: the output of the layer's ``fc2``, before the residual, the point the
paper cuts (fairseq's ``TransformerEncoderLayerBase`` names it, in every version). As in the official
code (``BertOutput.forward``), the cut takes the place of the dropout there: the layer's
``dropout_module`` passes the cut output through unchanged on that call (it also follows the
self-attention, where it stays). The
span's start is drawn among the tokens that receive the most attention in that layer's self-attention
of the clean pass: the head-averaged softmax of the layer's own q and k (its ``q_proj``, ``k_proj``,
``scaling``), recomputed without gradient from the attention's input (fairseq's encoder calls its
attention with ``need_weights=False``, so no map comes back), before attention dropout, one block of
query rows at a time (no (T, T) map is held). The loss is the sum over real target
tokens of both passes' label-smoothed CE plus alpha times their JS divergence, divided by one copy's
``ntokens``. Validation: one pass, the stock loss.

Refused when the criterion is built (fairseq-train builds the model first; the options are read from
its config, with either task): ``--encoder-layerdrop`` above 0 (a layer LayerDrop skips has no map in
the clean pass or takes no cut in the cut pass; the decoder's is allowed, as in the Hugging Face
trainers) and ``--hiddencut-layers`` past the encoder's layers. The first training step checks the
model itself again, for a criterion built without fairseq-train's config. The cut pass's masks are
held only while it runs, so a layer recomputed in the backward would not repeat them:
``--checkpoint-activations`` is refused at the first training step.
"""

import contextlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterionConfig
from fairseq.modules import LayerDropModuleList
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from ..core.regularizers.combinations import HIDDENCUT
from ..core.regularizers.hiddencut import CutPlan, HiddenCutConfig, SpanCut, attention_received_by_blocks
from .options import fairseq_options
from .own_passes_criterion import OwnPassesCriterion
from .task_regularizers import whole_config

NAME = "hiddencut_label_smoothed_cross_entropy"

# The --hiddencut-* flags: HiddenCutConfig's fields, defaults and help (core.options).
HiddenCutOptions = fairseq_options("HiddenCutOptions", [HiddenCutConfig])


@dataclass
class HiddenCutLabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig, HiddenCutOptions):
    pass


def refuse_layerdrop(setting: str) -> None:
    """LayerDrop on the encoder, whose layers HiddenCut ranks and cuts (the wording of the HF trainers')."""
    raise ValueError(
        f"HiddenCut (--criterion {NAME}) ranks each selected encoder layer's attention in the clean pass and cuts "
        f"the layer in the cut pass, but {setting} skips the encoder's layers at random in training (LayerDrop): "
        "set --encoder-layerdrop 0 (--decoder-layerdrop may stay: the decoder is neither ranked nor cut)"
    )


def _encoder_option(model_cfg, key: str):
    """An encoder option of fairseq-train's model config: ``encoder_KEY`` in an ``--arch``'s flat args (a
    Namespace, or the dict the attn_reg task stores), ``encoder.KEY`` in a TransformerConfig; else None."""
    value = getattr(model_cfg, f"encoder_{key}", None)
    return value if value is not None else getattr(getattr(model_cfg, "encoder", None), key, None)


def check_the_model_options(config: HiddenCutConfig, criterion_cfg) -> None:
    """What the criterion can check before training: the model is built, but only fairseq-train's config
    reaches the criterion (fairseq hands it ``cfg.criterion`` and the task, which keeps no model)."""
    root = whole_config(criterion_cfg)
    model_cfg = root.get("model") if root is not None else None
    if model_cfg is None:
        return  # a criterion built from a plain namespace: the first training step checks the model
    layerdrop = _encoder_option(model_cfg, "layerdrop")
    if isinstance(layerdrop, (int, float)) and layerdrop > 0:
        refuse_layerdrop(f"--encoder-layerdrop {layerdrop}")
    count = _encoder_option(model_cfg, "layers")
    if isinstance(count, int) and not isinstance(count, bool):
        config.selected_layers(count, "encoder layers")  # refuses an index past them


def self_attention_received(attn, query, key_padding_mask, attn_mask) -> tuple:
    """(attention received (B, T), real tokens (B, T)) of a fairseq self-attention's call, without gradient,
    block by block of query rows (``core.hiddencut.attention_received_by_blocks``)."""
    length, batch, _ = query.shape
    heads, head_dim = attn.num_heads, attn.head_dim
    with torch.no_grad():
        q = attn.q_proj(query).view(length, batch, heads, head_dim).permute(1, 2, 0, 3)
        k = attn.k_proj(query).view(length, batch, heads, head_dim).permute(1, 2, 0, 3)
        valid = torch.ones(batch, length, dtype=torch.bool, device=query.device)
        if key_padding_mask is not None:
            valid = ~key_padding_mask.bool()
        received = attention_received_by_blocks(q, k, valid, scale=attn.scaling, mask=attn_mask)
    return received, valid


class _Hooks:
    """The encoder layers' hooks: the clean pass records each selected layer's attention received, the
    cut pass zeroes spans of their ``fc2`` outputs (``core.hiddencut.CutSites``: both steered by hooks,
    no keyword of the model's call)."""

    extra: Mapping[str, Any] = MappingProxyType({})  # as a Ranking: the model's call carries nothing

    def __init__(self, model, config: HiddenCutConfig):
        layers = [m for m in model.modules() if isinstance(m, TransformerEncoderLayerBase)]
        if not layers:
            raise ValueError(f"--criterion {NAME} cuts encoder layers; this model has no TransformerEncoderLayer")
        if any(hasattr(layer, "precheckpoint_forward") for layer in layers):
            raise ValueError(
                f"--criterion {NAME} with --checkpoint-activations is not supported: a recomputed layer would "
                "not repeat its cut"
            )
        self.selected = config.selected_layers(len(layers), "encoder layers")
        # What the options did not show (check_the_model_options). modules(), not iteration: iterating a
        # LayerDropModuleList in training skips layers at random, drawing from torch's generator.
        ranked = {id(layers[index]) for index in self.selected}
        for name, module in model.named_modules():
            if (
                isinstance(module, LayerDropModuleList)
                and module.p > 0
                and any(id(m) in ranked for m in module.modules())
            ):
                refuse_layerdrop(f"the model's {name} (p={module.p})")
        self.recorded = None  # {layer: (received, valid)} while the clean pass runs
        self.cut = SpanCut()
        self.cut_not_dropped = set()  # layers whose fc2 was cut and whose dropout after it is still to come
        for index in self.selected:
            layers[index].self_attn.register_forward_pre_hook(self._recorder(index), with_kwargs=True)
            self.cut.attach(layers[index].fc2, index, time_first=True)
            self._cut_replaces_dropout(layers[index], index)

    @contextlib.contextmanager
    def ranking(self):
        """The clean pass records each selected layer's attention received, in call order (the layers')."""
        self.recorded = {}
        try:
            yield self
        finally:
            self.recorded = None

    def ranked(self) -> dict:
        return dict(self.recorded)

    @contextlib.contextmanager
    def cutting(self, plan: CutPlan):
        try:
            with self.cut.cutting(plan):
                yield self.extra
        finally:
            self.cut_not_dropped.clear()

    def _cut_replaces_dropout(self, layer, index) -> None:
        """In the cut pass, the layer's ``dropout_module`` call right after ``fc2`` returns its input."""

        def cut(module, args, output):
            if self.cut.plan is not None:  # every selected layer has a mask: no LayerDrop skips one
                self.cut_not_dropped.add(index)

        def undropped(module, args, output):
            if index in self.cut_not_dropped:
                self.cut_not_dropped.discard(index)
                return args[0]
            return None

        layer.fc2.register_forward_hook(cut)
        layer.dropout_module.register_forward_hook(undropped)

    def _recorder(self, index):
        def record(module, args, kwargs):
            if self.recorded is not None:
                query = kwargs["query"] if "query" in kwargs else args[0]
                self.recorded[index] = self_attention_received(
                    module, query, kwargs.get("key_padding_mask"), kwargs.get("attn_mask")
                )

        return record


@register_criterion(NAME, dataclass=HiddenCutLabelSmoothedCrossEntropyConfig)
class HiddenCutLabelSmoothedCrossEntropyCriterion(OwnPassesCriterion):
    """Label-smoothed cross-entropy trained with HiddenCut; validation is the base criterion unchanged."""

    regularizers = (HIDDENCUT,)
    own_passes = "hiddencut"
    name = NAME

    @classmethod
    def build_criterion(cls, cfg, task):
        """The base criterion, built as fairseq builds it, then HiddenCut's options from the same cfg (checked here)."""
        criterion = super().build_criterion(cfg, task)
        criterion.hiddencut_config = HiddenCutConfig.from_namespace(cfg).validate()
        criterion.hiddencut_hooks = None
        check_the_model_options(criterion.hiddencut_config, cfg)
        return criterion

    def own_pass_sites(self, model) -> _Hooks:
        """The encoder's hooks, installed at the first training step (refusing what the model does not allow)."""
        if self.hiddencut_hooks is None:
            self.hiddencut_hooks = _Hooks(model, self.hiddencut_config)
        return self.hiddencut_hooks
