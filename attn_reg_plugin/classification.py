"""A classifier's scores, and whether a run learned anything: one home for every command that reports them.

A fine-tuning run can end as a constant predictor (a learning rate too high or too low, too few
updates); its accuracy is then the majority class's share and reads like a result. The functions
here take integer predictions and gold labels (sequences or numpy arrays) and say so in words.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import numpy as np


def _arrays(pred: Sequence[int], gold: Sequence[int]):
    pred, gold = np.asarray(pred).reshape(-1), np.asarray(gold).reshape(-1)
    if pred.shape != gold.shape or pred.size == 0:
        raise ValueError(
            f"predictions and gold labels must be two non-empty lists of one length, got {pred.size} and {gold.size}"
        )
    return pred, gold


def mcc(pred: Sequence[int], gold: Sequence[int]) -> float:
    """Matthews correlation (multi-class form); 0 when a side is constant."""
    pred, gold = _arrays(pred, gold)
    classes = np.union1d(pred, gold)
    confusion = np.array([[np.sum((gold == a) & (pred == b)) for b in classes] for a in classes], dtype=np.float64)
    total, correct = confusion.sum(), np.trace(confusion)
    true_counts, pred_counts = confusion.sum(1), confusion.sum(0)
    denominator = math.sqrt((total**2 - pred_counts @ pred_counts) * (total**2 - true_counts @ true_counts))
    return float((correct * total - true_counts @ pred_counts) / denominator) if denominator else 0.0


def class_scores(tp: int, predicted: int, actual: int) -> tuple:
    """(precision, recall, F1) of one class from its true positives and its predicted and gold counts;
    0 where a count they divide by is 0 (a class never predicted, or never present)."""
    precision = tp / predicted if predicted else 0.0
    recall = tp / actual if actual else 0.0
    return precision, recall, 2 * tp / (predicted + actual) if predicted + actual else 0.0


def macro_f1(pred: Sequence[int], gold: Sequence[int]) -> float:
    """The mean over the gold classes of each class's F1 (a class never predicted scores 0)."""
    pred, gold = _arrays(pred, gold)
    f1s = []
    for c in np.unique(gold):
        tp = np.sum((pred == c) & (gold == c))
        f1s.append(class_scores(tp, np.sum(pred == c), np.sum(gold == c))[2])
    return float(np.mean(f1s))


def majority_rate(gold: Sequence[int]) -> float:
    """The accuracy of always predicting the most frequent gold class."""
    _, counts = np.unique(np.asarray(gold).reshape(-1), return_counts=True)
    return float(counts.max() / counts.sum())


def chance_macro_f1(gold: Sequence[int]) -> float:
    """The best macro-F1 of a predictor that ignores the text: always the majority class, uniformly
    at random over the gold classes, or at random in the gold shares (expected values)."""
    _, counts = np.unique(np.asarray(gold).reshape(-1), return_counts=True)
    shares, k = counts / counts.sum(), counts.size
    constant = 2 * shares.max() / (shares.max() + 1) / k  # F1 of the majority class, 0 for the others
    uniform = float(np.mean(2 * shares / (k * shares + 1)))  # each class: precision g, recall 1/k
    stratified = 1 / k  # each class: precision = recall = its share g -> F1 g; the mean of the shares
    return float(max(constant, uniform, stratified))


def scores(pred: Sequence[int], gold: Sequence[int]) -> Dict[str, float]:
    """accuracy, macro_f1, mcc; what a predictor that ignores the text scores (``majority_rate`` for
    accuracy, ``macro_f1_chance``; MCC's is 0); how many classes were predicted, how many examples."""
    pred, gold = _arrays(pred, gold)
    return {
        "accuracy": float((pred == gold).mean()),
        "macro_f1": macro_f1(pred, gold),
        "mcc": mcc(pred, gold),
        "majority_rate": majority_rate(gold),
        "macro_f1_chance": chance_macro_f1(gold),
        "predicted_classes": int(np.unique(pred).size),
        "examples": int(pred.size),
    }


LEARNING_METRICS = ("accuracy", "macro_f1", "mcc")


def chance_level(result: Dict[str, float], metric: str, prefix: str = "") -> Tuple[float, float, str]:
    """``(chance, margin, what scores chance)`` of ``metric`` on the split :func:`scores` scored: a score
    at or below ``chance + margin`` is no evidence of learning. The margin is 1.96 standard errors of
    that score under chance over the split's n examples, so it shrinks as 1/sqrt(n): binomial at the
    chance rate for accuracy and macro-F1, 1/sqrt(n) for MCC (sqrt(n) x MCC of a predictor independent
    of the labels is about standard normal)."""
    n = int(result[prefix + "examples"])
    if metric == "accuracy":
        rate = result[prefix + "majority_rate"]
        return rate, 1.96 * math.sqrt(rate * (1 - rate) / n), "always predicting the majority class"
    if metric == "macro_f1":
        rate = result[prefix + "macro_f1_chance"]
        return rate, 1.96 * math.sqrt(rate * (1 - rate) / n), "a predictor that ignores the text"
    if metric == "mcc":
        return 0.0, 1.96 / math.sqrt(n), "a predictor that ignores the text"
    raise ValueError(f"metric must be one of {', '.join(LEARNING_METRICS)}, got {metric!r}")


