"""AttendOut, scheduled attention dropout and attention LayerDrop in the framework-free core."""

import math

import pytest
import torch

from attn_reg_plugin.core.kernel import devices
from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import EditScores, Plan, hook_in_progress, passing
from attn_reg_plugin.core.kernel.controller import RegularizationController
from attn_reg_plugin.core.regularizers.attendout import (
    AttendOut,
    AttendOutConfig,
    Generator,
    copy_model_state,
    copy_optimizer_state,
    drop_log_prob,
    gumbel_drops,
    per_sample_loss,
    reinforce_loss,
    win_probability,
)
from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDrop, AttentionLayerDropConfig
from attn_reg_plugin.core.regularizers.scheduled_dropout import (
    ScheduledAttentionDropout,
    ScheduledDropoutConfig,
    parse_schedules,
    schedule_value,
)
from helpers import controller_with_sites


# -- Gumbel sampling and the policy gradient ---------------------------------------------------
def test_gumbel_drops_have_sigmoid_probability_in_expectation():
    torch.manual_seed(0)
    logits = torch.tensor([-3.0, -1.0, 0.0, 0.5, 2.0])
    n = 40000
    rate = gumbel_drops(logits.expand(n, 5), torch.rand(n, 5)).float().mean(0)
    expected = torch.sigmoid(logits)
    sigma = (expected * (1 - expected) / n).sqrt()
    assert torch.all((rate - expected).abs() < 5 * sigma), (rate, expected)


def test_gumbel_drops_are_the_logistic_difference_of_the_two_gumbels():
    """Hand-built: a unit drops where logit + g_drop > g_keep; the difference g_keep - g_drop is
    logistic, logit(u), so it drops where logit > logit(u), i.e. u < sigmoid(logit)."""
    logits = torch.tensor([0.0, 0.0, 2.0, 2.0, -1.0, float("-inf"), float("inf")])
    uniforms = torch.tensor([0.49, 0.51, 0.88, 0.89, 0.26, 0.0, 0.999])
    assert gumbel_drops(logits, uniforms).tolist() == [True, False, True, False, True, False, True]


def test_drop_log_prob_matches_bernoulli():
    logits = torch.tensor([-2.0, 0.3, 1.5])
    drops = torch.tensor([True, False, True])
    expected = torch.distributions.Bernoulli(logits=logits).log_prob(drops.float())
    assert torch.allclose(drop_log_prob(logits, drops), expected)


def test_reinforce_gradient_raises_the_probability_of_the_rewarded_action():
    logit = torch.zeros((), requires_grad=True)
    drops = torch.tensor([True, False])  # action 0 dropped (rewarded), action 1 kept (punished)
    log_probs = drop_log_prob(logit.expand(2), drops)
    loss = reinforce_loss(log_probs, torch.tensor([1.0, -1.0]), baseline=0.0)
    loss.backward()
    assert logit.grad < 0  # gradient descent raises the logit, i.e. P(drop)


def test_generator_learns_to_drop_more_when_dropping_is_rewarded():
    """Whole loop: the game rewards each update by its drop fraction; G's drop probability rises."""
    torch.manual_seed(0)
    controller = controller_with_sites({"encoder-self": 2})
    config = AttendOutConfig(dropout_step=4, generator_dim=8, lr=0.05, init_drop=0.3, baseline_decay=0.5)
    generator = Generator({"source": 20}, {"source": 1}, 8, 32, config.init_drop, config.temperature)
    game = AttendOut(config, controller, generator)
    tokens = torch.randint(2, 20, (4, 6))
    tokens[0, 4:] = 1  # padding
    first = None
    for _step in range(15):
        rewards = []
        for _ in range(config.dropout_step):
            hooks = game.attacker_hooks({"source": tokens})
            drops = torch.stack([hooks[s].drop.dense().float().mean() for s in game.sites])
            rewards.append(drops.mean())
            game.end_update()
        probs = game.mean_drop_probabilities()
        first = first or probs
        stats = game.finish_dropout_step(torch.stack(rewards), torch.zeros(len(rewards)))
        assert set(stats) >= {"keep_attacker", "win_rate", "reward", "baseline", "drop_prob"}
    last = stats["drop_prob"]
    for name in first:
        assert last[name] > first[name] + 0.1, (first, last)


