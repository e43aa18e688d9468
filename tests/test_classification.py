"""attn_reg_plugin.classification: a classifier's scores and the learned-nothing check, on hand-built labels."""

import math

import numpy as np
import pytest

from attn_reg_plugin.classification import (
    chance_level,
    chance_macro_f1,
    learned_nothing,
    macro_f1,
    majority_rate,
    mcc,
    paired_bootstrap_sd,
    scores,
)


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


def _imbalanced_with_balanced_errors(n=10_000, minority=0.1, recall=0.8, false_positive_rate=0.1):
    """The review's case: 90% one class; the model finds 80% of the minority at 10% false positives."""
    positives = int(n * minority)
    gold = np.array([1] * positives + [0] * (n - positives))
    pred = gold.copy()
    pred[int(positives * recall) : positives] = 0
    pred[positives : positives + int((n - positives) * false_positive_rate)] = 1
    return pred, gold


def test_learning_is_judged_by_the_chosen_metric_on_imbalanced_labels():
    """Accuracy under the majority share, MCC 0.5+: it learned, by MCC and macro-F1 (it was flagged "no
    evidence that it learned" whatever the metric, and its row left out of the comparison)."""
    pred, gold = _imbalanced_with_balanced_errors()
    got = scores(pred, gold)
    assert got["accuracy"] < got["majority_rate"] == pytest.approx(0.9) and got["mcc"] > 0.5
    assert learned_nothing(got, metric="mcc") is None
    assert learned_nothing(got, metric="macro_f1") is None
    assert "within noise of always predicting the majority class" in learned_nothing(got, metric="accuracy")


@pytest.mark.parametrize("metric", ["accuracy", "macro_f1", "mcc"])
def test_a_predictor_that_ignores_the_text_learned_nothing_by_any_metric(metric):
    rng = np.random.default_rng(0)
    gold = (rng.random(2000) < 0.3).astype(int)
    guessing = (rng.random(2000) < 0.5).astype(int)  # two classes predicted, independent of the labels
    why = learned_nothing(scores(guessing, gold), metric=metric)
    assert why is not None and why.endswith("no evidence that it learned")
    assert learned_nothing(scores([0] * 2000, gold), metric=metric).startswith("predicts one class for all 2000")


def test_the_chance_margin_shrinks_with_the_splits_size():
    """MCC 0.1 is noise on 100 examples (margin 1.96 / sqrt(100) = 0.196) and learning on 10,000 (0.0196)."""
    for n, learned in ((100, False), (10_000, True)):
        result = {"examples": n, "mcc": 0.1, "predicted_classes": 2, "accuracy": 0.6}
        assert (learned_nothing(result, metric="mcc") is None) == learned
        assert chance_level(result, "mcc") == (
            0.0,
            pytest.approx(1.96 / math.sqrt(n)),
            "a predictor that ignores the text",
        )


def test_chance_macro_f1_is_the_best_of_constant_uniform_and_share_guessing():
    assert chance_macro_f1([1] * 9 + [0]) == pytest.approx(0.5)  # share guessing: 1/k beats 2*0.9/1.9/2
    assert chance_macro_f1([0, 1]) == pytest.approx(0.5)
    gold = [0] * 98 + [1, 2]
    constant = 2 * 0.98 / 1.98 / 3
    uniform = np.mean([2 * g / (3 * g + 1) for g in (0.98, 0.01, 0.01)])
    assert chance_macro_f1(gold) == pytest.approx(max(constant, uniform, 1 / 3))


def test_the_paired_bootstrap_over_examples_by_hand():
    """One example of 80 more right at each of 2 seeds: the difference +0.0125 is within the test set's
    noise; the same examples' predictions on both sides move nothing; the metric is recomputed per resample."""
    gold = np.array([0] * 40 + [1] * 40)
    plain = {s: gold.copy() for s in (1, 2)}
    for s in plain:
        plain[s][:10] = 1 - plain[s][:10]
    method = {s: p.copy() for s, p in plain.items()}
    method[1][0], method[2][1] = gold[0], gold[1]
    sd = paired_bootstrap_sd(method, plain, gold, "accuracy")
    # The difference per resample is (times example 0 drawn + times example 1 drawn) / 80 / 2: each count is
    # binomial(80, 1/80), so the sd is sqrt(2 x 80 x 1/80 x 79/80) / 160.
    assert sd == pytest.approx(math.sqrt(2 * 79 / 80) / 160, rel=0.1)
    assert 0.0125 - 1.96 * sd < 0
    assert paired_bootstrap_sd(plain, plain, gold, "mcc") == 0.0
    with pytest.raises(ValueError, match="the same seeds on both sides"):
        paired_bootstrap_sd(method, {1: plain[1]}, gold, "accuracy")
