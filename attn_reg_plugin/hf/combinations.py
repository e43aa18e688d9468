"""The regularizers a trainer class combines, checked against core.combinations' table when it is built.

A trainer combines regularizers by its mixins (``class T(ADDropTrainerMixin, RDropTrainerMixin, Trainer)``),
each declaring what it turns on (``attn_reg_regularizers``); each mixin's ``__init__`` asks :func:`check_trainer_combination` before the Trainer's own set-up, so
the first one to run refuses a combination that does not exist, naming both keywords.
"""

from __future__ import annotations

from typing import Callable, Dict

from ..core.regularizers.combinations import check_combination, regularizer_names

# A mixin's ``attn_reg_regularizers(trainer, kwargs)``: the regularizers it turns on, each with its keyword.
TurnsOn = Callable[[object, Dict[str, object]], Dict[str, str]]


def turns_on(regularizer: str, keyword: str) -> staticmethod:
    """``attn_reg_regularizers`` of a mixin that always turns on one ``regularizer`` by ``keyword``."""
    return staticmethod(lambda trainer, kwargs: {regularizer: keyword})


def trainer_regularizers(trainer, kwargs: Dict[str, object]) -> Dict[str, str]:
    """Each regularizer ``trainer``'s class turns on, with the keyword that turns it on, as each mixin in
    its bases declares (``attn_reg_regularizers``; the mixins are not imported here, they import this).
    ``kwargs``: the calling mixin's keywords, where a later mixin's still are."""
    on: Dict[str, str] = {}
    for cls in type(trainer).__mro__:
        declared = cls.__dict__.get("attn_reg_regularizers")
        if declared is not None:
            on.update(declared.__func__(trainer, kwargs))
    return {r: on[r] for r in regularizer_names() if r in on}


def check_trainer_combination(trainer, kwargs: Dict[str, object]) -> None:
    """Refuse ``trainer``'s class if its regularizers do not combine (core.combinations)."""
    check_combination(trainer_regularizers(trainer, kwargs))
