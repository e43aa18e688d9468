"""One rank of the FSDP2 equivalence runs of tests/test_fsdp.py (porting API, plain PyTorch).

    torchrun --nproc_per_node 2 tests/fsdp_rank.py OUT_DIR SCENARIO [SCENARIO ...]

Every rank builds the custom seq2seq model of examples/custom_seq2seq twice from one seed: a
reference, unsharded, whose gradients are averaged over the ranks by hand as DDP would, and a
copy sharded with ``fully_shard`` (each layer, then the root) over a 2-rank gloo mesh. Both train
the rank's half of one global batch from the same random state, and the rank writes, per
scenario, what each did: losses, AD-DROP's masks and counts, the full (gathered) gradients and
parameters after every update. The test compares them.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples", "custom_seq2seq"))

from seq2seq_model import Seq2SeqTransformer  # noqa: E402

import attn_reg_plugin.core.kernel.blockwise as blockwise  # noqa: E402
from attn_reg_plugin.core import (  # noqa: E402
    ADDrop,
    ADDropConfig,
    AttendOut,
    AttendOutConfig,
    AttentionLayerDrop,
    AttentionLayerDropConfig,
    RegularizationController,
    ScheduledAttentionDropout,
    ScheduledDropoutConfig,
    token_loss_target,
)
from attn_reg_plugin.core.regularizers.attendout import (  # noqa: E402
    Generator,
    build_attacker,
    copy_model_state,
    copy_optimizer_state,
    end_dropout_step,
)
from attn_reg_plugin.core.training.distributed import all_reduce_mean_  # noqa: E402
from attn_reg_plugin.core.training.sharding import check_supported_sharding, is_fully_sharded, shard_like  # noqa: E402

PAD, BOS, VOCAB, BATCH = 0, 2, 40, 8
ALL_KINDS = "encoder-self,decoder-self,encoder-decoder"
RECORDED = []  # AD-DROP's drop masks, in the order the kernel makes them (one block per call)
_rule_drops = blockwise.rule_drops


def _recording_rule_drops(*args):
    made = _rule_drops(*args)
    if made[0] is not None:  # a call with a drop rule
        RECORDED.append(made[0].clone())
    return made


blockwise.rule_drops = _recording_rule_drops


def build(controller):
    torch.manual_seed(0)
    return Seq2SeqTransformer(
        VOCAB, PAD, dim=16, heads=2, ffn_dim=32, encoder_layers=2, decoder_layers=2, dropout=0.0,
        attention_dropout=0.0, controller=controller,
    )  # fmt: skip


def shard(model, mesh, **settings):
    for layer in list(model.encoder) + list(model.decoder):
        fully_shard(layer, mesh=mesh, **settings)
    fully_shard(model, mesh=mesh, **settings)


def batch(step, rank):
    """This rank's half of global batch ``step``: padded sources and targets."""
    g = torch.Generator().manual_seed(10 + step)
    src = torch.randint(3, VOCAB, (BATCH, 7), generator=g)
    src[::3, -2:] = PAD
    tgt = torch.randint(3, VOCAB, (BATCH, 6), generator=g)
    tgt[1::3, -1] = PAD
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    src, tgt = src[half], tgt[half]
    prev = torch.cat([torch.full((tgt.shape[0], 1), BOS), tgt[:, :-1]], 1)
    return src, prev, tgt


