"""``--criterion rdrop_label_smoothed_cross_entropy``: label-smoothed cross-entropy with R-Drop
(``--rdrop-alpha``, ``--rdrop-concat-batch``), with ``--task translation`` or ``attn_reg_translation``.

Training: two passes (two forwards, or one of a concatenated *copy* of ``net_input``); the loss is
the sum over real target tokens of both passes' label-smoothed CE plus alpha times the symmetric KL
(``core.rdrop.rdrop_step``), divided by one copy's ``ntokens``: R-Drop's official fairseq code
(:mod:`.own_passes_criterion`). Validation: one pass, the stock loss, so valid loss is comparable with
a plain run's.

Why not fairseq's own ``label_smoothed_cross_entropy_with_rdrop``: fairseq 0.12.2 does not have it
(added after it, in 0.12.3); it concatenates ``sample['net_input']`` in place (fairseq#5410) and
runs the doubled batch in validation too, so its valid loss is two passes' CE, twice a plain run's.
"""

import logging
from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterionConfig

from ..core.regularizers.combinations import RDROP
from ..core.regularizers.rdrop import RDropConfig, no_dropout_warning
from .options import fairseq_options
from .own_passes_criterion import OwnPassesCriterion

NAME = "rdrop_label_smoothed_cross_entropy"
FAIRSEQ_DROPOUT = "set --dropout (and --attention-dropout, --activation-dropout) above 0"

logger = logging.getLogger(__name__)

# The --rdrop-* flags: RDropConfig's fields, defaults and help (core.options).
RDropOptions = fairseq_options("RDropOptions", [RDropConfig])


@dataclass
class RDropLabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig, RDropOptions):
    pass


@register_criterion(NAME, dataclass=RDropLabelSmoothedCrossEntropyConfig)
class RDropLabelSmoothedCrossEntropyCriterion(OwnPassesCriterion):
    """Label-smoothed cross-entropy trained with R-Drop; validation is the base criterion unchanged."""

    regularizers = (RDROP,)
    own_passes = "rdrop"
    name = NAME

    @classmethod
    def build_criterion(cls, cfg, task):
        """The base criterion, built as fairseq builds it, then R-Drop's options from the same cfg (checked here)."""
        criterion = super().build_criterion(cfg, task)
        criterion.rdrop_config = RDropConfig.from_namespace(cfg).validate()
        criterion.criterion_name = str(getattr(cfg, "_name", NAME))  # as the user named it (a subclass's too)
        return criterion

    def own_pass_sites(self, model):
        if not getattr(self, "dropout_checked", False):  # once, at the first training step
            self.dropout_checked = True
            message = no_dropout_warning(model, f"--criterion {self.criterion_name}", FAIRSEQ_DROPOUT)
            if message:
                logger.warning(message)
        return None
