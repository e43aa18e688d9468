"""One rank of a ``torchrun --nproc_per_node 2`` HiddenCutTrainer run on CPU, for tests/hf/test_hf_hiddencut.py.

    torchrun --nproc_per_node 2 tests/hiddencut_rank.py OUT_DIR

Trains a tiny eager-attention BERT classifier (same seed on every rank) with HiddenCut's clean and cut
passes through the DDP wrapper, ``ddp_find_unused_parameters=False``, then writes ``OUT_DIR/rank{R}.pt``:
the initial and final parameters, the Trainer's log history, DDP's find_unused_parameters and, per
training log, this rank's own counts (tokens cut, real tokens of the cut layers), recorded just before
the trainer sums them over the ranks.
"""

import sys

import torch
import transformers

from attn_reg_plugin.core.regularizers.hiddencut import HiddenCutConfig
from attn_reg_plugin.hf.hiddencut_trainer import HiddenCutTrainer
from helpers import classification_rows, pad_collate


class LocalRecordingTrainer(HiddenCutTrainer):
    local = []

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            self.local.append((int(self.own_pass_sums["hiddencut_cut"]), int(self.own_pass_sums["hiddencut_tokens"])))
        return super().log(logs, *args, **kwargs)


def main(out_dir):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100,
        attn_implementation="eager",
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=3, per_device_train_batch_size=6, logging_steps=1, report_to=[],
        use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False, save_strategy="no",
        learning_rate=1e-3, seed=0, disable_tqdm=True, remove_unused_columns=False,
    )  # fmt: skip
    trainer = LocalRecordingTrainer(
        model=model,
        args=args,
        train_dataset=classification_rows(36, 1, vocab=100, length_spread=9),
        data_collator=pad_collate,
        hiddencut=HiddenCutConfig(ratio=0.3),
    )
    trainer.train()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    wrapped = trainer.model_wrapped
    torch.save(
        {
            "initial": initial,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "log_history": trainer.state.log_history,
            "local": trainer.local,
            "world_size": trainer.args.world_size,
            "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
        },
        f"{out_dir}/rank{rank}.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1])
