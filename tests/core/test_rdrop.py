"""R-Drop's math (core.rdrop): the symmetric KL on hand-built distributions, its gradient against the
explicit formula, the concatenated batch as a copy, the config's refusals."""

import math

import pytest
import torch
import torch.nn.functional as F

from attn_reg_plugin.core.regularizers.rdrop import (
    RDropConfig,
    concat_with_itself,
    rdrop_kl,
    rdrop_objective,
    split_in_two,
    symmetric_kl,
)

pytestmark = pytest.mark.host_only  # no device branch: the portable run skips it


def explicit_kl(p, q):
    """KL(p || q) = sum p log(p / q), written out."""
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))


def test_symmetric_kl_on_hand_built_distributions_is_the_formula():
    p, q = [0.7, 0.2, 0.1], [0.2, 0.5, 0.3]
    expected = (explicit_kl(p, q) + explicit_kl(q, p)) / 2
    logits_p, logits_q = torch.tensor(p).log(), torch.tensor(q).log() + 3.0  # a shift leaves softmax unchanged
    assert symmetric_kl(logits_p, logits_q).item() == pytest.approx(expected, rel=1e-6)
    assert symmetric_kl(logits_q, logits_p).item() == pytest.approx(expected, rel=1e-6)  # symmetric
    # log-probabilities are taken as they are
    assert symmetric_kl(torch.tensor(p).log(), torch.tensor(q).log(), log_probs=True).item() == pytest.approx(
        expected, rel=1e-6
    )
    # 0.5 * (KL(p||q) + KL(q||p)), as fairseq's compute_kl_loss: kl_div(log p, q) is KL(q || p)
    lp, lq = F.log_softmax(logits_p, -1), F.log_softmax(logits_q, -1)
    fairseq_style = (F.kl_div(lp, lq.exp(), reduction="sum") + F.kl_div(lq, lp.exp(), reduction="sum")) / 2
    assert symmetric_kl(logits_p, logits_q).item() == pytest.approx(fairseq_style.item(), rel=1e-6)


def test_symmetric_kl_is_zero_for_identical_passes_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 5, 11, generator=g), torch.randn(4, 5, 11, generator=g)
    assert torch.equal(symmetric_kl(a, a), torch.zeros(4, 5))
    kl = symmetric_kl(a, b)
    assert kl.shape == (4, 5) and bool((kl > 0).all())
    assert torch.allclose(kl, symmetric_kl(b, a))


def test_half_precision_scores_are_compared_in_float32():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    kl = symmetric_kl(a.bfloat16(), b.bfloat16())
    assert kl.dtype == torch.float32
    torch.testing.assert_close(kl, symmetric_kl(a.bfloat16().float(), b.bfloat16().float()))


def test_rdrop_kl_sums_only_the_kept_positions():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 4, 6, generator=g), torch.randn(2, 4, 6, generator=g)
    keep = torch.tensor([[True, True, False, False], [True, True, True, False]])
    total, n = rdrop_kl(a, b, keep)
    assert n.item() == 5
    torch.testing.assert_close(total, symmetric_kl(a, b)[keep].sum())
    total_all, n_all = rdrop_kl(a, b)
    assert n_all.item() == 8
    torch.testing.assert_close(total_all, symmetric_kl(a, b).sum())


def test_loss_gradient_equals_autograd_of_the_explicit_formula():
    """CE(p1) + CE(p2) + alpha * sum_t (KL(p1||p2) + KL(p2||p1)) / 2, written with p log(p/q) and summed by
    hand, against rdrop_objective: the loss and the gradient of both passes' logits."""
    g = torch.Generator().manual_seed(3)
    alpha = 5.0
    target = torch.tensor([[1, 4, 0], [2, 2, 3]])
    keep = torch.tensor([[True, True, False], [True, True, True]])
    logits_1 = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    logits_2 = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)

    def ce_sum(logits):
        return F.cross_entropy(logits[keep], target[keep], reduction="sum")

    kl, _ = rdrop_kl(logits_1, logits_2, keep)
    loss = rdrop_objective(ce_sum(logits_1) + ce_sum(logits_2), kl, alpha)

    p1, p2 = logits_1.softmax(-1)[keep], logits_2.softmax(-1)[keep]
    explicit = ce_sum(logits_1) + ce_sum(logits_2)
    explicit = explicit + alpha * 0.5 * ((p1 * (p1 / p2).log()).sum() + (p2 * (p2 / p1).log()).sum())
    torch.testing.assert_close(loss, explicit)
    grads = torch.autograd.grad(loss, [logits_1, logits_2])
    expected = torch.autograd.grad(explicit, [logits_1, logits_2])
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)
    assert torch.equal(grads[0][~keep], torch.zeros_like(grads[0][~keep]))  # a padded position adds nothing
    # and against finite differences of the explicit formula (float64)
    assert torch.autograd.gradcheck(
        lambda a, b: rdrop_objective(ce_sum(a) + ce_sum(b), rdrop_kl(a, b, keep)[0], alpha), (logits_1, logits_2)
    )


