"""Training configurations: what is refused before training (with the message docs/CONFIGURATIONS.md
lists), AttendOut's fp16 / AMP overflow rules and fp32 master re-sync, and AD-DROP's rule for a
non-finite attribution target.
Each precision × regularizer trained end to end is in test_precision.py."""

import math

import pytest
import torch
import transformers

from attn_reg_plugin.core.kernel.attention_call import hook_in_progress
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.core.regularizers.attribution import logit_target
from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
from attn_reg_plugin.fairseq_plugin.attendout import stepped_tensors
from attn_reg_plugin.hf import ADDropTrainer, AttendOutTrainer, AttnRegTrainer
from helpers import (
    REPO,
    TINY_TRANSFORMER,
    classifier_rows,
    cpu_fp16,
    fairseq_in_process,
    fairseq_setup,
    tiny_bert_classifier,
    tiny_core_model,
)

DOC = (REPO / "docs" / "CONFIGURATIONS.md").read_text(encoding="utf-8")


def _documented(message: str) -> None:
    assert message in DOC, f"docs/CONFIGURATIONS.md does not list: {message}"


# -- AD-DROP: a non-finite target trains with the plain loss ---------------------------------------
def _tiny_classifier():
    return tiny_core_model()


@pytest.mark.parametrize("attribution", ["ga", "iga"])
def test_non_finite_target_skips_ad_drop_for_the_step(attribution):
    model = _tiny_classifier()
    x = torch.randn(2, 6, 8)
    ad_drop = ADDrop(
        ADDropConfig(p=0.5, q=0.5, schedule="always", attribution=attribution, iga_steps=2), model.controller
    )

    def overflowing(logits, labels):
        value, used = logit_target(logits, labels)
        return value * math.inf, used

    torch.manual_seed(1)
    with ad_drop.masked(lambda: model(x), overflowing, frozen=model) as stats:
        assert all(hook_in_progress(site) is None for site in model.controller.sites)  # nothing masked
        skipped_out = model(x)
    assert int(stats["skipped"]) == 1 and int(stats["dropped"]) == 0
    torch.manual_seed(1)
    model(x)  # the attribution forward's draws, as above
    assert torch.equal(skipped_out, model(x))  # the block's forward is the plain one
    with ad_drop.masked(lambda: model(x), logit_target, frozen=model) as stats:
        model(x)
    assert int(stats["skipped"]) == 0 and int(stats["dropped"]) > 0


def test_hf_logs_skipped_steps(tmp_path):
    model = tiny_bert_classifier()
    rows = [{"input_ids": torch.randint(3, 50, (6,)), "labels": torch.tensor(i % 2)} for i in range(8)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
    )
    trainer = ADDropTrainer(model=model, args=args, train_dataset=rows, ad_drop=ADDropConfig(schedule="always"))
    real = trainer.ad_drop_target
    calls = []

    def every_other_overflows(model, inputs):  # the first step's target overflows, the second's not
        value = real(model, inputs)
        calls.append(1)
        overflow = len(calls) % 2 == 1
        return lambda out, labels: tuple(
            (v * math.inf if overflow and i == 0 else v) for i, v in enumerate(value(out, labels))
        )

    trainer.ad_drop_target = every_other_overflows
    trainer.train()
    logs = [h for h in trainer.state.log_history if "ad_drop_skipped" in h]
    assert [h["ad_drop_skipped"] for h in logs] == [1, 0]
    assert logs[0]["ad_drop_rate"] == 0.0 and logs[1]["ad_drop_rate"] > 0
    assert all(math.isfinite(h["loss"]) for h in logs)


# -- refusals before training ----------------------------------------------------------------------
FSDP_FAIRSEQ = (
    "does not support --ddp-backend fully_sharded: fairseq shards with fairscale's FSDP, which is not verified "
    "with the regularizers' extra forward passes (it does not run without CUDA, and fairscale is not a "
    "dependency). Use --ddp-backend pytorch_ddp (or legacy_ddp), with --checkpoint-activations to save memory; "
    "to shard parameters, use FSDP2 through the Hugging Face trainers or the core API (docs/DISTRIBUTED.md)"
)


