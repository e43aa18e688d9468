"""Every precision × regularizer end to end for a few updates: finite losses, the regularizer acts.

This file is also the GPU check (`make gpu-check` = `pytest -m gpu`): on a CUDA machine every
case runs on the GPU (fairseq's FP16Optimizer `--fp16`, `--amp`; HF `fp16`/`bf16`; fairseq 0.12's
`--bf16` is TPU-only, see FAIRSEQ_PRECISION);
without CUDA the cases that exist on CPU run (`--fp16 --memory-efficient-fp16 --cpu`, HF
`bf16` with `use_cpu`, HF `fp16` with a CPU loss scaler, see ``helpers.cpu_fp16``), so
`make test` exercises the harness itself, and the CUDA-only cases skip saying so. Refused combinations skip here: their messages are tested where the others are.
"""

import math
import re

import pytest
import torch
import transformers

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig
from attn_reg_plugin.hf import ADDropTrainer, AttendOutTrainer, AttnRegTrainer
from helpers import (
    TINY_TRANSFORMER,
    classification_rows,
    classifier_rows,
    cpu_fp16,
    fairseq_train,
    tiny_bert_classifier,
    tiny_llama,
    train_updates,
)

pytestmark = pytest.mark.gpu
CUDA = torch.cuda.is_available()

# precision -> (fairseq flags, runs on CPU). fairseq 0.12 has no GPU bf16: its options.py sets
# `tpu = True` whenever --bf16 is given, on any device (measured on an H100: plain --bf16 fails
# in Trainer asking torch_xla for a device, --bf16 --memory-efficient-fp16 with "Cannot combine
# --fp16 and --tpu"). bf16 is covered through Hugging Face below; docs/CONFIGURATIONS.md says so.
FAIRSEQ_PRECISION = {
    "fp16-memory-efficient": (["--fp16", "--memory-efficient-fp16"], True),
    "fp16": (["--fp16"], False),  # FP16Optimizer's flat fp32 masters need CUDA
    "fp16-no-flatten": (["--fp16", "--fp16-no-flatten-grads"], True),  # FP16Optimizer, one master per parameter
    "amp": (["--amp"], False),
}
FAIRSEQ_REGULARIZER = {
    "ad-drop": [
        "--criterion",
        "ad_drop_label_smoothed_cross_entropy",
        "--label-smoothing",
        "0.1",
        "--ad-drop-schedule",
        "always",
        "--ad-drop-p",
        "0.3",
        "--ad-drop-q",
        "0.5",
    ],
    "attendout": [
        "--criterion",
        "label_smoothed_cross_entropy",
        "--label-smoothing",
        "0.1",
        "--attendout",
        "--attendout-dropout-step",
        "3",
    ],
    "scheduled-dropout": ["--criterion", "label_smoothed_cross_entropy", "--attn-sched-dropout-schedule", "0:0.3"],
}


@pytest.mark.parametrize("precision", list(FAIRSEQ_PRECISION))
@pytest.mark.parametrize("regularizer", list(FAIRSEQ_REGULARIZER))
def test_fairseq_precision(tiny_mt_data, tmp_path, regularizer, precision):
    flags, on_cpu = FAIRSEQ_PRECISION[precision]
    if not (CUDA or on_cpu):
        pytest.skip(f"fairseq {' '.join(flags)} needs CUDA")
    device = [] if CUDA else ["--cpu"]
    proc = fairseq_train(
        tiny_mt_data["bin"],
        [
            "--save-dir",
            tmp_path,
            *device,
            "--task",
            "attn_reg_translation",
            *TINY_TRANSFORMER,
            *FAIRSEQ_REGULARIZER[regularizer],
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            "--max-tokens",
            "500",
            "--max-update",
            "6",
            "--seed",
            "2",
            "--no-save",
            "--log-format",
            "json",
            "--log-interval",
            "1",
            "--no-progress-bar",
            *flags,
        ],
    )
    updates = train_updates(proc.stdout)
    assert len(updates) >= 3, proc.stdout[-3000:]
    assert all(math.isfinite(float(u["loss"])) for u in updates.values())
    if regularizer == "ad-drop":
        assert all(0.05 < float(u["ad_drop_rate"]) < 0.3 for u in updates.values())
        print(
            f"{precision} AD-DROP: rates {[u['ad_drop_rate'] for u in updates.values()]}, "
            f"skipped {sum(float(u.get('ad_drop_skipped', 0)) for u in updates.values())}"
        )
    elif regularizer == "attendout":
        assert all(math.isfinite(float(u["attendout_attacker_loss"])) for u in updates.values())
        assert re.search(r"AttendOut dropout step 1 \(update 3\)", proc.stdout)
    else:
        assert "loss" in updates[max(updates)]


