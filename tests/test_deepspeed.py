"""DeepSpeed ZeRO-1/2 through the Hugging Face trainers, on 2 CPU ranks (DeepSpeed's CPU accelerator, gloo).

DeepSpeed is an optional dependency (``pip install -e .[deepspeed]``; it is not in
requirements.lock), so this file is skipped where it is not installed. tests/deepspeed_rank.py
trains a tiny BERT for 2 epochs (AD-DROP cross-tuned: epoch 2 is AD-DROP; or attention
LayerDrop) under ZeRO and under plain DDP from the same seeds: in fp32 the two runs log the
same losses and rates and end with the same weights. In bf16 and fp16 (DeepSpeed casts the
weights) AD-DROP trains with finite losses at its usual rate. ZeRO-3, offload and AttendOut are
refused before training (tests/test_training_configurations.py).
"""

import pytest
import torch

from helpers import torchrun_ranks

pytest.importorskip("deepspeed")

WORLD = 2


_RUNS = {}


def run(tmp_path_factory, regularizer, mode):
    key = (regularizer, mode)
    if key not in _RUNS:
        out = tmp_path_factory.mktemp(f"{regularizer}-{mode}")
        _RUNS[key] = torchrun_ranks("deepspeed_rank.py", out, regularizer, mode, env={"DS_ACCELERATOR": "cpu"})
    return _RUNS[key]


def _training_logs(result):
    return [h for h in result["log_history"] if "loss" in h]


@pytest.mark.parametrize("regularizer,mode", [("ad-drop", "zero1"), ("ad-drop", "zero2"), ("layerdrop", "zero2")])
def test_zero_equals_ddp(tmp_path_factory, regularizer, mode):
    zero, ddp = run(tmp_path_factory, regularizer, mode), run(tmp_path_factory, regularizer, "ddp")
    assert zero[0]["engine"] == "DeepSpeedEngine" and zero[0]["zero_stage"] == int(mode[-1])
    assert ddp[0]["engine"] == "DistributedDataParallel"
    z, d = _training_logs(zero[0]), _training_logs(ddp[0])
    assert len(z) == len(d) == 8  # 32 rows / (4 x 2 ranks) = 4 updates per epoch, 2 epochs
    rate = "ad_drop_rate" if regularizer == "ad-drop" else "attn_layerdrop_rate"
    for a, b in zip(z, d):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a[rate] == b[rate]
    if regularizer == "ad-drop":
        assert [h["ad_drop_on"] for h in z] == [0] * 4 + [1] * 4 and all(h[rate] > 0.1 for h in z[4:])
    for name, value in ddp[0]["params"].items():
        assert torch.allclose(zero[0]["params"][name], value, atol=1e-6), name
    assert all(torch.equal(zero[0]["params"][k], zero[1]["params"][k]) for k in zero[0]["params"])


@pytest.mark.parametrize("mode", ["zero2-bf16", "zero2-fp16"])
def test_zero_half_precision_trains(tmp_path_factory, mode):
    logs = _training_logs(run(tmp_path_factory, "ad-drop", mode)[0])
    assert len(logs) == 8 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert all(0.1 < h["ad_drop_rate"] < 0.3 and h["ad_drop_skipped"] == 0 for h in logs[4:])
