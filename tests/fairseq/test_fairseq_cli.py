"""End to end through the real fairseq CLIs on tiny data: preprocess -> train -> generate."""

import os
import re

import pytest
import torch

pytest.importorskip("fairseq")

from helpers import REPO, TINY_TRANSFORMER, USER_DIR, fairseq_train, run_cli, train_epoch_stats  # noqa: E402

AD_DROP = [
    "--task",
    "attn_reg_translation",
    *TINY_TRANSFORMER,
    "--criterion",
    "ad_drop_label_smoothed_cross_entropy",
    "--label-smoothing",
    "0.1",
    "--ad-drop-p",
    "0.3",
    "--ad-drop-q",
    "0.5",
    "--ad-drop-attention",
    "encoder-self,decoder-self,encoder-decoder",
    "--optimizer",
    "adam",
    "--lr",
    "1e-3",
    "--max-tokens",
    "500",
    "--cpu",
    "--seed",
    "3",
    "--no-progress-bar",
    "--log-format",
    "simple",
    "--log-interval",
    "1",
    "--no-epoch-checkpoints",
]


def test_train_cross_tuning_generate_and_resume(tiny_mt_data, tmp_path):
    save = tmp_path / "ckpt"
    first = fairseq_train(tiny_mt_data["bin"], ["--save-dir", save, *AD_DROP, "--max-epoch", "2"])
    stats = train_epoch_stats(first.stdout)
    assert set(stats) == {1, 2}
    assert stats[1]["ad_drop_on"] == "0" and stats[1]["ad_drop_rate"] == "0"  # odd epoch: plain, nothing dropped
    assert stats[2]["ad_drop_on"] == "1"  # even epoch: AD-DROP
    rate = float(stats[2]["ad_drop_rate"])
    assert 0.5 * 0.3 * 0.5 < rate < 0.3 * 0.5 * 2.5, rate  # about p*q (ceil(p*n) inflates short rows)
    assert "nan" not in first.stdout.lower().replace("nan_", "")

    # Resume from checkpoint_last: epoch 3 continues the count and is a plain epoch again.
    second = fairseq_train(tiny_mt_data["bin"], ["--save-dir", save, *AD_DROP, "--max-epoch", "3"])
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch 3 @ [1-9]\d* updates\)", second.stdout)
    stats = train_epoch_stats(second.stdout)
    assert set(stats) == {3} and stats[3]["ad_drop_on"] == "0" and stats[3]["ad_drop_rate"] == "0"

    # The checkpoint is a plain fairseq checkpoint that loads with torch's safe unpickler once
    # the plugin is imported (it allow-lists the one class fairseq pickles).
    import attn_reg_plugin.fairseq_plugin  # noqa: F401

    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    assert "encoder.layers.0.self_attn.q_proj.weight" in state["model"]

    gen = run_cli(
        "fairseq-generate",
        [
            tiny_mt_data["bin"],
            "--user-dir",
            USER_DIR,
            "--path",
            save / "checkpoint_last.pt",
            "--scoring",
            "sacrebleu",
            "--required-batch-size-multiple",
            "1",
            "--cpu",
            "--beam",
            "2",
            "--max-len-b",
            "20",
            "--remove-bpe",
            "sentencepiece",
        ],
    )
    assert re.search(r"Generate test with beam=2: BLEU = \d+\.\d+", gen.stdout)
    assert len(re.findall(r"^D-\d+\t", gen.stdout, flags=re.M)) == 40  # no sentence lost


def documented_command(path, starts_with):
    """The shell command a doc shows (its first line starting with ``starts_with``, joined with its
    backslash continuations), comment markers and indentation removed."""
    lines = [line.lstrip("# ").rstrip() for line in path.read_text(encoding="utf-8").splitlines()]
    first = next(i for i, line in enumerate(lines) if line.startswith(starts_with))
    command = []
    for line in lines[first:]:
        command.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            break
    return " ".join(command)


# The overrides the recipes document for a machine without CUDA, and the tiny model and data
# (the yaml's own sizes are WMT16's); every key is overridden as written, no hydra '+'.
HYDRA_TINY = [
    "common.cpu=true",
    "model.encoder_layers=2",
    "model.decoder_layers=2",
    "model.encoder_embed_dim=16",
    "model.decoder_embed_dim=16",
    "model.encoder_ffn_embed_dim=32",
    "model.decoder_ffn_embed_dim=32",
    "model.encoder_attention_heads=2",
    "model.decoder_attention_heads=2",
    "common.log_interval=1",
    "common.seed=3",
    "dataset.max_tokens=500",
    "optimization.max_update=4",
    "checkpoint.no_save=true",
]


