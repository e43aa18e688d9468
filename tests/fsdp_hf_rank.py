"""One rank of the FSDP2 runs of the Hugging Face trainers, for tests/test_fsdp.py.

    torchrun --nproc_per_node 2 tests/fsdp_hf_rank.py OUT_DIR SCENARIO [SCENARIO ...]

The Trainer cannot shard on a CPU (accelerate wraps DDP instead), so this does what it does on
GPUs around the trainers' own step: build the trainer on the unsharded model, shard the model
with ``fully_shard`` (each BertLayer, then the root, as accelerate's transformer-layer policy
does), build the optimizer on the sharded parameters, then per update call the trainer's
``training_step``, step the optimizer and run the trainer's callbacks. A reference trainer on an
unsharded copy does the same with its gradients averaged by hand (DDP's job). Both train this
rank's half of each global batch from the same seeds; the rank writes losses, logged counts,
full gradients and parameters (and, for AttendOut, the Attacker's and the state saved in
``attendout.pt`` and read back into a fresh sharded trainer).
"""

import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig
from attn_reg_plugin.core.training.distributed import all_reduce_mean_
from attn_reg_plugin.core.training.sharding import is_fully_sharded
from attn_reg_plugin.hf import ADDropTrainer, AttendOutTrainer, AttnRegTrainer
from attn_reg_plugin.hf.attendout_checkpoint import ATTENDOUT_STATE
from helpers import classification_rows, pad_collate

BATCH, VOCAB = 8, 50


def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=VOCAB,
        pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def llama(tied):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
        vocab_size=VOCAB, pad_token_id=0, tie_word_embeddings=tied, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def rows(n, seed, causal=False):
    return classification_rows(n, seed, vocab=VOCAB, causal=causal)


