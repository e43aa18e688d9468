"""Scheduled Bernoulli attention dropout (AttendOut paper Sec. 7.2), a no-extra-cost regularizer.

Scores dropout (Eq. 3: a dropped key gets the masked fill before softmax) with a per-layer drop
probability that follows a piecewise-linear schedule over training updates, the random stand-in
for the patterns the AttendOut generator learns (paper Fig. 3). The coins are keyed by a seed the
pass draws from torch's global generator, which fairseq and the Trainer seed per update, so runs
are reproducible.

DropKey (Li et al., CVPR 2023) is a preset of it, not a second implementation: the schedule
``dropkey:RATE`` gives each selected layer a constant rate that decreases linearly with depth
(:func:`dropkey_rates`), resolved when the sites are selected, since the depth is the model's.
"""

from __future__ import annotations

import bisect
import logging
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..kernel.attention_call import AttentionSite, EditScores
from ..kernel.controller import RegularizationController
from ..kernel.rules import BernoulliRule
from .options import RegularizerOptions, attention_option, check_probability, layers_option, option
from .registry import Method, Regularizer, register

logger = logging.getLogger(__name__)

Schedule = List[Tuple[int, float]]  # (update, drop probability) knots, updates increasing

DROPKEY = "dropkey"  # the preset's name in a schedule: 'dropkey:RATE'
# The regularizers a schedule turns on, as messages name them (DropKey for 'dropkey:RATE').
SCHEDULED_DROPOUT, DROPKEY_REGULARIZER = "scheduled attention dropout", "DropKey"


def check_dropkey_rate(value, option: str) -> float:
    """DropKey's base rate: a number in [0, 1) (1 would drop every key of the first layer)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0 <= value < 1:
        raise ValueError(f"{option}: DropKey's rate must be a number in [0, 1), got {value!r}")
    return float(value)


def dropkey_rate(spec: str, option: str) -> Optional[float]:
    """The base rate of a ``'dropkey:RATE'`` schedule (checked); None for a knot schedule."""
    if not isinstance(spec, str) or not spec.strip().lower().startswith(DROPKEY):
        return None
    name, _, text = spec.strip().partition(":")
    try:
        rate = float(text) if name.strip().lower() == DROPKEY else None
    except ValueError:
        rate = None
    if rate is None:
        raise ValueError(f"{option}: cannot read {spec.strip()!r}; expected dropkey:RATE such as dropkey:0.1")
    return check_dropkey_rate(rate, option)


def dropkey_rates(rate: float, num_layers: int) -> List[float]:
    """DropKey's per-layer rates for a stack of ``num_layers``: ``rate * (1 - l / num_layers)`` at
    0-based depth ``l``, constant over training.

    The paper's "decreasing schedule" lowers the drop ratio along the stack of self-attention layers
    (low-level features regularized most, the top semantic layers least); the exact line is this
    plugin's choice: the first layer drops at the base rate and the rate falls linearly towards 0,
    reaching it one layer past the last. So every layer keeps a rate above 0 (the last
    ``rate / num_layers``) and a one-layer stack keeps the base rate, where a line ending at 0 on
    the last layer would leave that layer unregularized and is undefined for one layer.
    """
    return [rate * (1 - layer / num_layers) for layer in range(num_layers)]


def dropkey_schedules(
    rate: float, sites: List[AttentionSite], controller: RegularizationController, config: ScheduledDropoutConfig
) -> Dict[int, Schedule]:
    """One constant schedule per selected layer, at its DropKey rate for its depth in its stack.
    The depth count is the stack's (the model's layers of the selected kinds), not the selection's."""
    depths = {kind: controller.num_layers(kind) for kind in dict.fromkeys(s.kind for s in sites)}
    if len(set(depths.values())) > 1:
        raise ValueError(
            f"{config.name('schedule')} {config.schedule.strip()}: the selected attention kinds have different "
            f"layer counts ({depths}), so a layer index has no single DropKey rate; select kinds of one "
            f"depth with {config.name('attention')}"
        )
    rates = dropkey_rates(rate, next(iter(depths.values())))
    return {layer: [(0, rates[layer])] for layer in sorted({s.layer for s in sites})}


def schedule_given(spec, option: str, example: str) -> bool:
    """Whether a schedule option is set (not empty); anything but a string is refused, naming the option
    (a bare number such as 0.1 is not a schedule: the knots say from which update it holds)."""
    if not isinstance(spec, str):
        raise ValueError(f"{option} must be a string, {example} (empty: off), got {spec!r} ({type(spec).__name__})")
    return bool(spec.strip())


