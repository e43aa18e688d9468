"""The device helpers (core/kernel/devices.py): the CPU's own branches and the portable ones an accelerator
runs give the same drops, counts, losses and gradients; ATTN_REG_PORTABLE=1 forces the portable ones.

`make test` also runs all of tests/core with ATTN_REG_PORTABLE=1, so every kernel test and a step of
every regularizer run the portable branches on the CPU; here the two are compared in one process.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_causal import _CausalLM, _small_blocks, _step

from attn_reg_plugin.core.kernel import devices

CORE = Path(devices.__file__).parent.parent  # core/, every floor
DEVICE_CHECK = re.compile(r"device\.type *(==|!=|in )|is_cuda")


def test_the_switch_forces_the_portable_branches(monkeypatch):
    """ATTN_REG_PORTABLE=1 sets devices.PORTABLE when the plugin is imported; with it the helpers take
    their portable branches on the CPU."""
    code = "from attn_reg_plugin.core.kernel import devices; print(devices.PORTABLE)"
    for value, want in (("1", "True"), ("", "False")):
        env = {**os.environ, devices.PORTABLE_ENV: value}
        assert (
            subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == want
        )
    x = torch.zeros(2)
    monkeypatch.setattr(devices, "PORTABLE", False)
    assert devices.on_host(x) and devices.has_cpu_softmax_stats(x, x, x) == (devices.FLASH_CPU is not None)
    monkeypatch.setattr(devices, "PORTABLE", True)
    assert not devices.on_host(x) and not devices.has_cpu_softmax_stats(x, x, x)


def test_the_core_compares_device_types_only_in_the_device_helpers():
    found = [
        f"{path.name}:{n}"
        for path in sorted(CORE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if DEVICE_CHECK.search(line)
    ]
    # _is_cpu (on_host, has_cpu_softmax_stats, random_stream) and fused_route_asked
    assert len(found) <= 3 and all(f.startswith("devices.py:") for f in found), found


def _both_ways(monkeypatch, run):
    monkeypatch.setattr(devices, "PORTABLE", False)
    host = run()
    monkeypatch.setattr(devices, "PORTABLE", True)
    portable = run()
    return host, portable


@pytest.mark.parametrize("attribution", ["ga", "aa", "rd", "iga"])
@pytest.mark.parametrize("blocks", ["one", "several"])
@pytest.mark.parametrize("padded", [False, True])
def test_an_ad_drop_step_is_the_same_on_the_cpu_branches_and_the_portable_ones(
    attribution, blocks, padded, monkeypatch
):
    """numpy's selection against topk, packed bits by numpy against shifts, host looks against the
    plain edits, the CPU flash backward from the rows' log-sum-exp against a recomputed block: the
    same drops and counts, and the same loss and gradients to float rounding."""
    if blocks == "several":
        _small_blocks(monkeypatch)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(4))
    padding = (torch.arange(6)[None, :] < torch.tensor([6, 3])[:, None]).view(2, 1, 1, 6) if padded else None
    host, portable = _both_ways(monkeypatch, lambda: _step(_CausalLM(True), x, padding, attribution))
    assert host[2:] == portable[2:] and host[2] > 0
    torch.testing.assert_close(portable[0], host[0])
    for a, e in zip(portable[1], host[1]):
        torch.testing.assert_close(a, e)


def test_tied_attributions_rank_the_same_on_both_branches(monkeypatch):
    """Ties straddling each row's threshold (many and few per row), lowest key first either way."""
    from attn_reg_plugin.core.kernel.rules import candidate_region

    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 3, (2, 3, 16, 40), generator=g).float()  # many ties
    scores[1] = torch.randn(3, 16, 40, generator=g).round(decimals=1)  # a few
    valid = torch.rand(2, 1, 16, 40, generator=g) > 0.2
    host, portable = _both_ways(monkeypatch, lambda: [candidate_region(scores, valid, p) for p in (0.1, 0.35, 0.8)])
    assert all(torch.equal(a, b) for a, b in zip(host, portable))


def _edit_of_one_block(hook, dropout_p=0.1):
    """One call of the model's strided q, k, v (a transformers layer's views) under ``hook``, with a bool
    mask of padding, a row with one valid key and a row with none: output, gradients and counts."""
    from attn_reg_plugin.core.kernel.attention import attend
    from helpers import HandPass

    g = torch.Generator().manual_seed(5)
    b, h, t, d = 4, 3, 9, 8
    q, k, v = (torch.randn(b, t, h, d, generator=g).transpose(1, 2).requires_grad_() for _ in range(3))
    valid = (torch.arange(t)[None, :] < torch.tensor([t, t - 3, 1, t - 1])[:, None])[:, None, None, :]
    valid = valid.expand(b, 1, t, t).clone()
    valid[1, 0, 2, :] = False  # no valid key
    valid[0, 0, 3, 1:] = False  # one
    one = HandPass(hook, torch.tensor(17))
    torch.manual_seed(0)
    out, _ = attend(q, k, v, bias=valid, dropout_p=dropout_p, **one.call)
    grads = torch.autograd.grad((out * torch.randn(out.shape, generator=g)).sum(), (q, k, v))
    return [out, *grads, *one.record.counts()]


def _hooks():
    from attn_reg_plugin.core.kernel.attention_call import EditScores
    from attn_reg_plugin.core.kernel.rules import MapScores, TopRegionRule
    from attn_reg_plugin.core.regularizers.attendout.policy import GeneratorRule, PolicyLogits

    g = torch.Generator().manual_seed(6)
    tied = torch.randint(0, 3, (4, 3, 9, 9), generator=g).float()  # ties straddle the thresholds
    real = torch.ones(4, 9, dtype=torch.bool)
    real[1, -3:] = False
    yield EditScores(drop=TopRegionRule(MapScores(tied), 0.5, 0.7), counted=True)
    yield EditScores(drop=TopRegionRule(MapScores(tied), 1.0, 1.0), counted=True)  # every row emptied: one kept
    for offset in (-0.5, 4.0):  # 4: most rows lose every key and attend uniformly
        policy = PolicyLogits(torch.randn(4, 9, 4, generator=g), torch.randn(4, 9, 4, generator=g),
                              torch.tensor(offset), real, real, False)  # fmt: skip
        droppable = (policy.query_real[:, None, :, None], policy.key_real[:, None, None, :])
        yield EditScores(drop=GeneratorRule(policy, torch.tensor(3)), counted=True, droppable=droppable)


@pytest.mark.parametrize("case", range(4), ids=["region-ties", "region-emptied", "generator", "generator-emptied"])
def test_an_edit_of_one_block_under_attention_dropout_is_the_same_bits_on_both_branches(case, monkeypatch):
    """Under the model's attention dropout one block takes the explicit softmax on both branches, so the
    CPU's looks and numpy selection, and the portable ops a device runs instead (each row's region
    ranked, an emptied row's key kept back and a row made uniform without a look, counts in one
    reduction, the query kept zeroed for the backward), give the same bits: output, gradients, counts."""
    hook = list(_hooks())[case]
    host, portable = _both_ways(monkeypatch, lambda: _edit_of_one_block(hook))
    assert host[-2] > 0
    for a, b in zip(host, portable):
        assert torch.equal(a, b)