def learned_nothing(result: Dict[str, float], prefix: str = "", metric: str = "accuracy") -> Optional[str]:
    """A sentence when :func:`scores` (its keys under ``prefix``, e.g. the Trainer's ``eval_``) show no
    learning, judged by ``metric`` (the one that picks the best epoch): every prediction one class; or
    the metric not above what a predictor that ignores the text scores on that split by more than
    its noise (:func:`chance_level`). On imbalanced labels a model with balanced errors can score
    under the majority share in accuracy and still learn: judge it by macro_f1 or mcc."""
    n = int(result[prefix + "examples"])
    value = result[prefix + metric]
    if result[prefix + "predicted_classes"] == 1:
        accuracy = result[prefix + "accuracy"]
        return f"predicts one class for all {n} examples (accuracy {accuracy:.4f} = that class's share): it learned nothing"
    chance, margin, what = chance_level(result, metric, prefix)
    if value <= chance + margin:
        name = {"accuracy": "accuracy", "macro_f1": "macro-F1", "mcc": "MCC"}[metric]
        return (
            f"{name} {value:.4f} is within noise of {what} ({chance:.4f}, +{margin:.4f} over {n} examples): "
            "no evidence that it learned"
        )
    return None


# -- the test set's own noise: a paired bootstrap over examples ---------------------------------------
BOOTSTRAP_SAMPLES = 1000
BOOTSTRAP_SEED = 12345  # fixed, as sacrebleu's paired test fixes its own: a report is reproducible


def _metric_of_confusions(confusion: np.ndarray, metric: str) -> np.ndarray:
    """``metric`` of each (K, K) confusion matrix (rows gold, columns predicted) in a (B, K, K) stack,
    as :func:`scores` computes it on the examples they count."""
    total = confusion.sum((1, 2))
    correct = np.trace(confusion, axis1=1, axis2=2)
    gold_counts, pred_counts = confusion.sum(2), confusion.sum(1)
    if metric == "accuracy":
        return correct / total
    if metric == "macro_f1":
        diagonal = np.diagonal(confusion, axis1=1, axis2=2)
        both = gold_counts + pred_counts
        f1 = np.divide(2 * diagonal, both, out=np.zeros_like(diagonal, dtype=np.float64), where=both > 0)
        present = gold_counts > 0  # the classes in the resample's gold labels, as macro_f1 averages
        return (f1 * present).sum(1) / present.sum(1)
    if metric == "mcc":
        numerator = correct * total - (gold_counts * pred_counts).sum(1)
        square = total.astype(np.float64) ** 2
        denominator = np.sqrt((square - (pred_counts**2).sum(1)) * (square - (gold_counts**2).sum(1)))
        return np.divide(numerator, denominator, out=np.zeros_like(square), where=denominator > 0)
    raise ValueError(f"metric must be one of {', '.join(LEARNING_METRICS)}, got {metric!r}")


def _resampled(pred: np.ndarray, gold: np.ndarray, weights: np.ndarray, classes: int, metric: str) -> np.ndarray:
    """``metric`` of ``pred`` on each resample, a row of ``weights`` (how often each example is drawn)."""
    confusion = weights @ np.eye(classes * classes)[gold * classes + pred]  # (B, K*K) counts
    return _metric_of_confusions(confusion.reshape(-1, classes, classes), metric)


def paired_bootstrap_sd(
    method: Dict[int, Sequence[int]],
    plain: Dict[int, Sequence[int]],
    gold: Sequence[int],
    metric: str,
    samples: int = BOOTSTRAP_SAMPLES,
) -> float:
    """The standard deviation, over resamples of the test examples, of the mean over seeds of
    ``metric(method's predictions) - metric(plain's)``: how much the difference would move on another
    test set of the same size. One resample (examples drawn with replacement) serves every seed and
    both sides, since every run predicts the same examples. ``method``/``plain``: ``{seed: predicted
    class per example}`` over the same seeds; ``gold``: the class per example."""
    gold = np.asarray(gold).reshape(-1)
    seeds = sorted(method)
    if not seeds or sorted(plain) != seeds:
        raise ValueError(f"paired bootstrap: the same seeds on both sides, got {seeds} and {sorted(plain)}")
    arrays = {side: {s: np.asarray(p[s]).reshape(-1) for s in seeds} for side, p in (("m", method), ("p", plain))}
    if any(a.shape != gold.shape for side in arrays.values() for a in side.values()):
        raise ValueError(f"paired bootstrap: every run predicts the {gold.size} test examples")
    classes = int(max(gold.max(), *(a.max() for side in arrays.values() for a in side.values()))) + 1
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    drawn = rng.integers(0, gold.size, (samples, gold.size))
    weights = np.stack([np.bincount(row, minlength=gold.size) for row in drawn]).astype(np.float64)
    difference = np.zeros(samples)
    for s in seeds:
        difference += _resampled(arrays["m"][s], gold, weights, classes, metric)
        difference -= _resampled(arrays["p"][s], gold, weights, classes, metric)
    return float((difference / len(seeds)).std(ddof=1))
