"""Which regularizers one run may combine: one table, read by both adapters when the trainer, task or
criterion is built, so that a combination either works the same way in fairseq and transformers or is
refused before anything trains.

Every regularizer edits the same attention calls (or, R-Drop and HiddenCut, runs the model twice), and
a combination is right only when someone decided in which pass each one acts and tested it. Only the
combinations in :data:`COMBINATIONS` are; every other pair is refused, naming both regularizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, Mapping, Optional, Tuple

from .registry import Method

# The plugin's regularizers of their own passes, by the names the papers give them (each registered
# under that name by its own module, :mod:`.registry`), for the adapters that name them.
AD_DROP = "AD-DROP"
ATTENDOUT = "AttendOut"
RDROP = "R-Drop"
HIDDENCUT = "HiddenCut"


def regularizer_names() -> Tuple[str, ...]:
    """Every regularizer's name, in the order messages name them: the registry's order."""
    from .registry import registered

    return tuple(name for r in registered() for name in r.names)


@dataclass(frozen=True)
class Combination:
    """Regularizers that one run may turn on together: what the run then does, and how each framework
    spells it; ``method``: the combination as a method of the comparison commands, taking the options
    of the methods named in ``parts`` (their defaults, flags and log keys)."""

    regularizers: FrozenSet[str]
    does: str
    fairseq: str
    transformers: str
    method: Optional[Method] = None
    parts: Tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return " + ".join(sorted(self.regularizers))


COMBINATIONS: Tuple[Combination, ...] = (
    Combination(
        frozenset({AD_DROP, RDROP}),
        "R-Drop's two forwards are AD-DROP's masked pass: one attribution pass, then two forwards with the "
        "step's AD-DROP drops, each with its own model dropout, trained on R-Drop's objective; in a plain "
        "epoch of cross-tuning, plain R-Drop",
        "`--criterion ad_drop_rdrop_label_smoothed_cross_entropy`",
        "`class T(ADDropTrainerMixin, RDropTrainerMixin, Trainer)` with `ad_drop=` and `rdrop=`",
        Method(
            "ad-drop-r-drop",
            "R-Drop over AD-DROP's masked pass",
            fairseq_criterion="ad_drop_rdrop_label_smoothed_cross_entropy",
            trainer="ADDropRDropTrainer",
        ),
        ("ad-drop", "r-drop"),
    ),
)


def existing_combinations() -> str:
    """The combinations that exist, for an error message."""
    return "; ".join(f"{c.name} ({c.fairseq} in fairseq, {c.transformers} in transformers)" for c in COMBINATIONS)


def check_combination(chosen: Mapping[str, str]) -> None:
    """Refuse a run whose regularizers do not combine. ``chosen`` maps each regularizer the run turns on
    to how the user turned it on (``--attendout``, ``ad_drop=ADDropConfig``); one option that turns on two
    (a combined criterion) is named once."""
    if len(chosen) <= 1 or frozenset(chosen) in {c.regularizers for c in COMBINATIONS}:
        return
    by_spelling: dict = {}
    for regularizer, spelled in chosen.items():
        by_spelling.setdefault(spelled, []).append(regularizer)
    named = " and ".join(f"{' + '.join(regs)} ({spelled})" for spelled, regs in by_spelling.items())
    raise ValueError(
        f"{named} do not combine in one run: choose one attention regularizer per run, or one of the "
        f"combinations that exist: {existing_combinations()} (docs/OPTIONS.md#combinations)"
    )


def combinations_table() -> str:
    """The Markdown table of :data:`COMBINATIONS` (docs/OPTIONS.md embeds it)."""
    rows = ["| regularizers | what the run does | fairseq | transformers |", "|---|---|---|---|"]
    for c in COMBINATIONS:
        rows.append(f"| {c.name} | {c.does} | {c.fairseq} | {c.transformers} |")
    return "\n".join(rows)
