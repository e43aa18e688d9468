"""examples/glue: the script's own code path on local JSON lines with the real MiniLM encoder."""

import json
import math

import numpy as np
import pytest

from helpers import MOVIE_REVIEWS_TINY as REVIEWS
from helpers import REPO, TEST_DATA, load_script, minilm_path

PAIRS = TEST_DATA / "rte_style_tiny.jsonl"


glue = load_script(REPO / "examples" / "glue" / "run_glue.py", "run_glue")


def test_sst2_local_files_plain_then_ad_drop_epoch(tmp_path, capsys):
    p, q = 0.3, 0.3
    out = tmp_path / "out"
    assert (
        glue.main(
            [
                "--task",
                "sst2",
                "--model",
                minilm_path(),
                "--train-file",
                str(REVIEWS),
                "--validation-file",
                str(REVIEWS),
                "--max-train-samples",
                "32",
                "--max-eval-samples",
                "16",
                "--epochs",
                "2",
                "--batch-size",
                "8",
                "--max-length",
                "48",
                "--methods",
                "ad-drop",
                "--ad-drop-p",
                str(p),
                "--ad-drop-q",
                str(q),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    (result,) = json.loads((out / "results.json").read_text())
    assert result["ad_drop_layers"] == "0"  # the paper: first layer only for SST-2
    first, second = result["epochs"]
    assert first["ad_drop_on"] == 0 and first["ad_drop_rate"] == 0
    assert second["ad_drop_on"] == 1 and 0.5 * p * q < second["ad_drop_rate"] < p * q + 0.05, second
    assert all(math.isfinite(e["train_loss"]) and 0 <= e["eval_accuracy"] <= 1 for e in result["epochs"])
    assert result["best_dev"] == max(e["eval_accuracy"] for e in result["epochs"])
    assert "| AD-DROP | " in printed and "dev accuracy" in printed


def test_paper_layers_per_task():
    layers = {t: glue.parse_args(["--task", t, "--out", "x"]).ad_drop_layers for t in glue.TASKS}
    assert layers == {
        "cola": "all",
        "mrpc": "all",
        "rte": "all",
        "sst2": "0",
        "mnli": "0",
        "qnli": "0",
        "qqp": "0",
        "stsb": "0",
    }
    assert glue.parse_args(["--task", "rte", "--out", "x", "--ad-drop-layers", "0,1"]).ad_drop_layers == "0,1"


@pytest.mark.parametrize(
    "content,message",
    [
        (
            b'{"sentence": "fine", "label": 1}\n{"sentence": "bad", "label": 2}\n',
            r":2: label must be an integer in 0\.\.1, got 2",
        ),
        (
            b'{"sentence": "fine", "label": 1}\n{"sentence": "  ", "label": 0}\n',
            r":2: empty sentence in field 'sentence'",
        ),
        (b'{"sentence": "fine", "label": 1}\n{"sentence": "x", "label": 0\n', r":2: not valid JSON"),
        (b'{"sentence": "caf\xe9", "label": 1}\n', r":1: not valid UTF-8"),
        (b'{"sentence": "fine", "label": 1}\n\n{"sentence": "x", "label": 0}\n', r":2: empty line"),
        (b'{"text": "fine", "label": 1}\n', r":1: field 'sentence' must be a string"),
        (b'{"sentence": "fine", "label": true}\n', r":1: label must be an integer"),
    ],
)
def test_local_files_reject_malformed_lines(tmp_path, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    args = glue.parse_args(
        ["--task", "sst2", "--out", str(tmp_path), "--train-file", str(bad), "--validation-file", str(REVIEWS)]
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl" + message):
        glue.load_split(args, "train")


def test_hub_rows_are_checked_too(tmp_path):
    rows = [{"sentence1": "a b", "sentence2": "c d", "label": 4.2}, {"sentence1": "e", "sentence2": "f", "label": 5.5}]
    args = glue.parse_args(["--task", "stsb", "--out", str(tmp_path)])
    with pytest.raises(
        ValueError, match=r"glue/stsb validation row 1: label must be a number in \[0\.0, 5\.0\], got 5\.5"
    ):
        glue.load_split(args, "dev", load_dataset=lambda name, task: {"validation": rows})
    args = glue.parse_args(["--task", "mnli", "--out", str(tmp_path)])
    seen = []
    rows = [{"premise": "p", "hypothesis": "h", "label": 2}]
    glue.load_split(
        args, "dev", load_dataset=lambda name, task: seen.append((name, task)) or {"validation_matched": rows}
    )
    assert seen == [("glue", "mnli")]


def test_bad_options_fail_before_loading(tmp_path):
    def never(*a):
        raise AssertionError("data must not be loaded")

    with pytest.raises(ValueError, match=r"--ad-drop-layers: layer indices are 0-based"):
        glue.main(["--task", "rte", "--out", str(tmp_path), "--ad-drop-layers", "-1"], load_dataset=never)
    with pytest.raises(SystemExit):
        glue.main(["--task", "rte", "--out", str(tmp_path), "--train-file", str(REVIEWS)], load_dataset=never)


def test_metrics_on_hand_computed_cases():
    # TP=1 FP=1 TN=2 FN=0: MCC = (1*2 - 1*0) / sqrt(2*1*3*2)
    assert glue.scores(np.array([1, 1, 0, 0]), np.array([1, 0, 0, 0]))["mcc"] == pytest.approx(2 / math.sqrt(12))
    assert glue.scores(np.array([0, 0, 0]), np.array([0, 1, 0]))["mcc"] == 0.0
    assert glue.scores(np.array([0, 1, 2]), np.array([0, 1, 2]))["mcc"] == pytest.approx(1.0)
    assert glue.pearson(np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 7.0])) == pytest.approx(0.9933992677987827)
    assert math.isnan(glue.pearson(np.array([1.0, 1.0]), np.array([0.0, 1.0])))


@pytest.mark.parametrize("family", ["roberta", "electra"])
def test_roberta_and_electra_checkpoints_take_the_same_path(tmp_path, family):
    """--model with a RoBERTa / ELECTRA checkpoint folder: sites found, AD-DROP epoch drops.

    Tiny random weights in the real model classes; MiniLM's WordPiece tokenizer supplies ids
    (no RoBERTa / ELECTRA vocabulary can be downloaded here).
    """
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(minilm_path())
    config_cls = {"roberta": transformers.RobertaConfig, "electra": transformers.ElectraConfig}[family]
    sizes = dict(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=80,
        pad_token_id=tok.pad_token_id,
        num_labels=2,
    )
    if family == "electra":
        sizes["embedding_size"] = 32
    torch.manual_seed(0)
    folder = tmp_path / family
    transformers.AutoModelForSequenceClassification.from_config(config_cls(**sizes)).save_pretrained(folder)
    tok.save_pretrained(folder)
    out = tmp_path / "out"
    assert (
        glue.main(
            [
                "--task",
                "rte",
                "--model",
                str(folder),
                "--train-file",
                str(PAIRS),
                "--validation-file",
                str(PAIRS),
                "--epochs",
                "2",
                "--batch-size",
                "4",
                "--lr",
                "1e-3",
                "--methods",
                "ad-drop",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    (result,) = json.loads((out / "results.json").read_text())
    assert result["ad_drop_layers"] == "all"
    assert [e["ad_drop_on"] for e in result["epochs"]] == [0, 1]
    assert result["epochs"][0]["ad_drop_rate"] == 0 and result["epochs"][1]["ad_drop_rate"] > 0.05


def test_a_run_that_learned_nothing_says_so_in_its_row_and_below_the_table(tmp_path, capsys):
    """A learning rate of 1e-12 leaves the random head as it was: its dev accuracy is the majority's or chance."""
    args = ["--task", "sst2", "--model", minilm_path(), "--train-file", str(REVIEWS), "--validation-file", str(REVIEWS)]
    args += ["--max-train-samples", "16", "--max-eval-samples", "64", "--epochs", "1", "--batch-size", "16"]
    assert glue.main([*args, "--lr", "1e-12", "--max-length", "32", "--methods", "plain", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    (result,) = json.loads((tmp_path / "results.json").read_text())
    (epoch,) = result["epochs"]
    assert epoch["eval_examples"] == 64 and 0 <= epoch["eval_macro_f1"] <= 1
    assert result["learned_nothing"] and (
        "predicts one class" in result["learned_nothing"] or "within noise" in result["learned_nothing"]
    )
    (row,) = [line for line in printed.splitlines() if line.startswith("| plain | ")]
    assert row.endswith("| no |"), row
    assert f"plain learned nothing at its best dev epoch (1): {result['learned_nothing']}" in printed
    assert "No method learned anything, so this table compares nothing" in printed
