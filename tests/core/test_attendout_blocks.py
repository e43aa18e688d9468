"""AttendOut at any length: the Generator's masks are a drop rule the kernel makes per block of query
rows, and REINFORCE's log-probability is taken block by block, so no (T, S) map is ever held."""

import contextlib

import pytest
import torch

from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import hook_in_progress
from attn_reg_plugin.core.regularizers.attendout import AttendOut, AttendOutConfig, Generator, policy
from attn_reg_plugin.core.regularizers.attendout.policy import (
    PolicyLogits,
    action_log_prob,
    drop_log_prob,
    sampled_drops,
)
from helpers import controller_with_sites, run_in_blocks


def _policy(b, t, s, d=4, causal=False, pad=0, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(b, t, d, generator=g).to(device).requires_grad_()
    key = torch.randn(b, s, d, generator=g).to(device).requires_grad_()
    offset = torch.tensor(-0.7, device=device, requires_grad=True)
    query_real = torch.ones(b, t, dtype=torch.bool, device=device)
    key_real = torch.ones(b, s, dtype=torch.bool, device=device)
    if pad:
        query_real[0, -pad:] = False
        key_real[0, -pad:] = False
    return PolicyLogits(query, key, offset, query_real, key_real, causal, every_unit=not causal and not pad)


CAUSAL_PAD = [(False, 0), (False, 37), (True, 0), (True, 11)]
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)")


@pytest.mark.parametrize("causal,pad", CAUSAL_PAD)
def test_the_log_probability_block_by_block_is_the_dense_one_with_its_gradient(monkeypatch, causal, pad):
    _log_probability_against_dense(monkeypatch, causal, pad, "cpu")


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("causal,pad", CAUSAL_PAD)
def test_the_log_probability_on_cuda_is_the_dense_one_with_its_gradient(monkeypatch, causal, pad):
    _log_probability_against_dense(monkeypatch, causal, pad, "cuda")


def _log_probability_against_dense(monkeypatch, causal, pad, device):
    """Sums and gradients against autograd of the whole map: the same actions (keyed by the seed,
    whatever the blocks), log P summed over each sample's units, d/dlogit = action - sigmoid."""
    monkeypatch.setattr(policy, "POLICY_BLOCK_ELEMENTS", 1)  # one chunk of 64 rows a block: 3 blocks
    t = s = 150
    p = _policy(2, t, s, causal=causal, pad=pad, device=device)
    seed = torch.tensor(12345)
    sums, counts, probability = action_log_prob(p, seed)
    assert len(p.row_blocks()) == 3
    weights = torch.tensor([0.3, -1.1], device=device)
    grads = torch.autograd.grad(sums @ weights, (p.query, p.key, p.offset))

    logits = torch.matmul(p.query, p.key.transpose(-2, -1)).unsqueeze(1) + p.offset
    with torch.no_grad():
        drops, _, units = sampled_drops(p.detached(), seed, slice(0, t), s)
    assert (units is None) == (not causal and not pad)  # every pair a unit: no mask made
    units = torch.ones_like(drops) if units is None else units
    dense = (drop_log_prob(logits, drops) * units).sum(dim=(1, 2, 3))
    torch.testing.assert_close(sums, dense)
    assert torch.equal(counts, units.sum(dim=(1, 2, 3)))
    torch.testing.assert_close(probability, (torch.sigmoid(logits) * units).sum().detach())
    expected = torch.autograd.grad(dense @ weights, (p.query, p.key, p.offset))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if causal:
        assert not (drops[0, 0].triu(1)).any()
    if pad:
        assert not drops[0, :, -pad:].any() and not drops[0, ..., -pad:].any()


def test_the_actions_do_not_depend_on_the_blocks():
    p = _policy(2, 200, 170, causal=True, pad=5).detached()
    seed = torch.tensor(7)
    whole = sampled_drops(p, seed, slice(0, 200), 170)[0]
    parts = [sampled_drops(p, seed, slice(a, min(200, a + 64)), 170)[0] for a in range(0, 200, 64)]
    assert torch.equal(whole, torch.cat(parts, dim=2))
    # a block covering fewer keys (a causal block's) draws the same numbers for the keys it has
    assert torch.equal(sampled_drops(p, seed, slice(64, 128), 100)[0], whole[:, :, 64:128, :100])
    assert 0.25 < whole[p.block(slice(0, 200), 170)[1]].float().mean() < 0.42  # sigmoid(-0.7) = 0.33


