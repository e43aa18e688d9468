"""The regularizers a trainer class combines, checked against core.combinations' table when it is built.

A trainer combines regularizers by its mixins (``class T(ADDropTrainerMixin, RDropTrainerMixin, Trainer)``);
each mixin's ``__init__`` asks :func:`check_trainer_combination` before the Trainer's own set-up, so
the first one to run refuses a combination that does not exist, naming both keywords.
"""

from __future__ import annotations

from typing import Dict

from ..core.combinations import (
    AD_DROP,
    ATTENDOUT,
    ATTENTION_LAYERDROP,
    DROPHEAD,
    HIDDENCUT,
    RDROP,
    check_combination,
)


def _task_level(configs: Dict[str, object]) -> Dict[str, str]:
    """AttnRegTrainerMixin's regularizers, from its ``scheduled_dropout`` / ``layerdrop`` / ``drophead``."""
    on = {}
    scheduled, layerdrop, drophead = (configs.get(k) for k in ("scheduled_dropout", "layerdrop", "drophead"))
    if scheduled is not None:
        on[scheduled.regularizer] = f"scheduled_dropout=ScheduledDropoutConfig(schedule={scheduled.schedule!r})"
    if layerdrop is not None and layerdrop.enabled:
        on[ATTENTION_LAYERDROP] = "layerdrop=AttentionLayerDropConfig"
    if drophead is not None:
        on[DROPHEAD] = "drophead=DropHeadConfig"
    return on


def trainer_regularizers(trainer, kwargs: Dict[str, object]) -> Dict[str, str]:
    """Each regularizer ``trainer``'s class turns on, with the keyword that turns it on. ``kwargs``: the
    calling mixin's keywords, where AttnRegTrainerMixin's still are when that mixin comes later in the
    bases (once it took them, its attributes say)."""
    from .ad_drop_trainer import ADDropTrainerMixin
    from .attendout_trainer import AttendOutTrainerMixin
    from .attn_reg_trainer import AttnRegTrainerMixin
    from .hiddencut_trainer import HiddenCutTrainerMixin
    from .rdrop_trainer import RDropTrainerMixin

    on = {}
    for mixin, regularizer, keyword in (
        (ADDropTrainerMixin, AD_DROP, "ad_drop=ADDropConfig"),
        (AttendOutTrainerMixin, ATTENDOUT, "attendout=AttendOutConfig"),
        (RDropTrainerMixin, RDROP, "rdrop=RDropConfig"),
        (HiddenCutTrainerMixin, HIDDENCUT, "hiddencut=HiddenCutConfig"),
    ):
        if isinstance(trainer, mixin):
            on[regularizer] = keyword
    if isinstance(trainer, AttnRegTrainerMixin):
        attn_reg_configs = {k: kwargs.get(k) for k in ("scheduled_dropout", "layerdrop", "drophead")}
        if not any(v is not None for v in attn_reg_configs.values()):
            attn_reg_configs = {
                "scheduled_dropout": getattr(getattr(trainer, "attn_reg_scheduled_dropout", None), "config", None),
                "layerdrop": getattr(getattr(trainer, "attn_reg_layerdrop", None), "config", None),
                "drophead": getattr(getattr(trainer, "attn_reg_drophead", None), "config", None),
            }
        on.update(_task_level(attn_reg_configs))
    return on


def check_trainer_combination(trainer, kwargs: Dict[str, object]) -> None:
    """Refuse ``trainer``'s class if its regularizers do not combine (core.combinations)."""
    check_combination(trainer_regularizers(trainer, kwargs))
