"""Activation checkpointing and the regularizers' passes, on a plain-PyTorch model (no framework)."""

import functools

import pytest
import torch

from attn_reg_plugin.core.kernel.attention_call import EditScores, active_plan, hook_in_progress
from attn_reg_plugin.core.kernel.controller import RegularizationController
from attn_reg_plugin.core.kernel.rules import BernoulliRule
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attribution import logit_target
from attn_reg_plugin.core.training.checkpointing import activation_checkpointing_paused
from attn_reg_plugin.hf import install_attention_sites
from helpers import (
    CORE_B,
    CORE_D,
    CORE_T,
    CoreBlock,
    assert_all_close_to_reference,
    assert_close_to_reference,
    tiny_core_model,
    tiny_llama,
)

B, T, D = CORE_B, CORE_T, CORE_D
_model = tiny_core_model


def _ad_drop_step(checkpointed, reentrant, plain_after=False):
    """One AD-DROP step of the custom model, its backward after the pass ended and outside any scope,
    as a user's own loop runs it: (loss, gradients). ``plain_after``: a plain forward's loss is added
    before the one backward (a checkpointed ordinary call recomputed beside the pass's)."""
    model = _model(checkpointed=checkpointed)
    for block in model.blocks:
        block.forward = functools.partial(CoreBlock.forward, block, reentrant=reentrant)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ad_drop = ADDrop(ADDropConfig(p=0.5, q=0.5, schedule="always"), model.controller)
    torch.manual_seed(0)
    with ad_drop.masked(lambda: model(x), logit_target, frozen=model) as stats:
        loss = model(x).sum()
    if plain_after:
        loss = loss + model(x).sum()
    assert all(active_plan(s) is None for s in model.controller.sites)  # nothing left behind
    loss.backward()
    assert int(stats["dropped"]) > 0
    return loss.detach(), [p.grad for p in model.parameters()], x.grad


@pytest.mark.parametrize("plain_after", [False, True])
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_step_back_propagated_after_its_pass_equals_the_plain_one(reentrant, plain_after):
    """The pass travels with each checkpointed call (controller.checkpoint keeps it for the recompute):
    a backward after the pass ended, with no step scope, repeats the forward's drops, and a plain
    forward back-propagated beside it recomputes as plain. Loss and every parameter's gradient are
    bit-identical to the step without checkpointing; the input's, summed from two paths in another
    order by a reentrant backward, equal within float rounding."""
    loss, grads, x_grad = _ad_drop_step(False, reentrant, plain_after)
    loss_ckpt, grads_ckpt, x_grad_ckpt = _ad_drop_step(True, reentrant, plain_after)
    assert torch.equal(loss, loss_ckpt)
    for a, b in zip(grads, grads_ckpt):
        assert torch.equal(a, b)
    assert_close_to_reference(x_grad_ckpt, x_grad, rtol=1e-6)


def _two_calls_step(checkpointed, reentrant):
    """One step of a model whose sites are each called twice per forward, drops drawn from the pass's
    seeds: (loss, gradients)."""
    model = _model(calls=2, checkpointed=checkpointed)
    for block in model.blocks:
        block.forward = functools.partial(CoreBlock.forward, block, reentrant=reentrant)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(3)
    edits = {s: EditScores(drop=BernoulliRule(torch.tensor(0.3))) for s in model.controller.sites}
    with model.controller.hooks(edits):
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


def test_attribution_inside_a_reentrant_checkpoint_is_a_clear_error():
    """A reentrant checkpoint that ADDrop cannot pause (torch's own, unflagged) hides the layer from
    autograd: refuse, never return zero attributions."""
    import torch.utils.checkpoint

    model = _model(checkpointed=True)
    for block in model.blocks:
        block.checkpoint = torch.utils.checkpoint.checkpoint
    x = torch.randn(B, T, D, requires_grad=True)
    ad_drop = ADDrop(ADDropConfig(p=0.5, q=0.5, schedule="always"), model.controller)
    with pytest.raises(RuntimeError, match="reentrant activation checkpoint"):
        ad_drop.attributions(lambda: model(x), logit_target, frozen=None)  # frozen=None: nothing paused
    sites, attributions, _ = ad_drop.attributions(lambda: model(x), logit_target, frozen=model)
    assert len(sites) == 2 and all(a.abs().sum() > 0 for a in attributions)