@pytest.mark.parametrize(
    "args,who",
    [
        (["--criterion", "ad_drop_label_smoothed_cross_entropy"], "--criterion ad_drop_label_smoothed_cross_entropy"),
        (["--criterion", "cross_entropy", "--attendout"], "--attendout"),
        (["--criterion", "cross_entropy", "--attn-layerdrop-p", "0.2"], "--attn-layerdrop-p"),
        (["--criterion", "cross_entropy", "--attn-sched-dropout-schedule", "0:0.2"], "--attn-sched-dropout-schedule"),
    ],
)
def test_fairseq_refuses_fully_sharded_at_set_up(tiny_mt_data, args, who):
    with pytest.raises(ValueError) as e:
        fairseq_setup(
            tiny_mt_data["bin"],
            ["--task", "attn_reg_translation", *TINY_TRANSFORMER, *args, "--ddp-backend", "fully_sharded"],
        )
    assert str(e.value) == f"{who} {FSDP_FAIRSEQ}"
    _documented(FSDP_FAIRSEQ)


ATTENDOUT_FAIRSEQ = [
    "--task",
    "attn_reg_translation",
    *TINY_TRANSFORMER,
    "--attendout",
    "--criterion",
    "cross_entropy",
    "--optimizer",
    "adam",
    "--lr",
    "1e-3",
    "--max-tokens",
    "500",
    "--seed",
    "2",
]


def test_fairseq_attendout_fp16_overflow_semantics(tiny_mt_data):
    """In-process with fairseq's MemoryEfficientFP16Optimizer (fairseq's own CPU overflow handler
    calls .cuda(), so an overflow cannot be forced through the CPU CLI):
    - D's step skipped (fairseq does not call optimizer_step): A's gradients and sample size of that
      update are kept, and A steps once over both updates' batches when D next steps;
    - A's gradients overflow: A skips its step with its own scaler (halved), its weights unchanged,
      D steps, the update counts for the dropout step, and the next log reports the overflow."""
    from fairseq import optim

    cfg, task, model, criterion, data = fairseq_in_process(
        tiny_mt_data["bin"],
        [
            "--task",
            "attn_reg_translation",
            *TINY_TRANSFORMER,
            "--attendout",
            "--attendout-dropout-step",
            "5",
            "--criterion",
            "cross_entropy",
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            "--fp16",
            "--memory-efficient-fp16",
        ],
        seed=2,
    )
    model = model.half()
    optimizer = optim.MemoryEfficientFP16Optimizer.build_optimizer(cfg, [p for p in model.parameters()])
    batches = [data.collater([data[i] for i in range(j, j + 4)]) for j in (0, 4, 8)]
    attendout = task.attn_reg_attendout

    def train(sample):
        optimizer.zero_grad()  # as fairseq's trainer does at every update
        return task.train_step(sample, model, criterion, optimizer, update_num=0)[2]

    train(batches[0])  # D's step of this update is skipped: no optimizer_step
    first_size = attendout.sample_size
    train(batches[1])
    assert attendout.sample_size > first_size  # both updates' batches
    before = [p.detach().clone() for p in attendout.attacker.parameters()]
    task.optimizer_step(optimizer, model, update_num=0)
    assert attendout.sample_size == 0 and attendout.game.update_in_step == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, attendout.attacker.parameters()))

    train(batches[2])
    scale = attendout.attacker_optimizer.scaler.loss_scale
    next(p for p in attendout.attacker.parameters() if p.grad is not None).grad.fill_(float("inf"))
    before_a = [p.detach().clone() for p in attendout.attacker.parameters()]
    before_d = [p.detach().clone() for p in model.parameters()]
    task.optimizer_step(optimizer, model, update_num=1)
    assert attendout.attacker_optimizer.scaler.loss_scale == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before_a, attendout.attacker.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(before_d, model.parameters()))
    assert all(p.grad is None or not p.grad.any() for p in attendout.attacker.parameters())
    assert attendout.game.update_in_step == 2
    assert train(batches[0])["attendout_attacker_overflows"] == 1
    assert all(torch.isfinite(p).all() for p in attendout.attacker.parameters())