def global_batch(step, rank, causal=False):
    batch = rows(BATCH, 100 + step, causal)
    return pad_collate(batch[rank * BATCH // 2 : (rank + 1) * BATCH // 2])


def shard_as_accelerate(model, layer_class, mesh):
    """What the Trainer's FSDP2 path does to the model: accelerate's own fsdp2_prepare_model (its
    embedding and tied-head units included), called with the few accelerator fields it reads."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[layer_class]
    )
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh={("dp_shard",): mesh},
        parallelism_config=SimpleNamespace(fsdp_dim_names=["dp_shard"]), mixed_precision="no",
        is_main_process=True, device=torch.device("cpu"),
    )  # fmt: skip
    return fsdp2_prepare_model(accelerator, model)


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def parameters(model):
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def make_trainer(scenario, out_dir, mesh):
    causal = "llama" in scenario
    model = llama("tied" in scenario) if causal else bert()
    args = transformers.TrainingArguments(
        output_dir=out_dir, use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no", disable_tqdm=True,
        per_device_train_batch_size=BATCH // 2, per_device_eval_batch_size=2, remove_unused_columns=False,
        max_grad_norm=0.5,
    )  # fmt: skip
    common = dict(model=model, args=args, data_collator=pad_collate, train_dataset=rows(BATCH, 0, causal))
    if scenario.startswith("ad-drop"):
        trainer = ADDropTrainer(**common, ad_drop=ADDropConfig(p=0.3, q=0.5, schedule="always"))
    elif scenario == "scheduled-dropout":
        trainer = AttnRegTrainer(**common, scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.4,3:0.2"))
    elif scenario.startswith("attendout"):
        trainer = AttendOutTrainer(
            **common, eval_dataset=rows(6, 1, causal), attendout=AttendOutConfig(dropout_step=2, generator_dim=8)
        )
    if scenario.endswith("-checkpointing") or scenario.endswith("-reentrant"):
        # What the Trainer does at train() for activation_checkpointing=True, before accelerate shards.
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": scenario.endswith("-reentrant")}
        )
    if mesh is not None and causal:
        model = trainer.model = shard_as_accelerate(model, "LlamaDecoderLayer", mesh)
    elif mesh is not None:
        for layer in model.bert.encoder.layer:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    trainer.current_gradient_accumulation_steps = 1  # set by the loop this harness stands in for
    return trainer


def update(trainer, step, rank, causal):
    """One optimizer update as the Trainer's loop runs it (its callbacks included)."""
    model = trainer.model
    torch.manual_seed(1000 + 10 * step + rank)
    loss = trainer.training_step(model, global_batch(step, rank, causal))
    if not is_fully_sharded(model):
        all_reduce_mean_([p.grad for p in model.parameters() if p.grad is not None])
    grads = {n: None if p.grad is None else full(p.grad).clone() for n, p in model.named_parameters()}
    trainer.optimizer.step()
    trainer.callback_handler.on_optimizer_step(trainer.args, trainer.state, trainer.control)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.state.global_step += 1
    trainer.callback_handler.on_step_end(trainer.args, trainer.state, trainer.control)
    return {"loss": loss.detach(), "grads": grads}


def counts(trainer):
    if isinstance(trainer, ADDropTrainer):
        return trainer.ad_drop_counts()
    if isinstance(trainer, AttnRegTrainer):
        (regularizer_counts,) = trainer._attn_reg_counts.values()  # the one regularizer's [done, of]
        return tuple(int(c) for c in regularizer_counts)
    return ()


def run(scenario, out_dir, rank, mesh):
    trainer = make_trainer(scenario, os.path.join(out_dir, f"{scenario}-{mesh is not None}"), mesh)
    steps = [update(trainer, step, rank, "llama" in scenario) for step in range(3)]
    result = {"steps": steps, "counts": counts(trainer), "params": parameters(trainer.model)}
    if isinstance(trainer, AttendOutTrainer):
        result["attacker_fsdp_units"] = [
            n for n, m in trainer.attendout_attacker.named_modules() if "FSDP" in type(m).__name__
        ]
        result["defender_fsdp_units"] = [n for n, m in trainer.model.named_modules() if "FSDP" in type(m).__name__]
        result["attacker_checkpointed"] = [
            n for n, m in trainer.attendout_attacker.named_modules() if m.__dict__.get("gradient_checkpointing")
        ]
        result["attacker"] = parameters(trainer.attendout_attacker)
        result["dropout_steps"] = trainer.attendout_game.dropout_steps_done
        state = trainer.attendout_state_dict()  # every rank: a sharded Attacker is gathered
        folder = os.path.join(out_dir, f"checkpoint-{scenario}-{mesh is not None}")
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
            torch.save(state, os.path.join(folder, ATTENDOUT_STATE))
        dist.barrier()
        result["saved_optimizer_keys"] = sorted(k for k in state if "optimizer" in k)
        # A fresh trainer reads it back at its first step, sharded the same way.
        fresh = make_trainer(scenario, os.path.join(out_dir, f"fresh-{mesh is not None}"), mesh)
        fresh._attendout_resume_from = folder
        fresh._attendout_start()
        result["loaded_attacker"] = parameters(fresh.attendout_attacker)
        momentum = fresh.attendout_optimizer.state
        result["loaded_momentum"] = {
            n: full(momentum[p]["momentum_buffer"]).clone()
            for n, p in fresh.attendout_attacker.named_parameters()
            if p in momentum
        }
        original = trainer.attendout_optimizer.state
        result["momentum"] = {
            n: full(original[p]["momentum_buffer"]).clone()
            for n, p in trainer.attendout_attacker.named_parameters()
            if p in original
        }
    return result


def refusals(out_dir, mesh):
    """What a trainer says when it is handed a model FSDP2 already shards."""
    model = bert()
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    args = transformers.TrainingArguments(output_dir=out_dir, use_cpu=True, ddp_backend="gloo", report_to=[])
    try:
        AttendOutTrainer(model=model, args=args, eval_dataset=rows(2, 1), attendout=AttendOutConfig())
    except ValueError as err:
        return {"AttendOutTrainer": str(err)}
    return {"AttendOutTrainer": None}


def main(out_dir, scenarios):
    probe = transformers.TrainingArguments(output_dir=out_dir, use_cpu=True, ddp_backend="gloo", report_to=[])
    _ = probe.device  # accelerate initialises the gloo process group from torchrun's environment
    rank = dist.get_rank()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {s: {"reference": run(s, out_dir, rank, None), "fsdp2": run(s, out_dir, rank, mesh)} for s in scenarios}
    results["refusals"] = refusals(out_dir, mesh)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