@pytest.mark.parametrize("regularizer", ["ad-drop", "edit"])
def test_a_bare_reentrant_checkpoint_under_a_pass_is_refused_naming_the_fix(regularizer):
    """torch's reentrant checkpoint runs the forward without autograd and recomputes it in the
    backward, after the pass, as ordinary attention: the gradients would be another function's,
    silently. The forward is refused, naming controller.checkpoint; the controller's own reentrant
    checkpoint (the pass carried into the recompute) and a non-reentrant bare one (torch's own
    CheckpointError in the backward) are not."""
    import torch.utils.checkpoint

    model = _model(checkpointed=True)
    for block in model.blocks:
        block.checkpoint = torch.utils.checkpoint.checkpoint
    x = torch.randn(B, T, D, requires_grad=True)
    if regularizer == "ad-drop":
        ad_drop = ADDrop(ADDropConfig(p=0.5, q=0.5, schedule="always"), model.controller)
        scope = functools.partial(ad_drop.masked, lambda: model(x), logit_target, frozen=model)
    else:
        edits = {s: EditScores(drop=BernoulliRule(torch.tensor(0.3))) for s in model.controller.sites}
        scope = functools.partial(model.controller.hooks, edits)
    with pytest.raises(
        RuntimeError, match=r"encoder-self\[0\] ran a regularized pass with autograd off.*controller\.checkpoint"
    ):
        with scope():
            model(x).sum()
    with pytest.raises(torch.utils.checkpoint.CheckpointError):  # non-reentrant: torch refuses the recompute
        for block in model.blocks:
            block.forward = functools.partial(CoreBlock.forward, block, reentrant=False)
        with scope():
            loss = model(x).sum()
        loss.backward()
    with torch.no_grad(), model.controller.hooks({}):  # no pass on the sites: nothing to refuse
        model(x)


@pytest.mark.parametrize("outer_reentrant", [False, True])
def test_a_bare_reentrant_checkpoint_inside_the_controllers_is_refused(outer_reentrant):
    """The controller's checkpoint carries the pass to its own recompute, not to a bare reentrant
    torch checkpoint nested inside it (recomputed after the pass, as ordinary attention): that one is
    refused too, in the forward or at the latest in the outer recompute."""
    import torch.utils.checkpoint

    model = _model(checkpointed=True)
    controller = model.controller
    for block in model.blocks:
        block.checkpoint = lambda f, *a, **k: controller.checkpoint(
            lambda *b: torch.utils.checkpoint.checkpoint(f, *b, use_reentrant=True), *a, use_reentrant=outer_reentrant
        )
    x = torch.randn(B, T, D, requires_grad=True)
    edits = {s: EditScores(drop=BernoulliRule(torch.tensor(0.3))) for s in controller.sites}
    with pytest.raises(RuntimeError, match="ran a regularized pass with autograd off"):
        with controller.hooks(edits):
            loss = model(x).sum()
        loss.backward()


@pytest.mark.parametrize("attribution", ["ga", "iga"])
def test_the_controllers_reentrant_checkpoint_pauses_itself_for_the_attribution_pass(attribution):
    """controller.checkpoint(..., use_reentrant=True) where no flag pauses the layers (frozen=None):
    the attribution pass, which takes autograd.grad, runs them unchecked, and the step equals the
    uncheckpointed one."""

    def step(checkpointed):
        model = _model(checkpointed=checkpointed)
        x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        config = ADDropConfig(p=0.5, q=0.5, schedule="always", attribution=attribution, iga_steps=3)
        torch.manual_seed(0)
        with ADDrop(config, model.controller).masked(lambda: model(x), logit_target, frozen=None) as stats:
            loss = model(x).sum()
        loss.backward()
        assert int(stats["dropped"]) > 0
        return loss.detach(), [p.grad for p in model.parameters()]

    loss, grads = step(False)
    loss_ckpt, grads_ckpt = step(True)
    assert torch.equal(loss, loss_ckpt)
    assert_all_close_to_reference(grads_ckpt, grads, rtol=1e-6)


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


