"""What ``ADDrop.masked`` yields: plain Python numbers (``json.dumps`` takes them, no 0-d tensor), a
``rate`` that is never NaN (0.0 for a step that dropped nothing: a skipped one), and a clear error
for a block that ran no regularized forward (its rate was 0 / 0: NaN)."""

import json
import math

import pytest
import torch

from attn_reg_plugin.core import devices
from attn_reg_plugin.core.ad_drop import ADDrop
from attn_reg_plugin.core.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.attribution import logit_target
from helpers import CORE_B, CORE_D, CORE_T, tiny_core_model

KEYS = {"skipped", "dropped", "droppable", "rate"}


def _ad_drop(attribution="ga"):
    model = tiny_core_model()
    config = ADDropConfig(p=0.5, q=0.5, schedule="always", attribution=attribution, iga_steps=2)
    x = torch.randn(CORE_B, CORE_T, CORE_D, generator=torch.Generator().manual_seed(1))
    return model, ADDrop(config, model.controller), x


@pytest.mark.parametrize("attribution", ["ga", "iga", "aa", "rd"])
def test_the_stats_are_plain_numbers_with_their_rate(attribution):
    model, ad_drop, x = _ad_drop(attribution)
    torch.manual_seed(0)
    with ad_drop.masked(lambda: model(x), logit_target, frozen=model) as stats:
        model(x).sum().backward()
    assert json.loads(json.dumps(stats)) == stats
    assert set(stats) == KEYS
    assert all(type(stats[k]) is int for k in ("skipped", "dropped", "droppable")) and type(stats["rate"]) is float
    assert stats["skipped"] == 0 and 0 < stats["dropped"] < stats["droppable"]
    assert stats["rate"] == stats["dropped"] / stats["droppable"]
    _, step_stats = ad_drop.step(lambda: model(x), lambda: model(x), logit_target, frozen=model)
    assert json.loads(json.dumps(step_stats)) == step_stats


def test_a_skipped_step_rates_0_not_nan(monkeypatch):
    # The CPU's branch looks at the target (the portable one does not synchronise for an fp32 one).
    monkeypatch.setattr(devices, "PORTABLE", False)
    model, ad_drop, x = _ad_drop()

    def overflowing(logits, labels):
        value, used = logit_target(logits, labels)
        return value * math.inf, used

    with ad_drop.masked(lambda: model(x), overflowing, frozen=model) as stats:
        model(x)
    assert json.loads(json.dumps(stats)) == {"skipped": 1, "dropped": 0, "droppable": 0, "rate": 0.0}


@pytest.mark.parametrize("attribution", ["ga", "rd"])
def test_a_block_that_runs_no_forward_is_an_error_naming_it(attribution):
    model, ad_drop, x = _ad_drop(attribution)
    with pytest.raises(RuntimeError, match=r"ADDrop\.masked: the block ran no forward through the selected attention"):
        with ad_drop.masked(lambda: model(x), logit_target, frozen=model):
            pass  # a loop that forgot the training forward (or ran it outside the block)


def test_tensor_counts_for_the_adapters_stay_on_the_device():
    """The fairseq criterion and the HF trainers sum counts over steps with no host sync per step."""
    model, ad_drop, x = _ad_drop()
    with ad_drop.masked(lambda: model(x), logit_target, frozen=model, tensors=True) as stats:
        model(x)
    assert set(stats) == KEYS and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in stats.values())
    assert float(stats["rate"]) == pytest.approx(int(stats["dropped"]) / int(stats["droppable"]))
