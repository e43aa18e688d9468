"""What attn-reg-mt-compare may claim about a method against plain: per metric the mean and sample sd
over seeds, the paired difference to plain over the seeds both ran with a 95% t-interval, sacrebleu's
own paired bootstrap test per seed on the test set, and the verdict in words. attn-reg-cls-compare
(and the lab's few-shot runner) use the same spread, paired differences and verdict, on a classifier's
scores (:data:`VerdictMetric`) and without a per-seed test.

Seeds are the unit of evidence (DESIGN.md, "Evidence in MT"): the verdict rests on the interval
over seeds; sacrebleu's per-seed test is reported beside it and never decides alone (it called
plain seed 1 against plain seed 2 significant, p 0.04, on 10k TR-EN pairs).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from .verdict import LENGTH_RATIO_RANGE, NEAR_ZERO_BLEU

# Two-sided 95% Student t quantiles t(0.975, df) for df = 1..30 (any statistics table; scipy's
# stats.t.ppf(0.975, df) to the 3 decimals shown). The plugin does not depend on scipy.
T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
SIGNIFICANCE = 0.05
BOOTSTRAP_SAMPLES = 1000  # sacrebleu's default for its paired bootstrap test
# (record key, label, higher is better, digits) of each metric the comparison reports
METRICS = (
    ("valid_bleu", "valid BLEU", True, 2),
    ("test_bleu", "test BLEU", True, 2),
    ("test_chrf", "test chrF", True, 2),
    ("valid_loss", "best valid loss", False, 3),
)


def t_quantile(df: int) -> float:
    """t(0.975, df): the table for df <= 30, beyond it the Cornish-Fisher expansion (error < 1e-4)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(T_975):
        return T_975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def translation_scores(record: dict, key: str) -> Dict[int, float]:
    """``{seed: value}`` of one metric over a translation cell's runs (test chrF from the run's test
    scores; a diverged run's missing or non-finite values left out)."""
    out = {}
    for run in record["runs"]:
        value = (run.get("test") or {}).get("chrf") if key == "test_chrf" else run.get(key)
        if value is not None and math.isfinite(value):
            out[run["seed"]] = value
    return out


def spread(values: Sequence[float]) -> dict:
    """Mean and sample sd (None for fewer than 2 values) of ``values``."""
    return {
        "n": len(values),
        "mean": statistics.fmean(values) if values else None,
        "sd": statistics.stdev(values) if len(values) > 1 else None,
    }


def paired_difference(method: Dict[int, float], plain: Dict[int, float]) -> dict:
    """The method minus plain over the seeds both ran: per seed, mean, sd and the 95% t-interval
    ``mean ± t(0.975, n-1) sd / sqrt(n)`` (None for one seed)."""
    seeds = sorted(set(method) & set(plain))
    diffs = {s: method[s] - plain[s] for s in seeds}
    out = {"seeds": seeds, "per_seed": diffs, **spread(list(diffs.values())), "ci": None}
    if out["sd"] is not None:
        half = t_quantile(len(seeds) - 1) * out["sd"] / math.sqrt(len(seeds))
        out["ci"] = [out["mean"] - half, out["mean"] + half]
    return out


def read_lines(path: Path) -> List[str]:
    """A hypothesis or reference file, one sentence per \\n-ended line (as the sweep writes them)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def sacrebleu_paired_test(plain_hyps: List[str], hyps: List[str], refs: List[str], tokenize: str) -> dict:
    """sacrebleu's paired bootstrap resampling (``sacrebleu.significance.PairedTest``, test_type
    ``bs``, its seed 12345 unless SACREBLEU_SEED says otherwise) of ``hyps`` against the baseline
    ``plain_hyps``, on BLEU and chrF: each p-value and sacrebleu's signature."""
    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest

    if not len(plain_hyps) == len(hyps) == len(refs):
        raise ValueError(f"paired test: {len(plain_hyps)} plain and {len(hyps)} hypotheses for {len(refs)} references")
    metrics = {"BLEU": BLEU(tokenize=tokenize), "chrF": CHRF()}
    test = PairedTest(
        [("plain", plain_hyps), ("method", hyps)], metrics, [refs], test_type="bs", n_samples=BOOTSTRAP_SAMPLES
    )
    signatures, scores = test()
    bleu_name, chrf_name = list(signatures)  # sacrebleu names them BLEU and chrF2
    return {
        "bleu_p": scores[bleu_name][1].p_value,
        "chrf_p": scores[chrf_name][1].p_value,
        "bleu_plain": scores[bleu_name][0].score,
        "bleu": scores[bleu_name][1].score,
        "chrf_plain": scores[chrf_name][0].score,
        "chrf": scores[chrf_name][1].score,
        "signature": str(signatures[bleu_name]),
    }


def is_significant(test: dict) -> bool:
    """A seed's paired test says the method's BLEU differs from plain's: p < SIGNIFICANCE and the
    scores differ (for identical scores sacrebleu's bootstrap returns its smallest p, 1 / (resamples
    + 1): it counts resampled differences strictly above the observed 0, and none is)."""
    return test["bleu_p"] < SIGNIFICANCE and test["bleu"] != test["bleu_plain"]