def test_a_held_out_loss_that_is_not_finite_updates_neither_the_generator_nor_the_baseline(caplog):
    """One diverged held-out sample made the reward, then the Generator's weights and the baseline,
    NaN for the rest of the run, and AttendOut silently stopped dropping. Such a step is skipped by
    G and the baseline (a warning counts the losses), the survivor is still picked (the Attacker's
    infinite loss losing), and the next finite step learns again."""
    torch.manual_seed(0)
    controller = controller_with_sites({"encoder-self": 2})
    config = AttendOutConfig(dropout_step=2, generator_dim=8, lr=0.05, baseline_decay=0.5)
    game = AttendOut(config, controller, Generator({"source": 20}, {"source": 1}, 8, 32, 0.3, config.temperature))
    tokens = torch.randint(2, 20, (4, 6))

    def dropout_step(attacker_losses):
        for _ in range(config.dropout_step):
            game.attacker_hooks({"source": tokens})
            game.end_update()
        before = [p.detach().clone() for p in game.generator.parameters()], game.baseline
        stats = game.finish_dropout_step(torch.ones(2), attacker_losses)
        return before, stats

    (weights, baseline), stats = dropout_step(torch.tensor([0.5, math.inf]))
    assert all(torch.equal(a, b) for a, b in zip(weights, game.generator.parameters()))
    assert game.baseline == baseline and math.isinf(stats["reward"]) and stats["win_rate"] == 0.5
    assert "0 of 2 held-out losses of the Defender and 1 of the Attacker are not finite" in caplog.text
    (weights, baseline), stats = dropout_step(torch.tensor([0.5, 0.25]))
    assert not all(torch.equal(a, b) for a, b in zip(weights, game.generator.parameters()))
    assert game.baseline != baseline and all(torch.isfinite(p).all() for p in game.generator.parameters())


def test_generator_starts_at_init_drop_and_shapes_follow_the_sites():
    torch.manual_seed(0)
    controller = controller_with_sites({"encoder-self": 2, "decoder-self": 1, "encoder-decoder": 1})
    generator = Generator({"source": 30, "target": 40}, {"source": 1, "target": 1}, 16, 64, 0.2, 2.0)
    assert math.isclose(torch.sigmoid(generator.drop_bias / generator.temperature).item(), 0.2, rel_tol=1e-5)
    src = torch.randint(2, 30, (3, 5))
    tgt = torch.randint(2, 40, (3, 7))
    policies = generator.policies({"source": src, "target": tgt}, controller.sites)
    assert [p.shape for p in policies] == [(3, 1, 5, 5), (3, 1, 5, 5), (3, 1, 7, 7), (3, 1, 7, 5)]
    assert [p.causal for p in policies] == [False, False, True, False]
    _, dec_units = policies[2].block(slice(0, 7), 7)
    assert not dec_units[0, 0].triu(1).any()  # decoder self-attention: no future keys
    # Each factor is linear in length: nothing (T, S) is made until a block asks for its rows.
    assert all(p.query.dim() == 3 and p.key.dim() == 3 for p in policies)


@pytest.mark.parametrize("side", ["left", "right"])
def test_generator_logits_of_a_sentence_do_not_depend_on_its_batch_padding(side):
    """fairseq left-pads sources, HF right-pads: a sentence's drop logits over its real tokens are
    those it gets alone, so its masks do not depend on the batch it lands in."""
    torch.manual_seed(0)
    controller = controller_with_sites({"encoder-self": 2})
    generator = Generator({"source": 30}, {"source": 1}, 16, 64, 0.2, 1.0)
    sentence = torch.randint(2, 30, (1, 5))
    padded = (
        torch.cat([torch.ones(1, 3, dtype=torch.long), sentence], 1)
        if side == "left"
        else torch.cat([sentence, torch.ones(1, 3, dtype=torch.long)], 1)
    )
    real = slice(3, 8) if side == "left" else slice(0, 5)
    alone = generator.policies({"source": sentence}, controller.sites)
    in_batch = generator.policies({"source": padded}, controller.sites)
    for a, b in zip(alone, in_batch):
        a_logits, _ = a.block(slice(0, 5), 5)
        b_logits, units = b.block(slice(0, 8), 8)
        torch.testing.assert_close(b_logits[:, :, real, real], a_logits, rtol=1e-5, atol=1e-6)
        pad = slice(0, 3) if side == "left" else slice(5, 8)
        assert not units[..., pad].any() and not units[..., pad, :].any()  # padding is never a unit


