"""R-Drop over AD-DROP's masked pass for transformers' Trainer: the one combination the plugin allows
(core.combinations), its mixins in the one order that makes R-Drop's two passes AD-DROP's masked pass."""

import transformers

from .ad_drop_trainer import ADDropTrainerMixin
from .rdrop_trainer import RDropTrainerMixin


class ADDropRDropTrainer(ADDropTrainerMixin, RDropTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with R-Drop over AD-DROP's masked pass: ``ad_drop=ADDropConfig``, ``rdrop=RDropConfig``."""
