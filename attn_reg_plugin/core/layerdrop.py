"""Attention LayerDrop (AttendOut paper Sec. 7.1), a no-extra-cost regularizer.

Each selected attention layer is skipped with probability p for a whole forward pass; a skipped
layer attends uniformly to its valid keys (Eq. 4). Draws come from torch's global generator,
which fairseq and the Trainer seed per update, so runs are reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from .attention import EditScores
from .controller import AttentionSite, RegularizationController, parse_kinds, parse_layers
from .options import attention_option, check_probability, config_from_namespace, layers_option, option, option_name


@dataclass
class AttentionLayerDropConfig:
    """``--attn-layerdrop-*``; p = 0 means off."""

    FLAG_PREFIX = "--attn-layerdrop-"

    p: float = option(0.0, "attention LayerDrop: probability that a selected attention layer attends uniformly "
                           "over its real keys for the whole batch; 0 = off", "[0, 1]")
    layers: str = layers_option()
    attention: str = attention_option()

    @property
    def enabled(self) -> bool:
        return isinstance(self.p, (int, float)) and self.p > 0

    def validate(self) -> "AttentionLayerDropConfig":
        def flag(name: str) -> str:
            return option_name(self, name)

        check_probability(self.p, flag("p"))
        parse_layers(self.layers, flag("layers"))
        parse_kinds(self.attention, flag("attention"))
        return self

    @classmethod
    def from_namespace(cls, ns, prefix: Optional[str] = None) -> "AttentionLayerDropConfig":
        return config_from_namespace(cls, ns, prefix)


class AttentionLayerDrop:
    """Skips whole attention layers: a skipped layer's every row is uniform over its valid keys."""

    def __init__(self, config: AttentionLayerDropConfig, controller: RegularizationController):
        self.config = config.validate()

        def flag(name: str) -> str:
            return option_name(config, name)

        kinds = parse_kinds(config.attention, flag("attention"))
        self.sites: List[AttentionSite] = controller.select(kinds, parse_layers(config.layers, flag("layers")), flag("layers"))

    def hooks(self) -> Dict[AttentionSite, EditScores]:
        """Hooks for one training forward: each selected layer skipped with probability p.

        Every selected site gets a hook whose ``uniform_rows`` is a (1, 1, 1, 1) bool flag, True
        when the layer is skipped: a compiled model then runs one graph whichever layers are
        skipped, instead of one per subset.
        """
        # One draw per layer on the CPU generator: no device synchronisation.
        skipped = torch.rand(len(self.sites)) < self.config.p
        return {s: EditScores(uniform_rows=skip.view(1, 1, 1, 1)) for s, skip in zip(self.sites, skipped)}


def skipped_layers(hooks: Dict[AttentionSite, EditScores]) -> int:
    """How many of :meth:`AttentionLayerDrop.hooks`' layers are skipped in this forward."""
    return sum(bool(h.uniform_rows) for h in hooks.values())