def _edits(model, p=0.3):
    return {s: EditScores(drop=BernoulliRule(torch.tensor(p))) for s in model.controller.sites}


@pytest.mark.cpu_branch
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
        with ad_drop.masked(lambda: model(x), overflow, frozen=model) as stats:
            loss = model(x).sum()
        loss.backward()
        return int(stats["skipped"]), loss.detach(), [p.grad for p in model.parameters()]

    plain, checkpointed = step(False), step(True)
    assert plain[0] == checkpointed[0] == 1 and torch.equal(plain[1], checkpointed[1])
    assert all(torch.equal(a, b) for a, b in zip(plain[2], checkpointed[2]))


def test_two_checkpointed_passes_back_propagated_together_recompute_each_its_own():
    """Each checkpointed call keeps its own pass, so two passes summed into one loss (once refused) are
    recomputed each with its drops: the same gradients as without checkpointing."""

    def step(checkpointed):
        model = _model(checkpointed=checkpointed)
        x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(2), requires_grad=True)
        torch.manual_seed(5)
        with model.controller.hooks(_edits(model)):
            first = model(x).sum()
        with model.controller.hooks(_edits(model, p=0.6)):
            (first + model(x).sum()).backward()
        return [p.grad for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(step(False), step(True)))


def test_what_is_not_a_checkpoint_runs():
    """An evaluation without autograd between a pass and its backward, and saved-tensor hooks that
    offload rather than checkpoint, are no recompute: they run."""
    model = _model(checkpointed=False)
    x = torch.randn(B, T, D, requires_grad=True)
    c = model.controller
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
        assert (copied.kind, copied.layer) == ("encoder-self", 0) and copied is not c.sites[0]
        assert hook_in_progress(copied) is None and hook_in_progress(c.sites[0]) is not None
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


def test_a_recompute_adds_nothing_to_any_passs_record():
    """What a pass collected is its forward's: a recompute adds nothing to a pass that ended, to an open
    pass whose record was read, or (recomputing an earlier pass's layers) to the pass open at the time,
    since each checkpointed call carries its own pass's record. No test of whether autograd runs."""
    model = _model(checkpointed=True)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(3), requires_grad=True)

    def counted(p):
        return {s: EditScores(drop=BernoulliRule(torch.tensor(p)), counted=True) for s in model.controller.sites}

    torch.manual_seed(0)
    with model.controller.hooks(counted(0.3)) as first:
        loss = model(x).sum()
    with model.controller.hooks(counted(0.6)) as second:
        loss = loss + model(x).sum()
        seen = [[int(c) for c in record.counts()] + [len(record.entries)] for record in (first, second)]
        loss.backward()  # recomputes both passes' layers, inside the second pass
    assert [[int(c) for c in record.counts()] + [len(record.entries)] for record in (first, second)] == seen
    assert seen[0][2] == seen[1][2] == len(model.controller.sites) and 0 < seen[0][0] < seen[1][0]


def test_a_plan_kept_for_a_recompute_does_not_keep_its_pass_record_alive():
    """A checkpoint keeps a layer's arguments, the pass's plan among them, until its backward. The
    plan holds its record weakly, so what the pass captured (GA's outputs, which hold the attribution
    pass's whole graph) is freed when the pass is done with it: a tiny Llama's RSS growth under GA
    with gradient checkpointing went from 1.26x to 1.96x the stock Trainer's when it held it strongly."""
    import gc
    import weakref

    from attn_reg_plugin.core.kernel.attention import attend
    from attn_reg_plugin.core.kernel.attention_call import CaptureOutput, call_of, plan_of

    controller = RegularizationController()
    site = controller.register("encoder-self", 0)
    q = torch.randn(1, 2, 5, 4, requires_grad=True)
    with controller.hooks({site: CaptureOutput()}) as record:
        plan = plan_of(controller.sites)
        attend(q, q, q, site=site, plan=plan)
        assert len(record.outputs) == 1  # read: the pass's record is closed
        watched = weakref.ref(record)
    del record
    gc.collect()
    assert watched() is None and plan  # the plan lives on; its record, and the captured output, do not
    assert call_of(site, plan).recompute  # a recompute under it adds nothing
