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