@pytest.mark.parametrize("layout", ["none", "left", "right", "an-empty-sample"])
def test_the_generator_on_a_device_route_reads_nothing_on_the_host_and_gives_the_host_s_units(monkeypatch, layout):
    """On a device's route the Generator makes its masks without looking at the padding (issue 80: 2 to
    8 syncs a step): a causal stream is ``is_causal`` with padded keys shut by an extra key feature, in
    linear memory. Over every real unit its logits are the host route's, for every padding layout."""
    torch.manual_seed(0)
    controller = controller_with_sites({"encoder-self": 2, "decoder-self": 2, "encoder-decoder": 2})
    generator = Generator({"source": 30, "target": 30}, {"source": 1, "target": 1}, 16, 64, 0.2, 1.0)
    tokens = torch.randint(2, 30, (3, 9))
    if layout == "left":
        tokens[0, :4], tokens[2, :1] = 1, 1
    elif layout == "right":
        tokens[0, 5:], tokens[1, 8:] = 1, 1
    elif layout == "an-empty-sample":
        tokens[1], tokens[0, 6:] = 1, 1
    streams = {"source": tokens, "target": tokens}
    host = generator.policies(streams, controller.sites)
    monkeypatch.setattr(devices, "PORTABLE", True)
    reads = []
    real_bool = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or real_bool(t))
    device = generator.policies(streams, controller.sites)
    monkeypatch.undo()
    assert not reads
    for a, b in zip(host, device):
        a_logits, a_units = a.block(slice(0, 9), 9)
        b_logits, b_units = b.block(slice(0, 9), 9)
        units = torch.ones_like(a_logits, dtype=torch.bool) if a_units is None else a_units
        assert torch.equal(units, b_units)  # the device route always makes its units
        torch.testing.assert_close(b_logits[units], a_logits[units], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(b_logits).all()


def test_generator_rejects_sequences_beyond_max_positions():
    generator = Generator({"source": 10}, {"source": 1}, 4, 3, 0.2, 1.0)
    with pytest.raises(ValueError, match="--attendout-max-positions"):
        generator.policies({"source": torch.full((1, 5), 2)}, controller_with_sites({"encoder-self": 1}).sites)


def test_the_actions_applied_are_those_the_update_scores():
    """The masks the Attacker's calls apply are the actions whose log-probability the Generator's
    update takes: regenerated from the batch's recorded seed, not stored."""
    torch.manual_seed(3)
    controller = controller_with_sites({"encoder-self": 2})
    generator = Generator({"source": 12}, {"source": 1}, 8, 16, 0.3, 1.0)
    game = AttendOut(AttendOutConfig(dropout_step=2), controller, generator)
    tokens = torch.randint(2, 12, (2, 5))
    tokens[1, 3:] = 1
    hooks = game.attacker_hooks({"source": tokens})
    log_prob = game._log_prob(game.cache[0])
    expected, units = 0.0, 0
    for site, policy in zip(game.sites, generator.policies({"source": tokens}, game.sites)):
        logits, valid = policy.block(slice(0, 5), 5)
        drops = hooks[site].drop.dense()
        assert not (drops & ~valid).any()
        expected = expected + (drop_log_prob(logits, drops) * valid).sum(dim=(1, 2, 3))
        units = units + valid.sum(dim=(1, 2, 3))
    torch.testing.assert_close(log_prob, (expected / units).mean())


def _attendout_rate(tokens: torch.Tensor, pad: int = 1) -> float:
    """The drop rate AttendOut logs for one batch of ``tokens`` through one encoder-self site, with
    a Generator whose every unit has drop probability 0.3 (its score weights zeroed)."""
    torch.manual_seed(0)
    controller = controller_with_sites({"encoder-self": 1})
    generator = Generator({"source": 12}, {"source": pad}, 8, 64, 0.3, 1.0)
    with torch.no_grad():
        for layer in (generator.query, generator.key):
            layer.weight.zero_()
            layer.bias.zero_()
    game = AttendOut(AttendOutConfig(dropout_step=1), controller, generator)
    b, t = tokens.shape
    q, k, v = (torch.randn(b, 2, t, 4) for _ in range(3))
    bias = torch.zeros(b, 1, 1, t).masked_fill(tokens.eq(pad)[:, None, None, :], float("-inf"))
    with game.attacker_pass({"source": tokens}):
        attend(q, k, v, bias, site=controller.sites[0])
    game.end_update()
    return game.finish_dropout_step(torch.zeros(1), torch.zeros(1))["drop_rate"]


def test_attendout_rate_counts_only_units_the_generator_can_drop():
    """Padding query rows are never masked by the Generator, so they are not in the denominator: a
    padded batch logs the same rate as an unpadded one with the same probabilities (0.3), where the
    count over every valid unit read about half of it (issue 31: 0.095 logged for 0.20)."""
    real = torch.randint(2, 12, (8, 48), generator=torch.Generator().manual_seed(1))
    padded = real.clone()
    padded[:, 12:] = 1  # three quarters of each sequence is padding: right-padded keys and queries
    unpadded_rate, padded_rate = _attendout_rate(real), _attendout_rate(padded)
    # 8 x 2 heads x 48 x 48 units unpadded, 8 x 2 x 12 x 12 padded: 5 sigma of the smaller is 0.04
    assert abs(unpadded_rate - 0.3) < 0.02 and abs(padded_rate - 0.3) < 0.04, (unpadded_rate, padded_rate)


def test_attendout_state_round_trip_continues_identically():
    def make():
        torch.manual_seed(5)
        controller = controller_with_sites({"encoder-self": 2})
        generator = Generator({"source": 12}, {"source": 1}, 8, 16, 0.3, 1.0)
        return AttendOut(AttendOutConfig(dropout_step=3, lr=0.1), controller, generator)

    tokens = torch.randint(2, 12, (2, 5), generator=torch.Generator().manual_seed(1))
    a = make()
    for _ in range(2):
        a.attacker_hooks({"source": tokens})
        a.end_update()
    b = make()
    b.load_state_dict(a.state_dict())
    for game in (a, b):
        torch.manual_seed(11)
        game.attacker_hooks({"source": tokens})
        assert game.end_update()
        game.finish_dropout_step(torch.tensor([1.0, 0.5, 0.0]), torch.tensor([0.5, 0.5, 0.5]))
    for pa, pb in zip(a.generator.parameters(), b.generator.parameters()):
        assert torch.equal(pa, pb)
    assert a.baseline == b.baseline


def test_per_sample_loss_on_hand_built_tensors():
    logits = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    assert torch.allclose(
        per_sample_loss(logits, torch.tensor([0, 1])), torch.tensor([math.log(1 + math.exp(-2)), math.log(2)])
    )
    assert torch.allclose(
        per_sample_loss(torch.tensor([[1.0], [3.0]]), torch.tensor([2.0, 3.0])), torch.tensor([1.0, 0.0])
    )
    tokens = torch.zeros(1, 3, 2)
    tokens[0, 0] = torch.tensor([5.0, 0.0])
    target = torch.tensor([[0, 1, -100]])
    expected = (math.log(1 + math.exp(-5)) + math.log(2)) / 2
    assert torch.allclose(per_sample_loss(tokens, target), torch.tensor([expected]))


def test_win_probability_counts_ties_half():
    assert win_probability(torch.tensor([1.0, 1.0, 2.0, 0.5]), torch.tensor([0.5, 1.0, 3.0, 0.1])).item() == 0.625


def test_a_network_whose_held_out_loss_is_nan_loses_the_sample():
    """NaN compares false both ways: a Defender diverged to NaN would have won every such sample."""
    nan, inf = math.nan, math.inf
    defender, attacker = torch.tensor([nan, 1.0, nan, inf]), torch.tensor([1.0, nan, nan, nan])
    assert win_probability(defender, attacker).item() == (1 + 0 + 0.5 + 0.5) / 4


def test_copy_model_and_optimizer_state_make_two_networks_identical():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    oa, ob = torch.optim.Adam(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters(), lr=0.1)
    for model, opt in ((a, oa), (b, ob)):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    copy_model_state(a, b)
    copy_optimizer_state(oa, list(a.parameters()), ob, list(b.parameters()))
    x = torch.randn(5, 3)
    for model, opt in ((a, oa), (b, ob)):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("dropout_step", 0, "--attendout-dropout-step must be an integer >= 1"),
        ("temperature", 0.0, "--attendout-temperature must be a finite number > 0"),
        ("temperature", -1.0, "--attendout-temperature must be a finite number > 0"),
        ("init_drop", 1.0, r"--attendout-init-drop must be in the open interval \(0, 1\)"),
        ("init_drop", -0.1, r"--attendout-init-drop must be in the open interval \(0, 1\)"),
        ("baseline_decay", 1.0, r"--attendout-baseline-decay must be in \[0, 1\)"),
        ("lr", float("nan"), "--attendout-lr must be a finite number > 0"),
        ("generator_dim", 0, "--attendout-generator-dim must be an integer >= 1"),
        ("layers", "x", "--attendout-layers must be 'all' or a comma-separated list"),
        ("attention", "cross", "--attendout-attention: unknown attention kind 'cross'"),
    ],
)
def test_attendout_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        AttendOutConfig(**{field: value}).validate()


