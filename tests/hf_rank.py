"""One rank of a ``torchrun --nproc_per_node 2`` ADDropTrainer run on CPU, for tests/test_distributed.py.

    torchrun --nproc_per_node 2 tests/hf_rank.py OUT_DIR

Trains a tiny BERT classifier (from BertConfig, same seed on every rank) for 2 epochs with
cross-tuning (epoch 2 is AD-DROP), then writes ``OUT_DIR/rank{R}.pt``: the final parameters,
the Trainer's log history and, per training log, this rank's own dropped / valid counts
(recorded just before the trainer sums them over the ranks).
"""

import sys

import torch
import transformers

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.hf import ADDropTrainer
from helpers import classification_rows, pad_collate


class CountRecordingTrainer(ADDropTrainer):
    local_counts = []

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            self.local_counts.append((int(self._ad_drop_dropped), int(self._ad_drop_droppable)))
        return super().log(logs, *args, **kwargs)


def main(out_dir):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        attn_implementation="sdpa",
    )
    model = transformers.BertForSequenceClassification(config)
    args = transformers.TrainingArguments(
        output_dir=out_dir,
        num_train_epochs=2,
        per_device_train_batch_size=6,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        learning_rate=1e-3,
        seed=0,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = CountRecordingTrainer(
        model=model,
        args=args,
        train_dataset=classification_rows(48, 1, vocab=100, length_spread=9),
        data_collator=pad_collate,
        ad_drop=ADDropConfig(p=0.3, q=0.3),
    )
    trainer.train()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.save(
        {
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "log_history": trainer.state.log_history,
            "local_counts": trainer.local_counts,
            "world_size": trainer.args.world_size,
        },
        f"{out_dir}/rank{rank}.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1])
