"""One rank of a 2-rank Hugging Face Trainer run under DeepSpeed ZeRO (or DDP), for tests/test_deepspeed.py.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 tests/deepspeed_rank.py \\
        OUT_DIR {ad-drop,layerdrop} {ddp,ddp-bf16,zero1,zero2,zero2-bf16}

Trains a tiny BERT classifier (no hidden dropout, so runs with the same seeds are comparable) for
2 epochs: with AD-DROP cross-tuned (epoch 2 is AD-DROP) or attention LayerDrop, and writes
``OUT_DIR/rank{R}.pt``: the log history and the final parameters.
"""

import sys

import torch
import transformers

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
from attn_reg_plugin.hf import ADDropTrainer, AttnRegTrainer
from helpers import classification_rows, pad_collate


def deepspeed_config(mode):
    if mode.startswith("ddp"):
        return None
    stage = int(mode[len("zero")])
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
    }
    if mode.endswith("-bf16"):
        config["bf16"] = {"enabled": True}
    if mode.endswith("-fp16"):
        config["fp16"] = {"enabled": True}
    return config


def main(out_dir, regularizer, mode):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=50,
        pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    args = transformers.TrainingArguments(
        output_dir=out_dir, num_train_epochs=2, per_device_train_batch_size=4, logging_steps=1, report_to=[],
        use_cpu=True, ddp_backend="gloo", save_strategy="no", learning_rate=1e-3, seed=0, disable_tqdm=True,
        remove_unused_columns=False, deepspeed=deepspeed_config(mode), bf16=mode.endswith("-bf16"), fp16=mode.endswith("-fp16"),
    )  # fmt: skip
    common = dict(
        model=model, args=args, train_dataset=classification_rows(32, 1, length_spread=6), data_collator=pad_collate
    )
    if regularizer == "ad-drop":
        trainer = ADDropTrainer(**common, ad_drop=ADDropConfig(p=0.3, q=0.5))
    else:
        trainer = AttnRegTrainer(**common, layerdrop=AttentionLayerDropConfig(p=0.5))
    trainer.train()
    rank = torch.distributed.get_rank()
    engine = trainer.model_wrapped
    torch.save(
        {
            "log_history": trainer.state.log_history,
            "params": {k: v.detach().float().clone() for k, v in model.state_dict().items()},
            "engine": type(engine).__name__,
            "zero_stage": engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None,
        },
        f"{out_dir}/rank{rank}.pt",
    )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
