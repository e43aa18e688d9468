"""Scheduled Bernoulli attention dropout (AttendOut paper Sec. 7.2), a no-extra-cost regularizer.

Scores dropout (Eq. 3: a dropped key gets the masked fill before softmax) with a per-layer drop
probability that follows a piecewise-linear schedule over training updates, the random stand-in
for the patterns the AttendOut generator learns (paper Fig. 3). Random draws come from torch's
global generator, which fairseq and the Trainer seed per update, so runs are reproducible.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .attention import EditScores
from .block_rules import BernoulliRule
from .controller import AttentionSite, RegularizationController
from .options import RegularizerOptions, attention_option, check_probability, layers_option, option

Schedule = List[Tuple[int, float]]  # (update, drop probability) knots, updates increasing


def parse_schedules(spec: str, option: str) -> List[Schedule]:
    """``'0:0.6,10000:0.3'`` -> one schedule; ``'0:0.6,1e4:0.5|0:0.6,1e4:0.1'`` -> one per layer.

    Each schedule is ``UPDATE:PROB`` knots with strictly increasing updates (>= 0) and
    probabilities in [0, 1]; before the first knot and after the last the value is constant.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"{option} must be 'UPDATE:PROB,UPDATE:PROB,...' (one schedule, or one per layer separated by '|'), got {spec!r}"
        )
    schedules = []
    for part in spec.split("|"):
        knots: Schedule = []
        for knot in part.split(","):
            try:
                update_text, prob_text = knot.split(":")
                update, prob = float(update_text), float(prob_text)
            except ValueError:
                raise ValueError(
                    f"{option}: cannot read knot {knot.strip()!r}; expected UPDATE:PROB such as 0:0.6"
                ) from None
            if update < 0 or update != int(update):
                raise ValueError(f"{option}: knot updates must be integers >= 0, got {update_text.strip()!r}")
            check_probability(prob, f"{option}: knot {knot.strip()!r} probability")
            if knots and int(update) <= knots[-1][0]:
                raise ValueError(
                    f"{option}: knot updates must increase strictly, got {knots[-1][0]} then {int(update)}"
                )
            knots.append((int(update), prob))
        schedules.append(knots)
    return schedules


def schedule_value(schedule: Schedule, update: int) -> float:
    """Piecewise-linear interpolation of ``schedule`` at ``update`` (constant outside the knots)."""
    updates = [u for u, _ in schedule]
    i = bisect.bisect_right(updates, update)
    if i == 0:
        return schedule[0][1]
    if i == len(schedule):
        return schedule[-1][1]
    (u0, p0), (u1, p1) = schedule[i - 1], schedule[i]
    return p0 + (p1 - p0) * (update - u0) / (u1 - u0)


def first_dropping_update(schedules: List[Schedule], planned_updates: int) -> Optional[int]:
    """The first 0-based update before ``planned_updates`` at which some schedule's probability is
    above 0; None when it is 0 throughout. Linear between knots, so the first positive update
    is 0, a knot, or the update after a knot."""
    candidates = sorted({0} | {u + d for schedule in schedules for u, _ in schedule for d in (0, 1)})
    return next(
        (u for u in candidates if u < planned_updates and any(schedule_value(s, u) > 0 for s in schedules)), None
    )


@dataclass
class ScheduledDropoutConfig(RegularizerOptions):
    """``--attn-sched-dropout-*``; empty ``schedule`` means off."""

    FLAG_PREFIX = "--attn-sched-dropout-"

    schedule: str = option(
        "",
        "scheduled attention dropout: each real key dropped before softmax with its layer's "
        "piecewise-linear probability at the current update; empty = off",
        "UPDATE:PROB,... knots, updates increasing, PROB in [0, 1]; one schedule, or one per "
        "selected layer joined by '|'",
    )
    layers: str = layers_option()
    attention: str = attention_option()

    @property
    def enabled(self) -> bool:
        return bool(self.schedule and self.schedule.strip())

    def validate(self) -> ScheduledDropoutConfig:
        if self.enabled:
            parse_schedules(self.schedule, self.name("schedule"))
        self.check_site_options()
        return self


class ScheduledAttentionDropout:
    """Bernoulli scores dropout whose per-layer probability follows a schedule over updates."""

    def __init__(self, config: ScheduledDropoutConfig, controller: RegularizationController):
        self.config = config.validate()
        flag = config.name
        if not config.enabled:
            raise ValueError(f"{flag('schedule')} is empty: scheduled attention dropout is off")
        self.sites: List[AttentionSite] = config.select_sites(controller)
        schedules = parse_schedules(config.schedule, flag("schedule"))
        layer_ids = sorted({s.layer for s in self.sites})
        if len(schedules) == 1:
            schedules = schedules * len(layer_ids)
        if len(schedules) != len(layer_ids):
            raise ValueError(
                f"{flag('schedule')} gives {len(schedules)} schedules separated by '|', but "
                f"{len(layer_ids)} layers are selected ({layer_ids}): give one schedule, or one per layer"
            )
        self.schedule_of_layer: Dict[int, Schedule] = dict(zip(layer_ids, schedules))

    def probabilities(self, update: int) -> Dict[int, float]:
        """Drop probability of each selected layer at ``update``."""
        return {layer: schedule_value(s, update) for layer, s in self.schedule_of_layer.items()}

    def hooks(self, update: int, stats: Optional[List[torch.Tensor]] = None) -> Dict[AttentionSite, EditScores]:
        """Hooks for one training forward at ``update``: each key dropped with its layer's probability."""
        probs = self.probabilities(update)

        # Drawn per (sample, head, query, key) inside the kernel, where the shape is known. The
        # probability is a tensor, not a float: a compiled model sees a new probability every update
        # as new data, where a Python float would be baked into the graph and recompile it.
        return {
            s: EditScores(drop=BernoulliRule(torch.tensor(probs[s.layer])), stats=stats)
            for s in self.sites
            if probs[s.layer] > 0
        }