def _run_recipe(tiny_mt_data, tmp_path, recipe, overrides):
    """The command line in the recipe's header, run by bash from the repository root with DATA_BIN
    and the checkpoint folder pointed at the tiny run, plus the documented CPU override and ``overrides``."""
    import shlex
    import subprocess

    from helpers import VENV_BIN

    command = documented_command(REPO / "examples" / "hydra" / f"{recipe}.yaml", "fairseq-hydra-train")
    assert "$(attn-reg-user-dir)" in command and "$PWD/DATA_BIN" in command
    command = command.replace("$PWD/DATA_BIN", str(tiny_mt_data["bin"])).replace(
        "$PWD/checkpoints", str(tmp_path / "ckpt")
    )
    extra = [f"hydra.run.dir={tmp_path}", *HYDRA_TINY, *overrides]
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", "-c", command + " " + " ".join(map(shlex.quote, extra))],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "[en] dictionary" in proc.stdout and "[ro] dictionary" in proc.stdout  # the pair, read from the data-bin
    updates = re.findall(r"\[train_inner\]\[INFO\] - (\{.*\})", proc.stdout)  # hydra's log format
    assert len(updates) == 4, proc.stdout[-3000:]
    return proc, updates


@pytest.mark.parametrize(
    "recipe,key", [("ad_drop_transformer", "ad_drop_rate"), ("attendout_transformer", "attendout_attacker_loss")]
)
def test_hydra_recipes_train_as_documented(tiny_mt_data, tmp_path, recipe, key):
    """The command line in the recipe's header, run by bash from the repository root with DATA_BIN
    and the checkpoint folder pointed at the tiny run, plus the documented CPU override."""
    override = (
        "task.attendout_dropout_step=2" if recipe.startswith("attendout") else "criterion.ad_drop_schedule=always"
    )
    proc, updates = _run_recipe(tiny_mt_data, tmp_path, recipe, [override])
    assert all(f'"{key}"' in u for u in updates)
    if recipe.startswith("attendout"):
        assert "AttendOut dropout step 2 (update 4)" in proc.stdout


def test_the_attendout_recipe_is_switched_off_by_one_override(tiny_mt_data, tmp_path):
    """task.attendout=false turns the recipe's AttendOut off: it trains plain, and the recipe's other
    attendout_* options get one warning line naming them (fairseq-train's flags given with --attendout
    off are still refused: tests/fairseq/test_fairseq_attendout.py)."""
    proc, updates = _run_recipe(tiny_mt_data, tmp_path, "attendout_transformer", ["task.attendout=false"])
    assert not any("attendout" in u for u in updates)
    warnings = [line for line in proc.stdout.splitlines() if "leaves its regularizer off" in line]
    assert len(warnings) == 1, proc.stdout[-3000:]
    assert "[WARNING]" in warnings[0]
    assert warnings[0].endswith(
        "task.attendout=False leaves its regularizer off, so these options of it have no effect: "
        "task.attendout_attention='encoder-self'"
    )  # the recipe's other attendout_* values are the defaults


def readme_block(heading):
    """The first ```bash block under ``heading`` in the README."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    return section[section.index("```bash\n") + len("```bash\n") : section.index("\n```", section.index("```bash"))]


def _run_readme_quick_start(cwd, substitutions):
    import subprocess

    from helpers import VENV_BIN

    block = readme_block("## Quick start: fairseq CLI")
    for old, new in substitutions.items():
        assert old in block, old
        block = block.replace(old, new)
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    stats = train_epoch_stats(proc.stdout)
    assert set(stats) == {1, 2} and stats[2]["ad_drop_on"] == "1"  # it stops, after a cross-tuned AD-DROP epoch
    assert re.search(r"Generate test with beam=5: BLEU = \d+\.\d+", proc.stdout)
    return proc


def test_readme_fairseq_quick_start_runs_on_a_cut_of_the_corpus(tiny_mt_data, tmp_path):
    """The README's commands as written, but on the 120-pair cut (and a vocabulary that fits it)."""
    _run_readme_quick_start(
        tmp_path, {"data/gettext_en_ro/": f"{tiny_mt_data['raw']}/", "--vocab-size 2000": "--vocab-size 300"}
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the run's own limit below; pytest.ini's 600 s is for the rest
def test_readme_fairseq_quick_start_runs_verbatim(tmp_path):
    """Character for character, from a copy of the shipped data's folder layout (about 2 minutes)."""
    (tmp_path / "data").symlink_to(REPO / "data")
    _run_readme_quick_start(tmp_path, {})


def test_registration_does_not_depend_on_import_order(tiny_mt_data, tmp_path):
    """attn_reg_plugin imported before fairseq, then fairseq's own train entry point with the
    documented --user-dir: the plugin's task and criterion are found (the checkout path as
    --user-dir would be skipped here, since the package is already loaded)."""
    import subprocess
    import sys

    script = f"""
import sys
import attn_reg_plugin
assert "fairseq" not in sys.modules
from fairseq_cli import train
sys.argv = ["fairseq-train", {str(tiny_mt_data["bin"])!r}, "--user-dir", {USER_DIR!r}, "--task", "attn_reg_translation",
            *{TINY_TRANSFORMER!r}, "--criterion", "ad_drop_label_smoothed_cross_entropy", "--ad-drop-schedule", "always",
            "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu", "--max-update", "2", "--no-save",
            "--log-format", "simple", "--log-interval", "1"]
train.cli_main()
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "ad_drop_rate" in proc.stdout
