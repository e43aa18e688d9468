"""One measurement of ``attn-reg-scaling`` in a fresh process: the models, each method's training
step, and what is measured (see :mod:`attn_reg_lab.scaling` for the grid, the report and the
targets). Run as ``python -m attn_reg_lab.scaling --worker SPEC``."""

from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional

MIB = 2**20

MODELS = {
    "a": dict(kind="core", dim=64, heads=2, layers=2, description="porting-API encoder, width 64, 2 heads, 2 layers"),
    "b": dict(
        kind="core", dim=768, heads=12, layers=2, description="porting-API encoder, width 768, 12 heads, 2 layers"
    ),
    "c": dict(
        kind="hf", dim=64, heads=4, layers=2, description="tiny HF Llama (hidden 64, 4 heads, 2 layers), Trainer"
    ),
    # Where users need it most: long sequences with gradient checkpointing, wide enough that what the
    # regularizer keeps outside the checkpointed layers shows (on (c) the gap hides).
    "d": dict(
        kind="hf",
        dim=128,
        heads=4,
        kv_heads=2,
        layers=4,
        checkpointing=True,
        description="tiny HF Llama (hidden 128, 4 heads, 2 key/value heads, 4 layers), Trainer, gradient checkpointing",
    ),  # fmt: skip
}
METHODS = ("plain", "ga", "aa", "rd", "iga", "sched-dropout", "attendout", "attendout-update", "hiddencut")
TRAINER_ONLY_METHODS = ("hiddencut",)  # a baseline with a Trainer of its own: models c and d
AD_DROP_METHODS = ("ga", "aa", "rd", "iga")
DEFAULT_LENGTHS = (128, 512, 1024, 2048, 4096, 8192)
AD_DROP_P = AD_DROP_Q = 0.3
SCHEDULE = "0:0.3,10000:0.1"
VOCAB = 1000
PAD = 0
RESULT_MARK = "SCALING_RESULT "


# ===================================================================== the child: one measurement
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set (VmHWM)
            f.write("5")
        return True
    except OSError:
        return False


