"""DropHead (Zhou et al. 2020, "Scheduled DropHead"), one of the papers' baselines.

Each (sample, head) output of a selected attention layer is dropped with probability p, and a
sample's kept heads are rescaled by heads / kept, so the layer's expected output is unchanged. A
sample drawn to lose every head keeps one at random (the paper's H / kept would divide by 0), so the
rate is p - p**H / H: p itself but for a few heads at a large p.
The paper's schedule for p is V-shaped over training (down to 0, then back up); here it is the
piecewise-linear knots of scheduled attention dropout, so a V is three knots, e.g.
``0:0.1,5000:0,10000:0.1``. The kernel draws the heads at each call from torch's global generator
(B x H numbers), which fairseq and the Trainer seed per update and an activation checkpoint restores
for its recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ..kernel.attention_call import AttentionSite, EditOutputs
from ..kernel.controller import RegularizationController
from .options import RegularizerOptions, attention_option, layers_option, option
from .registry import Method, Regularizer, register
from .scheduled_dropout import Schedule, first_dropping_update, parse_schedules, schedule_given, schedule_value


@dataclass
class DropHeadConfig(RegularizerOptions):
    """``--attn-drophead-*``; empty ``schedule`` means off."""

    FLAG_PREFIX = "--attn-drophead-"

    schedule: str = option(
        "",
        "DropHead: each (sample, head) output of a selected attention layer dropped with the "
        "piecewise-linear probability at the current update, kept heads rescaled by heads/kept (a "
        "sample drawn to lose every head keeps one); the paper's V is three knots, e.g. "
        "0:0.1,5000:0,10000:0.1; empty = off",
        "UPDATE:PROB,... knots, updates increasing, PROB in [0, 1]",
    )
    layers: str = layers_option()
    attention: str = attention_option()

    @property
    def enabled(self) -> bool:
        return schedule_given(self.schedule, self.name("schedule"), "a knot string such as '0:0.1,5000:0,10000:0.1'")

    def validate(self) -> DropHeadConfig:
        if self.enabled:
            self._schedule()
        self.check_site_options()
        return self

    def _schedule(self) -> Schedule:
        schedules = parse_schedules(self.schedule, self.name("schedule"))
        if len(schedules) != 1:
            raise ValueError(
                f"{self.name('schedule')} takes one schedule (every selected layer follows it), got "
                f"{len(schedules)} joined by '|'"
            )
        return schedules[0]

    def first_dropping_update(self, planned_updates: int) -> Optional[int]:
        """The first update of the planned run at which some head may be dropped (None: never)."""
        return first_dropping_update([self._schedule()], planned_updates)


class DropHead:
    """Hooks that drop whole heads of the selected layers' attention output for one forward."""

    def __init__(self, config: DropHeadConfig, controller: RegularizationController):
        self.config = config.validate()
        if not config.enabled:
            raise ValueError(f"{config.name('schedule')} is empty: DropHead is off")
        self.schedule = config._schedule()
        self.sites: List[AttentionSite] = config.select_sites(controller)

    def probability(self, update: int) -> float:
        return schedule_value(self.schedule, update)

    def logged(self, update: int) -> Dict[str, float]:
        """What a training log says of ``update`` beside the rate: the probability."""
        return {"p": self.probability(update)}

    def hooks(self, update: int) -> Dict[AttentionSite, EditOutputs]:
        """Hooks for one training forward at ``update``; the pass's record counts ``[dropped, (sample,
        head) pairs]``. The probability is a tensor: a compiled model sees it as data."""
        p = self.probability(update)
        if p <= 0:
            return {}
        return {s: EditOutputs(torch.tensor(p), counted=True) for s in self.sites}


def _method_check(config: DropHeadConfig) -> None:
    if not config.enabled:
        raise ValueError(f"{config.name('schedule')} is empty: method drophead would not drop anything")


REGULARIZER = register(
    Regularizer(
        "drophead",
        "DropHead",
        DropHeadConfig,
        "schedule",
        DropHead,
        "attn_drophead",
        counted=("dropped", "heads"),
        methods=(
            Method(
                "drophead",
                "DropHead: its V-shaped schedule is in updates, so give it for your run's length, e.g. "
                "'drophead=--attn-drophead-schedule 0:0.1,N/2:0,N:0.1' for N updates",
                {"schedule": "0:0.1"},
                required=("--attn-drophead-schedule",),
                check=_method_check,
            ),
        ),
    )
)