def test_attendout_rejects_layers_the_model_lacks():
    with pytest.raises(ValueError, match="--attendout-layers: layer 3 does not exist"):
        AttendOut(
            AttendOutConfig(layers="3"),
            controller_with_sites({"encoder-self": 2}),
            Generator({"source": 5}, {"source": 1}, 4, 8, 0.2, 1.0),
        )


# -- the kernel's uniform rows (Eq. 4) ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_dropped_row_attends_uniformly_over_valid_keys(dtype):
    torch.manual_seed(0)
    q = torch.randn(2, 2, 3, 4, dtype=dtype)
    k, v = (torch.randn(2, 2, 4, 4, dtype=dtype) for _ in range(2))
    pad = torch.tensor([[True, True, True, True], [True, True, False, False]])  # sample 1: 2 real keys
    bias = pad[:, None, None, :]
    site = RegularizationController().register("encoder-self", 0)
    drop = torch.zeros(2, 1, 3, 4, dtype=torch.bool)
    drop[:, :, 1] = True  # row 1 of every sample loses every key
    with passing(Plan.asking({site: EditScores(drop=drop)})):
        out, _ = attend(q, k, v, bias=bias, site=site)
    assert torch.isfinite(out).all()
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out[0, :, 1].float(), v[0].float().mean(dim=1), atol=tol)
    assert torch.allclose(out[1, :, 1].float(), v[1, :, :2].float().mean(dim=1), atol=tol)
    plain, _ = attend(q, k, v, bias=bias, site=site)  # the pass ended: plain attention
    assert torch.equal(out[:, :, 0], plain[:, :, 0])  # other rows untouched