def loss_of(model, src, prev, tgt):
    logits = model(src, prev)
    return F.cross_entropy(logits.transpose(1, 2), tgt, ignore_index=PAD, reduction="sum") / tgt.ne(PAD).sum()


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gradients(model):
    """Full gradients averaged over the ranks: FSDP2 reduced them already; the reference, by hand."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    if not is_fully_sharded(model):
        all_reduce_mean_([g for g in grads.values() if g is not None])
    return {n: None if g is None else full(g).detach().clone() for n, g in grads.items()}


def parameters(model):
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def train_ad_drop(model, controller, rank, attribution, steps=2):
    ad_drop = ADDrop(ADDropConfig(p=0.3, q=0.5, attention=ALL_KINDS, attribution=attribution, iga_steps=3), controller)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    record = []
    for step in range(steps):
        src, prev, tgt = batch(step, rank)
        keep = tgt.ne(PAD)
        RECORDED.clear()
        torch.manual_seed(100 + 10 * step + rank)  # each rank its own draws, as under DDP
        target = lambda logits, labels: token_loss_target(logits, keep, labels)  # noqa: E731
        with ad_drop.masked(lambda: model(src, prev), target, frozen=model) as stats:
            loss = loss_of(model, src, prev, tgt)
        loss.backward()
        record.append(
            {
                "loss": loss.detach(),
                "masks": list(RECORDED),
                "dropped": int(stats["dropped"]),
                "droppable": int(stats["droppable"]),
                "grads": gradients(model),
            }
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"steps": record, "params": parameters(model)}


def train_no_extra_cost(model, controller, rank, regularizer, steps=2):
    if regularizer == "scheduled-dropout":
        reg = ScheduledAttentionDropout(ScheduledDropoutConfig(schedule="0:0.4,4:0.1", attention=ALL_KINDS), controller)
    else:
        reg = AttentionLayerDrop(AttentionLayerDropConfig(p=0.5, attention=ALL_KINDS), controller)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    record = []
    for step in range(steps):
        src, prev, tgt = batch(step, rank)
        torch.manual_seed(100 + 10 * step + rank)
        hooks = reg.hooks(step) if regularizer == "scheduled-dropout" else reg.hooks()
        with controller.hooks(hooks):
            loss = loss_of(model, src, prev, tgt)
        loss.backward()
        record.append({"loss": loss.detach(), "grads": gradients(model)})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"steps": record, "params": parameters(model)}


def train_attendout(defender, controller, rank, mesh):
    """Two updates of a dropout step of T = 2, then the held-out duel and the re-sync."""
    del controller  # the Defender's sites stay idle
    # The copy's modules hold copies of D's sites (the model registered them at construction).
    attacker, attacker_controller = build_attacker(defender, lambda copy, c: [c.add(s) for s in copy.controller.sites])
    if mesh is not None:
        shard(defender, mesh)
        shard_like(defender, attacker)
    torch.manual_seed(7)  # the Generator is replicated: the same on every rank
    generator = Generator({"source": VOCAB, "target": VOCAB}, {"source": PAD, "target": PAD}, 8, 16, 0.3, 1.0)
    game = AttendOut(
        AttendOutConfig(dropout_step=2, attention=ALL_KINDS, generator_dim=8, max_positions=16),
        attacker_controller,
        generator,
    )
    # Momentum: per-parameter state for the re-sync to copy. (Adam would turn the ~1e-9 noise in the
    # zero gradients of the key biases into full steps, in either run.)
    optimizers = {
        "defender": torch.optim.SGD(defender.parameters(), lr=0.5, momentum=0.9),
        "attacker": torch.optim.SGD(attacker.parameters(), lr=0.5, momentum=0.9),
    }
    nets = {"defender": defender, "attacker": attacker}
    record = []
    for step in range(2):
        src, prev, tgt = batch(step, rank)
        torch.manual_seed(100 + 10 * step + rank)
        d_loss = loss_of(defender, src, prev, tgt)
        d_loss.backward()
        with attacker_controller.hooks(game.attacker_hooks({"source": src, "target": prev})):
            a_loss = loss_of(attacker, src, prev, tgt)
        a_loss.backward()
        record.append({"loss": d_loss.detach(), "attacker_loss": a_loss.detach()})
        for name, net in nets.items():
            if not is_fully_sharded(net):  # the reference: averaged by hand (DDP would, for D)
                all_reduce_mean_([p.grad for p in net.parameters() if p.grad is not None])
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
        game.end_update()

    def copy_network(source, destination):
        copy_model_state(nets[source], nets[destination])
        copy_optimizer_state(
            optimizers[source],
            list(nets[source].parameters()),
            optimizers[destination],
            list(nets[destination].parameters()),
        )

    heldout = [batch(5, 0)]  # the same held-out samples on every rank

    def logits_of(model, held):
        src, prev, tgt = held
        return model(src, prev), tgt, tgt.ne(PAD)

    torch.manual_seed(55)
    before = {name: parameters(net) for name, net in nets.items()}
    stats = end_dropout_step(game, defender, attacker, heldout, logits_of, copy_network)
    # The step after the re-sync: both networks must train from the survivor's weights and moments.
    src, prev, tgt = batch(3, rank)
    for name, net in nets.items():
        loss_of(net, src, prev, tgt).backward()
        if not is_fully_sharded(net):
            all_reduce_mean_([p.grad for p in net.parameters() if p.grad is not None])
        optimizers[name].step()
    return {
        "steps": record,
        "before_sync": before,
        "keep_attacker": stats["keep_attacker"],
        "win_rate": stats["win_rate"],
        "reward": stats["reward"],
        "generator": {k: v.clone() for k, v in generator.state_dict().items()},
        "after": {name: parameters(net) for name, net in nets.items()},
    }


def bf16_parameters(rank, mesh, layers_only=False):
    """AD-DROP under FSDP2 mixed precision (bf16 compute, fp32 gradient reduction): no reference to
    equal, so what it did: losses, counts, gradients (fp32, finite). ``layers_only``: the root is not
    sharded, so every layer is a root of its own."""
    controller = RegularizationController()
    model = build(controller)
    if mesh is None:
        return None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if layers_only:  # the unsharded embeddings and head stay fp32: the layers hand back fp32
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
        for layer in list(model.encoder) + list(model.decoder):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    else:
        shard(model, mesh, mp_policy=policy)
    return train_ad_drop(model, controller, rank, "ga")


def refusals(mesh):
    """What check_supported_sharding says about the FSDP2 settings it refuses."""
    said = {}
    # (reshard_after_forward=<int> needs 4 ranks or more: on 2, FSDP2 reads 1 as False and 2 as True.)
    for name, settings in {"offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)}}.items():
        model = build(RegularizationController())
        shard(model, mesh, **settings)
        try:
            check_supported_sharding(model, "ADDrop")
            said[name] = None
        except NotImplementedError as err:
            said[name] = str(err)
    plain = build(RegularizationController())
    shard(plain, mesh)
    check_supported_sharding(plain, "ADDrop")  # raises nothing
    return said


def run(scenario, rank, mesh):
    if scenario.startswith("ad-drop-bf16-parameters"):
        return bf16_parameters(rank, mesh, layers_only=scenario.endswith("-layers-only"))
    controller = RegularizationController()
    model = build(controller)
    if scenario == "attendout":
        return train_attendout(model, controller, rank, mesh)
    if mesh is not None:
        shard(model, mesh)
    if scenario.startswith("ad-drop-"):
        return train_ad_drop(model, controller, rank, scenario[len("ad-drop-") :])
    return train_no_extra_cost(model, controller, rank, scenario)


def main(out_dir, scenarios):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.set_num_threads(1)
    results = {s: {"reference": run(s, rank, None), "fsdp2": run(s, rank, mesh)} for s in scenarios}
    results["refusals"] = refusals(mesh)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