# -- HF AttendOut in fp16: each network has its own loss scaler ------------------------------------
class _AtStep(transformers.TrainerCallback):
    """Runs ``action(trainer)`` at the end of update ``step`` and keeps both networks' parameters then."""

    def __init__(self, trainer, step, action):
        self.trainer, self.step, self.action, self.before = trainer, step, action, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.action(self.trainer)
            self.before = {
                "defender": [p.detach().clone() for p in self.trainer.model.parameters()],
                "attacker": [p.detach().clone() for p in self.trainer.attendout_attacker.parameters()],
            }


def _fp16_attendout(tmp_path, steps):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        fp16=True,
        max_grad_norm=1.0,
    )
    return cpu_fp16(
        AttendOutTrainer(
            model=tiny_bert_classifier(),
            args=args,
            train_dataset=classifier_rows(16, 1),
            eval_dataset=classifier_rows(4, 2),
            attendout=AttendOutConfig(dropout_step=3),
        )
    )


def _changed(a, b):
    return any(not torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("overflowing", ["defender", "attacker"])
def test_hf_attendout_fp16_skips_each_networks_overflow_on_its_own(tmp_path, overflowing):
    trainer = _fp16_attendout(tmp_path, steps=2)

    def provoke(t):  # a scale so large that this network's next fp16 backward overflows
        (t.accelerator.scaler if overflowing == "defender" else t.attendout_scaler).update(new_scale=2.0**70)

    at = _AtStep(trainer, 1, provoke)
    trainer.add_callback(at)
    trainer.train()
    assert trainer.attendout_scaler is not None and trainer.attendout_scaler is not trainer.accelerator.scaler
    other = "attacker" if overflowing == "defender" else "defender"
    now = {"defender": list(trainer.model.parameters()), "attacker": list(trainer.attendout_attacker.parameters())}
    assert not _changed(at.before[overflowing], now[overflowing])  # its step was skipped ...
    assert _changed(at.before[other], now[other])  # ... the other network stepped
    scaler = trainer.accelerator.scaler if overflowing == "defender" else trainer.attendout_scaler
    assert scaler.get_scale() == 2.0**69  # halved by its own overflow only
    unaffected = trainer.attendout_scaler if overflowing == "defender" else trainer.accelerator.scaler
    assert unaffected.get_scale() == 2.0**16
    assert trainer.attendout_game.update_in_step == 2  # the update counts towards T either way
    overflows = [h["attendout_attacker_overflows"] for h in trainer.state.log_history if "loss" in h]
    assert overflows == ([0, 1] if overflowing == "attacker" else [0, 0])
    assert all(torch.isfinite(p).all() for p in [*now["defender"], *now["attacker"]])


def test_hf_attendout_fp16_trains_and_resyncs(tmp_path):
    trainer = _fp16_attendout(tmp_path, steps=6)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 6 and all(
        math.isfinite(h["loss"]) and math.isfinite(h["attendout_attacker_loss"]) for h in logs
    )
    assert trainer.attendout_game.dropout_steps_done == 2
    # Re-synced at the end of the last dropout step: the two networks are equal again.
    assert not _changed(list(trainer.model.parameters()), list(trainer.attendout_attacker.parameters()))
    assert "attacker_scaler" in trainer.attendout_state_dict()


def test_fairseq_attendout_amp_overflow_semantics(tiny_mt_data, monkeypatch):
    """In-process with fairseq's AMPOptimizer, whose CUDA GradScaler is a CPU one here (the same
    class; on a CPU-only machine the CUDA one disables itself):
    - D's gradients overflow: fairseq still calls optimizer_step (D's scaler skips the step and
      halves) and retries the batch; A drops that update's gradients and cached masks, the update
      does not count, and the retried batch trains both once;
    - A's gradients overflow: A's scaler skips A's step and halves, D steps, the update counts."""
    from fairseq import optim

    monkeypatch.setattr(torch.cuda.amp, "GradScaler", lambda **kw: torch.amp.GradScaler("cpu", **kw))
    cfg, task, model, criterion, data = fairseq_in_process(
        tiny_mt_data["bin"],
        [
            "--task",
            "attn_reg_translation",
            *TINY_TRANSFORMER,
            "--attendout",
            "--attendout-dropout-step",
            "5",
            "--criterion",
            "cross_entropy",
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            "--amp",
        ],
        seed=2,
    )
    optimizer = optim.AMPOptimizer.build_optimizer(cfg, [p for p in model.parameters()])
    batch = data.collater([data[i] for i in range(4)])
    attendout = task.attn_reg_attendout

    def update(poison):
        optimizer.zero_grad()
        task.train_step(batch, model, criterion, optimizer, update_num=0)
        network = model if poison == "defender" else attendout.attacker if poison == "attacker" else None
        if network is not None:
            next(p for p in network.parameters() if p.grad is not None).grad.fill_(float("inf"))
        before = {
            "defender": [p.detach().clone() for p in model.parameters()],
            "attacker": [p.detach().clone() for p in attendout.attacker.parameters()],
        }
        optimizer.clip_grad_norm(0.0)  # fairseq's trainer unscales D here
        task.optimizer_step(optimizer, model, update_num=0)
        return {
            name: any(not torch.equal(a, b) for a, b in zip(before[name], net.parameters()))
            for name, net in (("defender", model), ("attacker", attendout.attacker))
        }

    d_scale = optimizer.scaler.get_scale()
    moved = update("defender")
    assert moved == {"defender": False, "attacker": False} and optimizer.scaler.get_scale() == d_scale / 2
    assert attendout.game.update_in_step == 0 and attendout.game.cache == [] and attendout.sample_size == 0
    assert all(p.grad is None or not p.grad.any() for p in attendout.attacker.parameters())
    moved = update(None)  # the retry
    assert moved == {"defender": True, "attacker": True} and attendout.game.update_in_step == 1
    assert [c.update for c in attendout.game.cache] == [0]
    a_scale = attendout.attacker_optimizer.scaler.get_scale()
    moved = update("attacker")
    assert moved == {"defender": True, "attacker": False} and attendout.game.update_in_step == 2
    assert attendout.attacker_optimizer.scaler.get_scale() == a_scale / 2
    optimizer.zero_grad()
    log = task.train_step(batch, model, criterion, optimizer, update_num=0)[2]
    assert log["attendout_attacker_overflows"] == 1


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("keep_attacker", [True, False])
def test_fairseq_attendout_fp16_optimizer_resync_copies_master_weights(
    tiny_mt_data, monkeypatch, flatten, keep_attacker
):
    """Plain --fp16 (FP16Optimizer) steps fp32 master copies: after the re-sync the other network's
    masters, fp16 weights and Adam state are the survivor's, so the two networks go on from the
    same state (without the master copy, the loser's next step would restore its own weights)."""
    from fairseq import optim

    # FP16Optimizer keys its flat masters by torch.cuda.current_device() and matches parameters to
    # them by p.device.index; a CPU parameter's index is None (the buffer is made on the
    # parameters' device anyway), so this is the CPU equivalent of one GPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    cfg, task, model, criterion, data = fairseq_in_process(
        tiny_mt_data["bin"],
        [
            "--task",
            "attn_reg_translation",
            *TINY_TRANSFORMER,
            "--attendout",
            "--attendout-dropout-step",
            "2",
            "--criterion",
            "cross_entropy",
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            "--fp16",
            *([] if flatten else ["--fp16-no-flatten-grads"]),
        ],
        seed=2,
    )
    model = model.half()
    optimizer = optim.FP16Optimizer.build_optimizer(cfg, [p for p in model.parameters()])
    assert isinstance(optimizer.fp32_params, dict) == flatten
    attendout = task.attn_reg_attendout
    survivor = {}

    def finish(d_losses, a_losses, generator=None):
        stats = type(attendout.game).finish_dropout_step(attendout.game, d_losses, a_losses, generator)
        stats["keep_attacker"] = keep_attacker
        side = (attendout.attacker, attendout.attacker_optimizer) if keep_attacker else (model, optimizer)
        survivor["weights"] = [p.detach().clone() for p in side[0].parameters()]
        survivor["masters"] = [t.detach().clone() for t in stepped_tensors(*side)]
        return stats

    for update, start in enumerate((0, 4)):
        optimizer.zero_grad()
        task.train_step(data.collater([data[i] for i in range(start, start + 4)]), model, criterion, optimizer, update)
        attendout.game.finish_dropout_step = finish  # the game exists from the first train step on
        optimizer.multiply_grads(1.0 / 4)
        task.optimizer_step(optimizer, model, update_num=update)
    assert attendout.game.dropout_steps_done == 1
    d_masters, a_masters = (
        stepped_tensors(model, optimizer),
        stepped_tensors(attendout.attacker, attendout.attacker_optimizer),
    )
    # D and A stepped on different masks, so their masters differed before the copy.
    assert d_masters[0].dtype == torch.float32 and len(d_masters) == (1 if flatten else len(survivor["weights"]))
    for masters in (d_masters, a_masters):
        assert all(torch.equal(m, s) for m, s in zip(masters, survivor["masters"]))
    for network in (model, attendout.attacker):
        assert all(torch.equal(p, s) for p, s in zip(network.parameters(), survivor["weights"]))
    d_state, a_state = optimizer.optimizer.state, attendout.attacker_optimizer.optimizer.state
    for d, a in zip(d_masters, a_masters):
        assert torch.equal(d_state[d]["exp_avg"], a_state[a]["exp_avg"]) and d_state[d]["exp_avg"].any()