class VerdictMetric(NamedTuple):
    """A metric the verdict reads: its key in the differences, its label, a short name (``BLEU``,
    ``valid loss``), whether higher is better, and the digits shown."""

    key: str
    label: str
    short: str
    higher_is_better: bool
    digits: int


# attn-reg-mt-compare's verdict: on test BLEU's interval over seeds, then on the best valid loss's.
MT_VERDICT = (
    VerdictMetric("test_bleu", "test BLEU", "BLEU", True, 2),
    VerdictMetric("valid_loss", "best valid loss", "valid loss", False, 3),
)


def _interval(d: dict, digits: int) -> str:
    f = f"{{:+.{digits}f}}"
    if d["ci"] is None:
        return f"{f.format(d['mean'])} ({d.get('no_interval', 'one seed, no interval')})"
    return f"{f.format(d['mean'])} [{f.format(d['ci'][0])}, {f.format(d['ci'][1])}]"


def _side(d: dict, higher_is_better: bool) -> int:
    """+1 when the interval lies on the better side of 0, -1 on the worse side, 0 when it holds 0."""
    if d["ci"] is None or d["ci"][0] <= 0 <= d["ci"][1]:
        return 0
    return 1 if (d["ci"][0] > 0) == higher_is_better else -1


def cautions(record: dict, plain: Optional[dict], plain_bleu: Optional[float]) -> List[str]:
    """What weakens any verdict on ``record`` against ``plain`` (the sweep's notions, verdict.py):
    plain's test BLEU near 0, hypotheses far from the references' length (valid split)."""
    out = []
    if plain_bleu is not None and plain_bleu < NEAR_ZERO_BLEU:
        out.append(f"plain's test BLEU is {plain_bleu:.2f}: the models do not translate yet, BLEU says little")
    low, high = LENGTH_RATIO_RANGE
    for r in (plain or {}, record):  # no plain: none of its runs finished
        ratio = r.get("length_ratio")
        if ratio is not None and not low <= ratio <= high:
            out.append(
                f"{r['name']}'s hypotheses are {ratio:.2f} x the references' length: degenerate output, BLEU says little"
            )
    return out


def verdict(
    name: str,
    diffs: Dict[str, dict],
    tests: Optional[Dict[int, dict]],
    flags: Sequence[str],
    notes: Sequence[str] = (),
    metrics: Tuple[VerdictMetric, VerdictMetric] = MT_VERDICT,
) -> str:
    """The verdict on method ``name`` against plain, in words: on the first of ``metrics``' interval
    over seeds (test BLEU), then on the second's (the best valid loss); sacrebleu's per-seed test said
    beside, never deciding alone (``tests`` None: the command has no per-seed test)."""
    primary, secondary = metrics
    main, other = diffs[primary.key], diffs[secondary.key]
    n = main["n"]
    if flags:
        return f"{name}: not compared: " + "; ".join(flags)
    if n == 0:
        return f"{name}: no seed in common with plain: run the same --seeds"
    tests_given = tests is not None
    tests = tests or {}
    significant = [s for s, t in tests.items() if is_significant(t)]
    agree = [s for s in significant if (tests[s]["bleu"] > tests[s]["bleu_plain"]) == (main["mean"] > 0)]
    paired = f"sacrebleu's paired test (p < {SIGNIFICANCE:g}) agrees at {len(agree)} of {len(tests)} seed(s)"
    seeds = f"{n} seed{'s' * (n != 1)}"
    main_text = f"{primary.label} {_interval(main, primary.digits)}"
    if n == 1:
        (seed,) = main["seeds"]
        out = f"{name}: not distinguishable from plain at 1 seed ({main_text}; no seed spread, add seeds)"
        if seed in tests and tests[seed]["bleu"] == tests[seed]["bleu_plain"]:
            out += f"; the same test BLEU as plain at seed {seed}"
        elif seed in tests:
            out += f"; sacrebleu's paired test at seed {seed}: p {tests[seed]['bleu_p']:.3f}, which alone over-claims"
        return out + "".join(f"; {note}" for note in notes)
    side_main, side_other = _side(main, primary.higher_is_better), _side(other, secondary.higher_is_better)
    other_text = f"{secondary.label} {_interval(other, secondary.digits)}"
    if side_main:
        words = "better" if side_main > 0 else "worse"
        out = f"{name}: {words}: {main_text} at {seeds}" + (f", and {paired}" if tests_given else "")
    elif side_other:
        on_better_side = (lambda d: d > 0) if secondary.higher_is_better else (lambda d: d < 0)
        every = all(on_better_side(d) == (side_other > 0) for d in other["per_seed"].values())
        words = "better" if side_other > 0 else "worse"
        out = (
            f"{name}: {words} on {secondary.short}{' at every seed' * every} ({other_text}), {primary.short} "
            f"within noise ({main_text}) at {seeds}"
        )
    else:
        out = f"{name}: not distinguishable from plain at {seeds} ({main_text}; {other_text})"
        if significant:
            out += (
                f"; sacrebleu's paired test calls {len(significant)} of {len(tests)} seed(s) significant (p < "
                f"{SIGNIFICANCE:g}), but the seeds do not: a per-seed test alone over-claims"
            )
    return out + "".join(f"; {note}" for note in notes)