def build_encoder(dim: int, heads: int, layers: int, max_len: int):
    """The porting-API encoder: token + learned position embeddings, pre-LN blocks, mean-pooled 2-class head.

    Its attention sites are registered with its own ``controller``; ``install_sites(net, controller)``
    registers a copy's (AttendOut's Attacker) with another."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from attn_reg_plugin.core import RegularizationController, attend

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.site = None

        def forward(self, x, allowed):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            o, _ = attend(q, k, v, bias=allowed, site=self.site)
            return self.out(o.transpose(1, 2).reshape(b, t, dim))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.norm1, self.norm2 = SelfAttention(), nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x, allowed):
            x = x + F.dropout(self.attn(self.norm1(x), allowed), 0.1, self.training)
            return x + F.dropout(self.ffn(self.norm2(x)), 0.1, self.training)

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.positions = nn.Embedding(VOCAB, dim, padding_idx=PAD), nn.Embedding(max_len, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 2)
            self.controller = RegularizationController()
            install_sites(self, self.controller)

        def forward(self, ids):
            real = ids.ne(PAD)
            allowed = real[:, None, None, :]  # key padding, True = may attend (none in these batches)
            x = self.embed(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x, allowed)
            x = self.norm(x)
            return self.head((x * real[..., None]).sum(1) / real.sum(1, keepdim=True))

    def install_sites(net, controller):
        for i, block in enumerate(net.blocks):
            block.attn.site = controller.register("encoder-self", i)

    return Encoder(), install_sites


def _core_step(spec: dict):
    """(model, step function) of one method on a core-API encoder; step() runs one training update."""
    import torch
    import torch.nn.functional as F

    from attn_reg_plugin.core import (
        ADDrop,
        ADDropConfig,
        AttendOut,
        AttendOutConfig,
        ScheduledAttentionDropout,
        ScheduledDropoutConfig,
        logit_target,
    )
    from attn_reg_plugin.core.regularizers.attendout import Generator, build_attacker

    cfg, method, length = MODELS[spec["model"]], spec["method"], spec["length"]
    torch.manual_seed(spec["seed"])
    model, install_sites = build_encoder(cfg["dim"], cfg["heads"], cfg["layers"], max_len=length)
    model.train()
    g = torch.Generator().manual_seed(spec["seed"])
    ids = torch.randint(3, VOCAB, (1, length), generator=g)
    labels = torch.tensor([1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    info: Dict[str, object] = {}

    def loss_of(net):
        return F.cross_entropy(net(ids), labels)

    if method == "plain":

        def update():
            loss_of(model).backward()

    elif method in AD_DROP_METHODS:
        config = ADDropConfig(
            p=AD_DROP_P, q=AD_DROP_Q, attribution=method, layers="all", attention="encoder-self",
            schedule="always", iga_steps=spec["iga_steps"],
        )  # fmt: skip
        ad_drop = ADDrop(config, model.controller)

        def update():
            with ad_drop.masked(lambda: model(ids), logit_target, frozen=model) as stats:
                loss = loss_of(model)
            loss.backward()
            droppable = int(stats["droppable"])
            info["drop_rate"] = round(int(stats["dropped"]) / droppable, 4) if droppable else None

    elif method == "sched-dropout":
        sched = ScheduledAttentionDropout(
            ScheduledDropoutConfig(schedule=SCHEDULE, attention="encoder-self"), model.controller
        )
        counter = {"update": 0}

        def update():
            with model.controller.hooks(sched.hooks(counter["update"])):
                loss = loss_of(model)
            loss.backward()
            counter["update"] += 1

    elif method in ("attendout", "attendout-update"):
        attacker, attacker_controller = build_attacker(model, install_sites)
        attacker_optimizer = torch.optim.AdamW(attacker.parameters(), lr=1e-4)
        # attendout-update: a dropout step of one update, so every step also makes the Generator's
        # REINFORCE update (its log-probability over the whole map); the batch's own losses stand for
        # the held-out ones. attendout: one update of the duel (the update comes every T of them).
        updates = 1 if method == "attendout-update" else 10**6
        config = AttendOutConfig(dropout_step=updates, attention="encoder-self", layers="all", max_positions=length)
        generator = Generator(
            {"source": VOCAB}, {"source": PAD}, config.generator_dim, length, config.init_drop, config.temperature
        )
        game = AttendOut(config, attacker_controller, generator)

        def update():
            defender_loss = loss_of(model)
            defender_loss.backward()
            with attacker_controller.hooks(game.attacker_hooks({"source": ids})):
                loss = loss_of(attacker)
            loss.backward()
            attacker_optimizer.step()
            attacker_optimizer.zero_grad(set_to_none=True)
            if game.end_update():
                game.finish_dropout_step(defender_loss.detach().view(1), loss.detach().view(1))

    else:
        raise ValueError(method)

    def step():
        update()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, info


def _profile(step, rows: int = 12) -> List[dict]:
    """The operators of one step by self CPU time (torch.profiler), the largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    return [{"op": e.key, "self_cpu_ms": round(e.self_cpu_time_total / 1000, 1), "calls": e.count} for e in ops]


def measure_core(spec: dict) -> dict:
    import torch

    from .benchmark.measure import cpu_step_peak_bytes

    step, info = _core_step(spec)
    for _ in range(spec["warmup"]):
        step()
    cpu, wall = [], []
    rss_before = _status_kib("VmRSS")
    peak_ok = _reset_peak_rss()
    for _ in range(spec["repeats"]):
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    rss_growth = (_status_kib("VmHWM") - rss_before) / 1024 if peak_ok and spec["repeats"] else None
    peak = cpu_step_peak_bytes(step)
    if spec.get("profile"):
        info["profile"] = _profile(step)
    return {
        "memory_mib": round(peak / MIB, 2),
        "memory_metric": "allocator step peak",
        "step_peak_mib": round(peak / MIB, 2),
        "rss_growth_mib": None if rss_growth is None else round(rss_growth, 1),
        "cpu_s": round(statistics.median(cpu), 4) if cpu else None,
        "wall_s": round(statistics.median(wall), 4) if wall else None,
        "cpu_s_all": [round(c, 4) for c in cpu],
        "torch_threads": torch.get_num_threads(),
        **info,
    }


def default_iga_steps() -> int:
    """IGA's m where a run does not set it: ADDropConfig's own default, declared there only."""
    from attn_reg_plugin.core import ADDropConfig

    return ADDropConfig.__dataclass_fields__["iga_steps"].default


