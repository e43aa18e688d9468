"""The steps of the regularizers of their own passes (core.regularizers.training_step), over a step of
a framework written here by hand: the objective rebuilt from the passes, the doubled batch, HiddenCut's
ranking and cut in their order, the declared log numbers reduced."""

import contextlib
import math

import torch
import torch.nn.functional as F

from attn_reg_plugin.core.regularizers import registry
from attn_reg_plugin.core.regularizers.hiddencut import HiddenCutConfig, hiddencut_spans, hiddencut_step, js_consistency
from attn_reg_plugin.core.regularizers.rdrop import RDropConfig, rdrop_kl, rdrop_step
from attn_reg_plugin.core.regularizers.training_step import Compared, Logged, Pass, sum_keys


class MeanCEStep:
    """A framework whose loss is the mean CE over the batch's rows of a dropout model's logits."""

    log_probs = False

    def __init__(self, x, y, p=0.5):
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(x.size(-1), 5)
        self.x, self.y, self.p = x, y, p
        self.calls = []

    def _logits(self, x):
        return self.linear(F.dropout(x, self.p, training=True))

    def forward(self, extra=None):
        self.calls.append(("forward", dict(extra or {})))
        logits = self._logits(self.x)
        return Pass(F.cross_entropy(logits, self.y), logits, logits)

    def forward_doubled(self):
        self.calls.append(("doubled", {}))
        logits = self._logits(torch.cat([self.x, self.x]))
        first, second = logits.chunk(2)
        loss = F.cross_entropy(logits, torch.cat([self.y, self.y]))
        return 2 * loss, Pass(None, logits, first), Pass(None, logits, second)

    def compared(self, first, second, term):
        return Compared(first.scores, second.scores, self.y, None)

    def reduced(self, term_sum, positions, pair_loss, compared):
        return term_sum / positions


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, 6, generator=g), torch.tensor([0, 1, 4, 2])


def test_rdrop_step_is_both_passes_losses_plus_alpha_times_the_mean_kl():
    x, y = _batch()
    step = MeanCEStep(x, y)
    torch.manual_seed(7)
    result = rdrop_step(RDropConfig(alpha=2.0), step)
    torch.manual_seed(7)
    first, second = step._logits(x), step._logits(x)
    kl_sum, positions = rdrop_kl(first, second)
    expected = F.cross_entropy(first, y) + F.cross_entropy(second, y) + 2.0 * kl_sum / positions
    torch.testing.assert_close(result.loss, expected)
    assert kl_sum > 0 and int(result.sums["rdrop_tokens"]) == 4
    torch.testing.assert_close(result.sums["rdrop_kl_sum"], kl_sum.detach())
    assert not result.sums["rdrop_kl_sum"].requires_grad and result.loss.requires_grad
    assert [c[0] for c in step.calls] == ["forward", "forward"] and result.reported.scores is not result.second.scores


def test_rdrop_step_with_the_doubled_batch_runs_one_forward_and_compares_its_halves():
    x, y = _batch()
    step = MeanCEStep(x, y)
    torch.manual_seed(7)
    result = rdrop_step(RDropConfig(alpha=1.0, concat_batch=True), step)
    torch.manual_seed(7)
    logits = step._logits(torch.cat([x, x]))
    kl_sum, _ = rdrop_kl(*logits.chunk(2))
    expected = 2 * F.cross_entropy(logits, torch.cat([y, y])) + kl_sum / 4
    torch.testing.assert_close(result.loss, expected)
    assert [c[0] for c in step.calls] == ["doubled"]


class RecordingSites:
    """Cut sites whose 'model' is the step above: ranking records two layers, cutting hands a keyword."""

    def __init__(self, valid):
        self.valid, self.events = valid, []

    @contextlib.contextmanager
    def ranking(self):
        self.events.append("rank")
        sites = self

        class Ranking:
            extra = {"ranking": "R"}

            def ranked(self):
                sites.events.append("ranked")
                g = torch.Generator().manual_seed(1)
                return {layer: (torch.rand(4, 6, generator=g), sites.valid) for layer in (2, 0)}

        yield Ranking()
        self.events.append("ranked closed")

    @contextlib.contextmanager
    def cutting(self, plan):
        self.events.append(("cut", sorted(plan.masks)))
        plan.cut, plan.tokens = torch.tensor(3), torch.tensor(20)  # as the layers' hooks count them
        yield {"plan": plan}
        self.events.append("cut checked")


def test_hiddencut_step_ranks_in_the_clean_pass_draws_in_the_layers_order_and_cuts_in_the_second():
    x, y = _batch()
    valid = torch.ones(4, 6, dtype=torch.bool)
    valid[1, 4:] = False
    step, sites = MeanCEStep(x, y), RecordingSites(valid)
    config = HiddenCutConfig(alpha=3.0, ratio=0.3)
    torch.manual_seed(11)
    result = hiddencut_step(config, step, sites)
    assert sites.events == ["rank", "ranked", "ranked closed", ("cut", [0, 2]), "cut checked"]
    assert step.calls[0] == ("forward", {"ranking": "R"}) and list(step.calls[1][1]) == ["plan"]
    plan = step.calls[1][1]["plan"]
    assert list(plan.masks) == [2, 0]  # drawn in the order the ranking gave the layers
    # the same draws, by hand: the clean pass's dropout, then one span per layer, then the cut pass's dropout
    torch.manual_seed(11)
    clean = step._logits(x)
    g = torch.Generator().manual_seed(1)
    for layer in (2, 0):
        torch.testing.assert_close(
            plan.masks[layer][0], hiddencut_spans(valid, torch.rand(4, 6, generator=g), 0.3, 0.4)
        )
    cut = step._logits(x)
    js_sum, positions = js_consistency(clean, cut)
    expected = F.cross_entropy(clean, y) + F.cross_entropy(cut, y) + 3.0 * js_sum / positions
    torch.testing.assert_close(result.loss, expected)
    assert {k: int(v) for k, v in result.sums.items() if k != "hiddencut_js_sum"} == {
        "hiddencut_positions": 4,
        "hiddencut_cut": 3,
        "hiddencut_tokens": 20,
    }


def test_logged_numbers_reduce_a_mean_in_bits_or_nats_and_a_total():
    mean, total = Logged("kl", "kl_sum", "tokens"), Logged("cut", "cut")
    sums = {"kl_sum": 6.0, "tokens": 3, "cut": 7}
    assert mean.value(sums, bits=False) == 2.0
    assert math.isclose(mean.value(sums, bits=True), 2.0 / math.log(2))
    assert mean.value({"kl_sum": 1.0, "tokens": 0}, bits=False) == 0.0  # an interval without a step
    assert total.value(sums, bits=True) == 7.0
    assert sum_keys((mean, total, Logged("again", "tokens"))) == ("kl_sum", "tokens", "cut")


def test_rdrop_and_hiddencut_declare_their_step_and_log_in_the_registry():
    for key, names in {
        "rdrop": ("rdrop_kl",),
        "hiddencut": ("hiddencut_js", "hiddencut_cut", "hiddencut_tokens"),
    }.items():
        regularizer = registry.by_key(key)
        assert regularizer.passes == registry.OWN_PASSES and regularizer.step is not None
        assert regularizer.log_keys() == names