def test_uniform_row_backward_is_finite_and_query_gets_no_gradient():
    q, k, v = (torch.randn(1, 1, 2, 3, requires_grad=True) for _ in range(3))
    site = RegularizationController().register("encoder-self", 0)
    drop = torch.tensor([[[[True, True], [False, False]]]])
    with passing(Plan.asking({site: EditScores(drop=drop)})):
        out, _ = attend(q, k, v, site=site)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert torch.equal(q.grad[0, 0, 0], torch.zeros(3))


# -- scheduled dropout and attention LayerDrop -------------------------------------------------
def test_knot_updates_are_read_exactly():
    """An update count is read as the integer written (a float would round 12345678901234567 up by 1,
    and misquote two counts past 2**53 as equal); 1e4 still reads as 10000."""
    assert parse_schedules("0:0.1,12345678901234567:0.2", "s") == [[(0, 0.1), (12345678901234567, 0.2)]]
    assert parse_schedules("1e4:0.3,9007199254740993:0", "s") == [[(10000, 0.3), (2**53 + 1, 0.0)]]


def test_schedule_value_is_piecewise_linear_and_constant_outside():
    schedule = parse_schedules("0:0.6,100:0.2,200:0.4", "--s")[0]
    assert schedule_value(schedule, 0) == 0.6
    assert math.isclose(schedule_value(schedule, 50), 0.4)
    assert math.isclose(schedule_value(schedule, 150), 0.3)
    assert schedule_value(schedule, 10_000) == 0.4
    assert parse_schedules("10:0.5", "--s")[0] == [(10, 0.5)]
    assert schedule_value([(10, 0.5)], 0) == 0.5


@pytest.mark.parametrize(
    "spec, message",
    [
        ("0:1.5", r"probability must be a probability in \[0, 1\]"),
        ("0:-0.1", r"probability must be a probability in \[0, 1\]"),
        ("10:0.5,5:0.1", "must increase strictly"),
        ("abc", "cannot read knot"),
        ("-1:0.2", "integers >= 0"),
        ("", "UPDATE:PROB"),
    ],
)
def test_schedule_parse_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_schedules(spec, "--attn-sched-dropout-schedule")