def method_trainer(method: str, common: dict, length: int, iga_steps: Optional[int] = None):
    """The Trainer that trains ``common["model"]`` on ``common["train_dataset"]`` (rows of ``length``
    tokens) with ``method``: the stock Trainer for plain, else the plugin's, with this grid's settings
    (AttendOut scores its first row as the held-out set; ``iga_steps`` None: the config's default).
    ``attn-reg-gpu-bench``'s long rows use it too."""
    import transformers

    from attn_reg_plugin.core import ADDropConfig, AttendOutConfig, ScheduledDropoutConfig

    iga_steps = default_iga_steps() if iga_steps is None else iga_steps

    if method == "plain":
        return transformers.Trainer(**common)
    if method in AD_DROP_METHODS:
        from attn_reg_plugin.hf import ADDropTrainer

        ad_drop = ADDropConfig(
            p=AD_DROP_P, q=AD_DROP_Q, attribution=method, layers="all", schedule="always", iga_steps=iga_steps
        )
        return ADDropTrainer(ad_drop=ad_drop, **common)
    if method == "sched-dropout":
        from attn_reg_plugin.hf import AttnRegTrainer

        return AttnRegTrainer(scheduled_dropout=ScheduledDropoutConfig(schedule=SCHEDULE), **common)
    if method in ("attendout", "attendout-update"):
        from attn_reg_plugin.hf import AttendOutTrainer

        # attendout-update: every update ends a dropout step (held-out scores, REINFORCE, re-sync); else
        # the held-out evaluation every T updates is amortised outside the step, as in attn-reg-benchmark
        updates = 1 if method == "attendout-update" else 10**6
        attendout = AttendOutConfig(dropout_step=updates, max_positions=length)
        return AttendOutTrainer(attendout=attendout, eval_dataset=common["train_dataset"][:1], **common)
    if method == "hiddencut":
        from attn_reg_plugin.core.regularizers.hiddencut import HiddenCutConfig
        from attn_reg_plugin.hf import HiddenCutTrainer

        return HiddenCutTrainer(hiddencut=HiddenCutConfig(), **common)
    raise ValueError(method)


def measure_hf(spec: dict) -> dict:
    import tempfile

    import torch
    import transformers

    from attn_reg_plugin.hf.trainer_arguments import checkpointing_argument

    cfg, method, length = MODELS[spec["model"]], spec["method"], spec["length"]
    transformers.logging.set_verbosity_error()
    torch.manual_seed(spec["seed"])
    config = transformers.LlamaConfig(
        hidden_size=cfg["dim"], intermediate_size=4 * cfg["dim"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], num_key_value_heads=cfg.get("kv_heads", cfg["heads"]), vocab_size=VOCAB,
        max_position_embeddings=max(length, 2048), pad_token_id=PAD, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(spec["seed"])
    steps = spec["hf_steps"]
    rows = []
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (length,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    times: List[tuple] = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = (time.process_time(), time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            times.append((time.process_time() - self.start[0], time.perf_counter() - self.start[1]))

    with tempfile.TemporaryDirectory(prefix="attn_reg_scaling_") as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=1, max_steps=steps, learning_rate=1e-4,
            report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
            use_cpu=True, seed=spec["seed"], dataloader_num_workers=0,
            **checkpointing_argument(cfg.get("checkpointing", False)),
        )  # fmt: skip
        common = dict(model=model, args=args, train_dataset=rows, callbacks=[StepTimes()])
        trainer = method_trainer(method, common, length, spec["iga_steps"])
        rss_before = _status_kib("VmRSS")
        peak_ok = _reset_peak_rss()
        trainer.train()
        checkpointed = bool(model.is_gradient_checkpointing)  # as the Trainer left the model
        rss_growth = (_status_kib("VmHWM") - rss_before) / 1024 if peak_ok else None
    measured = times[1:] if len(times) > 1 else times
    return {
        "memory_mib": None if rss_growth is None else round(rss_growth, 1),
        "memory_metric": "process RSS growth",
        "step_peak_mib": None,
        "rss_growth_mib": None if rss_growth is None else round(rss_growth, 1),
        "cpu_s": round(statistics.median(c for c, _ in measured), 4) if measured else None,
        "wall_s": round(statistics.median(w for _, w in measured), 4) if measured else None,
        "cpu_s_all": [round(c, 4) for c, _ in times],
        "torch_threads": torch.get_num_threads(),
        "gradient_checkpointing": checkpointed,
    }


def _is_oom(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, MemoryError) or any(
        s in text for s in ("can't allocate memory", "cannot allocate memory", "out of memory", "defaultcpuallocator")
    )


def worker(spec: dict) -> dict:
    """One measurement in this (fresh) process; never raises: failures become a status."""
    import torch

    torch.set_num_threads(spec["threads"])
    started = time.perf_counter()
    try:
        result = (measure_hf if MODELS[spec["model"]]["kind"] == "hf" else measure_core)(spec)
        result["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded, the parent goes on
        import traceback

        result = {"status": "oom" if _is_oom(e) else "error", "reason": f"{type(e).__name__}: {e}"[:2000]}
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()[-4000:]
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result
