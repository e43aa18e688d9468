"""attn-reg-sweep: the grid, dev-only selection, resume after a kill, refusal of other settings, the heatmap."""

import dataclasses
import json
import random
from pathlib import Path

import pytest
import sacrebleu

from attn_reg_lab import sweep
from helpers import MOVIE_REVIEWS_TINY as REVIEWS
from helpers import minilm_path


def test_grid_names_and_dev_only_selection():
    cells = sweep.grid([0.1, 0.3], [0.5], ["all", "0,1"], ["cross-tuning", "always"], plain=True)
    assert cells[0] == {"method": "plain"} and len(cells) == 1 + 2 * 1 * 2 * 2
    assert sweep.cell_name(cells[1]) == "p0.1_q0.5_layers-all_cross-tuning"
    assert sweep.cell_name(cells[3]) == "p0.1_q0.5_layers-0-1_cross-tuning"
    results = [
        {"cell": c, "dev": d, "test": t}
        for c, d, t in zip(
            cells, [0.99, 0.7, 0.8, 0.8, 0.6, 0.5, 0.5, 0.5, 0.5], [0.0, 0.9, 0.1, 0.2, 0.99, 0, 0, 0, 0]
        )
    ]
    # plain is never chosen; ties go to the first cell in grid order; test plays no part.
    assert sweep.best_cell(results, higher_is_better=True)["cell"] == cells[2]
    assert sweep.best_cell(results, higher_is_better=False)["cell"] == cells[5]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["fewshot", "--p", "0.1,1.0", "--", "--sizes", "8"],
            "--p must be a comma list of distinct numbers in the open interval (0, 1), got '0.1,1.0'",
        ),
        (
            ["fewshot", "--q", "0.2,0.2", "--", "--sizes", "8"],
            "--q must be a comma list of distinct numbers in the open interval (0, 1)",
        ),
        (["mt", "--schedules", "odd"], "--schedules must be a comma list of cross-tuning, always, got 'odd'"),
        (["mt", "--", "--epochs", "2", "--methods", "plain"], "--methods after '--' are set by the sweep"),
        (["mt", "--", "--max-tokens", "100"], "mt: unknown options after '--': --max-tokens 100"),
        (
            ["fewshot", "--", "--sizes", "8", "--ad-drop-p", "0.3"],
            "--ad-drop-p after '--' are set by the sweep for each cell",
        ),
        (["fewshot", "--", "--sizes", "8", "--out-dir=x"], "--out-dir after '--' are set by the sweep"),
        (["lm"], "invalid choice: 'lm'"),
        (["fewshot", "--", "--sizes", "16,64"], "fewshot: give exactly one training-set size after '--' (--sizes N)"),
        (["fewshot"], "fewshot: give exactly one training-set size after '--' (--sizes N)"),
    ],
)
def test_bad_arguments_are_refused_before_any_cell_runs(capsys, argv, message):
    with pytest.raises(SystemExit):
        sweep.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.fixture()
def tiny_fewshot_args(tmp_path):
    lines = REVIEWS.read_text(encoding="utf-8").splitlines(keepends=True)
    random.Random(0).shuffle(lines)
    files = []
    for name, chunk in (("train", lines[:32]), ("dev", lines[32:48]), ("test", lines[48:64])):
        (tmp_path / f"{name}.jsonl").write_text("".join(chunk), encoding="utf-8")
        files += [f"--{name}", str(tmp_path / f"{name}.jsonl")]
    return [
        *files,
        "--model",
        minilm_path(),
        "--sizes",
        "8",
        "--seeds",
        "1",
        "--epochs",
        "2",
        "--batch-size",
        "4",
        "--max-length",
        "32",
    ]


