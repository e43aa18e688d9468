"""attn_reg_plugin.classification: a classifier's scores and the learned-nothing check, on hand-built labels."""

import math

import numpy as np
import pytest

from attn_reg_plugin.classification import learned_nothing, macro_f1, majority_rate, mcc, scores


def test_scores_by_hand():
    gold = [0, 0, 0, 1, 1, 2]
    pred = [0, 0, 1, 1, 2, 2]
    got = scores(pred, gold)
    assert got["accuracy"] == pytest.approx(4 / 6)
    # F1 per class: 0: tp 2, 2 predicted, 3 actual -> 4/5; 1: tp 1, 2, 2 -> 1/2; 2: tp 1, 2, 1 -> 2/3
    assert got["macro_f1"] == pytest.approx((4 / 5 + 1 / 2 + 2 / 3) / 3)
    assert got["majority_rate"] == pytest.approx(3 / 6) and got["predicted_classes"] == 3 and got["examples"] == 6
    # Matthews, multi-class: (c*s - t.p) / sqrt((s^2 - p.p)(s^2 - t.t)), t = (3, 2, 1), p = (2, 2, 2)
    expected = (4 * 6 - (3 * 2 + 2 * 2 + 1 * 2)) / math.sqrt((36 - 12) * (36 - 14))
    assert got["mcc"] == pytest.approx(expected)


def test_a_class_never_predicted_scores_zero_f1_and_a_constant_side_zero_mcc():
    assert macro_f1([0, 0, 0, 0], [0, 0, 1, 1]) == pytest.approx((2 * 2 / 6 + 0) / 2)
    assert mcc([1, 1, 1], [0, 1, 0]) == 0.0
    assert majority_rate(np.array([1, 1, 0])) == pytest.approx(2 / 3)


def test_a_constant_predictor_learned_nothing_whatever_its_accuracy():
    gold = [1] * 212 + [0] * 188
    verdict = learned_nothing(scores([1] * 400, gold))
    assert verdict.startswith("predicts one class for all 400 examples (accuracy 0.5300")
    assert scores([1] * 400, gold)["accuracy"] == pytest.approx(0.53)  # what a table shows without the check


def test_majority_rate_within_noise_is_named_and_above_it_is_not():
    n = 400
    gold = np.array([1] * 212 + [0] * 188)
    rate, noise = 0.53, 1.96 * math.sqrt(0.53 * 0.47 / n)
    # Two classes predicted, accuracy exactly at the edge of the noise band: named.
    right = int(round((rate + noise) * n)) - 1
    pred = gold.copy()
    pred[right:] = 1 - pred[right:]
    assert (pred == gold).mean() <= rate + noise
    assert "within noise of always predicting the majority class" in learned_nothing(scores(pred, gold))
    # Clearly above: nothing to say.
    pred = gold.copy()
    pred[: int(0.2 * n)] = 1 - pred[: int(0.2 * n)]
    assert (pred == gold).mean() == pytest.approx(0.8) and learned_nothing(scores(pred, gold)) is None


@pytest.mark.parametrize("pred, gold", [([], []), ([0, 1], [0])])
def test_bad_input_is_refused_naming_the_lengths(pred, gold):
    with pytest.raises(ValueError, match="non-empty lists of one length"):
        scores(pred, gold)


def test_the_trainers_prefixed_metrics_are_read_as_they_are_logged():
    logged = {f"eval_{k}": v for k, v in scores([0, 0, 0, 0], [0, 1, 0, 1]).items()}
    assert learned_nothing(logged, prefix="eval_").startswith("predicts one class for all 4 examples")
