"""attn-reg-average-checkpoints: fairseq's checkpoint averaging (scripts/average_checkpoints.py, not in
the pip package) from the installed plugin, with torch's safe unpickler (docs/CHECKPOINTS.md)."""

import os
import pickle
import re
import shlex
import subprocess

import numpy as np
import pytest
import torch

pytest.importorskip("fairseq")

import attn_reg_plugin.fairseq_plugin  # noqa: E402,F401  (the allow-list, to read the checkpoints here)
from attn_reg_plugin.average_checkpoints import main  # noqa: E402
from helpers import (  # noqa: E402
    EVAL_BLEU,
    LOGGED_TRAIN,
    REPO,
    USER_DIR,
    VENV_BIN,
    cli_env,
    fairseq_train,
    run_cli,
    run_python,
)


class ForeignClass:
    """An ordinary class nobody allow-listed."""


def numpy_leaves(value, path=""):
    """The paths of the numpy arrays and scalars anywhere in ``value`` (dicts, lists, tuples)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in numpy_leaves(v, f"{path}/{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in numpy_leaves(v, f"{path}[{i}]")]
    return []


def as_lists(value):
    """``value`` with its numpy arrays and scalars as Python lists and numbers (tuples stay tuples)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    if isinstance(value, dict):
        return {k: as_lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(as_lists(v) for v in value)
    return value


def test_average_the_last_epochs_and_generate(tiny_mt_data, eval_bleu_run, tmp_path):
    """The two epoch checkpoints of an --eval-bleu run (numpy BLEU counts in their extra_state), picked
    by --num-epoch-checkpoints as fairseq's script picks them; the result is their parameters' mean,
    and fairseq-generate translates with it."""
    save, averaged = eval_bleu_run["save"], tmp_path / "averaged.pt"
    out = run_python(
        ["-m", "attn_reg_plugin.average_checkpoints", "--inputs", save, "--num-epoch-checkpoints", "2"]
        + ["--output", averaged],
        tmp_path,
    )
    assert f"averaged 2 checkpoints ({save / 'checkpoint2.pt'}, {save / 'checkpoint1.pt'})" in out
    first, second, mean = (
        torch.load(p, weights_only=True) for p in (save / "checkpoint1.pt", save / "checkpoint2.pt", averaged)
    )
    assert mean["model"].keys() == first["model"].keys()
    for key, value in mean["model"].items():
        assert torch.allclose(value, (first["model"][key] + second["model"][key]) / 2), key
    key = "encoder.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(first["model"][key], second["model"][key])
    # everything else is the newest input's, as in fairseq's script
    assert (
        mean["extra_state"]["train_iterator"]
        == second["extra_state"]["train_iterator"]
        != first["extra_state"]["train_iterator"]
    )
    # the BLEU counts are the newest input's, as plain Python numbers: stock fairseq loads the file
    assert numpy_leaves(second["extra_state"]) and not numpy_leaves(mean["extra_state"])
    assert mean["extra_state"]["metrics"] == as_lists(second["extra_state"]["metrics"])

    gen = run_cli(
        "fairseq-generate",
        [tiny_mt_data["bin"], "--user-dir", USER_DIR, "--task", "attn_reg_translation", "--path", averaged]
        + ["--cpu", "--beam", "1", "--max-len-b", "5", "--required-batch-size-multiple", "1"],
    )
    assert len(re.findall(r"^D-\d+\t", gen.stdout, flags=re.M)) == 40


def test_named_inputs_and_an_upper_bound(eval_bleu_run, tmp_path):
    save = eval_bleu_run["save"]
    main(["--inputs", str(save / "checkpoint1.pt"), str(save / "checkpoint2.pt"), "--output", str(tmp_path / "a.pt")])
    main(["--inputs", str(save), "--num-epoch-checkpoints", "2", "--output", str(tmp_path / "b.pt")])
    a, b = (torch.load(tmp_path / name, weights_only=True)["model"] for name in ("a.pt", "b.pt"))
    assert all(torch.allclose(a[k], b[k]) for k in a)
    main(
        ["--inputs", str(save), "--num-epoch-checkpoints", "1", "--checkpoint-upper-bound", "1"]
        + ["--output", str(tmp_path / "c.pt")]
    )
    c, first = (torch.load(p, weights_only=True)["model"] for p in (tmp_path / "c.pt", save / "checkpoint1.pt"))
    assert all(torch.equal(c[k], first[k]) for k in c)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--num-epoch-checkpoints", "3"],
            r"--num-epoch-checkpoints 3: .* holds 2 epoch checkpoint\(s\) \(checkpoint1.pt, checkpoint2.pt\)",
        ),
        (["--num-update-checkpoints", "1"], r"--num-update-checkpoints 1: .* holds 0 update checkpoint\(s\) \(none\)"),
        (["--num-epoch-checkpoints", "0"], r"--num-epoch-checkpoints must be >= 1, got 0"),
        (
            ["--checkpoint-upper-bound", "1"],
            r"--checkpoint-upper-bound needs --num-epoch-checkpoints or --num-update-checkpoints",
        ),
    ],
)
def test_bad_options_are_named(eval_bleu_run, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit):
        main(["--inputs", str(eval_bleu_run["save"]), *args, "--output", str(tmp_path / "x.pt")])
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "x.pt").exists()


