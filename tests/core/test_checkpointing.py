"""The kernel's replay for activation checkpointing, on a plain-PyTorch model (no framework)."""

import functools

import pytest
import torch

from attn_reg_plugin.core.ad_drop import ADDrop, ADDropConfig
from attn_reg_plugin.core.attention import CaptureOutput, EditScores
from attn_reg_plugin.core.attribution import logit_target
from attn_reg_plugin.core.checkpointing import activation_checkpointing_paused
from helpers import CORE_B, CORE_D, CORE_T, CoreBlock, tiny_core_model

B, T, D = CORE_B, CORE_T, CORE_D
_model = tiny_core_model


def test_records_keep_no_attribution_graph():
    model = _model(checkpointed=True)
    x = torch.randn(B, T, D, requires_grad=True)
    ad_drop = ADDrop(ADDropConfig(p=0.5, q=0.5, schedule="always"), model.controller)
    with ad_drop.masked(lambda: model(x), logit_target, frozen=model):
        # pass 1 is over: what the sites remember of it is an empty capture, no tensor
        for site in model.controller.sites:
            assert isinstance(site.replay.hook, CaptureOutput)
            assert site.replay.hook.outputs == [] and site.replay.edit.drop is None
        loss = model(x).sum()
    assert all(isinstance(s.replay.hook, EditScores) and s.replay.edit.drop is not None for s in model.controller.sites)
    loss.backward()


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_site_called_twice_under_checkpointing_is_refused_in_backward(reentrant):
    model = _model(calls=2, checkpointed=True)
    for block in model.blocks:
        block.forward = functools.partial(CoreBlock.forward, block, reentrant=reentrant)
    x = torch.randn(B, T, D, requires_grad=True)
    edits = {s: EditScores(drop=lambda valid: torch.rand(valid.shape) < 0.3) for s in model.controller.sites}
    with model.controller.hooks(edits):
        loss = model(x).sum()
    with pytest.raises(RuntimeError, match=r"encoder-self\[1\] was called 2 times in one regularized pass"):
        loss.backward()


def test_same_site_twice_without_checkpointing_trains():
    """Without checkpointing a site may be called twice in a pass: each call applies its own edit.
    An edit that drops nothing trains exactly as no edit; one that drops keys changes the loss and
    every call was edited."""
    model = _model(calls=2, checkpointed=False).eval()  # no model dropout: the runs are comparable
    x = torch.randn(B, T, D)
    params = list(model.parameters())
    plain = model(x).sum()
    plain_grads = torch.autograd.grad(plain, params)

    calls = []

    def nothing(valid):
        calls.append(valid.shape)
        return torch.zeros(valid.shape, dtype=torch.bool)

    with model.controller.hooks({s: EditScores(drop=nothing) for s in model.controller.sites}):
        loss = model(x).sum()
    grads = torch.autograd.grad(loss, params)
    assert len(calls) == 2 * len(model.controller.sites)  # every call of every site was edited
    torch.testing.assert_close(loss, plain)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want)

    edits = {s: EditScores(drop=lambda valid: torch.rand(valid.shape) < 0.3) for s in model.controller.sites}
    with model.controller.hooks(edits):
        dropped = model(x).sum()
    grads = torch.autograd.grad(dropped, params)
    assert not torch.allclose(dropped, plain) and all(torch.isfinite(g).all() for g in grads)


def test_attribution_inside_a_reentrant_checkpoint_is_a_clear_error():
    """A reentrant checkpoint that ADDrop cannot pause hides the layer from autograd: refuse, never
    return zero attributions."""
    model = _model(checkpointed=True)
    x = torch.randn(B, T, D, requires_grad=True)
    ad_drop = ADDrop(ADDropConfig(p=0.5, q=0.5, schedule="always"), model.controller)
    with pytest.raises(RuntimeError, match="reentrant activation checkpoint"):
        ad_drop.attributions(lambda: model(x), logit_target, frozen=None)  # frozen=None: nothing paused
    sites, attributions, _ = ad_drop.attributions(lambda: model(x), logit_target, frozen=model)
    assert len(sites) == 2 and all(a.abs().sum() > 0 for a in attributions)


def test_pausing_restores_both_conventions():
    model = _model(checkpointed=True)
    wrapped = model.blocks[1]
    original = wrapped.forward
    wrapped.precheckpoint_forward = original  # fairseq's checkpoint_wrapper convention
    wrapped.forward = functools.partial(lambda *a: "checkpointed")
    with activation_checkpointing_paused(model):
        assert [b.gradient_checkpointing for b in model.blocks] == [False, False]
        assert wrapped.forward is original
    assert [b.gradient_checkpointing for b in model.blocks] == [True, True]
    assert wrapped.forward() == "checkpointed"
