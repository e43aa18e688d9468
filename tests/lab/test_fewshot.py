"""attn-reg-fewshot (attn_reg_lab.fewshot): the JSONL loader's errors, balanced subsets, option checks, and a toy end-to-end run."""

import json
import math
import random
import statistics
from collections import Counter

import pytest

from attn_reg_lab import fewshot
from attn_reg_lab.fewshot_data import DataError, Example, load_jsonl, sample_balanced
from helpers import MOVIE_REVIEWS_TINY as REVIEWS
from helpers import minilm_path

GOOD = b'{"sentence": "fine film", "label": 1}\n'


# -- the loader ----------------------------------------------------------------------------
def test_loader_reads_the_tiny_file():
    rows = load_jsonl(REVIEWS)
    assert len(rows) == len(REVIEWS.read_text(encoding="utf-8").splitlines())
    first = json.loads(REVIEWS.read_text(encoding="utf-8").splitlines()[0])
    assert rows[0] == Example(first["sentence"], first["label"])
    assert {r.label for r in rows} == {0, 1}


@pytest.mark.parametrize(
    "bad_line,message",
    [
        (b'{"sentence": "good", "label": 1', "not valid JSON"),
        (b'{"label": 1}', "missing key 'sentence'"),
        (b'{"sentence": "good"}', "missing key 'label'"),
        (b'{"sentence": "good", "label": 2}', r"label 2 is not in the label set \{0, 1\}"),
        (b'{"sentence": "good", "label": -1}', "label -1 is not in the label set"),
        (b'{"sentence": "good", "label": "1"}', "label '1' is not in the label set"),
        (b'{"sentence": "good", "label": true}', "label True is not in the label set"),
        (b'{"sentence": "good", "label": 1.0}', "label 1.0 is not in the label set"),
        (b'{"sentence": "", "label": 0}', "empty sentence"),
        (b'{"sentence": "  \\t ", "label": 0}', "empty sentence"),
        (b'{"sentence": 7, "label": 0}', "'sentence' must be a string"),
        (b'["good", 1]', "expected a JSON object"),
        (b"", "empty line"),
        (b'{"sentence": "caf\xe9", "label": 1}', "not valid UTF-8"),
    ],
)
def test_loader_rejects_bad_lines_naming_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "split.jsonl"
    path.write_bytes(GOOD + GOOD + bad_line + b"\n" + GOOD)
    with pytest.raises(DataError, match=message) as info:
        load_jsonl(path)
    assert str(info.value).startswith(f"{path}:3: ")


def test_loader_label_set_follows_num_labels_and_empty_file_fails(tmp_path):
    path = tmp_path / "three.jsonl"
    path.write_bytes(b'{"sentence": "meh", "label": 2}\n')
    assert load_jsonl(path, num_labels=3) == [Example("meh", 2)]
    with pytest.raises(DataError, match=rf"^{path}:1: label 2 is not in the label set"):
        load_jsonl(path, num_labels=2)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="no examples"):
        load_jsonl(empty)


# -- subsets -------------------------------------------------------------------------------
def test_sample_balanced_is_balanced_seeded_and_without_repeats():
    pool = [Example(f"s{i}", int(i % 3 == 0)) for i in range(90)]  # 30 of label 1, 60 of label 0
    a = sample_balanced(pool, 16, seed=1, num_labels=2)
    assert Counter(e.label for e in a) == {0: 8, 1: 8}
    assert len(set(a)) == 16 and set(a) <= set(pool)
    assert a == sample_balanced(pool, 16, seed=1, num_labels=2)
    assert set(a) != set(sample_balanced(pool, 16, seed=2, num_labels=2))
    odd = Counter(e.label for e in sample_balanced(pool, 7, seed=3, num_labels=2))
    assert sorted(odd.values()) == [3, 4]
    with pytest.raises(DataError, match="needs 31 examples of label 1, but the training file has 30"):
        sample_balanced(pool, 62, seed=1, num_labels=2)


def test_best_epoch_is_the_earliest_maximum():
    assert fewshot.best_epoch([0.5, 0.7, 0.6, 0.7]) == 2
    assert fewshot.best_epoch([0.9]) == 1


