"""attn-reg-average-checkpoints: fairseq's checkpoint averaging (scripts/average_checkpoints.py, not in
the pip package) from the installed plugin, with torch's safe unpickler (docs/CHECKPOINTS.md)."""

import pickle
import re

import pytest
import torch

pytest.importorskip("fairseq")

import attn_reg_plugin.fairseq_plugin  # noqa: E402,F401  (the allow-list, to read the checkpoints here)
from attn_reg_plugin.average_checkpoints import main  # noqa: E402
from helpers import USER_DIR, run_cli, run_python  # noqa: E402


class ForeignClass:
    """An ordinary class nobody allow-listed."""


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