HF_TRAINERS = {
    "ADDropTrainer": lambda model, args: ADDropTrainer(model=model, args=args, ad_drop=ADDropConfig()),
    "AttendOutTrainer": lambda model, args: AttendOutTrainer(
        model=model, args=args, eval_dataset=[{}], attendout=AttendOutConfig()
    ),
    "AttnRegTrainer": lambda model, args: AttnRegTrainer(
        model=model, args=args, layerdrop=AttentionLayerDropConfig(p=0.1)
    ),
}


FSDP1 = (
    "does not support FSDP1 (fsdp_config version 1): its flat parameters are gathered once per forward-backward "
    "pair, and the regularizers run extra forwards. Use FSDP2: fsdp_config={'version': 2} (docs/DISTRIBUTED.md)"
)
FSDP_OFFLOAD = (
    "does not support FSDP2 with fsdp_config cpu_offload: it is not verified with the regularizers' extra passes. "
    "Shard over more GPUs instead, with activation_checkpointing=True to save memory"
)
FSDP_CHECKPOINTING = (
    "does not support fsdp_config activation_checkpointing (FSDP's checkpoint wrapper): AD-DROP's attribution "
    "pass cannot pause it. Use the TrainingArguments' activation_checkpointing=True (the layers' own flag), which "
    "the regularizers keep exact under FSDP2"
)
FSDP_COMPILE = (
    "does not support torch_compile=True with FSDP: compiled FSDP2 modules are not verified with the "
    "regularizers' extra passes. Use one of the two"
)
ZERO3 = (
    "does not support DeepSpeed ZeRO stage 3: ZeRO-3 partitions the parameters and gathers them per forward, and "
    "it fails on a second forward in one step (upstream). Use ZeRO-1 or ZeRO-2, or FSDP2 (fsdp_config={'version': "
    "2}), which shards the parameters too"
)
ZERO_OFFLOAD = (
    "does not support DeepSpeed zero_optimization.offload_optimizer (device cpu): offload is not verified with "
    "the regularizers' extra passes. Leave it out (ZeRO-1/2 without offload)"
)
ATTENDOUT_DEEPSPEED = (
    "does not support DeepSpeed (TrainingArguments.deepspeed): the engine owns the Defender's backward and "
    "optimizer step, and the Attacker's backward would run through it. Use FSDP2 (fsdp_config={'version': 2}) "
    "or DDP (torchrun)"
)