def _knot_update(text: str) -> Optional[int]:
    """A knot's update count, exactly: ASCII digits as an int, or a float literal such as ``1e4`` whose
    value is an integer a float holds exactly (at most 2**53); None for any other number (negative,
    fractional, ``1_000``, other scripts' digits, all of which ``float`` reads). Unreadable: ValueError."""
    if re.fullmatch(r"[0-9]+", text):
        return int(text)
    value = float(text)
    if re.fullmatch(r"[0-9.eE+]+", text) and value.is_integer() and value <= 2**53:
        return int(value)
    return None


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
                update, prob = _knot_update(update_text.strip()), float(prob_text)
            except ValueError:
                raise ValueError(
                    f"{option}: cannot read knot {knot.strip()!r}; expected UPDATE:PROB such as 0:0.6"
                ) from None
            if update is None:
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
        "piecewise-linear probability at the current update; dropkey:RATE = DropKey (Li et al. 2023), "
        "layer l of L dropped at RATE * (1 - l/L) throughout, in place of the model's attention-weight "
        "dropout (off at those layers in training); empty = off",
        "UPDATE:PROB,... knots, updates increasing, PROB in [0, 1]; one schedule, or one per "
        "selected layer joined by '|'; or dropkey:RATE, RATE in [0, 1)",
    )
    layers: str = layers_option()
    attention: str = attention_option()

    @property
    def enabled(self) -> bool:
        return schedule_given(
            self.schedule, self.name("schedule"), "a knot string such as '0:0.1,1000:0' or dropkey:0.1"
        )

    @property
    def regularizer(self) -> str:
        """Which regularizer the schedule turns on (:mod:`.combinations`): DropKey for ``dropkey:RATE``."""
        return (
            DROPKEY_REGULARIZER if dropkey_rate(self.schedule, self.name("schedule")) is not None else SCHEDULED_DROPOUT
        )

    def validate(self) -> ScheduledDropoutConfig:
        if self.enabled and dropkey_rate(self.schedule, self.name("schedule")) is None:
            parse_schedules(self.schedule, self.name("schedule"))
        self.check_site_options()
        return self

    def first_dropping_update(self, planned_updates: int) -> Optional[int]:
        """:func:`first_dropping_update` of this schedule; DropKey's rates are all above 0 or all 0."""
        rate = dropkey_rate(self.schedule, self.name("schedule"))
        if rate is not None:
            return 0 if rate > 0 and planned_updates > 0 else None
        return first_dropping_update(parse_schedules(self.schedule, self.name("schedule")), planned_updates)


class ScheduledAttentionDropout:
    """Bernoulli scores dropout whose per-layer probability follows a schedule over updates."""

    schedule_of_layer: Dict[int, Schedule]

    def __init__(self, config: ScheduledDropoutConfig, controller: RegularizationController):
        self.config = config.validate()
        flag = config.name
        if not config.enabled:
            raise ValueError(f"{flag('schedule')} is empty: scheduled attention dropout is off")
        self.sites: List[AttentionSite] = config.select_sites(controller)
        rate = dropkey_rate(config.schedule, flag("schedule"))
        self.dropkey = rate is not None
        if self.dropkey:
            self.schedule_of_layer = dropkey_schedules(rate, self.sites, controller, config)
            logger.info(
                "%s %s: DropKey replaces the attention-weight dropout at its %d attention sites (%s): the model's "
                "own attention dropout is off there in training, as in the DropKey paper",
                flag("schedule"),
                config.schedule.strip(),
                len(self.sites),
                ", ".join(f"{s.kind}[{s.layer}]" for s in self.sites),
            )
            return
        schedules = parse_schedules(config.schedule, flag("schedule"))
        layer_ids = sorted({s.layer for s in self.sites})
        if len(schedules) == 1:
            schedules = schedules * len(layer_ids)
        if len(schedules) != len(layer_ids):
            raise ValueError(
                f"{flag('schedule')} gives {len(schedules)} schedules separated by '|', but "
                f"{len(layer_ids)} layers are selected ({layer_ids}): give one schedule, or one per layer"
            )
        self.schedule_of_layer = dict(zip(layer_ids, schedules))

    def probabilities(self, update: int) -> Dict[int, float]:
        """Drop probability of each selected layer at ``update``."""
        return {layer: schedule_value(s, update) for layer, s in self.schedule_of_layer.items()}

    def logged(self, update: int) -> Dict[str, float]:
        """What a training log says of ``update`` beside the rate: each selected layer's probability."""
        return {f"p_layer{layer}": p for layer, p in self.probabilities(update).items()}

    def hooks(self, update: int) -> Dict[AttentionSite, EditScores]:
        """Hooks for one training forward at ``update``: each key dropped with its layer's probability,
        counted (the pass's record says how many units were dropped of how many)."""
        probs = self.probabilities(update)

        # Drawn per (sample, head, query, key) inside the kernel, where the shape is known. The
        # probability is a tensor, not a float: a compiled model sees a new probability every update
        # as new data, where a Python float would be baked into the graph and recompile it.
        return {
            s: EditScores(
                drop=BernoulliRule(torch.tensor(probs[s.layer])), counted=True, replaces_weight_dropout=self.dropkey
            )
            for s in self.sites
            if probs[s.layer] > 0
        }


def _dropkey_method_check(config: ScheduledDropoutConfig) -> None:
    if dropkey_rate(config.schedule, config.name("schedule")) is None:
        raise ValueError(f"{config.name('schedule')} must be dropkey:RATE for method dropkey, got {config.schedule!r}")


REGULARIZER = register(
    Regularizer(
        "scheduled_dropout",
        SCHEDULED_DROPOUT,
        ScheduledDropoutConfig,
        "schedule",
        ScheduledAttentionDropout,
        "attn_sched_dropout",
        methods=(
            Method(
                "dropkey",
                "DropKey, --attn-sched-dropout-schedule dropkey:0.1",
                {"schedule": "dropkey:0.1"},
                (("--attn-sched-dropout-schedule", "dropkey:0.1"),),
                check=_dropkey_method_check,
            ),
        ),
        named=lambda config: config.regularizer,
        variants=(DROPKEY_REGULARIZER,),
    )
)
