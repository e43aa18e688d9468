"""The two models the attribution commands load (attn-reg-attribution-agreement, -picture), built once here.

Each comes with what AD-DROP's pass 1 needs in training: a fairseq translation checkpoint with the
AD-DROP criterion (its attribution forward and pseudo-label token-loss target), and a transformers
sequence classifier with an ``ADDropTrainer`` (its forward inputs and pseudo-label logit target).
"""

from __future__ import annotations

import argparse
import tempfile
import weakref
from pathlib import Path

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.user_dir import FAIRSEQ_USER_DIR


def fairseq_translation(checkpoint: Path, data_bin: Path, device: str = "cpu"):
    """(model, task, criterion) of a checkpoint trained with ``--task attn_reg_translation``; the model in fp32."""
    import fairseq  # noqa: F401  (before the plugin: registration needs fairseq loaded)
    from fairseq import checkpoint_utils, utils

    import attn_reg_plugin.fairseq_plugin  # noqa: F401
    from attn_reg_plugin.fairseq_plugin.ad_drop_label_smoothed_cross_entropy import (
        ADDropLabelSmoothedCrossEntropyCriterion,
    )

    utils.import_user_module(argparse.Namespace(user_dir=FAIRSEQ_USER_DIR))
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data_bin)}
    )
    criterion = ADDropLabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1)
    criterion.init_ad_drop(task, ADDropConfig())  # its target: the pseudo-label token loss, as in training
    return models[0].float().to(device), task, criterion


def hf_classifier(model_dir: str, num_labels: int, device: str = "cpu"):
    """(tokenizer, model, trainer): a sequence classifier routed through the plugin by an ``ADDropTrainer``.

    A folder without a trained head (the offline MiniLM) gets a new one from torch's current seed.
    """
    import transformers

    from attn_reg_plugin.hf import ADDropTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=num_labels).to(device)
    # The trainer only takes attributions; its output folder goes when the trainer does (no empty
    # folder left in the temp dir per call).
    output_dir = tempfile.TemporaryDirectory(prefix="attn_reg_attribution_")
    args = transformers.TrainingArguments(output_dir=output_dir.name, report_to=[], use_cpu=device == "cpu")
    trainer = ADDropTrainer(model=model, args=args, ad_drop=ADDropConfig())
    weakref.finalize(trainer, output_dir.cleanup)
    return tokenizer, model, trainer