def _sharded_args(tmp_path, fsdp=None, deepspeed=None, **fields):
    if fsdp is not None:  # as given: transformers derives the accelerate plugin's arguments from it
        fields.update(fsdp=fsdp.pop("fsdp", True), fsdp_config=fsdp)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **fields)
    # Set after construction: DeepSpeed is not installed here (the check reads the field only).
    if deepspeed is not None:
        args.deepspeed = deepspeed
    return args


@pytest.mark.parametrize("who", list(HF_TRAINERS))
@pytest.mark.parametrize(
    "setting,message",
    [
        ({"fsdp": {"version": 1}}, FSDP1),
        ({"fsdp": {"version": 2, "cpu_offload": True}}, FSDP_OFFLOAD),
        # Spelled the ways transformers reads as offload: any truthy value, the fsdp_ prefix, the legacy string.
        ({"fsdp": {"version": 2, "cpu_offload": "yes"}}, FSDP_OFFLOAD),
        ({"fsdp": {"fsdp_version": 2, "fsdp_cpu_offload": 1}}, FSDP_OFFLOAD),
        ({"fsdp": {"fsdp": "full_shard offload"}}, FSDP_OFFLOAD),
        ({"fsdp": {"version": 2, "activation_checkpointing": "true"}}, FSDP_CHECKPOINTING),
        ({"fsdp": {"version": 2, "activation_checkpointing": 1}}, FSDP_CHECKPOINTING),
        ({"fsdp": {"version": 2}, "torch_compile": True}, FSDP_COMPILE),
        ({"deepspeed": {"zero_optimization": {"stage": 3}}}, ZERO3),
        ({"deepspeed": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}}, ZERO_OFFLOAD),
    ],
)
def test_hf_trainers_refuse_unverified_sharding_at_construction(tmp_path, who, setting, message):
    if who == "AttendOutTrainer" and "deepspeed" in setting:
        message = ATTENDOUT_DEEPSPEED  # AttendOut refuses DeepSpeed whatever its configuration
    with pytest.raises(NotImplementedError) as e:
        HF_TRAINERS[who](tiny_bert_classifier(), _sharded_args(tmp_path, **setting))
    assert str(e.value) == f"{who} {message}"
    _documented(message)


