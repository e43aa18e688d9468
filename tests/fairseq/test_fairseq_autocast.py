"""fairseq's attention module under autocast, every regularized call split into blocks: one
criterion forward under autocast (what ``--amp`` wraps it in), its backward outside, as fairseq's
``train_step`` runs them. The loss and every gradient are finite and the regularizer acts. On CPU
under ``torch.autocast("cpu")``; the CUDA cases are ``make gpu-check``'s (fairseq's own ``--amp``
runs end to end in tests/test_precision.py)."""

import pytest
import torch

from helpers import TINY_TRANSFORMER, fairseq_in_process

KINDS = "encoder-self,decoder-self,encoder-decoder"
AD_DROP = ["--criterion", "ad_drop_label_smoothed_cross_entropy", "--ad-drop-p", "0.5", "--ad-drop-q", "0.5"]
AD_DROP += ["--ad-drop-schedule", "always", "--ad-drop-attention", KINDS, "--ad-drop-iga-steps", "2"]
PLAIN = ["--criterion", "label_smoothed_cross_entropy"]
REGULARIZERS = {
    **{f"ad-drop-{a}": AD_DROP + ["--ad-drop-attribution", a] for a in ("ga", "iga", "aa", "rd")},
    "scheduled-dropout": PLAIN + ["--attn-sched-dropout-schedule", "0:0.3", "--attn-sched-dropout-attention", KINDS],
    "layerdrop": PLAIN + ["--attn-layerdrop-p", "0.5", "--attn-layerdrop-attention", KINDS],
}
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)"),
        ],
    ),
]


@pytest.fixture
def blocks_of_two_rows(monkeypatch):
    from attn_reg_plugin.core.kernel import blockwise, rules

    monkeypatch.setattr(rules, "CHUNK_ROWS", 2)
    monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(blockwise, "LINEAR_FACTOR", 0)
    monkeypatch.setattr(blockwise, "ONE_BLOCK_KEYS", 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("regularizer", list(REGULARIZERS))
def test_a_step_under_autocast_through_blocks(tiny_mt_data, blocks_of_two_rows, regularizer, dtype, device):
    extra = ["--task", "attn_reg_translation", *TINY_TRANSFORMER, "--label-smoothing", "0.1", "--seed", "3"]
    _, _, model, criterion, dataset = fairseq_in_process(tiny_mt_data["bin"], extra + REGULARIZERS[regularizer], 3)
    model.to(device).train()
    sample = dataset.collater([dataset[i] for i in range(4)])
    sample = {k: v.to(device) if torch.is_tensor(v) else v for k, v in sample.items()}
    sample["net_input"] = {k: v.to(device) for k, v in sample["net_input"].items()}
    torch.manual_seed(5)
    with torch.autocast(device, dtype=dtype):
        loss, _, log = criterion(model, sample)
    loss.backward()  # outside autocast, as fairseq's train_step runs it
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    if regularizer.startswith("ad-drop"):
        assert int(log["ad_drop_dropped"]) > 0