def test_fewshot_sweep_resumes_after_a_kill_and_refuses_other_settings(
    tmp_path, tiny_fewshot_args, monkeypatch, capsys
):
    out = tmp_path / "sweep"
    argv = ["fewshot", "--out-dir", str(out), "--p", "0.3,0.5", "--q", "0.5", "--plain", "--", *tiny_fewshot_args]
    real = sweep.RUNNERS["fewshot"]
    calls = []

    def killed_at_the_third_cell(cell, runner_args, run_dir):
        calls.append(cell)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real.run(cell, runner_args, run_dir)

    monkeypatch.setitem(sweep.RUNNERS, "fewshot", dataclasses.replace(real, run=killed_at_the_third_cell))
    with pytest.raises(KeyboardInterrupt):
        sweep.main(argv)
    finished = sorted(p.name for p in (out / "cells").iterdir())
    assert finished == ["p0.3_q0.5_layers-all_cross-tuning.json", "plain.json"]
    kept = {name: (out / "cells" / name).read_text() for name in finished}

    monkeypatch.setitem(sweep.RUNNERS, "fewshot", real)
    capsys.readouterr()
    assert sweep.main(argv) == 0
    printed = capsys.readouterr().out
    assert (
        "[cell 1/3] plain: kept from" in printed
        and "[cell 2/3] p0.3_q0.5_layers-all_cross-tuning: kept from" in printed
    )
    assert "[cell 3/3] p0.5_q0.5_layers-all_cross-tuning: running" in printed
    assert all((out / "cells" / name).read_text() == text for name, text in kept.items())

    summary = json.loads((out / "summary.json").read_text())
    ad_drop = [r for r in summary["results"] if r["cell"]["method"] == "ad-drop"]
    assert summary["best"] == max(ad_drop, key=lambda r: r["dev"])
    assert all(0.0 <= r["dev"] <= 1.0 and 0.0 <= r["test"] <= 1.0 and r["runs"] == 1 for r in summary["results"])
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with pytest.raises(SystemExit):
        sweep.main(argv[:-1] + ["48"])  # another --max-length
    assert "was written by a sweep with other settings" in capsys.readouterr().err


@pytest.mark.slow  # ~60 s; the plugin's sweep itself runs end to end in tests/test_mt_sweep.py
def test_mt_sweep_runs_the_plugin_sweep_on_the_demo_corpus(tmp_path, capsys):
    """attn-reg-sweep mt is attn-reg-mt-sweep (the plugin's) over the demo's EN-RO corpus and model."""
    out = tmp_path / "sweep"
    argv = [
        "mt",
        "--out-dir",
        str(out),
        "--p",
        "0.4",
        "--q",
        "0.3",
        "--schedules",
        "always",
        "--",
        "--quick",
        "--epochs",
        "2",
    ]
    assert sweep.main(argv) == 0
    (record,) = [json.loads(p.read_text()) for p in (out / "cells").iterdir()]
    cell = {"method": "ad-drop", "p": 0.4, "q": 0.3, "attribution": "ga", "layers": "all", "schedule": "always"}
    assert record["cell"] == cell
    log = (out / "runs" / "p0.4_q0.3_ga_layers-all_always" / "seed1" / "train.log").read_text()
    assert (
        "--ad-drop-p 0.4 --ad-drop-q 0.3 --ad-drop-attribution ga --ad-drop-layers all --ad-drop-schedule always" in log
    )
    assert "--ad-drop-attention encoder-self" in log and "--encoder-embed-dim 32" in log  # the demo's quick model
    assert record["valid_loss"] > 0
    # Each BLEU is sacrebleu's over the run's written hypotheses against the raw references.
    seed_dir = out / "runs" / "p0.4_q0.3_ga_layers-all_always" / "seed1"
    run = record["runs"][0]
    for split in ("valid", "test"):
        hyps = (seed_dir / f"{split}.hyp").read_text(encoding="utf-8").split("\n")[:-1]
        refs = Path(run[split]["reference"]).read_text(encoding="utf-8").split("\n")[:-1]
        assert len(hyps) == len(refs) > 0
        assert run[split]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=0.005)
    assert record["valid_bleu"] == run["valid"]["bleu"] and record["test_bleu"] == run["test"]["bleu"]
    results = json.loads((out / "results.json").read_text())
    assert results["direction"] == "en→ro" and results["best"]["cell"] == cell
    assert results["cells"][0]["runs"][0]["test"]["reference"].endswith("raw-subset/test.ro")
    assert (out / "heatmap.png").exists()
    with pytest.raises(SystemExit):
        sweep.main(argv[:-1] + ["3"])  # other epochs: refused, the finished cell kept
    assert "epochs: 2 then, 3 now" in capsys.readouterr().err
