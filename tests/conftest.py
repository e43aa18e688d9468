"""Shared fixtures: a tiny binarized EN-RO corpus cut from the shipped data, fairseq helpers."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
PLUGIN_DIR = REPO / "attn_reg_plugin"
CORPUS = REPO / "data" / "gettext_en_ro"
VENV_BIN = Path(sys.executable).parent

# The smallest Transformer fairseq builds: tests exercise the pipeline, not translation quality.
TINY_TRANSFORMER = [
    "--arch", "transformer", "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--share-all-embeddings",
]


@pytest.fixture(scope="session")
def tiny_mt_data(tmp_path_factory):
    """120/40/40 pairs of the shipped corpus, sentencepiece'd and binarized by fairseq-preprocess."""
    import mt_pipeline as mt

    root = tmp_path_factory.mktemp("tiny_mt")
    raw = root / "raw"
    raw.mkdir()
    sizes = {"train": 120, "valid": 40, "test": 40}
    for split, n in sizes.items():
        for lang in ("en", "ro"):
            lines = (CORPUS / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)[:n]
            (raw / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    data_bin = mt.prepare_data(raw, root, "en", "ro", vocab_size=300, log=lambda s: None)
    return {"raw": raw, "bin": data_bin, "root": root}


def run_cli(name, args, cwd=None, expect_ok=True, timeout=300):
    """Run one of the venv's fairseq console scripts; return the completed process (text)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(VENV_BIN / name), *map(str, args)], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return proc


def fairseq_setup(data_bin, extra):
    """Build (cfg, task, model, criterion) in-process exactly as fairseq-train does."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data_bin), "--user-dir", str(PLUGIN_DIR), "--cpu", *extra])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    return cfg, task, model, criterion


# AD-DROP training on the tiny corpus with a per-update JSON log: 12 updates per epoch, epoch 1
# plain, epoch 2 AD-DROP, epoch 3 plain.
AD_DROP_TRAIN = [
    "--task", "attn_reg_translation", *TINY_TRANSFORMER,
    "--criterion", "ad_drop_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--ad-drop-p", "0.3", "--ad-drop-q", "0.5", "--dropout", "0.1",
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu", "--seed", "3",
    "--no-progress-bar", "--log-format", "json", "--log-interval", "1", "--no-epoch-checkpoints",
]
UPDATES_PER_EPOCH = 12
# A checkpoint every 14 updates: the first is the 2nd update of epoch 2, inside an AD-DROP epoch.
# --rebuild-batches makes a resumed run's batches those of an uninterrupted run (README).
RESUMABLE = ["--rebuild-batches", "--save-interval-updates", "14"]


def train_updates(log: str):
    """{update number: fields} from fairseq's per-update JSON lines (--log-format json --log-interval 1)."""
    import json
    import re

    out = {}
    for m in re.finditer(r"\| train_inner \| (\{.*\})", log):
        record = json.loads(m.group(1))
        out[int(record["num_updates"])] = record
    return out


# Regularizer name -> fairseq-train arguments of a tiny run (AttendOut adds its entry here).
TRAIN_ARGS = {"ad_drop": AD_DROP_TRAIN}


@pytest.fixture(scope="session")
def reference_runs(tiny_mt_data, tmp_path_factory):
    """name -> one uninterrupted 3-epoch fairseq-train run of TRAIN_ARGS[name] + RESUMABLE, made once."""
    runs = {}

    def get(name):
        if name not in runs:
            save = tmp_path_factory.mktemp(f"{name}_run")
            proc = run_cli("fairseq-train", [tiny_mt_data["bin"], "--user-dir", PLUGIN_DIR, "--save-dir", save,
                                             *TRAIN_ARGS[name], *RESUMABLE, "--max-epoch", "3"])
            runs[name] = {"save": save, "log": proc.stdout, "updates": train_updates(proc.stdout)}
        return runs[name]

    return get


@pytest.fixture(scope="session")
def ad_drop_run(reference_runs):
    """The AD-DROP reference run: epoch 1 plain, epoch 2 AD-DROP, epoch 3 plain."""
    return reference_runs("ad_drop")
