"""DropHead (core.drophead): whole heads of the attention output dropped per sample, kept heads
rescaled by heads / kept, on hand-built tensors, through checkpointing, and through both adapters."""

import functools

import pytest
import torch
import torch.nn.functional as F

from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import EditOutputs
from attn_reg_plugin.core.kernel.rules import call_seed, keyed_draws
from attn_reg_plugin.core.regularizers.drophead import DropHead, DropHeadConfig
from attn_reg_plugin.core.regularizers.planned_run import idle_run_warning
from helpers import (
    CORE_B,
    CORE_D,
    CORE_T,
    CoreBlock,
    HandPass,
    assert_all_close_to_reference,
    assert_close_to_reference,
    controller_with_sites,
    tiny_core_model,
)


def _draws(b, h):
    """The kernel's numbers for a hook set by hand: keyed draws (stream -4, one per (sample, head)) of
    a seed drawn from torch's stream at the call."""
    return keyed_draws(call_seed(), -4, [b, h, 1, 1], 0, 1, 1, True, torch.device("cpu")).view(b, h)


def _drawn(b, h, p):
    """The kernel's drops, one draw per (sample, head); a sample whose every head is drawn keeps the
    one of largest draw."""
    draws = _draws(b, h)
    drop = draws < p
    drop[drop.all(-1), draws[drop.all(-1)].argmax(-1)] = False
    return drop


def _qkv(b=3, h=4, t=5, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=g, requires_grad=True) for _ in range(3)]


def test_dropped_heads_are_zero_and_kept_heads_scaled_by_heads_over_kept():
    q, k, v = _qkv()
    site = HandPass(EditOutputs(torch.tensor(0.4), counted=True))
    torch.manual_seed(7)
    out, _ = attend(q, k, v, **site.call)
    counts = site.record.counts()
    torch.manual_seed(7)
    drop = _drawn(3, 4, 0.4)
    assert drop.any() and not drop.all()
    plain = F.scaled_dot_product_attention(*(x.double() for x in (q, k, v)))
    kept = 4 - drop.sum(-1)
    for b in range(3):
        for h in range(4):
            expected = torch.zeros_like(plain[b, h]) if drop[b, h] else plain[b, h] * (4 / kept[b])
            assert_close_to_reference(out[b, h], expected)
    assert (int(counts[0]), int(counts[1])) == (int(drop.sum()), 12)  # counted by the kernel


def test_gradients_equal_autograd_of_the_explicit_rescaled_heads():
    q, k, v = _qkv(seed=1)
    torch.manual_seed(3)
    out, _ = attend(q, k, v, **HandPass(EditOutputs(torch.tensor(0.5))).call)
    grads = torch.autograd.grad(out.pow(2).sum(), [q, k, v])
    torch.manual_seed(3)
    drop = _drawn(3, 4, 0.5)
    scale = (~drop).double() * 4 / (4 - drop.sum(-1, keepdim=True))
    q2, k2, v2 = (x.detach().double().requires_grad_() for x in (q, k, v))  # the reference in float64
    weights = torch.softmax(q2 @ k2.transpose(-1, -2) / 8**0.5, -1)
    expected = torch.autograd.grad(((weights @ v2) * scale[:, :, None, None]).pow(2).sum(), [q2, k2, v2])
    assert_all_close_to_reference(grads, expected)


def test_a_sample_drawn_to_lose_every_head_keeps_its_largest_draw_scaled_by_heads():
    """p = 1 draws every head of every sample: each keeps the head of its largest draw, times H."""
    q, k, v = _qkv(seed=2)
    site = HandPass(EditOutputs(torch.tensor(1.0), counted=True))
    torch.manual_seed(4)
    out, _ = attend(q, k, v, **site.call)
    torch.manual_seed(4)
    kept = _draws(3, 4).argmax(-1)
    plain = F.scaled_dot_product_attention(q, k, v)
    for b in range(3):
        for h in range(4):
            expected = plain[b, h] * 4 if h == kept[b] else torch.zeros_like(plain[b, h])
            torch.testing.assert_close(out[b, h], expected)
    assert [int(c) for c in site.record.counts()[:2]] == [9, 12] and torch.isfinite(out).all()


