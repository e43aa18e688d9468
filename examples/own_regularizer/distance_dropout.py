"""Distance dropout, a regularizer written outside attn_reg_plugin in one file: each (query, key) of a
selected attention layer is dropped before softmax with probability ``rate * |i - j| / S`` (i the
query's position, j the key's, S the keys of the call), so far keys are dropped more than near ones.

Loaded by naming this file in ``ATTN_REG_EXTENSIONS``; then ``fairseq-train --user-dir ...`` takes
``--distance-dropout-rate``, ``AttnRegTrainer(distance_dropout=DistanceDropoutConfig(rate=0.3))``
trains it, and ``attn-reg-mt-compare`` / ``attn-reg-cls-compare`` offer the method
``distance-dropout`` (docs/PORTING.md#your-own-regularizer).
"""

from dataclasses import dataclass
from typing import Dict

import torch

from attn_reg_plugin.core.kernel.attention_call import EditScores
from attn_reg_plugin.core.kernel.rules import BlockRule
from attn_reg_plugin.core.regularizers.options import (
    RegularizerOptions,
    attention_option,
    check_probability,
    layers_option,
    option,
)
from attn_reg_plugin.core.regularizers.registry import Method, Regularizer, register


@dataclass
class DistanceDropoutConfig(RegularizerOptions):
    """``--distance-dropout-*``: its options, declared once (flags, keywords and the commands' options)."""

    FLAG_PREFIX = "--distance-dropout-"

    rate: float = option(
        0.0, "distance dropout: a key at distance d of a row dropped with probability rate * d / S; 0 = off", "[0, 1]"
    )
    layers: str = layers_option()
    attention: str = attention_option()

    @property
    def enabled(self) -> bool:
        return isinstance(self.rate, (int, float)) and self.rate > 0

    def validate(self) -> "DistanceDropoutConfig":
        check_probability(self.rate, self.name("rate"))
        self.check_site_options()
        return self


@dataclass(frozen=True, eq=False)
class DistanceRule(BlockRule):
    """The drop rule the kernel evaluates per block of query rows (the project's ``mask_mod``)."""

    rate: torch.Tensor  # 0-d: a compiled model sees it as data

    def drops(self, block) -> torch.Tensor:
        device = block.valid.device
        queries = torch.arange(block.rows.start, block.rows.stop, device=device)
        keys = torch.arange(block.shape[-1], device=device)
        probability = self.rate.to(device) * (queries[:, None] - keys[None, :]).abs() / block.call_shape[-1]
        return block.uniform() < probability  # the call's seeded uniform stream: a recompute draws the same


class DistanceDropout:
    """The running regularizer: the plan of each training forward."""

    def __init__(self, config: DistanceDropoutConfig, controller):
        self.config = config.validate()
        if not config.enabled:
            raise ValueError(f"{config.name('rate')} is 0: distance dropout is off")
        self.sites = config.select_sites(controller)

    def hooks(self, update: int) -> Dict:
        rate = torch.tensor(float(self.config.rate))
        return {site: EditScores(drop=DistanceRule(rate), counted=True) for site in self.sites}

    def logged(self, update: int) -> Dict[str, float]:
        return {}


register(
    Regularizer(
        "distance_dropout",
        "distance dropout",
        DistanceDropoutConfig,
        "rate",
        DistanceDropout,
        "distance_dropout",
        methods=(
            Method(
                "distance-dropout",
                "distance dropout, --distance-dropout-rate 0.2",
                {"rate": 0.2},
                (("--distance-dropout-rate", "0.2"),),
            ),
        ),
    )
)
