"""What a fairseq criterion that runs regularizer passes of its own declares to the attn_reg tasks.

AD-DROP, R-Drop and HiddenCut train through criteria (their passes are the loss's), the other
regularizers through the task (:mod:`.attn_reg_task`). A :class:`RegularizingCriterion` names its
regularizers as :mod:`..core.regularizers.combinations` names them; an attn_reg task, when it builds the criterion,
refuses them beside a regularizer of its own unless core.combinations lists the pair, and hands a
criterion whose passes edit attention calls (``edits_attention``) the task's controller. With one of
fairseq's own tasks (no regularizer of its own, no controller) a criterion trains as it is.
"""

from typing import Optional, Sequence, Tuple


class RegularizingCriterion:
    """A criterion's regularizers (``regularizers``) and, where its passes edit attention calls
    (``edits_attention``: AD-DROP's masked pass), how it takes the task's controller."""

    regularizers: Tuple[str, ...] = ()
    edits_attention: bool = False

    def attach_attention_sites(self, controller) -> None:
        """Take the task's :class:`~..core.kernel.controller.RegularizationController` (its model's attention
        sites), once, before training; checks the criterion's options against the model."""
        raise NotImplementedError(f"{type(self).__name__} edits attention calls but takes no controller")

    def configs(self) -> Sequence[object]:
        """The configs of its regularizers (the planned-run warning reads them)."""
        return ()

    def begin_epoch(self, epoch: int) -> Optional[str]:
        """Called by the attn_reg task at the start of every epoch; returns a line for its log, if any
        (AD-DROP names the epoch's phase)."""
        return None