@pytest.mark.parametrize("heads, p", [(2, 0.5), (2, 0.9), (1, 0.7), (12, 1.0)])
def test_the_rate_rises_with_p_as_p_minus_p_to_the_heads_over_heads(heads, p):
    """Where every head may be drawn the rate is p - p**H / H: 0.375 and 0.495 with two heads (more for
    the larger p), none for a single head (it is never dropped), 11/12 at p = 1 with twelve."""
    q, k, v = (x.detach() for x in _qkv(b=4000, h=heads, t=1, d=2, seed=5))
    site = HandPass(EditOutputs(torch.tensor(p), counted=True))
    torch.manual_seed(0)
    attend(q, k, v, **site.call)
    dropped, pairs = (int(c) for c in site.record.counts()[:2])
    assert abs(dropped / pairs - (p - p**heads / heads)) < 0.015


def test_the_rate_is_p_and_the_same_seed_gives_the_same_drops():
    q, k, v = (x.detach() for x in _qkv(b=2000, h=8, t=2, d=4, seed=3))
    site = HandPass(EditOutputs(torch.tensor(0.3), counted=True))
    torch.manual_seed(0)
    first, _ = attend(q, k, v, **site.call)
    counts = site.record.counts()
    assert abs(int(counts[0]) / int(counts[1]) - 0.3) < 0.01  # all 8 heads drawn: 0.3**8, negligible
    torch.manual_seed(0)
    again, _ = attend(q, k, v, **site.call)
    torch.manual_seed(1)
    other, _ = attend(q, k, v, **site.call)
    assert torch.equal(first, again) and not torch.equal(first, other)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_step_equals_the_plain_one(reentrant):
    """The heads are keyed draws of the pass's seed for the site, which the checkpointed call carries
    to its recompute: the same loss and gradients."""

    def step(checkpointed):
        model = tiny_core_model(checkpointed=checkpointed)
        for block in model.blocks:
            block.forward = functools.partial(CoreBlock.forward, block, reentrant=reentrant)
        x = torch.randn(CORE_B, CORE_T, CORE_D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        drophead = DropHead(DropHeadConfig(schedule="0:0.5"), model.controller)
        torch.manual_seed(4)
        with model.controller.hooks(drophead.hooks(update=0)):
            loss = model(x).sum()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    loss, grads = step(False)
    loss_ckpt, grads_ckpt = step(True)
    assert torch.equal(loss, loss_ckpt) and all(torch.equal(a, b) for a, b in zip(grads, grads_ckpt))


def test_the_schedule_is_piecewise_linear_and_a_v_needs_three_knots():
    drophead = DropHead(DropHeadConfig(schedule="0:0.2,100:0,200:0.2"), controller_with_sites({"encoder-self": 2}))
    assert [drophead.probability(u) for u in (0, 50, 100, 150, 250)] == pytest.approx([0.2, 0.1, 0.0, 0.1, 0.2])
    assert drophead.hooks(update=100) == {}  # p = 0: no hook, nothing drawn
    assert len(drophead.hooks(update=10)) == 2


@pytest.mark.parametrize(
    "schedule,message",
    [
        ("0:1.5", r"--attn-drophead-schedule: knot '0:1.5' probability must be a probability in \[0, 1\]"),
        ("0:0.1|0:0.2", r"--attn-drophead-schedule takes one schedule \(every selected layer follows it\)"),
        ("zero", r"--attn-drophead-schedule: cannot read knot 'zero'"),
    ],
)
def test_bad_schedules_are_refused_naming_the_option(schedule, message):
    with pytest.raises(ValueError, match=message):
        DropHeadConfig(schedule=schedule).validate()


def test_a_schedule_at_zero_for_the_planned_run_warns():
    config = DropHeadConfig(schedule="0:0,1000:0.1").validate()
    message = idle_run_warning(config, epochs=1, updates=1, plan="--max-update 1")
    assert "DropHead will never drop anything" in message
    assert idle_run_warning(config, epochs=1, updates=5, plan="--max-update 5") is None
