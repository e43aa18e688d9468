"""A regularizer added as one file outside the package plus one registration call (issue 81).

``examples/own_regularizer/distance_dropout.py`` drops each key with a probability that grows with its
distance from the query, and registers itself; ``ATTN_REG_EXTENSIONS`` names the file. Each run is a fresh
process, as a user's is (the registry is per process, and the plugin reads it when it is imported):

- ``fairseq-train --user-dir`` parses ``--distance-dropout-rate`` and logs ``distance_dropout_rate``;
- ``AttnRegTrainer(distance_dropout=DistanceDropoutConfig(...))`` trains it and logs its rate; with DropHead
  beside it, it is refused naming both;
- ``attn-reg-mt-compare`` and ``attn-reg-cls-compare`` run it as the method ``distance-dropout`` with
  ``--method-args``.

No file of the package names it.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO, TINY_MT_TRAIN, tiny_classifier_folder

pytest.importorskip("fairseq")
pytest.importorskip("transformers")

TOY = REPO / "examples" / "own_regularizer" / "distance_dropout.py"
BIN = os.path.dirname(sys.executable)


def _env():
    return {
        **os.environ,
        "ATTN_REG_EXTENSIONS": str(TOY),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


def _run(cmd, cwd, timeout=600):
    done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def test_the_package_does_not_name_it():
    hits = [p for p in (REPO / "attn_reg_plugin").rglob("*.py") if "distance" in p.read_text().lower()]
    assert not [p for p in hits if "distance_dropout" in p.read_text() or "DistanceDropout" in p.read_text()]


def test_fairseq_train_parses_its_flags_and_logs_its_rate(tiny_mt_data, tmp_path):
    from attn_reg_plugin.user_dir import FAIRSEQ_USER_DIR

    out = _run(
        [
            os.path.join(BIN, "fairseq-train"),
            str(tiny_mt_data["bin"]),
            "--user-dir",
            str(FAIRSEQ_USER_DIR),
            "--task",
            "attn_reg_translation",
            "--criterion",
            "label_smoothed_cross_entropy",
            "--distance-dropout-rate",
            "0.8",
            "--max-update",
            "2",
            "--log-format",
            "json",
            "--log-interval",
            "1",
            "--no-save",
            "--disable-validation",
            "--seed",
            "1",
            *TINY_MT_TRAIN,
        ],
        tmp_path,
    )
    logs = [json.loads(line[line.index("{") :]) for line in out.splitlines() if '"distance_dropout_rate"' in line]
    rates = [float(log["distance_dropout_rate"]) for log in logs]
    assert rates and all(0 < r < 0.8 for r in rates), out[-2000:]  # below the rate: near keys drop less


HF_SCRIPT = textwrap.dedent(
    """
    import json, pathlib, sys
    import transformers
    from attn_reg_plugin.core.regularizers.drophead import DropHeadConfig
    from attn_reg_plugin.core.regularizers.registry import by_key
    from attn_reg_plugin.hf import AttnRegTrainer
    from helpers import pad_collate, small_bert, token_data, trainer_args

    DistanceDropoutConfig = by_key("distance_dropout").config
    args = trainer_args(pathlib.Path(sys.argv[1]), None, max_steps=4, logging_steps=2)
    common = dict(model=small_bert(), args=args, train_dataset=token_data(16, 1), data_collator=pad_collate)
    try:
        AttnRegTrainer(**common, distance_dropout=DistanceDropoutConfig(rate=0.5), drophead=DropHeadConfig(schedule="0:0.1"))
    except ValueError as refused:
        print("REFUSED", refused)
    trainer = AttnRegTrainer(**common, distance_dropout=DistanceDropoutConfig(rate=0.9))
    trainer.train()
    print("LOGS", json.dumps([log for log in trainer.state.log_history if "distance_dropout_rate" in log]))
    """
)


def test_the_hf_trainer_trains_it_and_refuses_it_beside_drophead(tmp_path):
    script = tmp_path / "hf_run.py"
    script.write_text(HF_SCRIPT)
    out = _run([sys.executable, str(script), str(tmp_path / "run")], tmp_path)
    refused = next(line for line in out.splitlines() if line.startswith("REFUSED"))
    assert (
        "DropHead (drophead=DropHeadConfig) and distance dropout (distance_dropout=DistanceDropoutConfig) do not"
        in refused
    )
    logs = json.loads(next(line for line in out.splitlines() if line.startswith("LOGS"))[len("LOGS ") :])
    assert len(logs) == 2 and all(0 < log["distance_dropout_rate"] < 0.9 for log in logs)


def test_mt_compare_runs_it_as_a_method_with_its_method_args(tiny_mt_data, tmp_path):
    out_dir = tmp_path / "cmp"
    _run(
        [
            os.path.join(BIN, "attn-reg-mt-compare"),
            str(tiny_mt_data["bin"]),
            "--out-dir",
            str(out_dir),
            "--methods",
            "plain,distance-dropout",
            "--epochs",
            "1",
            "--seeds",
            "1",
            "--method-args",
            "distance-dropout=--distance-dropout-rate 0.5",
            "--",
            *TINY_MT_TRAIN,
        ],
        tmp_path,
        timeout=900,
    )
    results = json.loads((out_dir / "results.json").read_text())
    rows = {m["name"]: m for m in results["methods"]}
    assert set(rows) == {"plain", "distance-dropout_rate=0.5"}
    train_log = (out_dir / "runs" / "distance-dropout_rate=0.5" / "seed1" / "train.log").read_text()
    assert "distance_dropout_rate" in train_log  # fairseq-train logged its rate


def test_cls_compare_runs_it_as_a_method_with_its_method_args(tmp_path):
    tiny_classifier_folder(tmp_path / "model")
    reviews = REPO / "data" / "movie_reviews"
    for split in ("train", "dev", "test"):
        lines = (reviews / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()[:16]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out_dir = tmp_path / "out"
    _run(
        [
            os.path.join(BIN, "attn-reg-cls-compare"),
            str(tmp_path / "model"),
            "--train",
            str(tmp_path / "train.jsonl"),
            "--dev",
            str(tmp_path / "dev.jsonl"),
            "--test",
            str(tmp_path / "test.jsonl"),
            "--out-dir",
            str(out_dir),
            "--epochs",
            "1",
            "--max-length",
            "32",
            "--batch-size",
            "8",
            "--keep-going",
            "--seeds",
            "1",
            "--methods",
            "plain,distance-dropout",
            "--method-args",
            "distance-dropout=--distance-dropout-rate 0.5",
        ],
        tmp_path,
    )
    results = json.loads((out_dir / "results.json").read_text())
    assert [m["name"] for m in results["methods"]] == ["plain", "distance-dropout_rate=0.5"]
    run = json.loads((out_dir / "runs" / "distance-dropout_rate=0.5" / "seed1" / "result.json").read_text())
    assert any(0 < epoch.get("distance_dropout_rate", 0) < 0.5 for epoch in run["epochs"]), run["epochs"]