def test_scheduled_dropout_follows_its_per_layer_schedule():
    controller = controller_with_sites({"encoder-self": 2})
    sched = ScheduledAttentionDropout(ScheduledDropoutConfig(schedule="0:0.6,100:0.2|0:0.1,100:0.5"), controller)
    assert sched.probabilities(50) == pytest.approx({0: 0.4, 1: 0.3})
    torch.manual_seed(0)
    valid = torch.ones(8, 4, 32, 32, dtype=torch.bool)
    for update, expected in ((0, {0: 0.6, 1: 0.1}), (100, {0: 0.2, 1: 0.5})):
        hooks = sched.hooks(update)
        for site in controller.sites:
            rate = hooks[site].drop.whole(valid, seed=site.layer).float().mean().item()
            assert abs(rate - expected[site.layer]) < 0.01


def test_scheduled_dropout_needs_one_schedule_or_one_per_layer():
    with pytest.raises(ValueError, match="gives 2 schedules .* but 3 layers are selected"):
        ScheduledAttentionDropout(
            ScheduledDropoutConfig(schedule="0:0.1|0:0.2"), controller_with_sites({"encoder-self": 3})
        )


def test_layerdrop_p1_gives_exactly_uniform_attention_and_an_undrawn_layer_changes_nothing():
    torch.manual_seed(0)
    controller = controller_with_sites({"encoder-self": 1})
    site = controller.sites[0]
    q = torch.randn(2, 2, 3, 4)
    k, v = (torch.randn(2, 2, 4, 4) for _ in range(2))
    bias = torch.tensor([[True] * 4, [True, True, True, False]])[:, None, None, :]
    with controller.hooks(AttentionLayerDrop(AttentionLayerDropConfig(p=1.0), controller).hooks()):
        out, _ = attend(q, k, v, bias=bias, site=site)
    assert torch.allclose(out[0], v[0].mean(dim=1, keepdim=True).expand(2, 3, 4), atol=1e-6)
    assert torch.allclose(out[1], v[1, :, :3].mean(dim=1, keepdim=True).expand(2, 3, 4), atol=1e-6)
    # no layer drawn (p = 1e-12; p = 0 is refused as LayerDrop off): every selected layer gets a flag
    # (one compiled graph whatever is skipped), none set, and the output is ordinary attention
    hooks = AttentionLayerDrop(AttentionLayerDropConfig(p=1e-12), controller).hooks()
    assert list(hooks) == [site]
    with controller.hooks(hooks) as record:
        out, _ = attend(q, k, v, bias=bias, site=site)
    calls = record.calls()
    assert torch.allclose(out, attend(q, k, v, bias=bias)[0], atol=1e-6)
    assert [int(c) for c in calls] == [0, 1]  # the kernel saw the call and skipped nothing


def test_layerdrop_skips_layers_at_rate_p():
    torch.manual_seed(0)
    layerdrop = AttentionLayerDrop(AttentionLayerDropConfig(p=0.3), controller_with_sites({"encoder-self": 4}))
    skipped = sum(bool(h.uniform_rows) for _ in range(2000) for h in layerdrop.hooks().values()) / (2000 * 4)
    assert abs(skipped - 0.3) < 0.02


def test_layerdrop_rate_is_counted_by_the_kernel_not_by_the_draws():
    """A hook that never reaches the kernel (the site is not called) counts nothing."""
    controller = controller_with_sites({"encoder-self": 2})
    q = k = v = torch.randn(1, 1, 3, 4)
    with controller.hooks(AttentionLayerDrop(AttentionLayerDropConfig(p=1.0), controller).hooks()) as record:
        attend(q, k, v, site=controller.sites[0])  # only layer 0 attends
    calls = record.calls()
    assert [int(c) for c in calls] == [1, 1]


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_layerdrop_rejects_probabilities_outside_0_1(p):
    with pytest.raises(ValueError, match=r"--attn-layerdrop-p must be a probability in \[0, 1\]"):
        AttentionLayerDropConfig(p=p).validate()


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 1, 1, 1), (2, 1, 3, 0), (3, 2, 7, 54)])
def test_row_all_check_equals_torch_all(shape):
    """The kernel's fast row test (byte minimum) is torch's ``all`` over the last dim."""
    from attn_reg_plugin.core.kernel.rules import all_last as _all_last

    g = torch.Generator().manual_seed(0)
    for density in (0.0, 0.5, 0.9, 1.0):
        mask = torch.rand(shape, generator=g) < density
        for m in (mask, mask.transpose(0, 1)):  # contiguous and not
            assert torch.equal(_all_last(m), m.all(dim=-1, keepdim=True))


