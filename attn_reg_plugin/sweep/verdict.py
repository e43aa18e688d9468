"""What the sweep's numbers may claim: a cell's record over its seeds, the cells that cannot be
ranked (diverged; regularizer mostly skipped), the best of the rest, and what weakens that choice
(differences within the seed spread, BLEU near 0, hypotheses far from the references' length)."""

from __future__ import annotations

import math
import statistics
from typing import List, Optional

from .options import cell_name, number_text
from .records import MOSTLY_SKIPPED

# A cell whose last valid loss exceeds this many times plain's best has exploded, whatever the bound.
EXPLODED_OVER_PLAIN = 10.0
NEAR_ZERO_BLEU = 1.0
# Hypotheses this far from the references' length (sacrebleu's sys_len / ref_len) are degenerate:
# truncated, or looping until the length bound.
LENGTH_RATIO_RANGE = (0.8, 1.25)


def _mean(values: List[Optional[float]], digits: int = 4) -> Optional[float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return round(statistics.fmean(values), digits) if values else None


def summarize(cell: dict, runs: List[dict], settings: dict) -> dict:
    """A cell's record: its seeds' runs, their means, and sample sd over seeds (None for one seed).
    A run that diverged before it could be scored has no BLEU: the means are over the scored runs
    (None when there is none), and the record's ``diverged`` names it."""
    bleus = [r["valid_bleu"] for r in runs if r["valid_bleu"] is not None]
    translations = [r["valid"] for r in runs if r["valid"] is not None]
    known = [r["ad_drop_skipped"] for r in runs if r.get("ad_drop_skipped") is not None]
    return {
        "cell": cell,
        "name": cell_name(cell),
        "settings": settings,
        "seeds": [r["seed"] for r in runs],
        "valid_bleu": round(statistics.fmean(bleus), 2) if bleus else None,
        "valid_bleu_sd": round(statistics.stdev(bleus), 2) if len(bleus) > 1 else None,
        "valid_loss": _mean([r["valid_loss"] for r in runs]),
        "final_valid_loss": max((r.get("final_valid_loss", r["valid_loss"]) for r in runs), key=_badness),
        "test_bleu": _mean([r["test_bleu"] for r in runs]),
        "ad_drop_rate": _mean([r["ad_drop_rate"] for r in runs]),
        "ad_drop_skipped": sum(known) if known else None,
        "ad_drop_skipped_share": _mean([r.get("ad_drop_skipped_share") for r in runs]),
        "diverged": [f"seed {r['seed']}: {r['diverged']}" for r in runs if r.get("diverged")],
        "missing_epochs": {str(r["seed"]): r["missing_epochs"] for r in runs if r.get("missing_epochs")},
        "length_ratio": _mean([valid.get("length_ratio") for valid in translations], 3),
        "empty_hypotheses": sum(valid["empty_hypotheses"] for valid in translations),
        "train_seconds": round(sum(r["train_seconds"] for r in runs), 1),
        "runs": runs,
    }


def _badness(loss: Optional[float]) -> float:
    return math.inf if loss is None or not math.isfinite(loss) else loss


def plain_of(records: List[dict]) -> Optional[dict]:
    return next((r for r in records if r["cell"]["method"] == "plain"), None)


def scored(record: Optional[dict]) -> Optional[dict]:
    """``record`` when it has a valid BLEU to compare with, else None (none, or every run diverged unscored)."""
    return record if record is not None and record["valid_bleu"] is not None else None


def flags(record: dict, plain: Optional[dict]) -> List[str]:
    """Why ``record`` cannot be ranked: it diverged, or its regularizer mostly did not run."""
    out = []
    if record["diverged"]:
        out.append("diverged (" + "; ".join(record["diverged"]) + ")")
    elif plain is not None and plain is not record and plain["valid_loss"]:
        last = _badness(record["final_valid_loss"])
        if last > EXPLODED_OVER_PLAIN * plain["valid_loss"]:
            out.append(
                f"diverged (last valid loss {last:.4g}, over {EXPLODED_OVER_PLAIN:g} x plain's {plain['valid_loss']:.3f})"
            )
    share = record.get("ad_drop_skipped_share")
    if record["cell"]["method"] != "plain" and share is not None and share > MOSTLY_SKIPPED:
        out.append(
            f"AD-DROP skipped in {100 * share:.0f}% of its steps ({record['ad_drop_skipped']} skipped: non-finite "
            "attribution target, the plain loss used): not ranked as regularized"
        )
    return out


def ranked(records: List[dict]) -> List[dict]:
    """The AD-DROP cells that can be ranked, best first: mean valid BLEU, then lower mean valid loss,
    then grid order. Test is not looked at."""
    plain = plain_of(records)
    candidates = [r for r in records if r["cell"]["method"] == "ad-drop" and not flags(r, plain)]
    order = sorted(
        range(len(candidates)), key=lambda i: (-candidates[i]["valid_bleu"], _badness(candidates[i]["valid_loss"]), i)
    )
    return [candidates[i] for i in order]


def best_cell(records: List[dict]) -> Optional[dict]:
    """The first of :func:`ranked`; None when no AD-DROP cell can be ranked."""
    order = ranked(records)
    return order[0] if order else None


def seed_spread(records: List[dict]) -> Optional[float]:
    """The pooled sd of valid BLEU over seeds, of the cells run with more than one seed."""
    variances = [r["valid_bleu_sd"] ** 2 for r in records if r["valid_bleu_sd"] is not None]
    return round(math.sqrt(statistics.fmean(variances)), 2) if variances else None


def caveats(records: List[dict], best: dict) -> List[str]:
    """What weakens the choice of ``best``, each in a sentence, for the line beside it."""
    plain, order, spread = scored(plain_of(records)), ranked(records), seed_spread(records)
    out = []
    if spread is None:
        out.append(
            "one seed per cell: no seed spread to judge the differences by (MT seeds differ by about 0.5 "
            "BLEU); add seeds (--seeds 1,2,3) before trusting the ranking"
        )
    else:
        gaps = [("the next cell", order[1])] if len(order) > 1 else []
        gaps += [("plain", plain)] if plain is not None else []
        for what, other in gaps:
            gap = best["valid_bleu"] - other["valid_bleu"]
            if abs(gap) < spread:
                out.append(
                    f"best is {gap:+.2f} BLEU from {what}, within the seed spread (sd {spread:.2f}): not a finding"
                )
    if plain is not None and best["valid_bleu"] < plain["valid_bleu"]:
        out.append(
            f"no ranked AD-DROP cell beats plain on valid BLEU (best {best['valid_bleu'] - plain['valid_bleu']:+.2f})"
        )
    if best["valid_bleu"] < NEAR_ZERO_BLEU:
        out.append(
            f"valid BLEU near 0 ({best['valid_bleu']:.2f}): the models do not translate yet, BLEU cannot rank "
            "the cells (the valid loss broke the ties)"
        )
    ratio = best["length_ratio"]
    low, high = LENGTH_RATIO_RANGE
    if ratio is not None and not low <= ratio <= high:
        far = [r["name"] for r in records if r["length_ratio"] is not None and not low <= r["length_ratio"] <= high]
        out.append(
            f"hypotheses are {ratio:.2f} x the references' length (sacrebleu sys_len/ref_len; {len(far)} of "
            f"{len(records)} cells outside {low:g}-{high:g}): degenerate output, BLEU says little"
        )
    if len({tuple(r["seeds"]) for r in order + ([plain] if plain else [])}) > 1:
        out.append("the cells ran different seeds: their means are over different seeds")
    return out


def closing_hints(records: List[dict]) -> List[str]:
    """What to do next, for the end of the console output."""
    plain = plain_of(records)
    diverged = [r["name"] for r in records if any(f.startswith("diverged") for f in flags(r, plain))]
    out = []
    if diverged:
        out.append(
            f"diverged: {', '.join(diverged)}: their training blew up (lower --lr, raise --warmup-updates, or "
            "clip with --clip-norm); their BLEU says nothing about p and q"
        )
    healthy = [r for r in records if r["name"] not in diverged]
    if healthy and all(r["valid_bleu"] == 0.0 for r in healthy):
        out.append(
            f"every {'other ' * bool(diverged)}cell's valid BLEU is 0: the runs are too short to translate (empty "
            "or repeated-token hypotheses); raise --epochs, the cells were ranked by valid loss"
        )
    return out


def best_line(best: Optional[dict], plain: Optional[dict], records: List[dict]) -> str:
    """The line naming the best cell (or why there is none), plain beside it, and its caveats."""
    if scored(plain) is None:
        plain_text = "plain: diverged, not scored"
    else:
        plain_text = f"plain: valid BLEU {plain['valid_bleu']:.2f}, valid loss {plain['valid_loss']:.3f}"
    if best is None:
        return "best on valid: none: no AD-DROP cell can be ranked (each is flagged in the table)" + (
            f"; {plain_text}" if plain else ""
        )
    cell = best["cell"]
    line = (
        f"best on valid: {best['name']} (p {number_text(cell['p'])}, q {number_text(cell['q'])}): valid BLEU "
        f"{best['valid_bleu']:.2f}, valid loss {best['valid_loss']:.3f}" + (f"; {plain_text}" if plain else "")
    )
    return line + "".join(f"\n- caution: {c}" for c in caveats(records, best))