def _encoder_game(length=150, heads=2, width=8, device="cpu"):
    torch.manual_seed(0)
    controller = controller_with_sites({"encoder-self": 2})
    config = AttendOutConfig(dropout_step=1, generator_dim=8, init_drop=0.3, lr=0.05)
    generator = Generator({"source": 30}, {"source": 1}, 8, 256, config.init_drop, config.temperature).to(device)
    game = AttendOut(config, controller, generator)
    tokens = torch.randint(2, 30, (2, length))
    tokens[1, -20:] = 1  # padding
    weights = [torch.randn(width, 3 * heads * 4) * 0.3 for _ in controller.sites]
    embed = torch.randn(30, width)
    return game, tokens.to(device), [w.to(device) for w in weights], embed.to(device)


def _attacker_loss(game, tokens, weights, embed):
    """Two attention layers through the kernel at the game's sites; a loss of their outputs."""
    b, t = tokens.shape
    bias = tokens.ne(1)[:, None, None, :]
    h = embed[tokens]
    with game.attacker_pass({"source": tokens}) as record:
        for site, w in zip(game.sites, weights):
            q, k, v = (h @ w).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
            out, _ = attend(q, k, v, bias=bias, site=site)
            h = h + out.transpose(1, 2).reshape(b, t, 8)
        loss = h.pow(2).mean()
    return loss, record


@pytest.mark.parametrize("blocks", [False, True])
def test_a_game_step_is_the_same_one_block_or_many(monkeypatch, blocks):
    _game_step_in_blocks(monkeypatch, blocks, "cpu")


@pytest.mark.gpu
@NEEDS_CUDA
def test_a_game_step_on_cuda_is_the_same_one_block_or_many(monkeypatch):
    _game_step_in_blocks(monkeypatch, True, "cuda")


def _game_step_in_blocks(monkeypatch, blocks, device):
    """Masks, the Attacker's loss and gradients, the rate, the reward and baseline and the
    Generator's update: the same whether the calls and the log-probability run as one block or many."""

    def step(many):
        with monkeypatch.context() as mp:
            if many:
                run_in_blocks(mp)
            game, tokens, weights, embed = _encoder_game(device=device)
            for w in weights:
                w.requires_grad_()
            torch.manual_seed(1)
            loss, record = _attacker_loss(game, tokens, weights, embed)
            grads = torch.autograd.grad(loss, weights)
            counts = record.counts()
            game.end_update()
            stats = game.finish_dropout_step(loss.detach().view(1) + 0.1, loss.detach().view(1))
            return loss, grads, counts, stats, [p.detach().clone() for p in game.generator.parameters()]

    one, other = step(False), step(blocks)
    torch.testing.assert_close(one[0], other[0])
    for a, b in zip(one[1], other[1]):
        torch.testing.assert_close(a, b)
    assert [int(c) for c in one[2]] == [int(c) for c in other[2]] and int(one[2][0]) > 0
    assert one[3]["drop_rate"] == other[3]["drop_rate"] and one[3]["baseline"] == pytest.approx(other[3]["baseline"])
    for a, b in zip(one[4], other[4]):
        torch.testing.assert_close(a, b)


LONG = 1024  # tokens of the memory tests: a T x S map has 2**20 elements


def _long_game(layers):
    """(game, tokens) of one sentence of LONG tokens over ``layers`` encoder self-attention sites."""
    torch.manual_seed(0)
    controller = controller_with_sites({"encoder-self": layers})
    generator = Generator({"source": 30}, {"source": 1}, 8, LONG, 0.3, 1.0)
    return AttendOut(AttendOutConfig(dropout_step=1), controller, generator), torch.randint(2, 30, (1, LONG))


@contextlib.contextmanager
def _saved_sizes():
    """The number of elements of every tensor autograd saves for a backward inside the block."""
    sizes = []

    def pack(x):
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield sizes


def test_the_generator_update_holds_nothing_of_size_t_by_s():
    """What autograd saves for REINFORCE's backward at 1,024 tokens: the Generator's own states and
    the logits' factors, linear in length; no tensor with T x S elements (a 1,024 x 1,024 map)."""
    game, tokens = _long_game(2)
    game.attacker_hooks({"source": tokens})
    with _saved_sizes() as saved:
        log_prob = game._log_prob(game.cache[0])
    log_prob.backward()
    assert saved and max(saved) < LONG * LONG // 16, max(saved)


