"""fairseq task wrappers: they route attention through the plugin and track the epoch.

``attn_reg_translation`` is fairseq's ``translation`` task plus two duties: after the model
is built, every MultiheadAttention is routed through the core kernel (no new parameters),
and ``begin_epoch`` records the 1-based epoch that cross-tuning reads.
"""

from dataclasses import dataclass, field

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..core.controller import RegularizationController
from .attention import install_attention_sites


class AttnRegTaskMixin:
    """What every attn_reg task adds to its fairseq base task."""

    attn_reg_epoch: int = 1
    attn_reg_controller: RegularizationController = None

    def build_model(self, cfg, *args, **kwargs):  # from_checkpoint exists only in newer fairseq
        model = super().build_model(cfg, *args, **kwargs)
        # One controller per task: fairseq-train builds one model. (fairseq-generate with
        # several checkpoints builds more; they stay idle, so sharing the registry is harmless.)
        if self.attn_reg_controller is None:
            self.attn_reg_controller = RegularizationController()
        install_attention_sites(model, self.attn_reg_controller)
        return model

    def build_criterion(self, cfg, *args, **kwargs):
        criterion = super().build_criterion(cfg, *args, **kwargs)
        attach = getattr(criterion, "attach_attention_sites", None)
        if attach is not None:
            if self.attn_reg_controller is None:
                raise RuntimeError("attn_reg_plugin: the model must be built before the criterion")
            attach(self.attn_reg_controller)  # validates layers / kinds against the model
        return criterion

    def begin_epoch(self, epoch, model):
        super().begin_epoch(epoch, model)
        self.attn_reg_epoch = epoch


@dataclass
class AttnRegTranslationConfig(TranslationConfig):
    # fairseq's own option name (its audio tasks have it); get_batch_iterator reads it.
    rebuild_batches: bool = field(default=False, metadata={
        "help": "rebuild the training batches every epoch (equal-length sentences grouped by seed + epoch) "
                "instead of once per process; a run resumed from a checkpoint then sees exactly the batches "
                "of an uninterrupted run"})


@register_task("attn_reg_translation", dataclass=AttnRegTranslationConfig)
class AttnRegTranslationTask(AttnRegTaskMixin, TranslationTask):
    """fairseq's translation task with its attention routed through attn_reg_plugin."""