# -- options -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--sizes", "16,0"], "--sizes: every value must be >= 1, got 0"),
        (["--sizes", "16,x"], "--sizes must be a comma-separated list of integers"),
        (["--methods", "plain,dropout"], "--methods: got 'plain,dropout'"),
        (["--epochs", "1"], "--epochs must be >= 2 for method ad-drop"),
        (["--lr", "0"], "--lr must be a positive number"),
        (["--ad-drop-p", "1.5"], "--ad-drop-p must be in the open interval (0, 1), got 1.5"),
        (["--ad-drop-attribution", "shap"], "--ad-drop-attribution must be one of"),
    ],
)
def test_bad_options_fail_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        fewshot.parse_args([*argv, "--model", "unused-folder"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


# -- end to end ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    return minilm_path()


def _tiny_splits(tmp_path):
    lines = REVIEWS.read_text(encoding="utf-8").splitlines(keepends=True)
    random.Random(0).shuffle(lines)
    paths = {}
    for name, chunk in (("train", lines[:32]), ("dev", lines[32:48]), ("test", lines[48:64])):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(chunk), encoding="utf-8")
    return paths


def test_bad_data_file_stops_the_cli_naming_file_and_line(tmp_path, minilm, capsys):
    paths = _tiny_splits(tmp_path)
    text = paths["dev"].read_text(encoding="utf-8").splitlines(keepends=True)
    text[4] = '{"sentence": "x", "label": 5}\n'
    paths["dev"].write_text("".join(text), encoding="utf-8")
    with pytest.raises(SystemExit):
        fewshot.main(
            [
                "--train",
                str(paths["train"]),
                "--dev",
                str(paths["dev"]),
                "--test",
                str(paths["test"]),
                "--model",
                minilm,
                "--sizes",
                "8",
                "--seeds",
                "1",
                "--epochs",
                "2",
                "--out-dir",
                str(tmp_path / "o"),
            ]
        )
    assert f"{paths['dev']}:5: label 5 is not in the label set" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_end_to_end_toy_run(tmp_path, minilm):
    paths = _tiny_splits(tmp_path)
    out = tmp_path / "out"
    p, q = 0.3, 0.3
    code = fewshot.main(
        [
            "--train",
            str(paths["train"]),
            "--dev",
            str(paths["dev"]),
            "--test",
            str(paths["test"]),
            "--model",
            minilm,
            "--sizes",
            "8",
            "--seeds",
            "1",
            "--methods",
            "plain,ad-drop",
            "--epochs",
            "2",
            "--batch-size",
            "4",
            "--lr",
            "1e-4",
            "--max-length",
            "32",
            "--ad-drop-p",
            str(p),
            "--ad-drop-q",
            str(q),
            "--test-every-epoch",
            "--out-dir",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = {r["method"]: r for r in result["runs"]}
    assert set(runs) == {"plain", "ad-drop"}
    for run in runs.values():
        assert (run["size"], run["seed"], run["train_labels"]) == (8, 1, [4, 4])
        assert [e["epoch"] for e in run["epochs"]] == [1, 2]
        devs = [e["dev_acc"] for e in run["epochs"]]
        assert run["best_epoch"] == fewshot.best_epoch(devs) and run["best_dev_acc"] == max(devs)
        # The reported test accuracy is that of the weights of the selected epoch.
        assert run["test_acc"] == run["epochs"][run["best_epoch"] - 1]["test_acc"]
        assert all(round(16 * e["dev_acc"]) == 16 * e["dev_acc"] for e in run["epochs"])
    plain, ad = runs["plain"]["epochs"], runs["ad-drop"]["epochs"]
    assert all("ad_drop_rate" not in e for e in plain)
    assert (ad[0]["ad_drop_on"], ad[0]["ad_drop_rate"]) == (0, 0)
    assert ad[1]["ad_drop_on"] == 1 and 0.5 * p * q < ad[1]["ad_drop_rate"] < 2 * p * q + 0.05
    # Fair comparison: same subset, initial weights and batches, so the plain first epoch is identical.
    assert ad[0]["train_loss"] == plain[0]["train_loss"] and ad[0]["dev_acc"] == plain[0]["dev_acc"]
    assert ad[1]["train_loss"] != plain[1]["train_loss"]

    summary = {r["method"]: r for r in result["summary"]}
    assert summary["plain"]["test_acc_mean"] == runs["plain"]["test_acc"] and summary["plain"]["test_acc_std"] == 0
    assert summary["ad-drop"]["ad_drop_rate_mean"] == ad[1]["ad_drop_rate"]
    (paired,) = result["paired"]
    assert paired["diff_mean"] == pytest.approx(runs["ad-drop"]["test_acc"] - runs["plain"]["test_acc"])
    assert result["config"]["method_settings"]["ad-drop"]["p"] == p
    assert [json.loads(line)["method"] for line in (out / "runs.jsonl").read_text().splitlines()] == [
        "plain",
        "ad-drop",
    ]

    table = (out / "results.md").read_text(encoding="utf-8").splitlines()
    assert "| method | 8-shot |" in table
    plain_rows = [line for line in table if line.startswith("| plain |")]
    assert plain_rows[0] == f"| plain | {100 * runs['plain']['test_acc']:.2f} ± 0.00 |"
    assert plain_rows[1] == f"| plain | {100 * runs['plain']['best_dev_acc']:.2f} |"
    assert any(line.startswith("| ad-drop |") for line in table)
    assert any(line.startswith("| ad-drop − plain |") for line in table)


def test_attendout_method_draws_held_out_samples_from_dev(tmp_path, minilm):
    paths = _tiny_splits(tmp_path)
    out = tmp_path / "out"
    code = fewshot.main(
        [
            "--train",
            str(paths["train"]),
            "--dev",
            str(paths["dev"]),
            "--test",
            str(paths["test"]),
            "--model",
            minilm,
            "--sizes",
            "8",
            "--seeds",
            "1",
            "--methods",
            "plain,attendout",
            "--epochs",
            "2",
            "--batch-size",
            "4",
            "--lr",
            "1e-4",
            "--max-length",
            "32",
            "--attendout-dropout-step",
            "2",
            "--out-dir",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = {r["method"]: r for r in result["runs"]}
    assert 0 < runs["attendout"]["attendout_drop_prob"] < 1 and "attendout_drop_prob" not in runs["plain"]
    summary = {r["method"]: r for r in result["summary"]}
    assert summary["attendout"]["attendout_drop_prob_mean"] == runs["attendout"]["attendout_drop_prob"]
    assert result["config"]["method_settings"]["attendout"]["dropout_step"] == 2


def test_resume_keeps_finished_runs_and_refuses_other_settings(tmp_path, minilm, capsys):
    paths = _tiny_splits(tmp_path)
    out = tmp_path / "out"
    argv = [
        "--train",
        str(paths["train"]),
        "--dev",
        str(paths["dev"]),
        "--test",
        str(paths["test"]),
        "--model",
        minilm,
        "--sizes",
        "8",
        "--methods",
        "plain",
        "--epochs",
        "1",
        "--batch-size",
        "4",
        "--max-length",
        "32",
        "--out-dir",
        str(out),
    ]
    assert fewshot.main(argv + ["--seeds", "1"]) == 0
    (first,) = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert fewshot.main(argv + ["--seeds", "1,2", "--resume"]) == 0
    assert "size    8 seed 1 plain    kept from" in capsys.readouterr().out
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert [r["seed"] for r in result["runs"]] == [1, 2]
    assert result["runs"][0] == first  # not trained again: the very same record, timing included
    assert len((out / "runs.jsonl").read_text().splitlines()) == 2
    with pytest.raises(SystemExit):
        fewshot.main(argv + ["--seeds", "1,2,3", "--resume", "--lr", "3e-4"])
    assert "was written with other settings (training); use another --out-dir" in capsys.readouterr().err
    assert len((out / "runs.jsonl").read_text().splitlines()) == 2


# -- merging runs from several result files ----------------------------------------------------
def _result(lr, runs):
    config = {
        "model": "m",
        "num_labels": 2,
        "max_length": 64,
        "dev_subset": None,
        "training": {"epochs": 10, "lr": lr, "batch_size": 8},
        "files": {"train": {"path": "a", "sha256": "x"}, "dev": {"path": "b", "sha256": "y"}},
    }
    return {
        "config": config,
        "runs": [
            dict(size=s, seed=k, method=m, test_acc=a, best_dev_acc=a, best_epoch=1, train_seconds=1.0, epochs=[])
            for s, k, m, a in runs
        ],
    }


def test_merge_pairs_variants_with_the_baseline_by_seed():
    from attn_reg_lab.fewshot_merge import merge

    base = _result(
        2e-4, [(64, 1, "plain", 0.70), (64, 2, "plain", 0.60), (64, 3, "plain", 0.65), (64, 1, "ad-drop", 0.0)]
    )
    variant = _result(2e-4, [(64, 2, "ad-drop", 0.64), (64, 1, "ad-drop", 0.71), (64, 1, "plain", 0.5)])
    runs, sizes, methods = merge(base, [("layer 0", variant)])
    assert sizes == [64] and methods == ["plain", "ad-drop (layer 0)"]
    # The baseline file's own ad-drop and the variant file's plain runs are not used.
    assert sorted((r["method"], r["seed"], r["test_acc"]) for r in runs) == [
        ("ad-drop (layer 0)", 1, 0.71),
        ("ad-drop (layer 0)", 2, 0.64),
        ("plain", 1, 0.70),
        ("plain", 2, 0.60),
        ("plain", 3, 0.65),
    ]
    more = _result(2e-4, [(64, 3, "ad-drop", 0.66)])
    runs3, _, methods3 = merge(base, [("layer 0", variant), ("layer 0", more)])
    assert methods3 == methods and len(runs3) == len(runs) + 1
    with pytest.raises(ValueError, match="run size 64 seed 2 'ad-drop \\(layer 0\\)' appears twice"):
        merge(base, [("layer 0", variant), ("layer 0", variant)])
    summary, paired = fewshot.summarize(runs, sizes, methods)
    (pair,) = paired
    assert pair["seeds"] == 2 and (pair["wins"], pair["ties"], pair["losses"]) == (2, 0, 0)
    assert pair["diff_mean"] == pytest.approx(0.025)
    with pytest.raises(ValueError, match=r"variant 'lr' is not comparable with the baseline: training"):
        merge(base, [("lr", _result(1e-4, [(64, 1, "ad-drop", 0.7)]))])


def test_merge_cli_writes_the_table(tmp_path, capsys):
    from attn_reg_lab.fewshot_merge import main as merge_main

    base, variant = tmp_path / "base.json", tmp_path / "var.json"
    base.write_text(json.dumps(_result(2e-4, [(16, 1, "plain", 0.5), (16, 2, "plain", 0.7)])))
    variant.write_text(json.dumps(_result(2e-4, [(16, 1, "ad-drop", 0.6), (16, 2, "ad-drop", 0.6)])))
    assert (
        merge_main(["--baseline", str(base), "--variant", f"p=q=0.1={variant}", "--out", str(tmp_path / "t.md")]) == 0
    )
    table = (tmp_path / "t.md").read_text()
    assert "| plain | 60.00 ± 14.14 |" in table
    assert "| plain | 60.00 |" in table  # mean dev accuracy at the selected epochs (= test here)
    assert "| ad-drop (p=q=0.1) | 60.00 ± 0.00 |" in table
    assert "| ad-drop (p=q=0.1) − plain | +0.00 ± 14.14 [-127.06, +127.06] (1/0/1, p = 1.000) |" in table
    assert capsys.readouterr().out == table


@pytest.mark.parametrize(
    "t, df, p",
    [(2.262157, 9, 0.05), (12.7062, 1, 0.05), (1.0, 1, 0.5), (2.776445, 4, 0.05), (3.249836, 9, 0.01), (0.0, 5, 1.0)],
)
def test_paired_t_test_two_sided_p_matches_student_t_quantiles(t, df, p):
    from attn_reg_lab.fewshot_summary import paired_t_test

    # n diffs alternating around their mean, rescaled to sample std 1: their t statistic is mean * sqrt(n) = t
    n = df + 1
    mean = t / math.sqrt(n)
    pattern = ([1.0, -1.0] * n)[:n]
    centre, spread = statistics.fmean(pattern), statistics.stdev(pattern)
    diffs = [mean + (x - centre) / spread for x in pattern]
    got_t, got_p = paired_t_test(diffs)
    if t == 0.0:
        assert got_t == pytest.approx(0.0, abs=1e-12) and got_p == pytest.approx(1.0)
    else:
        assert got_t == pytest.approx(t, rel=1e-9) and got_p == pytest.approx(p, abs=2e-6)
    assert paired_t_test([0.1]) == (None, None)
    assert paired_t_test([0.1, 0.1]) == (math.inf, 0.0) and paired_t_test([0.0, 0.0]) == (0.0, 1.0)


def test_paired_difference_pairs_only_the_seeds_both_hold():
    from attn_reg_lab.fewshot_summary import paired_difference, paired_t_test

    diff = paired_difference({1: 2.0, 2: 3.5, 4: 9.0}, {1: 1.0, 2: 3.0, 3: 7.0})
    assert (diff["pairs"], diff["mean_diff"]) == (2, 0.75)
    assert diff["std_diff"] == pytest.approx(0.3535534) and (diff["t"], diff["p"]) == paired_t_test([1.0, 0.5])
    half = 12.706 * 0.3535534 / math.sqrt(2)  # the plugin's 95% t-interval: t(0.975, 1) sd / sqrt(n)
    assert diff["ci"] == pytest.approx([0.75 - half, 0.75 + half])
    assert paired_difference({1: 2.0}, {2: 1.0}) is None
    assert paired_difference({1: 2.0}, {1: 1.5}) == {
        "pairs": 1,
        "mean_diff": 0.5,
        "std_diff": None,
        "ci": None,
        "t": None,
        "p": None,
    }


# -- the papers' baselines (issue 42) -----------------------------------------------------------
BASELINES = {  # method: the log keys the plugin's trainer counted, recorded in every epoch
    "r-drop": ("rdrop_kl",),
    "hiddencut": ("hiddencut_js", "hiddencut_cut", "hiddencut_tokens"),
    "drophead": ("attn_drophead_rate", "attn_drophead_p"),
    "dropkey": ("attn_sched_dropout_rate", "attn_sched_dropout_p_layer0", "attn_sched_dropout_p_layer5"),
}


def test_unknown_method_is_refused_naming_every_accepted_one(capsys):
    with pytest.raises(SystemExit):
        fewshot.parse_args(["--methods", "plain,r_drop", "--model", "unused-folder"])
    err = capsys.readouterr().err
    assert "--methods: got 'plain,r_drop'" in err
    assert "plain, ad-drop, attendout, r-drop, hiddencut, drophead, dropkey" in err, err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--rdrop-alpha", "-1"], "--rdrop-alpha must be a finite number >= 0"),
        (["--hiddencut-ratio", "0"], "--hiddencut-ratio"),
        (["--attn-drophead-schedule", ""], "--attn-drophead-schedule is empty"),
        (["--attn-sched-dropout-schedule", "0:0.1"], "must be dropkey:RATE for method dropkey"),
    ],
)
def test_bad_baseline_options_fail_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit):
        fewshot.parse_args([*argv, "--methods", "plain,r-drop,hiddencut,drophead,dropkey", "--model", "x"])
    assert message in capsys.readouterr().err


def test_baselines_run_end_to_end_with_the_papers_defaults(tmp_path, minilm):
    paths = _tiny_splits(tmp_path)
    out = tmp_path / "out"
    argv = [*(f"--{n}={paths[n]}" for n in ("train", "dev", "test")), "--model", minilm, "--sizes", "8"]
    argv += ["--seeds", "1", "--methods", "plain," + ",".join(BASELINES), "--epochs", "1", "--batch-size", "4"]
    assert fewshot.main([*argv, "--max-length", "32", "--out-dir", str(out)]) == 0
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = {r["method"]: r for r in result["runs"]}
    assert set(runs) == {"plain", *BASELINES}
    for method, keys in BASELINES.items():
        (epoch,) = runs[method]["epochs"]
        assert all(key in epoch for key in keys), (method, epoch)
        assert not any(key in runs["plain"]["epochs"][0] for key in keys)
        # same subset and initial weights as plain, a different training loss: the regularizer acted
        assert runs[method]["train_labels"] == runs["plain"]["train_labels"] == [4, 4]
        assert epoch["train_loss"] != runs["plain"]["epochs"][0]["train_loss"]
    assert runs["r-drop"]["epochs"][0]["rdrop_kl"] > 0 and runs["hiddencut"]["epochs"][0]["hiddencut_js"] > 0
    assert runs["hiddencut"]["epochs"][0]["hiddencut_cut"] > 0
    assert runs["drophead"]["epochs"][0]["attn_drophead_p"] == 0.1
    dk = runs["dropkey"]["epochs"][0]
    assert dk["attn_sched_dropout_p_layer0"] == 0.1 and dk["attn_sched_dropout_p_layer5"] < 0.1  # less with depth
    assert 0 < dk["attn_sched_dropout_rate"] < 0.2 and 0 <= runs["drophead"]["epochs"][0]["attn_drophead_rate"] < 0.5
    settings = result["config"]["method_settings"]
    assert settings["r-drop"]["alpha"] == 1.0 and settings["dropkey"]["schedule"] == "dropkey:0.1"
    assert (settings["hiddencut"]["ratio"], settings["hiddencut"]["top"], settings["hiddencut"]["alpha"]) == (
        0.1,
        0.4,
        1.0,
    )
    summary = {r["method"]: r for r in result["summary"]}
    assert summary["r-drop"]["rdrop_kl_mean"] == runs["r-drop"]["epochs"][0]["rdrop_kl"]
    assert summary["dropkey"]["attn_sched_dropout_rate_mean"] == dk["attn_sched_dropout_rate"]
    paired = {r["method"]: r for r in result["paired"]}
    assert set(paired) == set(BASELINES)
    for method in BASELINES:
        assert paired[method]["baseline"] == "plain"
        assert paired[method]["diff_mean"] == pytest.approx(runs[method]["test_acc"] - runs["plain"]["test_acc"])
    table = (out / "results.md").read_text(encoding="utf-8")
    assert all(f"| {method} − plain |" in table for method in BASELINES)