# -- Hugging Face ----------------------------------------------------------------------------------
HF_REGULARIZER = {
    "ad-drop": (lambda common: ADDropTrainer(**common, ad_drop=ADDropConfig(schedule="always")), "ad_drop_rate"),
    "attendout": (
        lambda common: AttendOutTrainer(
            **common, eval_dataset=classifier_rows(4, 2), attendout=AttendOutConfig(dropout_step=2)
        ),
        "attendout_attacker_loss",
    ),
    "layerdrop": (
        lambda common: AttnRegTrainer(**common, layerdrop=AttentionLayerDropConfig(p=0.5)),
        "attn_layerdrop_rate",
    ),
}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("regularizer", list(HF_REGULARIZER))
def test_hf_precision(tmp_path, regularizer, precision):
    model = tiny_bert_classifier()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=not CUDA,
        report_to=[],
        max_steps=4,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        **{precision: True},
    )
    build, key = HF_REGULARIZER[regularizer]
    trainer = build(dict(model=model, args=args, train_dataset=classifier_rows(16, 1)))
    if precision == "fp16" and not CUDA:
        cpu_fp16(trainer)  # the Trainer's fp16 path (autocast, loss scaler) on CPU, see conftest
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and key in h]
    assert logs and all(math.isfinite(h["loss"]) and math.isfinite(h[key]) for h in logs)
    if regularizer != "attendout":
        assert sum(h[key] for h in logs) > 0
    print(f"HF {precision} {regularizer}: {[(round(h['loss'], 4), h[key]) for h in logs]}")


# -- mixed precision through the blockwise kernel --------------------------------------------------
def _blocks_of_two_rows(monkeypatch):
    """Every regularized call runs block by block (2 query rows a block), as long calls do."""
    from attn_reg_plugin.core.kernel import blockwise, rules

    monkeypatch.setattr(rules, "CHUNK_ROWS", 2)
    monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(blockwise, "LINEAR_FACTOR", 0)
    monkeypatch.setattr(blockwise, "ONE_BLOCK_KEYS", 0)


LM_REGULARIZER = {
    **{
        f"ad-drop-{attribution}": (
            lambda common, a=attribution: ADDropTrainer(
                **common, ad_drop=ADDropConfig(p=0.3, q=0.5, schedule="always", attribution=a)
            ),
            "ad_drop_rate",
        )
        for attribution in ("ga", "iga", "aa", "rd")
    },
    "ad-drop-ga-fp32-attribution": (
        lambda common: ADDropTrainer(
            **common, ad_drop=ADDropConfig(p=0.3, q=0.5, schedule="always", attribution_precision="fp32")
        ),
        "ad_drop_rate",
    ),
    "scheduled-dropout": (
        lambda common: AttnRegTrainer(**common, scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.3")),
        "attn_sched_dropout_rate",
    ),
    "layerdrop": (
        lambda common: AttnRegTrainer(**common, layerdrop=AttentionLayerDropConfig(p=0.5)),
        "attn_layerdrop_rate",
    ),
    "attendout": (
        lambda common: AttendOutTrainer(
            **common, eval_dataset=classification_rows(4, 2, causal=True), attendout=AttendOutConfig(dropout_step=2)
        ),
        "attendout_attacker_loss",
    ),
}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("regularizer", list(LM_REGULARIZER))
def test_hf_mixed_precision_through_blocks(tmp_path, monkeypatch, regularizer, precision):
    """A causal LM's whole Trainer step under the Trainer's autocast, every regularized call split
    into blocks: the kernel's backward runs in its forward's dtypes (bf16=True crashed it), and
    attribution_precision fp32 turns the Trainer's autocast off for the attribution pass."""
    _blocks_of_two_rows(monkeypatch)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=not CUDA,
        report_to=[],
        max_steps=3,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        **{precision: True},
    )
    build, key = LM_REGULARIZER[regularizer]
    trainer = build(dict(model=tiny_llama(), args=args, train_dataset=classification_rows(6, 1, causal=True)))
    if precision == "fp16" and not CUDA:
        cpu_fp16(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and key in h]
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) and math.isfinite(h[key]) for h in logs)
    if regularizer != "attendout":
        assert sum(h[key] for h in logs) > 0


@pytest.mark.parametrize("variant", ["checkpointing", "lora", "bf16-attribution"])
def test_hf_bf16_ad_drop_through_blocks_with_what_users_add(tmp_path, monkeypatch, variant):
    """The reported crash also came with gradient checkpointing, LoRA and a bf16 attribution pass."""
    _blocks_of_two_rows(monkeypatch)
    model = tiny_llama()
    if variant == "lora":
        peft = pytest.importorskip("peft")
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=not CUDA, report_to=[], max_steps=2, per_device_train_batch_size=2,
        logging_steps=1, save_strategy="no", bf16=True, gradient_checkpointing=variant == "checkpointing",
    )  # fmt: skip
    precision = "bf16" if variant == "bf16-attribution" else "auto"
    ad_drop = ADDropConfig(p=0.3, q=0.5, schedule="always", attribution_precision=precision)
    trainer = ADDropTrainer(
        model=model, args=args, train_dataset=classification_rows(4, 1, causal=True), ad_drop=ad_drop
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "ad_drop_rate" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) and h["ad_drop_rate"] > 0 for h in logs)
