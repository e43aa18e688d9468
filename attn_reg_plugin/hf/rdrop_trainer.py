"""R-Drop for transformers' Trainer / Seq2SeqTrainer: the Trainer's own loss on two passes, plus
alpha times the symmetric KL of their output distributions (``core.rdrop``).

    loss = loss(pass 1) + loss(pass 2) + alpha * KL

``loss`` is what the Trainer computes for the model (its CE, label smoothing included), and KL is
the symmetric KL (``(KL(p1||p2) + KL(p2||p1)) / 2``, nats) summed over the same positions the CE
covers and divided by what the model's loss is divided by (:mod:`.own_passes_trainer`). Per token it
is R-Drop's official fairseq objective. The step is ``core.rdrop.rdrop_step``; this module checks the
options and the model. Evaluation runs one pass, the loss unchanged.

No attention sites are installed: R-Drop works through the model's own dropout, so any model runs.
"""

from __future__ import annotations

import warnings

import transformers

from ..core.regularizers.combinations import AD_DROP, RDROP, check_combination
from ..core.regularizers.options import named_by_field
from ..core.regularizers.planned_run import IdleRegularizerWarning
from ..core.regularizers.rdrop import RDropConfig, no_dropout_warning
from .combinations import trainer_regularizers, turns_on
from .own_passes_trainer import OwnPassesTrainerMixin, refuse_data_parallel


def _over_ad_drops_masked_pass(trainer) -> bool:
    """ADDropTrainerMixin's compute_loss runs first and calls this mixin's inside its masked pass."""
    from .ad_drop_trainer import ADDropTrainerMixin

    mro = type(trainer).__mro__
    return mro.index(ADDropTrainerMixin) < mro.index(RDropTrainerMixin)


class RDropTrainerMixin(OwnPassesTrainerMixin):
    """Shared by :class:`RDropTrainer` and :class:`RDropSeq2SeqTrainer`."""

    own_passes = "rdrop"
    attn_reg_regularizers = turns_on(RDROP, "rdrop=RDropConfig")

    def __init__(self, *args, rdrop: RDropConfig, **kwargs):
        if not isinstance(rdrop, RDropConfig):
            raise TypeError(f"rdrop must be an RDropConfig, got {type(rdrop).__name__}")
        self.rdrop = named_by_field(rdrop).validate()
        others = trainer_regularizers(self, kwargs)
        if AD_DROP in others and _over_ad_drops_masked_pass(self):
            # R-Drop as AD-DROP's masked pass (core.combinations), in its one order of the bases
            if self.rdrop.concat_batch:
                raise ValueError(
                    "R-Drop over AD-DROP does not take rdrop=RDropConfig(concat_batch=True): AD-DROP's attribution "
                    "pass ranks one copy of the batch, so the doubled batch has no attributions for its second half"
                )
        elif AD_DROP in others and len(others) == 2:
            raise ValueError(
                "R-Drop over AD-DROP needs ADDropTrainerMixin before RDropTrainerMixin in the class's bases, so that "
                "R-Drop's two passes are AD-DROP's masked pass (class T(ADDropTrainerMixin, RDropTrainerMixin, Trainer))"
            )
        check_combination(others)
        super().__init__(*args, **kwargs)
        refuse_data_parallel(self, "R-Drop")
        message = no_dropout_warning(
            self.model, "rdrop=RDropConfig", "set the config's dropout probabilities (hidden, attention) above 0"
        )
        if message:
            warnings.warn(message, IdleRegularizerWarning, stacklevel=2)

    def rdrop_kl(self) -> float:
        """The mean symmetric KL per position (nats) since the last log, over all processes."""
        return self.own_pass_stats()["rdrop_kl"]


class RDropTrainer(RDropTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with R-Drop; extra keyword ``rdrop: RDropConfig``."""


class RDropSeq2SeqTrainer(RDropTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with R-Drop; extra keyword ``rdrop: RDropConfig``."""
