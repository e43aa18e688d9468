"""What ``ADDrop.masked`` yields: plain Python numbers (``json.dumps`` takes them, no 0-d tensor), a
``rate`` that is never NaN (0.0 for a step that dropped nothing: a skipped one), and a clear error
for a block that ran no regularized forward (its rate was 0 / 0: NaN)."""

import json
import math
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attn_reg_plugin.core.kernel import devices
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attribution import logit_target
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


class _ScalarReads(TorchDispatchMode):
    """The plugin files whose code read a tensor's value on the host (``_local_scalar_dense``)."""

    def __init__(self):
        super().__init__()
        self.where = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.where += [f.filename for f in traceback.extract_stack() if "attn_reg_plugin" in f.filename][-1:]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attribution", ["ga", "iga"])
@pytest.mark.parametrize("overflow", [False, True])
def test_a_half_precision_step_on_a_device_route_skips_an_overflow_without_a_host_read(
    monkeypatch, attribution, overflow
):
    """On a device's route a bf16 target that is not finite is not read on the host (issue 80: it was
    one sync a step): its gradients are zeroed on the device, so no sample is targeted, nothing is
    dropped and the step counts as skipped, 0 of 0, as the host's early return counts it."""
    monkeypatch.setattr(devices, "PORTABLE", True)
    model, ad_drop, x = _ad_drop(attribution)
    model, x = model.to(torch.bfloat16).eval(), x.to(torch.bfloat16)  # eval: no dropout to tell apart

    def target(logits, labels):
        value, used = logit_target(logits, labels)
        return (value * math.inf if overflow else value), used

    torch.manual_seed(0)
    with _ScalarReads() as reads:
        with ad_drop.masked(lambda: model(x), target, frozen=model, tensors=True) as stats:
            out = model(x)
    # (the pass seed, a host tensor, is read in controller.py: no sync on a device)
    assert not [where for where in reads.where if "ad_drop.py" in where or "attribution.py" in where], reads.where
    skipped, dropped, droppable = (int(stats[k]) for k in ("skipped", "dropped", "droppable"))
    if overflow:
        assert (skipped, dropped, droppable) == (0 + 1, 0, 0)
        with torch.no_grad():  # nothing dropped: the masked pass is the model's own forward
            torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)
    else:
        assert skipped == 0 and 0 < dropped < droppable
