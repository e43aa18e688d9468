"""Attention LayerDrop (AttendOut paper Sec. 7.1), a no-extra-cost regularizer.

Each selected attention layer is skipped with probability p for a whole forward pass; a skipped
layer attends uniformly to its valid keys (Eq. 4). Draws come from torch's global generator,
which fairseq and the Trainer seed per update, so runs are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ..kernel.attention_call import AttentionSite, EditScores
from ..kernel.controller import RegularizationController
from .options import RegularizerOptions, attention_option, check_probability, layers_option, option
from .registry import Regularizer, register


@dataclass
class AttentionLayerDropConfig(RegularizerOptions):
    """``--attn-layerdrop-*``; p = 0 means off."""

    FLAG_PREFIX = "--attn-layerdrop-"

    p: float = option(
        0.0,
        "attention LayerDrop: probability that a selected attention layer attends uniformly "
        "over its real keys for the whole batch; 0 = off",
        "[0, 1]",
    )
    layers: str = layers_option()
    attention: str = attention_option()

    @property
    def enabled(self) -> bool:
        return isinstance(self.p, (int, float)) and self.p > 0

    def validate(self) -> AttentionLayerDropConfig:
        check_probability(self.p, self.name("p"))
        self.check_site_options()
        return self


class AttentionLayerDrop:
    """Skips whole attention layers: a skipped layer's every row is uniform over its valid keys."""

    def __init__(self, config: AttentionLayerDropConfig, controller: RegularizationController):
        self.config = config.validate()
        if not config.enabled:  # as an empty dropout schedule: refused, not run as a kernel pass that drops nothing
            raise ValueError(f"{config.name('p')} is 0: attention LayerDrop is off; give p in (0, 1], or leave it out")
        self.sites: List[AttentionSite] = config.select_sites(controller)

    def logged(self, update: int) -> Dict[str, float]:
        """Nothing beside the rate: p is fixed."""
        return {}

    def hooks(self, update: Optional[int] = None) -> Dict[AttentionSite, EditScores]:
        """Hooks for one training forward: each selected layer skipped with probability p.

        Every selected site gets a hook whose ``uniform_rows`` is a (1, 1, 1, 1) bool flag, True
        when the layer is skipped: a compiled model then runs one graph whichever layers are
        skipped, instead of one per subset. The pass's record counts ``[skipped, total]`` layer
        calls as the kernel applies them (``Record.calls``).
        """
        # One draw per layer on the CPU generator: no device synchronisation.
        skipped = torch.rand(len(self.sites)) < self.config.p
        return {s: EditScores(uniform_rows=skip.view(1, 1, 1, 1), counted=True) for s, skip in zip(self.sites, skipped)}


REGULARIZER = register(
    Regularizer(
        "layerdrop",
        "attention LayerDrop",
        AttentionLayerDropConfig,
        "p",
        AttentionLayerDrop,
        "attn_layerdrop",
        counted=("skipped", "calls"),
        counts_calls=True,
    )
)