@pytest.mark.parametrize("grad, skipped", [(1.0, False), (float("inf"), True), (float("nan"), True)])
def test_scaler_skipped_step_tells_an_overflow_from_a_step(grad, skipped):
    """torch's GradScaler skips a non-finite step and lowers its scale; a finite step leaves the
    scale (before its growth interval) and moves the weight."""
    from attn_reg_plugin.core.regularizers.attendout import scaler_skipped_step

    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = scaler.get_scale()
    scaler.scale((w * torch.full((2,), grad)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler_skipped_step(scaler, before) is skipped
    assert torch.equal(w.detach(), torch.ones(2)) is skipped


def test_attendout_drop_rate_is_what_the_kernel_applied():
    """The game reports the fraction of the Attacker's units (real query, real key) its kernel dropped:
    0 when the masks reach no attention call, the masks' own fraction of those units when they do."""
    torch.manual_seed(0)
    controller = controller_with_sites({"encoder-self": 1})
    config = AttendOutConfig(dropout_step=1, generator_dim=8, init_drop=0.4)
    game = AttendOut(
        config, controller, Generator({"source": 20}, {"source": 1}, 8, 32, config.init_drop, config.temperature)
    )
    tokens = torch.randint(2, 20, (3, 5))
    tokens[0, 3:] = 1  # padding
    game.attacker_hooks({"source": tokens})  # masks drawn, never applied
    game.end_update()
    assert game.finish_dropout_step(torch.zeros(1), torch.zeros(1))["drop_rate"] == 0.0

    (site,) = game.sites
    valid = tokens.ne(1)[:, None, None, :]
    with game.attacker_pass({"source": tokens}):
        attend(*(torch.randn(3, 2, 5, 4) for _ in range(3)), bias=valid, site=site)
        drop = hook_in_progress(site).drop.dense()
    game.end_update()
    real = tokens.ne(1)
    units = real[:, None, :, None] & real[:, None, None, :]  # real query and real key: what G can mask
    drop = drop & units
    expected = drop.expand(3, 2, 5, 5).sum().item() / units.expand(3, 2, 5, 5).sum().item()
    assert game.finish_dropout_step(torch.zeros(1), torch.zeros(1))["drop_rate"] == pytest.approx(expected)
    assert expected > 0


def test_layerdrop_at_p_0_is_refused_not_run_as_a_pass_that_drops_nothing():
    """p = 0 is LayerDrop off (the fairseq task then builds none): built anyway, it would route every
    selected call through the kernel and draw from torch's generator each step, so a p = 0 control run
    would train unlike plain training, silently."""
    controller = controller_with_sites({"encoder-self": 2})
    with pytest.raises(ValueError, match=r"p is 0: attention LayerDrop is off; give p in \(0, 1\]"):
        AttentionLayerDrop(AttentionLayerDropConfig(p=0.0), controller)


def test_the_attackers_policies_take_the_generators_own_projections_bit_for_bit():
    """Without autograd (the Attacker's masks) a site's query and key of a layer the Generator's attention
    ran are that attention's projections; with autograd (REINFORCE) they are made again. The same bits."""
    torch.manual_seed(0)
    controller = controller_with_sites({"encoder-self": 3, "decoder-self": 2, "encoder-decoder": 2})
    generator = Generator({"source": 30, "target": 40}, {"source": 1, "target": 1}, 16, 64, 0.2, 2.0)
    streams = {"source": torch.randint(1, 30, (3, 6)), "target": torch.randint(1, 40, (3, 5))}
    made_again = generator.policies(streams, controller.sites)
    with torch.no_grad():
        taken = generator.policies(streams, controller.sites)
    assert made_again[0].query.requires_grad and not taken[0].query.requires_grad
    for a, b in zip(made_again, taken):
        assert torch.equal(a.query, b.query) and torch.equal(a.key, b.key)
