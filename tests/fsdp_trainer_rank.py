"""One rank of the Trainer's own FSDP2 run (a CUDA GPU per rank), for ``make gpu-check``.

    torchrun --nproc_per_node N tests/fsdp_trainer_rank.py OUT_DIR {ad-drop,attendout,scheduled-dropout}

accelerate shards a tiny BERT (each BertLayer, then the root) with ``fsdp_config={"version": 2}``
and trains it 2 epochs (AD-DROP: ``schedule="always"``; AttendOut: T = 2) with
``activation_checkpointing=True``, saving a checkpoint at the end; then a second trainer resumes
from it. Writes ``OUT_DIR/rank{R}.pt``: the log history, whether the model (and the Attacker) were
sharded, and the resumed AttendOut game's state.
"""

import os
import sys

import torch
import transformers

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig
from attn_reg_plugin.core.training.sharding import is_fully_sharded
from attn_reg_plugin.hf import ADDropTrainer, AttendOutTrainer, AttnRegTrainer
from attn_reg_plugin.hf.trainer_arguments import checkpointing_argument
from helpers import classification_rows, pad_collate


def trainer_for(kind, out_dir, epochs):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=50,
        pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    args = transformers.TrainingArguments(
        output_dir=out_dir, num_train_epochs=epochs, per_device_train_batch_size=4, logging_steps=1, report_to=[],
        save_strategy="epoch", learning_rate=1e-3, seed=0, disable_tqdm=True, remove_unused_columns=False,
        **checkpointing_argument(True), fsdp="full_shard",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]},
    )  # fmt: skip
    common = dict(
        model=model, args=args, train_dataset=classification_rows(32, 0, length_spread=6), data_collator=pad_collate
    )
    if kind == "ad-drop":
        return ADDropTrainer(**common, ad_drop=ADDropConfig(p=0.3, q=0.5, schedule="always"))
    if kind == "scheduled-dropout":
        return AttnRegTrainer(**common, scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.3"))
    return AttendOutTrainer(
        **common,
        eval_dataset=classification_rows(8, 1, length_spread=6),
        attendout=AttendOutConfig(dropout_step=2, generator_dim=8),
    )


def main(out_dir, kind):
    trainer = trainer_for(kind, out_dir, epochs=2)
    trainer.train()
    result = {"log_history": trainer.state.log_history, "sharded": is_fully_sharded(trainer.model)}
    if isinstance(trainer, AttendOutTrainer):
        result["attacker_sharded"] = is_fully_sharded(trainer.attendout_attacker)
        result["game"] = trainer.attendout_game.dropout_steps_done
        resumed = trainer_for(kind, out_dir, epochs=3)
        resumed.train(resume_from_checkpoint=True)
        result["resumed_log_history"] = resumed.state.log_history
        result["resumed_game"] = resumed.attendout_game.dropout_steps_done
    rank = torch.distributed.get_rank()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
