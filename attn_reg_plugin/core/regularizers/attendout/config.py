"""AttendOut's options (``--attendout-*`` in fairseq, ``AttendOutConfig`` in Python)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

from ..combinations import ATTENDOUT
from ..options import RegularizerOptions, attention_option, layers_option, option
from ..planned_run import WHY_A_WARNING, count, setting
from ..registry import OWN_PASSES, Method, Regularizer, register

logger = logging.getLogger(__name__)

# The generator's positions for a model whose maximum length is not known (T5's relative positions).
DEFAULT_MAX_POSITIONS = 1024
# Sized to a model stating more positions than this, the generator's table is worth a warning: at
# 131,072 (Llama 3.1) it adds about 100 MiB to every checkpoint, at 1M about 0.75 GiB.
LARGE_POSITION_TABLE = 16384


@dataclass
class AttendOutConfig(RegularizerOptions):
    """AttendOut's options; the fairseq flags are these names prefixed with ``--attendout-``."""

    FLAG_PREFIX = "--attendout-"

    dropout_step: int = option(20, "T: updates per dropout step and held-out samples per evaluation", "integer >= 1")
    generator_dim: int = option(
        64,
        "generator width (embeddings and its single attention head); on a GPU's fused route up to 64, a wider one "
        "draws its actions in PyTorch",
        "integer >= 1",
    )
    lr: float = option(1e-3, "generator Adam learning rate", "finite number > 0")
    temperature: float = option(
        1.0, "Gumbel temperature: drop probability = sigmoid(logit / temperature)", "finite number > 0"
    )
    baseline_decay: float = option(0.9, "moving-average baseline: b = decay * b + (1 - decay) * mean reward", "[0, 1)")
    init_drop: float = option(0.2, "drop probability the generator starts from", "(0, 1)")
    attention: str = attention_option()
    layers: str = layers_option()
    max_positions: Optional[int] = option(
        None,
        "longest sequence the generator covers (its position table: max_positions x generator_dim); unset: the "
        f"model's maximum length (HF: config.max_position_embeddings or n_positions; fairseq: the model's "
        f"max_positions), {DEFAULT_MAX_POSITIONS} for a model that states none (T5). A longer batch stops before "
        "its first update",
        "integer >= 1, or unset",
    )

    def validate(self) -> AttendOutConfig:
        flag = self.name

        def integer(name, low):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{flag(name)} must be an integer >= {low}, got {value!r}")

        def number(name, check, accepted):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not check(value):
                raise ValueError(f"{flag(name)} must be {accepted}, got {value!r}")

        integer("dropout_step", 1)
        integer("generator_dim", 1)
        if self.max_positions is not None:
            integer("max_positions", 1)
        number("lr", lambda v: 0 < v < math.inf, "a finite number > 0")
        number("temperature", lambda v: 0 < v < math.inf, "a finite number > 0")
        number("baseline_decay", lambda v: 0 <= v < 1, "in [0, 1)")
        number("init_drop", lambda v: 0 < v < 1, "in the open interval (0, 1)")
        self.check_site_options()
        return self


def generator_positions(config: AttendOutConfig, model_max_length: Optional[int]) -> int:
    """How many positions the generator covers: ``config.max_positions`` when set, else the model's
    maximum length (None: the model states none, so :data:`DEFAULT_MAX_POSITIONS`). Sized to the model,
    the generator takes every sequence the model takes; a smaller explicit value is checked on each batch."""
    if config.max_positions is not None:
        return config.max_positions
    if model_max_length and model_max_length > LARGE_POSITION_TABLE:
        mib = model_max_length * config.generator_dim * 4 * 3 / 2**20  # float32 weights and Adam's two moments
        logger.warning(
            "%s is unset, so AttendOut's generator covers the model's %d positions: a position table of about "
            "%.0f MiB with its optimizer state, in memory and in every checkpoint. Set %s to the longest "
            "sequence you train on",
            config.name("max_positions"), model_max_length, mib, config.name("max_positions"),
        )  # fmt: skip
    return model_max_length if model_max_length else DEFAULT_MAX_POSITIONS


def _idle_run(config: AttendOutConfig, epochs: Optional[int], updates: Optional[int], plan: str) -> Optional[str]:
    """Fewer planned updates than one dropout step: no dropout step ends."""
    if updates is None or updates >= config.dropout_step:
        return None
    return (
        f"AttendOut ends a dropout step (held-out scoring, the generator's update, the survivor's copy) every "
        f"{setting(config, 'dropout_step', config.dropout_step)} updates, and this run plans "
        f"{count(updates, 'update')} ({plan}): no dropout step will end, so the model is trained without "
        f"AttendOut. Lower {config.name('dropout_step')} to at most {updates}, or plan more updates{WHY_A_WARNING}"
    )


REGULARIZER = register(
    Regularizer(
        "attendout",
        ATTENDOUT,
        AttendOutConfig,
        "",
        None,
        "attendout",
        passes=OWN_PASSES,
        idle=_idle_run,
        methods=(
            Method(
                "attendout",
                "AttendOut (Defender, Attacker and Generator; held-out samples: the dev set); classifiers a "
                "dropout step every 4 updates, translation the plugin's defaults",
                {"dropout_step": 4},
                mt_defaults=(("--attendout",),),
                fairseq_switch="--attendout",
                trainer="AttendOutTrainer",
                heldout=True,
                flag_prefixes=("--attendout",),
                log_keys=(),
            ),
        ),
    )
)
