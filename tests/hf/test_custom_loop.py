"""docs/HF.md's own-loop block, run as written: install_attention_sites and the core API in an
accelerate loop on a tiny Llama (epoch 1 plain, epoch 2 masked), with and without checkpointing."""

import math
import re

import pytest
import torch

from attn_reg_plugin.core import ADDrop
from helpers import REPO, tiny_llama

MARKER = "<!-- tests/hf/test_custom_loop.py runs this block -->"


def documented_loop() -> str:
    text = (REPO / "docs" / "HF.md").read_text(encoding="utf-8")
    assert MARKER in text, "docs/HF.md lost the own-loop block this test runs"
    found = re.match(r"\s*```python\n(.*?)\n```", text.split(MARKER, 1)[1], re.S)
    return found.group(1)


@pytest.fixture
def fresh_accelerator_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # a Trainer of another test may have set it
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_the_documented_loop_trains_with_ad_drop_from_epoch_2(checkpointing, fresh_accelerator_state, monkeypatch):
    model = tiny_llama()
    if checkpointing:
        model.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (8, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[4:, 9:] = 0  # right padding on half the rows
    rows = [{"input_ids": i, "attention_mask": m, "labels": i.masked_fill(m == 0, -100)} for i, m in zip(ids, mask)]
    loader = torch.utils.data.DataLoader(rows, batch_size=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    masked_epochs = []
    real_masked = ADDrop.masked

    def counting(self, *args, **kwargs):
        masked_epochs.append(scope["epoch"])
        return real_masked(self, *args, **kwargs)

    monkeypatch.setattr(ADDrop, "masked", counting)
    scope = {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3), "loader": loader}
    scope["epochs"] = 2
    exec(compile(documented_loop(), "docs/HF.md", "exec"), scope)
    assert masked_epochs == [2, 2]  # the default schedule: epoch 1 plain, epoch 2 masked (two batches)
    assert 0.3 * 0.3 * 0.5 < scope["rate"] < 0.3 * 0.3 * 1.5 and math.isfinite(float(scope["loss"]))
    assert model.config._attn_implementation == "attn_reg"
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
