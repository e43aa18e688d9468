"""Old import path of :mod:`attn_reg_plugin.hf.attendout_trainer` and
:mod:`attn_reg_plugin.hf.attn_reg_trainer`, kept for one release."""
from .attendout_trainer import (  # noqa: F401
    ATTENDOUT_STATE,
    AttendOutSeq2SeqTrainer,
    AttendOutTrainer,
    AttendOutTrainerMixin,
    optimizer_like,
)
from .attn_reg_trainer import AttnRegSeq2SeqTrainer, AttnRegTrainer, AttnRegTrainerMixin  # noqa: F401
