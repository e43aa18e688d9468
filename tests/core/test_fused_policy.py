"""AttendOut's Generator on the fused route (core/kernel/fused_policy.py and fused_edit's GENERATOR rule): the
kernels' actions are Gumbel-max draws of the policy's logits over its units, any block of rows draws the
whole's, the attention kernel drops exactly them, the log-probability and its gradients are autograd's over
those actions, and through the game a batch's REINFORCE credits the very actions the Attacker's attention
dropped, whether its calls took the kernel or the PyTorch path. Triton's interpreter without CUDA."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import controller_with_sites, fused_kernel_device

DEVICE = fused_kernel_device()
pytestmark = pytest.mark.gpu  # make gpu-check: compiled on CUDA; here in the interpreter

from attn_reg_plugin.core.kernel import devices, fused_edit, fused_policy, fused_route  # noqa: E402
from attn_reg_plugin.core.kernel.attention import attend  # noqa: E402
from attn_reg_plugin.core.kernel.rules import SampledLogits  # noqa: E402
from attn_reg_plugin.core.regularizers.attendout import AttendOut, AttendOutConfig, Generator  # noqa: E402
from attn_reg_plugin.core.regularizers.attendout.game import _site_seed  # noqa: E402

UNIT_KINDS = {"every unit": (False, True), "real units": (False, False), "real, causal": (True, False)}


def policy(b=2, t=37, s=29, g=12, offset=-0.4, kind="real units", seed=0):
    generator = torch.Generator().manual_seed(seed)
    query, key = torch.randn(b, t, g, generator=generator), torch.randn(b, s, g, generator=generator)
    query_real, key_real = torch.ones(b, t, dtype=torch.bool), torch.ones(b, s, dtype=torch.bool)
    query_real[-1, -5:], key_real[-1, -7:] = False, False
    causal, every = UNIT_KINDS[kind]
    factors = [x.to(DEVICE) for x in (query, key, torch.tensor(offset), query_real, key_real)]
    return SampledLogits(*factors, causal, every, 777 + seed)


def units_of(p: SampledLogits) -> torch.Tensor:
    b, t, s = p.query.shape[0], p.query.shape[1], p.key.shape[1]
    if p.every_unit:
        return torch.ones((b, t, s), dtype=torch.bool, device=DEVICE)
    units = p.query_real[:, :, None] & p.key_real[:, None, :]
    return units & torch.ones((t, s), dtype=torch.bool, device=DEVICE).tril(s - t) if p.causal else units


@pytest.mark.parametrize("kind", list(UNIT_KINDS))
def test_an_action_is_a_uniform_below_sigmoid_of_the_logit_within_the_units(kind):
    p = policy(kind=kind)
    seen = fused_policy.inspect_policy(p)
    torch.testing.assert_close(seen.logit, p.query @ p.key.transpose(1, 2) + p.offset, rtol=1e-5, atol=1e-5)
    assert torch.equal(seen.units, units_of(p))
    assert torch.equal(seen.drop, seen.units & (seen.uniform < torch.sigmoid(seen.logit)))
    assert ((seen.uniform >= 0) & (seen.uniform < 1)).all()
    assert torch.equal(fused_policy.inspect_policy(p).drop, seen.drop)  # the seed alone decides
    assert (
        fused_policy.inspect_policy(dataclasses.replace(p, seed=p.seed + 1)).uniform != seen.uniform
    ).float().mean() > 0.99
    n = int(seen.units.sum())
    rate, expected = seen.drop[seen.units].float().mean().item(), torch.sigmoid(seen.logit)[seen.units].mean().item()
    assert abs(rate - expected) < 4 * math.sqrt(0.25 / n)


def test_one_mask_per_sample_its_heads_share():
    p = policy(kind="real, causal")
    q, k, v = (torch.randn(2, h, n, 8, generator=torch.Generator().manual_seed(h)).to(DEVICE) for h, n in
               ((4, 37), (2, 29), (2, 29)))  # fmt: skip
    spec = fused_edit.EditDrops(fused_edit.GENERATOR, 0.0, p.seed, policy=p)
    seen = fused_edit.inspect(q, k, v, spec, None, True)
    actions = fused_policy.inspect_policy(p).drop[:, None]
    assert torch.equal(seen.drop, actions & seen.valid & ~seen.uniform[..., None])
    assert torch.equal(seen.region, units_of(p)[:, None].expand_as(seen.region) & seen.valid)


def test_a_block_of_rows_draws_the_wholes_actions():
    p = policy(t=50, s=41)
    whole = fused_policy.inspect_policy(p).drop
    tile = fused_edit.tile()
    for rows, keys in ((slice(0, 50), 41), (slice(tile, 50), 41), (slice(2 * tile, 3 * tile), 20), (slice(0, 7), 3)):
        assert torch.equal(fused_policy.policy_drops(p, rows, keys)[:, 0], whole[:, rows, :keys]), (rows, keys)
    with pytest.raises(ValueError, match="starts at a multiple of"):
        fused_policy.policy_drops(p, slice(1, 9), 41)


@pytest.mark.parametrize("kind", list(UNIT_KINDS))
def test_the_log_probability_and_its_gradients_are_autograds_over_the_kernels_actions(kind):
    p = policy(kind=kind, offset=0.3)
    seen = fused_policy.inspect_policy(p)
    weights = torch.tensor([0.6, -1.4], device=DEVICE)
    leaves = [x.clone().requires_grad_() for x in (p.query, p.key, p.offset)]
    sums, counts, probability = fused_policy.policy_log_prob(p.with_factors(*leaves))
    got = [sums.detach(), *torch.autograd.grad((sums * weights).sum(), leaves)]
    reference = [x.clone().requires_grad_() for x in (p.query, p.key, p.offset)]
    logits = reference[0] @ reference[1].transpose(1, 2) + reference[2]
    log_p = torch.where(seen.drop, F.logsigmoid(logits), F.logsigmoid(-logits)).masked_fill(~seen.units, 0).sum((1, 2))
    expected = [log_p.detach(), *torch.autograd.grad((log_p * weights).sum(), reference)]
    for name, a, e in zip(("sums", "d query", "d key", "d offset"), got, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, msg=name)
    assert torch.equal(counts, seen.units.sum((1, 2)))
    torch.testing.assert_close(probability, torch.sigmoid(seen.logit)[seen.units].sum(), rtol=1e-5, atol=1e-4)


def test_the_attention_kernel_counts_the_units_it_could_drop():
    """dropped / droppable within the units (a padding query row's keys are none), an emptied row's units all
    counted dropped (it attends uniformly), as blockwise.block_counts counts AttendOut's droppable units."""
    for offset in (-0.4, 5.0):
        p = policy(offset=offset)
        q, k, v = (torch.randn(2, 2, n, 8, generator=torch.Generator().manual_seed(n)).to(DEVICE) for n in (37, 29, 29))
        spec = fused_edit.EditDrops(fused_edit.GENERATOR, 0.0, p.seed, policy=p)
        bias = torch.zeros(2, 1, 1, 29, device=DEVICE)
        bias[0, ..., -3:] = -math.inf
        seen = fused_edit.inspect(q, k, v, spec, bias)
        _, dropped, droppable = fused_edit.fused_edit_attention(q, k, v, spec, bias)
        units = units_of(p)[:, None] & seen.valid
        assert int(droppable) == int(units.sum())
        assert int(dropped) == int((seen.drop | (seen.uniform[..., None] & units)).sum())
        assert seen.uniform.any() == (offset > 0)


def test_the_first_use_check_passes_the_policy_kernels_and_catches_a_gradient_that_disagrees(monkeypatch):
    assert fused_route.check_policy_against_pytorch(torch.device(DEVICE)) is None
    original = fused_policy._PolicyLogProb.backward

    def key_off(ctx, *grads):
        dq, dk, doffset, none = original(ctx, *grads)
        return dq, dk * 1.01, doffset, none

    monkeypatch.setattr(fused_policy._PolicyLogProb, "backward", staticmethod(key_off))
    failed = fused_route.check_policy_against_pytorch(torch.device(DEVICE))
    assert failed is not None and failed.startswith("its gradient in gk off by")


def test_a_failed_policy_check_keeps_the_generator_on_pytorchs_draws(monkeypatch, caplog):
    monkeypatch.setattr(devices, "FUSED", None)
    monkeypatch.setattr(devices, "fused_route_asked", lambda q: True)
    monkeypatch.setattr(fused_route, "_CHECKED", {})
    monkeypatch.setattr(fused_route, "check_policy_against_pytorch", lambda device: "the units differ")
    with caplog.at_level("ERROR", logger=fused_route.__name__):
        assert not fused_route.policy_on_kernel(torch.zeros(1, device=DEVICE), 8)
        assert not fused_route.policy_on_kernel(torch.zeros(1, device=DEVICE), 8)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "AttendOut's Generator: the units differ" in errors[0]


def game(init_drop=0.3):
    torch.manual_seed(0)
    return AttendOut(
        AttendOutConfig(dropout_step=1, init_drop=init_drop),
        controller_with_sites({"encoder-self": 1}),
        Generator({"source": 50}, {"source": 1}, 8, 128, 0.3, 1.0).to(DEVICE),
    )


@pytest.mark.parametrize("route", ["kernel", "pytorch path"])
def test_reinforce_credits_the_actions_the_attackers_attention_dropped(route, monkeypatch):
    """Through the game with the route on: the batch draws on the kernels; its calls take the fused kernel
    (or, for a call the kernel does not take, the PyTorch path with the same actions), and the Generator's
    log-probability is over exactly the units they dropped. Read through the kernel: with q = k = 0 and
    v = I, a row's output is positive exactly at its kept keys."""
    monkeypatch.setattr(devices, "FUSED", True)
    taken = {"kernel": 0}
    original = fused_edit.fused_edit_attention

    def counted(*args, **kwargs):
        taken["kernel"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_edit, "fused_edit_attention", counted)
    if route == "pytorch path":
        monkeypatch.setattr(fused_route, "fused_or_why_not", lambda *args: (None, "a test's call"))
    g = game()
    b, h, t = 3, 2, 40
    tokens = torch.randint(2, 50, (b, t)).to(DEVICE)
    q = k = torch.zeros(b, h, t, t, device=DEVICE)
    v = torch.eye(t, device=DEVICE).expand(b, h, t, t).contiguous()
    with g.attacker_pass({"source": tokens}) as record:
        out, _ = attend(q, k, v, site=g.sites[0])
    assert g.cache[-1].on_kernel and taken["kernel"] == (1 if route == "kernel" else 0)
    applied = out[:, :1] <= 0  # dropped keys get weight 0 (one mask per sample, shared by the heads)
    assert torch.equal(applied, out[:, 1:] <= 0)
    p = g.generator.policies(g.cache[-1].streams, g.sites)[0]
    credited = fused_policy.inspect_policy(p.sampled(_site_seed(g.cache[-1].seed, 0)))
    assert 0.2 < credited.drop.float().mean() < 0.4
    assert int((applied[:, 0] != credited.drop).sum()) == 0
    dropped, units = (int(c) for c in record.counts())
    assert (dropped, units) == (h * int(credited.drop.sum()), h * b * t * t)  # counted per head, as blockwise
    log_p = g._log_prob(g.cache[-1])
    logits = credited.logit
    expected = torch.where(credited.drop, F.logsigmoid(logits), F.logsigmoid(-logits)).mean((1, 2)).mean()
    torch.testing.assert_close(log_p, expected, rtol=1e-4, atol=1e-5)


def test_a_saved_step_drawn_on_the_kernels_is_credited_only_where_they_run(monkeypatch):
    monkeypatch.setattr(devices, "FUSED", True)
    g = game()
    with g.attacker_pass({"source": torch.randint(2, 50, (2, 20)).to(DEVICE)}):
        pass
    state = g.state_dict()
    assert state["cache"][0]["on_kernel"]
    again = game()
    again.load_state_dict(state)
    assert again.cache[0].on_kernel
    monkeypatch.setattr(devices, "FUSED", False)
    elsewhere = game()
    elsewhere.load_state_dict(state)  # its device may still change before training; the credit cannot
    with pytest.raises(ValueError, match="drawn by the fused Triton kernels"):
        elsewhere._log_prob(elsewhere.cache[0])
    state["cache"][0].pop("on_kernel")  # a state saved before: PyTorch's draws
    resumed = game()
    resumed.load_state_dict(state)
    assert not resumed.cache[0].on_kernel


def test_a_compiled_attackers_attention_is_one_graph_with_the_kernels_actions(monkeypatch):
    """Under torch.compile the route steps aside before asking the rule anything, and the PyTorch path draws
    the kernels' actions through the opaque operator attn_reg::policy_drops: one graph (fullgraph), the output
    of eager's call on the kernel (the same drops; the sums in another order)."""
    monkeypatch.setattr(devices, "FUSED", True)
    g = game()
    q, k, v = (torch.randn(2, 2, 20, 8, generator=torch.Generator().manual_seed(i)).to(DEVICE) for i in range(3))

    def attacker(q, k, v):
        return attend(q, k, v, site=g.sites[0])[0]

    compiled = torch.compile(attacker, backend="eager", fullgraph=True)
    for _ in range(2):
        with g.attacker_pass({"source": torch.randint(2, 50, (2, 20)).to(DEVICE)}):
            out, eager = compiled(q, k, v), attacker(q, k, v)
        assert g.cache[-1].on_kernel
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


def test_a_policy_wider_than_the_kernels_take_draws_in_pytorch(monkeypatch):
    """Past fused_route.MAX_POLICY_WIDTH features a policy's tiles would take more shared memory than a GPU
    gives a block: a batch then draws in PyTorch, and a sampled rule that wide stays on the PyTorch path."""
    from attn_reg_plugin.core.kernel.blockwise import BlockCall

    monkeypatch.setattr(devices, "FUSED", True)
    widest = fused_route.MAX_POLICY_WIDTH
    probe = torch.zeros(1, device=DEVICE)
    assert fused_route.policy_on_kernel(probe, widest) and not fused_route.policy_on_kernel(probe, widest + 1)

    class Wide:  # a rule the kernel would draw itself, were it narrow enough
        def sampled_logits(self):
            return policy(g=widest + 1)

    q, k, v = (torch.randn(2, 2, n, 8).to(DEVICE) for n in (37, 29, 29))
    call = BlockCall(Wide(), None, None, 37, None, 0.0, None, True)
    assert fused_route.fused_or_why_not(q, k, v, None, call) == (None, f"a sampled rule's policy wider than {widest}")
