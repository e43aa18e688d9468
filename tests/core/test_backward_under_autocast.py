"""A regularized call's backward taken inside ``torch.autocast`` (a loop that wraps its whole step,
backward included, in autocast). Its forward runs with autocast off (blockwise.edit_attention), so its
backward must too: on the portable branch (the one a GPU takes) the blockwise backward met autocast's
bf16 matmuls beside a float32 softmax and raised ``expected scalar type BFloat16 but found Float``
in ``_softmax_backward_data``. AttendOut's Attacker (the Generator's masks), then every kind of edit."""

import pytest
import torch
from test_attendout_blocks import _attacker_loss, _encoder_game
from test_autocast import KINDS, _blocks, _hook, _inputs

from attn_reg_plugin.core.kernel import devices
from attn_reg_plugin.core.kernel.attention import attend
from helpers import HandPass, run_in_blocks


@pytest.fixture(params=[True, False], ids=["portable", "cpu-branch"])
def branch(request, monkeypatch):
    """The portable branch (forced, as ATTN_REG_PORTABLE=1 forces it), and the CPU's own when the
    run does not force the portable one."""
    if not request.param and devices.PORTABLE:
        pytest.skip(f"{devices.PORTABLE_ENV}=1 forces the portable branch")
    monkeypatch.setattr(devices, "PORTABLE", request.param)


def _attacker_grads(monkeypatch, autocast: bool, backward_in_autocast: bool, many: bool):
    with monkeypatch.context() as mp:
        if many:
            run_in_blocks(mp)  # more than 64 query rows: block by block
        game, tokens, weights, embed = _encoder_game(length=150)
        weights = [w.requires_grad_() for w in weights]
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, record = _attacker_loss(game, tokens, weights, embed)
            if backward_in_autocast:
                grads = torch.autograd.grad(loss, weights)
        if not backward_in_autocast:
            grads = torch.autograd.grad(loss, weights)
        return loss.detach(), grads, [int(c) for c in record.counts()]


@pytest.mark.parametrize("many", [False, True], ids=["one-block", "blocks"])
def test_the_attackers_bf16_backward_inside_autocast_is_the_fp32_one_to_bf16_rounding(branch, monkeypatch, many):
    loss, grads, counts = _attacker_grads(monkeypatch, True, True, many)
    _, outside, outside_counts = _attacker_grads(monkeypatch, True, False, many)
    fp32_loss, fp32, fp32_counts = _attacker_grads(monkeypatch, False, False, many)
    assert counts == outside_counts == fp32_counts and counts[0] > 0  # the same masks (float32 logits)
    for g, o, e in zip(grads, outside, fp32):
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
        torch.testing.assert_close(g, o)  # where the backward is taken changes nothing
        # bf16 keeps 8 bits of mantissa: a relative error of ~1e-2 per product, against the largest entry
        torch.testing.assert_close(g, e, rtol=3e-2, atol=3e-2 * float(e.abs().max()))
    torch.testing.assert_close(loss, fp32_loss, rtol=3e-2, atol=0)


@pytest.mark.parametrize("split", [True, False], ids=["blocks", "one-block"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_edits_backward_inside_autocast_is_its_backward_outside(branch, monkeypatch, kind, split):
    """The same call (q, k float32, v bf16, as a Llama hands them over) under bf16 autocast, its
    backward inside and outside autocast: the same gradients, bit for bit (drops and math alike)."""
    _blocks(monkeypatch, split)

    def run(backward_in_autocast):
        q, k, v, valid = _inputs("cpu")
        hook = _hook(kind, q, k, v, valid)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v.to(torch.bfloat16))]
        torch.manual_seed(11)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = attend(*leaves, valid, **HandPass(hook).call)
            loss = (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum()
            if backward_in_autocast:
                return torch.autograd.grad(loss, leaves)
        return torch.autograd.grad(loss, leaves)

    for inside, outside in zip(run(True), run(False)):
        assert inside.dtype == outside.dtype
        torch.testing.assert_close(inside, outside, atol=0, rtol=0)
