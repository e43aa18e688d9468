"""Activation checkpointing and the regularizers' passes, on a plain-PyTorch model (no framework)."""

import functools

import pytest
import torch

from attn_reg_plugin.core.ad_drop import ADDrop, ADDropConfig
from attn_reg_plugin.core.attention import EditScores
from attn_reg_plugin.core.attribution import logit_target
from attn_reg_plugin.core.block_rules import BernoulliRule
from attn_reg_plugin.core.checkpointing import activation_checkpointing_paused
from helpers import CORE_B, CORE_D, CORE_T, CoreBlock, tiny_core_model

B, T, D = CORE_B, CORE_T, CORE_D
_model = tiny_core_model


def test_a_pass_stays_set_until_its_training_step_ends_and_leaves_nothing_behind():
    model = _model(checkpointed=True)
    x = torch.randn(B, T, D, requires_grad=True)
    ad_drop = ADDrop(ADDropConfig(p=0.5, q=0.5, schedule="always"), model.controller)
    with model.controller.training_step():
        with ad_drop.masked(lambda: model(x), logit_target, frozen=model):
            hooks = [site.hook for site in model.controller.sites]
            assert all(isinstance(h, EditScores) and h.drop is not None for h in hooks)
            loss = model(x).sum()
        # the block has ended, the step has not: a forward sees no hook, its backward's recompute
        # repeats the pass (same hook, same seed)
        assert all(s.hook is None and s.ended_pass[0] is h for s, h in zip(model.controller.sites, hooks))
        loss.backward()
    state = [(s.hook, s.seed, s.through_backward, s.ended_pass) for s in model.controller.sites]
    assert state == [(None, None, False, None)] * len(state)


def _two_calls_step(checkpointed, reentrant):
    """One step of a model whose sites are each called twice per forward, drops drawn from the pass's
    seeds: (loss, gradients)."""
    model = _model(calls=2, checkpointed=checkpointed)
    for block in model.blocks:
        block.forward = functools.partial(CoreBlock.forward, block, reentrant=reentrant)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(3)
    edits = {s: EditScores(drop=BernoulliRule(torch.tensor(0.3))) for s in model.controller.sites}
    with model.controller.training_step(), model.controller.hooks(edits):
        loss = model(x).sum()
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_site_called_twice_recomputes_exactly_under_checkpointing(reentrant):
    """Nothing of a call is recorded, so a site called twice in one pass is no ambiguity: its
    checkpointed recompute repeats both calls' drops, and the step equals the uncheckpointed one."""
    loss, grads = _two_calls_step(checkpointed=False, reentrant=reentrant)
    loss_ckpt, grads_ckpt = _two_calls_step(checkpointed=True, reentrant=reentrant)
    assert torch.equal(loss, loss_ckpt)
    for a, b in zip(grads, grads_ckpt):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_regularized_forward_outside_a_training_step_is_refused(reentrant):
    """Its pass would end before the backward recomputes it (as ordinary attention): refused in the
    forward. Without checkpointing, or under a pass begun without autograd, nothing is refused."""
    model = _model(checkpointed=True)
    for block in model.blocks:
        block.forward = functools.partial(CoreBlock.forward, block, reentrant=reentrant)
    x = torch.randn(B, T, D, requires_grad=True)
    edits = {s: EditScores(drop=BernoulliRule(torch.tensor(0.3))) for s in model.controller.sites}
    with pytest.raises(RuntimeError, match=r"encoder-self\[0\] ran a regularized forward inside an activation"):
        with model.controller.hooks(edits):
            model(x)
    for block in model.blocks:
        block.gradient_checkpointing = False
    with model.controller.hooks(edits):
        model(x).sum().backward()
    with torch.no_grad(), model.controller.hooks(edits):
        model(x)


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


def test_inside_a_step_a_new_pass_forgets_the_ended_one_and_a_checkpointed_plain_forward_is_refused():
    """An ended pass is what the step's backward recomputes, until another pass of the controller
    begins (IGA's per-layer passes, AD-DROP's pass 2 after pass 1). A checkpointed ordinary forward
    after it in the same step could not be told from the pass's forwards: refused, not recomputed
    with the pass's drops."""
    model = _model(checkpointed=True)
    first, second = model.controller.sites
    x = torch.randn(B, T, D, requires_grad=True)
    edit = EditScores(drop=BernoulliRule(torch.tensor(0.3)))
    with model.controller.training_step():
        with model.controller.hooks({first: edit}):
            pass
        assert first.ended_pass[0] is edit
        with model.controller.hooks({second: edit}):
            assert first.ended_pass is None
        assert second.ended_pass[0] is edit
        with pytest.raises(RuntimeError, match=r"encoder-self\[1\] ran an ordinary forward inside an activation"):
            model(x)
    model(x).sum().backward()  # the step over, the same forward is ordinary and recomputes as such