@pytest.mark.parametrize(
    "plugin,message",
    [
        (dict(fsdp_version=1), FSDP1),
        (dict(fsdp_version=2, cpu_offload=True), FSDP_OFFLOAD),
        (dict(fsdp_version=2, activation_checkpointing=True), FSDP_CHECKPOINTING),
        (dict(fsdp_version=2), None),
    ],
)
def test_hf_trainers_refuse_what_accelerate_launch_turned_on(tmp_path, plugin, message):
    """accelerate launch can enable FSDP from its own config with the TrainingArguments' fsdp unset:
    the trainers check the accelerator's plugin after the Trainer built it."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin

    from attn_reg_plugin.hf.training_configurations import refuse_unsupported_launch

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    state = SimpleNamespace(fsdp_plugin=FullyShardedDataParallelPlugin(**plugin), deepspeed_plugin=None)
    trainer = SimpleNamespace(accelerator=SimpleNamespace(state=state), args=args)
    if message is None:
        refuse_unsupported_launch("ADDropTrainer", trainer)
        return
    with pytest.raises(NotImplementedError) as e:
        refuse_unsupported_launch("ADDropTrainer", trainer)
    assert str(e.value) == f"ADDropTrainer {message}"
    zero3 = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 3}})
    trainer.accelerator.state = SimpleNamespace(fsdp_plugin=None, deepspeed_plugin=zero3)
    with pytest.raises(NotImplementedError, match="AttnRegTrainer does not support DeepSpeed ZeRO stage 3"):
        refuse_unsupported_launch("AttnRegTrainer", trainer)


@pytest.mark.parametrize("who", list(HF_TRAINERS))
@pytest.mark.parametrize(
    "setting",
    [
        {"fsdp": {"version": 2}},
        {"fsdp": {"version": 2, "reshard_after_forward": False}},
        {"fsdp": {"version": 2}, "activation_checkpointing": True},
        {"deepspeed": {"zero_optimization": {"stage": 1}}},
        {"deepspeed": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}},
    ],
)
def test_hf_trainers_accept_fsdp2_and_zero_1_2(tmp_path, who, setting):
    """What tests/test_fsdp.py and tests/test_deepspeed.py run passes the construction check."""
    from attn_reg_plugin.hf.attendout_trainer import NO_DEEPSPEED
    from attn_reg_plugin.hf.training_configurations import refuse_unsupported

    args = _sharded_args(tmp_path, **setting)
    no_deepspeed = NO_DEEPSPEED if who == "AttendOutTrainer" else None  # what each trainer passes
    if no_deepspeed is not None and "deepspeed" in setting:
        with pytest.raises(NotImplementedError, match="AttendOutTrainer does not support DeepSpeed"):
            refuse_unsupported(who, args, tiny_bert_classifier(), no_deepspeed=no_deepspeed)
    else:
        refuse_unsupported(who, args, tiny_bert_classifier(), no_deepspeed=no_deepspeed)