def test_concatenated_batch_is_a_copy_and_splits_back():
    src = torch.tensor([[4, 5, 1], [6, 1, 1]])
    lengths = torch.tensor([2, 1])
    batch = {"net_input": {"src_tokens": src, "src_lengths": lengths, "extra": None}, "id": [7, 8], "n": 3}
    doubled = concat_with_itself(batch)
    assert batch["net_input"]["src_tokens"] is src and batch["net_input"]["src_lengths"] is lengths
    assert torch.equal(src, torch.tensor([[4, 5, 1], [6, 1, 1]]))
    assert doubled["net_input"] is not batch["net_input"]
    assert torch.equal(doubled["net_input"]["src_tokens"], torch.cat([src, src]))
    assert doubled["net_input"]["extra"] is None and doubled["n"] == 3
    first, second = split_in_two(doubled["net_input"]["src_tokens"])
    assert torch.equal(first, src) and torch.equal(second, src)
    with pytest.raises(ValueError, match="3 rows, not an even number"):
        split_in_two(torch.zeros(3, 2))


def test_dropout_is_the_only_difference_between_the_passes():
    """Two forwards of one model: with dropout the symmetric KL is positive; with dropout 0 it is 0,
    in both modes; and the same seed gives the same KL."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 5))
    x = torch.randn(6, 8)

    def kl(concat, seed=1):
        torch.manual_seed(seed)
        if concat:
            first, second = split_in_two(model(concat_with_itself(x)))
        else:
            first, second = model(x), model(x)
        return rdrop_kl(first, second)[0]

    assert kl(False) > 0 and kl(True) > 0
    assert torch.equal(kl(False), kl(False)) and torch.equal(kl(True), kl(True))  # a seed gives the same draws
    assert not torch.equal(kl(False, seed=1), kl(False, seed=2))
    model[1].p = 0.0
    assert kl(False) == 0 and kl(True) == 0


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"alpha": -1.0}, "--rdrop-alpha must be a finite number >= 0, got -1.0"),
        ({"alpha": math.nan}, "--rdrop-alpha must be a finite number >= 0, got nan"),
        ({"alpha": math.inf}, "--rdrop-alpha must be a finite number >= 0, got inf"),
        ({"alpha": "5"}, "--rdrop-alpha must be a finite number >= 0, got '5'"),
        ({"alpha": True}, "--rdrop-alpha must be a finite number >= 0, got True"),
        ({"concat_batch": "yes"}, "--rdrop-concat-batch must be True or False, got 'yes'"),
    ],
)
def test_config_refuses_bad_values_naming_the_option(fields, message):
    with pytest.raises(ValueError) as e:
        RDropConfig(**fields).validate()
    assert str(e.value) == message


def test_config_accepts_zero_and_the_papers_alpha():
    assert RDropConfig().alpha == 5.0 and RDropConfig().concat_batch is False
    RDropConfig(alpha=0).validate()
    RDropConfig(alpha=0.5, concat_batch=True).validate()


@pytest.mark.parametrize("name", ["symmetric_kl", "js_divergence"])
def test_a_class_impossible_in_both_passes_adds_nothing_and_no_nan(name):
    """A class whose logit is -inf in both passes (a vocabulary entry a model masks out) contributes 0
    to R-Drop's KL and HiddenCut's JS: value and gradients are those over the possible classes, with
    a 0 gradient at the impossible one, instead of 0 * (-inf - -inf) = NaN."""
    from attn_reg_plugin.core.regularizers.hiddencut import js_divergence

    divergence = {"symmetric_kl": symmetric_kl, "js_divergence": js_divergence}[name]
    masked = [torch.tensor([[1.0, 2.0, -math.inf], [0.0, -1.0, -math.inf]], requires_grad=True) for _ in range(2)]
    with torch.no_grad():
        masked[1][:, :2] += torch.tensor([[0.5, -1.5], [1.0, 0.0]])
    possible = [x.detach()[:, :2].clone().requires_grad_(True) for x in masked]
    value, reference = divergence(*masked), divergence(*possible)
    (value.sum() + reference.sum()).backward()
    torch.testing.assert_close(value, reference)
    for m, p in zip(masked, possible):
        torch.testing.assert_close(m.grad[:, :2], p.grad)
        assert torch.equal(m.grad[:, 2], torch.zeros(2))
    # Log-probabilities with an impossible class in one pass only: JS stays finite (KL is infinite then).
    one_sided = torch.tensor([[0.0, -1.0, -math.inf]]).log_softmax(-1), torch.tensor([[0.0, 0.0, 0.0]]).log_softmax(-1)
    if name == "js_divergence":
        assert torch.isfinite(divergence(*one_sided, log_probs=True)).all()