def test_the_drop_probabilities_are_the_same_made_alone_or_by_the_update():
    """fairseq reads each batch's probabilities right after its forward (a pass of their own); the
    HF trainer reads the dropout step's mean, which the Generator's update makes on the way."""
    stats, read = [], []
    for ask in (True, False):
        game, tokens, _, _ = _encoder_game(length=70)
        torch.manual_seed(1)
        game.attacker_hooks({"source": tokens})
        if ask:
            read.append(game.last_drop_probabilities.clone())
        game.end_update()
        stats.append(game.finish_dropout_step(torch.ones(1), torch.zeros(1))["drop_prob"])
    assert stats[0] == pytest.approx(stats[1], rel=1e-6)
    assert list(stats[0].values()) == pytest.approx(read[0].tolist(), rel=1e-6)
    assert all(0.2 < p < 0.4 for p in read[0].tolist())  # init_drop 0.3


def test_the_attackers_masked_call_holds_nothing_of_size_t_by_s():
    """What autograd saves for the Attacker's backward at 1,024 tokens: q, k, v, the output, a
    log-sum-exp per row and the blocks' drops as bits (one per sample, query and key, shared by the
    heads): no tensor with T x S elements."""
    game, tokens = _long_game(1)
    q, k, v = (torch.randn(1, 2, LONG, 8, requires_grad=True) for _ in range(3))
    with game.attacker_pass({"source": tokens}) as record:
        hook = hook_in_progress(game.sites[0])
        # what the call is handed: the Generator's factors and the seed, not a map
        held = [x for x in vars(hook.drop.policy).values() if isinstance(x, torch.Tensor)]
        assert held and max(x.numel() for x in held) <= LONG * 8
        # units by query and by key (made on a device's route, which does not look at the padding)
        assert hook.droppable is None or max(x.numel() for x in hook.droppable) <= LONG
        with _saved_sizes() as saved:
            out, _ = attend(q, k, v, site=game.sites[0])
    out.sum().backward()
    dropped, units = (int(c) for c in record.counts())
    assert units == 2 * LONG * LONG and 0.2 < dropped / units < 0.4  # init_drop 0.3
    assert saved and max(saved) < LONG * LONG // 16, max(saved)


@pytest.mark.parametrize("pass_under_autocast", [False, True])
def test_a_one_block_call_under_bf16_autocast_applies_the_actions_reinforce_credits(pass_under_autocast):
    """Under bf16 autocast (HF's bf16=True), a one-block call (S <= 128 keys) applies the actions that
    the float32 log-probability of REINFORCE makes again from the seed, unit for unit: the Generator's
    logits are float32 whether the pass begins outside autocast (the masks' logits, made in the call)
    or inside it (the Generator's states too). Read through the kernel: with q = k = 0 and v = I, a row's
    output is positive exactly at its kept keys."""
    from attn_reg_plugin.core.regularizers.attendout.game import _site_seed

    torch.manual_seed(0)
    game = AttendOut(
        AttendOutConfig(dropout_step=1, init_drop=0.3),
        controller_with_sites({"encoder-self": 1}),
        Generator({"source": 50}, {"source": 1}, 8, 128, 0.3, 1.0),
    )
    b, h, t = 16, 2, 120
    tokens = torch.randint(2, 50, (b, t))
    q = k = torch.zeros(b, h, t, 4)
    v = torch.eye(t).expand(b, h, t, t)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=pass_under_autocast):
        with game.attacker_pass({"source": tokens}):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, _ = attend(q, k, v, site=game.sites[0])
    applied = out[:, :1] <= 0  # dropped keys get weight 0 (mask shared by the heads)
    assert torch.equal(applied, out[:, 1:] <= 0)
    policy = game.generator.policies(game.cache[-1].streams, game.sites)[0]  # as REINFORCE makes them
    credited = sampled_drops(policy, _site_seed(game.cache[-1].seed, 0), slice(0, t), t)[0]
    assert 0.2 < credited.float().mean() < 0.4
    assert int((applied != credited).sum()) == 0
