"""AD-DROP's options (one dataclass, the source of its fairseq flags and its Python API) and the
cross-tuning schedule (paper Sec. 2.4, Alg. 1)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

from ..kernel.rules import decimal_fraction
from .attribution import ATTRIBUTIONS, LABEL_SOURCES
from .combinations import AD_DROP
from .options import RegularizerOptions, attention_option, layers_option, option
from .planned_run import WHY_A_WARNING, count, setting
from .registry import OWN_PASSES, Method, Regularizer, register

SCHEDULES = ("cross-tuning", "always")
REGIONS = ("top", "bottom")
ATTRIBUTION_PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class ADDropConfig(RegularizerOptions):
    """AD-DROP's options; the fairseq flags are these names prefixed with ``--ad-drop-``."""

    FLAG_PREFIX = "--ad-drop-"

    p: float = option(
        0.2, "candidate region: the top ceil(p*n) of each query row's n real keys by attribution", "(0, 1)"
    )
    q: float = option(0.2, "drop probability of each candidate", "(0, 1)")
    region: str = option(
        "top",
        "which keys of each row are candidates: top = the highest-attribution ceil(p*n) (AD-DROP), bottom = the "
        "lowest (analysis only: the paper's Fig. 2 drops either end to show which one regularizes)",
        "top, bottom",
    )
    layers: str = layers_option()
    attention: str = attention_option()
    attribution: str = option(
        "ga", "gradient, integrated gradients, attention weights, random region", "ga, iga, aa, rd"
    )
    iga_steps: int = option(20, "integration steps m of attribution iga", "integer >= 1")
    labels: str = option(
        "pseudo", "attribution target labels: pass-1 argmax (the paper) or gold (its ablation)", "pseudo, gold"
    )
    schedule: str = option(
        "cross-tuning", "cross-tuning: plain on odd 1-based epochs, AD-DROP on even ones", "cross-tuning, always"
    )
    attribution_precision: str = option(
        "auto",
        "precision of the attribution pass (pass 1; pass 2 and the update keep the training precision): "
        "auto = the training precision, fp32 = autocast off, bf16 = under bf16 autocast (faster, a ranking "
        "only; docs/PERFORMANCE.md measures how often it picks the fp32 candidates)",
        "auto, fp32, bf16",
    )

    def validate(self) -> ADDropConfig:
        """Check every option; the error names the option as the user spelled it (core.options.option_name)."""
        flag = self.name
        for name in ("p", "q"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{flag(name)} must be an int or float in the open interval (0, 1), got {value!r}")
            if not (0.0 < float(value) < 1.0) or math.isnan(value):
                raise ValueError(f"{flag(name)} must be in the open interval (0, 1), got {value!r}")
        try:
            decimal_fraction(self.p)
        except ValueError as e:
            raise ValueError(f"{flag('p')}: {e}") from None
        self.check_site_options()
        if self.region not in REGIONS:
            raise ValueError(f"{flag('region')} must be one of {', '.join(REGIONS)}, got {self.region!r}")
        if self.attribution not in ATTRIBUTIONS:
            raise ValueError(
                f"{flag('attribution')} must be one of {', '.join(ATTRIBUTIONS)}, got {self.attribution!r}"
            )
        if not isinstance(self.iga_steps, int) or isinstance(self.iga_steps, bool) or self.iga_steps < 1:
            raise ValueError(f"{flag('iga_steps')} must be an integer >= 1, got {self.iga_steps!r}")
        if self.labels not in LABEL_SOURCES:
            raise ValueError(f"{flag('labels')} must be one of {', '.join(LABEL_SOURCES)}, got {self.labels!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{flag('schedule')} must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.attribution_precision not in ATTRIBUTION_PRECISIONS:
            raise ValueError(
                f"{flag('attribution_precision')} must be one of {', '.join(ATTRIBUTION_PRECISIONS)}, "
                f"got {self.attribution_precision!r}"
            )
        if self.region == "bottom" and self.attribution in ("rd", "aa"):
            what = (
                "draws its region at random"
                if self.attribution == "rd"
                else "ranks by attention weights, not attribution"
            )
            raise ValueError(
                f"{flag('region')} bottom ranks keys by attribution, but {flag('attribution')} "
                f"{self.attribution} {what}; use ga or iga, or region top"
            )
        if self.attribution == "rd" and self.attribution_precision != "auto":
            raise ValueError(
                f"{flag('attribution_precision')} {self.attribution_precision} sets the precision of the "
                f"attribution pass, which {flag('attribution')} rd does not run; leave it at auto"
            )
        return self


def ad_drop_epoch(schedule: str, epoch: int) -> bool:
    """Whether 1-based ``epoch`` is an AD-DROP epoch (paper Alg. 1: plain on odd epochs)."""
    # Refused rather than taken modulo 2: a 0-based loop (range(n)) would silently swap the phases,
    # and a float (HF's fractional state.epoch) says nothing about which epoch it is in.
    if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 1:
        raise ValueError(f"epoch must be a 1-based integer >= 1 (the first epoch is 1), got {epoch!r}")
    if schedule == "always":
        return True
    if schedule == "cross-tuning":
        return int(epoch) % 2 == 0
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def first_ad_drop_epoch(schedule: str, planned_epochs: int) -> Optional[int]:
    """The first 1-based epoch of a run of ``planned_epochs`` in which AD-DROP acts; None when it
    never acts (cross-tuning over one epoch: its first AD-DROP epoch is epoch 2)."""
    return next((e for e in range(1, min(planned_epochs, 2) + 1) if ad_drop_epoch(schedule, e)), None)


def _recorded(config: ADDropConfig) -> dict:
    """AD-DROP's fields as a run records them: those at a value that changes nothing are left out, so
    that runs recorded before they existed stay comparable."""
    return {
        k: v
        for k, v in vars(config).items()
        if (k != "iga_steps" or config.attribution == "iga") and (k != "attribution_precision" or v != "auto")
    }


def _idle_run(config: ADDropConfig, epochs: Optional[int], updates: Optional[int], plan: str) -> Optional[str]:
    """Cross-tuning over one planned epoch: its first AD-DROP epoch is epoch 2."""
    if epochs is None or first_ad_drop_epoch(config.schedule, epochs) is not None:
        return None
    return (
        f"{setting(config, 'schedule', config.schedule)} is plain in epoch 1 and runs AD-DROP from epoch 2 "
        f"(then every other epoch), and this run plans {count(epochs, 'epoch')} ({plan}): AD-DROP will "
        f"never act and the run trains a plain model. Set {setting(config, 'schedule', 'always')} to use "
        f"AD-DROP in every epoch, or plan at least 2 epochs{WHY_A_WARNING}"
    )


REGULARIZER = register(
    Regularizer(
        "ad_drop",
        AD_DROP,
        ADDropConfig,
        "",
        None,
        "ad_drop",
        passes=OWN_PASSES,
        idle=_idle_run,
        active_key="ad_drop_on",
        methods=(
            Method(
                "ad-drop",
                "AD-DROP (attribution pass, then the masked pass); classifiers p = q = 0.3, translation the "
                "plugin's --ad-drop-* defaults",
                {"p": 0.3, "q": 0.3},
                min_epochs=lambda config: 2 if config.schedule == "cross-tuning" else 1,
                epochs_advice=lambda config: (
                    f"{config.name('schedule')} {config.schedule}",
                    f"{config.name('schedule')} always",
                ),
                recorded=_recorded,
                fairseq_criterion="ad_drop_label_smoothed_cross_entropy",
                trainer="ADDropTrainer",
                log_keys=("ad_drop_on", "ad_drop_rate"),
            ),
        ),
    )
)
