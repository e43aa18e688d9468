"""Per-rank memory of one training step under FSDP2, on 1 rank against 2 (``attn-reg-sharded-memory``).

    attn-reg-sharded-memory --out outputs/sharded_memory.json            # CPU, gloo
    attn-reg-sharded-memory --device cuda --out outputs/sharded_memory_cuda.json

For each method (plain, AD-DROP GA, AttendOut) and each world size, ``torchrun`` starts the ranks;
each builds the same BERT classifier (about 30M parameters by default), shards it with
``fully_shard`` (each BertLayer, then the root; AttendOut: Defender and Attacker alike, the
Generator replicated), trains one warm-up step (so Adam's state exists), then measures a second
step. Reported per rank:

* ``model_state_mb``: this rank's parameters, gradients and optimizer state (its shards), counted
  from the tensors themselves: the part sharding divides;
* ``step_peak_mb``: the peak during the measured step. On CUDA, ``torch.cuda.max_memory_allocated``;
  on a CPU, the process's peak resident set (Linux VmHWM, reset before the step) minus the resident
  set before it, plus the parameters and optimizer state held before it: what the step holds, not
  the interpreter. The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536``, so tensors are mapped and
  unmapped and the resident set follows them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Dict, List

import torch

METHODS = ("plain", "ad-drop", "attendout")


# -- one rank -------------------------------------------------------------------------------
def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set (VmHWM)
            f.write("5")


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _model_state_bytes(model, optimizer) -> int:
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return _local_bytes(params) + _local_bytes(p.grad for p in params) + _local_bytes(states)


def _worker(method: str, hidden: int, layers: int, vocab: int, batch: int, length: int, device_kind: str) -> Dict:
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from attn_reg_plugin.core import ADDrop, ADDropConfig, AttendOut, AttendOutConfig, RegularizationController
    from attn_reg_plugin.core.regularizers.attendout import Generator, build_attacker
    from attn_reg_plugin.core.regularizers.attribution import logit_target
    from attn_reg_plugin.core.training.sharding import shard_like
    from attn_reg_plugin.hf.attention import install_attention_sites

    backend = "nccl" if device_kind == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_kind, rank) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device_kind, (world,))
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden, vocab_size=vocab, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config).to(device)
    controller = RegularizationController()
    install_attention_sites(model, controller)
    attacker = game = None
    if method == "attendout":
        attacker, attacker_controller = build_attacker(model, install_attention_sites)

    def shard(net):
        for layer in net.bert.encoder.layer:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)

    shard(model)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-4)]
    if attacker is not None:
        shard_like(model, attacker)
        optimizers.append(torch.optim.AdamW(attacker.parameters(), lr=1e-4))
        generator = Generator({"source": vocab}, {"source": 0}, 64, length, 0.2, 1.0).to(device)
        config = AttendOutConfig(dropout_step=100, generator_dim=64, max_positions=length)
        game = AttendOut(config, attacker_controller, generator)
    ad_drop = ADDrop(ADDropConfig(p=0.3, q=0.3), controller) if method == "ad-drop" else None
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, vocab, (batch, length), generator=g).to(device)
    labels = torch.randint(0, 2, (batch,), generator=g).to(device)

    def step():
        if ad_drop is not None:
            with ad_drop.masked(lambda: model(input_ids=ids).logits, logit_target, frozen=model):
                loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits, labels)
        else:
            loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits, labels)
        loss.backward()
        if attacker is not None:
            with attacker_controller.hooks(game.attacker_hooks({"source": ids})):
                torch.nn.functional.cross_entropy(attacker(input_ids=ids).logits, labels).backward()
        for opt in optimizers:
            opt.step()

    step()  # warm-up: the optimizer state exists from here on
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    nets = [model] + ([attacker] if attacker is not None else [])
    # Held before the step: this rank's parameters and optimizer state (its gradients were freed).
    held = sum(_model_state_bytes(n, o) for n, o in zip(nets, optimizers))
    before = None if device.type == "cuda" else _rss_mb("VmRSS")
    _reset_peak(device)
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = held / 2**20 + (_rss_mb("VmHWM") - before)
    result = {
        "rank": rank,
        "world": world,
        "method": method,
        "model_state_mb": round(sum(_model_state_bytes(n, o) for n, o in zip(nets, optimizers)) / 2**20, 1),
        "step_peak_mb": round(peak, 1),
        "parameters_global": int(sum(full.numel() for full in model.parameters())),
        "device": str(device),
    }
    dist.barrier()
    dist.destroy_process_group()
    return result


# -- the launcher -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(method: str, world: int, args) -> List[Dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
            "--master_port", str(_free_port()), "-m", "attn_reg_lab.sharded_memory", "--worker", method,
            "--worker-out", tmp, "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab",
            str(args.vocab), "--batch", str(args.batch), "--length", str(args.length), "--device", args.device,
        ]  # fmt: skip
        # glibc serves blocks of 64 KiB and more from mmap and unmaps them when freed (a fixed threshold
        # also stops it from raising itself), so the resident set follows the live tensors and its peak
        # is the step's; with its default, memory freed by the warm-up step is reused unseen.
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": "65536"}
        proc = subprocess.run(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise RuntimeError(f"{method} on {world} ranks failed:\n{proc.stdout[-4000:]}")
        return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/sharded_memory.json")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--worlds", default="1,2", help="comma-separated numbers of ranks")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=8, help="per rank")
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = _worker(args.worker, args.hidden, args.layers, args.vocab, args.batch, args.length, args.device)
        with open(os.path.join(args.worker_out, f"rank{result['rank']}.json"), "w") as f:
            json.dump(result, f)
        return 0
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown[0]!r}; accepted: {', '.join(METHODS)}")
    worlds = [int(w) for w in args.worlds.split(",")]
    if any(w < 1 for w in worlds):
        parser.error(f"--worlds: numbers of ranks must be >= 1, got {args.worlds}")
    from .provenance import environment

    rows = []
    for method in methods:
        for world in worlds:
            ranks = measure(method, world, args)
            row = {
                "method": method,
                "world": world,
                "model_state_mb": max(r["model_state_mb"] for r in ranks),
                "step_peak_mb": max(r["step_peak_mb"] for r in ranks),
                "parameters": ranks[0]["parameters_global"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "settings": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
