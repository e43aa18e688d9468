"""attn-reg-mt-paired: a sweep's cells minus its plain cell, seed by seed."""

import json
import math

import pytest

from attn_reg_lab import mt_paired


def record(name, cell, runs):
    return {"name": name, "cell": cell, "runs": runs}


def run(seed, valid_bleu, valid_loss, test_bleu=None):
    return {"seed": seed, "valid_bleu": valid_bleu, "valid_loss": valid_loss, "test_bleu": test_bleu}


RESULTS = {
    "cells": [
        record("plain", {"method": "plain"}, [run(1, 5.0, 7.2, 4.0), run(2, 6.0, 7.1, 5.0), run(3, 4.0, 7.3, 3.5)]),
        record(
            "p0.3_q0.5_ga",
            {"method": "ad-drop", "p": 0.3, "q": 0.5},
            [run(1, 5.5, 7.1, 4.5), run(2, 6.1, 7.0, 4.0), run(3, 4.9, 7.25, 4.5)],
        ),
        record("p0.3_q0.5_rd", {"method": "ad-drop", "p": 0.3, "q": 0.5}, [run(1, 4.0, 7.4)]),  # one shared seed
    ]
}


def test_differences_are_paired_by_seed(tmp_path, capsys):
    rows = {(r["cell"], r["measure"]): r for r in mt_paired.paired_rows(RESULTS)}
    ga = rows[("p0.3_q0.5_ga", "valid BLEU")]["vs_plain"]
    diffs = [0.5, 0.1, 0.9]
    mean = sum(diffs) / 3
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    assert ga["pairs"] == 3 and ga["mean_diff"] == pytest.approx(mean) and ga["std_diff"] == pytest.approx(std)
    t = mean / (std / math.sqrt(3))
    assert ga["t"] == pytest.approx(t)
    # Two degrees of freedom have a closed form: two-sided p = 1 - t / sqrt(t^2 + 2).
    assert ga["p"] == pytest.approx(1 - t / math.sqrt(t * t + 2))
    assert rows[("p0.3_q0.5_ga", "test BLEU")]["vs_plain"]["mean_diff"] == pytest.approx((0.5 - 1.0 + 1.0) / 3)
    assert rows[("p0.3_q0.5_rd", "valid BLEU")]["vs_plain"]["pairs"] == 1
    assert ("p0.3_q0.5_rd", "test BLEU") not in rows  # no test BLEU: no row
    assert rows[("plain", "valid BLEU")]["vs_plain"] is None
    path = tmp_path / "results.json"
    path.write_text(json.dumps(RESULTS))
    assert mt_paired.main([str(path), "--json", str(tmp_path / "paired.json")]) == 0
    out = capsys.readouterr().out
    assert "| p0.3_q0.5_ga | valid BLEU | 1: 5.50, 2: 6.10, 3: 4.90 | +0.50 (3 pairs) | 0.40 | 0.163 |" in out
    assert len(json.loads((tmp_path / "paired.json").read_text())) == len(rows)


def test_a_sweep_without_plain_is_refused(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"cells": RESULTS["cells"][1:]}))
    with pytest.raises(SystemExit) as e:
        mt_paired.main([str(path)])
    assert e.value.code == 2 and "run it with --plain" in capsys.readouterr().err
