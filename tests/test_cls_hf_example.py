"""docs/HF.md's complete fine-tune on local files, run verbatim in a fresh Python: its three variables
point it at a tiny random BERT (MiniLM's tokenizer) and 32 movie reviews a split with string labels."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

from helpers import REPO, tiny_classifier_folder  # noqa: E402

MARKER = "<!-- the complete fine-tune: tests/test_cls_hf_example.py runs this block -->"


def documented_fine_tune() -> str:
    text = (REPO / "docs" / "HF.md").read_text(encoding="utf-8")
    assert MARKER in text, "docs/HF.md lost the complete fine-tune this test runs"
    return re.match(r"\s*```python\n(.*?)\n```", text.split(MARKER, 1)[1], re.S).group(1)


def test_the_documented_fine_tune_runs_verbatim_and_its_model_predicts_by_name(tmp_path):
    tiny_classifier_folder(tmp_path / "model", max_positions=128)
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "dev", "test"):
        lines = (REPO / "data" / "movie_reviews" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()[:32]
        rows = [json.loads(line) for line in lines]
        (data / f"{split}.jsonl").write_text(
            "".join(json.dumps({"sentence": r["sentence"], "label": ("neg", "pos")[r["label"]]}) + "\n" for r in rows),
            encoding="utf-8",
        )
    script = tmp_path / "fine_tune.py"
    script.write_text(documented_fine_tune(), encoding="utf-8")
    out = tmp_path / "out"
    env = {**os.environ, "CLS_MODEL": str(tmp_path / "model"), "CLS_DATA": str(data), "CLS_OUT": str(out)}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout.strip().splitlines()
    test_scores = next(line for line in printed if line.startswith("{") and "'test_accuracy'" in line)
    assert "'test_macro_f1'" in test_scores and "'test_examples': 32" in test_scores
    saved = json.loads((out / "model" / "config.json").read_text(encoding="utf-8"))
    assert saved["id2label"] == {"0": "neg", "1": "pos"}
    predictions = ast.literal_eval(printed[-1])  # the pipeline's [{'label': ..., 'score': ...}, ...]
    assert len(predictions) == 2 and {p["label"] for p in predictions} <= {"neg", "pos"}