def test_a_folder_without_a_count_and_a_missing_file_are_named(eval_bleu_run, tmp_path):
    save = eval_bleu_run["save"]
    with pytest.raises(SystemExit, match=f"--inputs {re.escape(str(save))} is a folder: .*--num-epoch-checkpoints N"):
        main(["--inputs", str(save), "--output", str(tmp_path / "x.pt")])
    with pytest.raises(SystemExit, match="--inputs: no such file: .*missing.pt"):
        main(
            ["--inputs", str(save / "checkpoint1.pt"), str(tmp_path / "missing.pt"), "--output", str(tmp_path / "x.pt")]
        )


def test_a_checkpoint_with_a_foreign_global_is_refused(eval_bleu_run, tmp_path):
    state = torch.load(eval_bleu_run["save"] / "checkpoint1.pt", weights_only=True)
    state["extra_state"]["note"] = ForeignClass()
    torch.save(state, tmp_path / "tampered.pt")
    inputs = [str(eval_bleu_run["save"] / "checkpoint2.pt"), str(tmp_path / "tampered.pt")]
    with pytest.raises(pickle.UnpicklingError, match="test_average_checkpoints.ForeignClass"):
        main(["--inputs", *inputs, "--output", str(tmp_path / "x.pt")])
    assert not (tmp_path / "x.pt").exists()


def test_the_documented_average_of_an_eval_bleu_run_translates_in_stock_fairseq(tiny_mt_data, tmp_path):
    """docs/CHECKPOINTS.md's averaging and stock generation commands, as printed, on a tiny AD-DROP run
    validated by BLEU (numpy counts in every checkpoint's extra_state) with as many epochs as the block
    averages: fresh processes, fairseq-generate --task translation without the plugin's --user-dir."""
    text = (REPO / "docs" / "CHECKPOINTS.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if "attn-reg-average-checkpoints" in b)
    save = re.search(r"--inputs (\S+)", block).group(1)
    epochs = re.search(r"--num-epoch-checkpoints (\d+)", block).group(1)
    assert "--user-dir" not in block and "DATA_BIN" in block
    fairseq_train(
        tiny_mt_data["bin"],
        ["--save-dir", tmp_path / save, *LOGGED_TRAIN["ad_drop"], *EVAL_BLEU, "--max-epoch", epochs],
    )
    newest = torch.load(tmp_path / save / f"checkpoint{epochs}.pt", weights_only=True)
    assert numpy_leaves(newest["extra_state"])  # the case: BLEU counts as numpy arrays
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.replace("DATA_BIN", shlex.quote(str(tiny_mt_data["bin"])))],
        cwd=tmp_path,
        env={**cli_env(), "PATH": f"{VENV_BIN}:{os.environ['PATH']}"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=600,
    )
    gen = (tmp_path / "gen.out").read_text(encoding="utf-8") if (tmp_path / "gen.out").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + gen[-3000:]
    log = proc.stdout[proc.stdout.index("fairseq_cli.generate") :]  # fairseq-generate's log: its config first
    assert "'user_dir': None" in log and "attn_reg" not in log  # stock fairseq only
    assert re.search(r"^Generate test with beam=5: BLEU = \d+\.\d+", gen, flags=re.M), gen[-2000:]
    assert len(re.findall(r"^D-\d+\t", gen, flags=re.M)) == 40  # every test sentence translated
