"""A classifier's scores, and whether a run learned anything: one home for every command that reports them.

A fine-tuning run can end as a constant predictor (a learning rate too high or too low, too few
updates); its accuracy is then the majority class's share and reads like a result. The functions
here take integer predictions and gold labels (sequences or numpy arrays) and say so in words.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

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


def macro_f1(pred: Sequence[int], gold: Sequence[int]) -> float:
    """The mean over the gold classes of each class's F1 (a class never predicted scores 0)."""
    pred, gold = _arrays(pred, gold)
    f1s = []
    for c in np.unique(gold):
        tp = np.sum((pred == c) & (gold == c))
        predicted, actual = np.sum(pred == c), np.sum(gold == c)
        f1s.append(2 * tp / (predicted + actual) if predicted + actual else 0.0)
    return float(np.mean(f1s))


def majority_rate(gold: Sequence[int]) -> float:
    """The accuracy of always predicting the most frequent gold class."""
    _, counts = np.unique(np.asarray(gold).reshape(-1), return_counts=True)
    return float(counts.max() / counts.sum())


def scores(pred: Sequence[int], gold: Sequence[int]) -> Dict[str, float]:
    """accuracy, macro_f1, mcc, the majority-class rate, how many classes were predicted, how many examples."""
    pred, gold = _arrays(pred, gold)
    return {
        "accuracy": float((pred == gold).mean()),
        "macro_f1": macro_f1(pred, gold),
        "mcc": mcc(pred, gold),
        "majority_rate": majority_rate(gold),
        "predicted_classes": int(np.unique(pred).size),
        "examples": int(pred.size),
    }


def learned_nothing(result: Dict[str, float], prefix: str = "") -> Optional[str]:
    """A sentence when :func:`scores` (its keys under ``prefix``, e.g. the Trainer's ``eval_``) show no learning.

    Two cases: every prediction is one class; or the accuracy is not above the majority-class rate
    by more than the noise of n draws (1.96 binomial standard errors at that rate), that is, the
    model does no better than always answering the majority class.
    """
    n, rate = int(result[prefix + "examples"]), result[prefix + "majority_rate"]
    accuracy = result[prefix + "accuracy"]
    if result[prefix + "predicted_classes"] == 1:
        return f"predicts one class for all {n} examples (accuracy {accuracy:.4f} = that class's share): it learned nothing"
    noise = 1.96 * math.sqrt(rate * (1 - rate) / n)
    if accuracy <= rate + noise:
        return (
            f"accuracy {accuracy:.4f} is within noise of always predicting the majority class "
            f"({rate:.4f}, +{noise:.4f} over {n} examples): no evidence that it learned"
        )
    return None
