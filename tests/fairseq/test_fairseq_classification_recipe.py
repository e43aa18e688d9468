"""FAIRSEQ.md's offline classifier recipe, run exactly as written there, on the repository's movie reviews:
attn-reg-prepare-cls, fairseq-train with AD-DROP, fairseq-validate on the test split, and the prediction
snippet. Plus attn-reg-prepare-cls's refusals, each before anything is written."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("fairseq")

from attn_reg_plugin.prepare_classification import main as prepare_cls  # noqa: E402
from helpers import REPO, VENV_BIN  # noqa: E402


def _recipe():
    text = (REPO / "docs" / "FAIRSEQ.md").read_text(encoding="utf-8")
    section = text.split("### Offline, from raw text: prepare, train, score, predict", 1)[1].split("\n### ", 1)[0]
    (bash,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    (python,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return bash, python


@pytest.mark.timeout(900)
def test_the_offline_recipe_prepares_trains_scores_and_predicts(tmp_path):
    bash, python = _recipe()
    (tmp_path / "data").symlink_to(REPO / "data")  # the recipe runs from a checkout's root
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", bash], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "labels ['0', '1']" in log and "train 7072 examples" in log
    epochs = re.findall(r"valid on 'valid' subset \| .*?accuracy ([\d.]+)", log)
    assert len(epochs) == 2, log[-3000:]
    ad_drop = re.findall(r"epoch 002 \| .*?ad_drop_on ([\d.]+) \| ad_drop_rate ([\d.]+)", log)
    assert ad_drop and float(ad_drop[-1][0]) == 1 and 0.05 < float(ad_drop[-1][1]) < 0.09 + 0.02, ad_drop
    (test,) = re.findall(r"valid on 'test' subset \| .*?accuracy ([\d.]+) .*?\| bsz (\d+)", log)
    assert int(test[1]) == 2000  # every test sentence scored
    assert float(test[0]) > 60, test  # above the 50% a constant predictor gets on these balanced labels
    # The prediction snippet, as written: a label of the data for each sentence.
    predicted = subprocess.run([sys.executable, "-c", python], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    lines = predicted.stdout.strip().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == [
        "a gorgeous, witty, seductive movie.",
        "the plot is nothing but boilerplate clichés.",
    ]
    assert {line.split(" ", 1)[0] for line in lines} <= {"0", "1"}
    print(json.dumps({"dev": epochs, "test": test, "predicted": lines}))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty text", "train.jsonl:2: field 'sentence' must be a non-empty string, got '  '"),
        (
            "no label",
            "train.jsonl:2: no field 'label'; the row's fields are 'sentence' (name the right one with --label-field)",
        ),
        ("null label", "train.jsonl:2: field 'label' must hold a label, got None"),
        ("unseen label", "--valid {valid}: labels ['2'] never occur in --train's ['0', '1']"),
        ("bad suffix", "train.txt: a data file ends .jsonl, .json, .csv or .tsv, got '.txt'"),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_field_before_anything_is_written(tmp_path, capsys, case, message):
    good = [{"sentence": "fine", "label": 0}, {"sentence": "not fine", "label": 1}]
    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    rows = {
        "empty text": [good[0], {"sentence": "  ", "label": 1}],
        "no label": [good[0], {"sentence": "x"}],
        "null label": [good[0], {"sentence": "x", "label": None}],
    }
    _write(train, rows.get(case, good))
    _write(valid, [{"sentence": "odd", "label": 2}] if case == "unseen label" else good)
    if case == "bad suffix":
        train = train.rename(tmp_path / "train.txt")
    out = tmp_path / "out"
    assert prepare_cls(["--train", str(train), "--valid", str(valid), "--out", str(out), "--vocab-size", "100"]) == 2
    assert message.format(valid=valid) in capsys.readouterr().err
    assert not out.exists()


def test_csv_and_tsv_with_a_header_read_as_json_lines_do(tmp_path):
    from attn_reg_plugin.prepare_classification import read_examples

    (tmp_path / "a.csv").write_text('premise,hypothesis,gold\n"a, b",c d,yes\n', encoding="utf-8")
    (tmp_path / "a.tsv").write_text("premise\thypothesis\tgold\na, b\tc   d\tyes\n", encoding="utf-8")
    want = [{"premise": "a, b", "hypothesis": "c d", "gold": "yes"}]  # runs of whitespace become one space
    assert read_examples(tmp_path / "a.csv", ["premise", "hypothesis"], "gold") == want
    assert read_examples(tmp_path / "a.tsv", ["premise", "hypothesis"], "gold") == want
