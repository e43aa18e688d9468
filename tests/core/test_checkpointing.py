"""Activation checkpointing and the regularizers' passes, on a plain-PyTorch model (no framework)."""

import functools

import pytest
import torch

from attn_reg_plugin.core.ad_drop import ADDrop, ADDropConfig
from attn_reg_plugin.core.attention import EditScores
from attn_reg_plugin.core.attribution import logit_target
from attn_reg_plugin.core.block_rules import BernoulliRule
from attn_reg_plugin.core.checkpointing import activation_checkpointing_paused
from attn_reg_plugin.core.controller import RegularizationController
from attn_reg_plugin.hf import install_attention_sites
from helpers import CORE_B, CORE_D, CORE_T, CoreBlock, tiny_core_model, tiny_llama

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


def _edits(model, p=0.3):
    return {s: EditScores(drop=BernoulliRule(torch.tensor(p))) for s in model.controller.sites}


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_skipped_ad_drop_step_trains_plainly_under_checkpointing(reentrant):
    """A non-finite attribution target skips the masks: the checkpointed step is the plain one (pass 1's
    captures leave nothing for the backward to repeat)."""

    def step(checkpointed):
        model = _model(checkpointed=checkpointed)
        for block in model.blocks:
            block.forward = functools.partial(CoreBlock.forward, block, reentrant=reentrant)
        x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        ad_drop = ADDrop(ADDropConfig(p=0.5, q=0.5, schedule="always"), model.controller)
        overflow = lambda out, labels: (out.sum() * float("inf"), labels)  # noqa: E731
        torch.manual_seed(0)
        with model.controller.training_step():
            with ad_drop.masked(lambda: model(x), overflow, frozen=model) as stats:
                loss = model(x).sum()
            loss.backward()
        return int(stats["skipped"]), loss.detach(), [p.grad for p in model.parameters()]

    plain, checkpointed = step(False), step(True)
    assert plain[0] == checkpointed[0] == 1 and torch.equal(plain[1], checkpointed[1])
    assert all(torch.equal(a, b) for a, b in zip(plain[2], checkpointed[2]))


def test_passes_not_back_propagated_in_their_step_are_refused_and_others_are_not():
    """Two checkpointed regularized passes back-propagated together, or a backward after the step,
    would be recomputed with the wrong pass or none: refused. Back-propagated in turn, they train."""
    model = _model(checkpointed=True)
    x = torch.randn(B, T, D, requires_grad=True)
    c = model.controller
    with pytest.raises(RuntimeError, match="not back-propagated before the next regularized pass began"):
        with c.training_step():
            with c.hooks(_edits(model)):
                first = model(x).sum()
            with c.hooks(_edits(model)):
                (first + model(x).sum()).backward()
    with pytest.raises(RuntimeError, match="not back-propagated before the training step ended"):
        with c.training_step(), c.hooks(_edits(model)):
            model(x).sum()
    with c.training_step():
        for _ in range(2):  # micro-batches, each back-propagated
            with c.hooks(_edits(model)):
                loss = model(x).sum()
            loss.backward()
    assert all(s.ended_pass is None and s.ledger is None for s in c.sites)


def test_what_is_not_a_checkpoint_is_not_refused():
    """An evaluation without autograd inside a step, and saved-tensor hooks that offload rather than
    checkpoint, are no recompute: nothing is refused."""
    model = _model(checkpointed=False)
    x = torch.randn(B, T, D, requires_grad=True)
    c = model.controller
    with c.training_step():
        with c.hooks(_edits(model)):
            loss = model(x).sum()
        with torch.no_grad():
            model(x)
        loss.backward()
    with torch.autograd.graph.save_on_cpu(), c.hooks(_edits(model)):
        model(x).sum().backward()


def test_a_copy_of_a_site_carries_no_pass_and_passes_do_not_nest_on_a_site():
    import copy

    model = _model()
    c = model.controller
    with c.hooks(_edits(model)):
        copied = copy.deepcopy(c.sites[0])
        assert (copied.kind, copied.layer, copied.hook, copied.seed) == ("encoder-self", 0, None, None)
        with pytest.raises(RuntimeError, match=r"began on encoder-self\[0\] inside another one"):
            with c.hooks({c.sites[0]: EditScores(drop=BernoulliRule(torch.tensor(0.1)))}):
                pass


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_attribution_pass_pauses_only_reentrant_checkpoints(reentrant):
    """A reentrant checkpoint refuses autograd.grad, so pass 1 runs those layers plainly; torch's
    non-reentrant one (transformers' default) stays on, and autograd.grad recomputes its layers
    inside pass 1 instead of pass 1 holding every layer's activations: the layers run twice there."""
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    layers = model.model.layers
    with activation_checkpointing_paused(model):
        assert [layer.gradient_checkpointing for layer in layers] == [not reentrant] * len(layers)
    assert all(layer.gradient_checkpointing for layer in layers)
    controller = RegularizationController()
    install_attention_sites(model, controller)
    calls = []
    layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))  # a recompute calls it too
    ad_drop = ADDrop(ADDropConfig(p=0.3, q=0.5, schedule="always", attention="decoder-self"), controller)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))

    def target(output, labels):
        return logit_target(output.logits[:, -1], labels)

    found = ad_drop.attributions(lambda: model(input_ids=ids), target, frozen=model, dense=False)
    assert found is not None
    assert len(calls) == (1 if reentrant else 2)
