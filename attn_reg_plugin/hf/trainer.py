"""Old import path of :mod:`attn_reg_plugin.hf.ad_drop_trainer`, kept for one release."""
from .ad_drop_trainer import ADDropSeq2SeqTrainer, ADDropTrainer, ADDropTrainerMixin  # noqa: F401
from .model_inputs import decoder_input_ids_from_labels  # noqa: F401
