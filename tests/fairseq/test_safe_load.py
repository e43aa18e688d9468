"""Checkpoints written by fairseq-train with the plugin load with torch's safe unpickler
(``weights_only=True``, the torch >= 2.6 default); stock fairseq checkpoints, which pickle an
argparse.Namespace, through the plugin's allow-list (--user-dir, ``python -m attn_reg_plugin.safe_run``);
a checkpoint carrying any other global is refused: loading never needs blanket pickle trust."""

import contextlib
import io
import os
import pickle
import re
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("fairseq")

import attn_reg_plugin.fairseq_plugin  # noqa: E402,F401  (the allow-list, as --user-dir installs it)
from helpers import (  # noqa: E402
    AVERAGE_CHECKPOINTS,
    STOCK_GENERATE,
    STOCK_GENERATE_BLEU,
    TINY_TRANSFORMER,
    USER_DIR,
    run_cli,
    run_python,
)


class ShellPayload:
    """Unpickled with full trust, this runs a shell command (pickle calls os.system)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class ForeignClass:
    """An ordinary class nobody allow-listed."""

    value = 1


def _checkpoint(ad_drop_run):
    return ad_drop_run["save"] / "checkpoint_last.pt"


def test_checkpoint_needs_no_allow_listed_class(ad_drop_run):
    path = _checkpoint(ad_drop_run)
    # Nothing outside torch's own default: the model arguments are a dict, not fairseq's Namespace.
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    state = torch.load(path, weights_only=True)
    assert "encoder.layers.0.self_attn.q_proj.weight" in state["model"]
    assert state["last_optimizer_state"]["state"]  # Adam moments
    assert state["extra_state"]["train_iterator"]["epoch"] == 4  # after 3 full epochs


def _tamper(ad_drop_run, tmp_path, kind):
    state = torch.load(_checkpoint(ad_drop_run), weights_only=True)
    marker = tmp_path / "payload-ran"
    state["extra_state"]["note"] = {"shell": ShellPayload(marker), "function": os.system, "class": ForeignClass()}[kind]
    path = tmp_path / "tampered.pt"
    torch.save(state, path)
    return path, marker


FOREIGN = {"shell": "posix.system", "function": "posix.system", "class": "test_safe_load.ForeignClass"}


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_tampered_checkpoint_is_refused(ad_drop_run, tmp_path, kind):
    from fairseq import checkpoint_utils

    path, marker = _tamper(ad_drop_run, tmp_path, kind)
    with pytest.raises(pickle.UnpicklingError, match=rf"(?i)unsupported( global:)? GLOBAL {FOREIGN[kind]}"):
        torch.load(path, weights_only=True)
    # fairseq-train's resume and fairseq-generate load through this function (torch's default).
    with pytest.raises(pickle.UnpicklingError, match=FOREIGN[kind]):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert not marker.exists()
    if kind == "shell":  # the payload is real: trusting the pickle runs it
        torch.load(path, weights_only=False)
        assert marker.exists()


NUMPY_REFUSED = "Unsupported global: GLOBAL numpy._core.multiarray._reconstruct"


@contextlib.contextmanager
def without_the_allow_list():
    """torch's safe unpickler as a process without the plugin has it."""
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        torch.serialization.add_safe_globals(allowed)


def _bleu_meters(state):
    return {name: meter for _, name, _, meter in state["extra_state"]["metrics"]["valid"] if name.startswith("_bleu")}


def test_eval_bleu_checkpoints_load_safely(eval_bleu_run):
    """--eval-bleu keeps the BLEU n-gram counts as numpy arrays in the meters of extra_state: refused by
    torch alone (Unsupported global: GLOBAL numpy._core.multiarray._reconstruct), loaded with the plugin's
    allow-list by torch.load and by fairseq's loader (fairseq-generate, -interactive, resume)."""
    from fairseq import checkpoint_utils

    for name in ("checkpoint_best.pt", "checkpoint_last.pt", "checkpoint1.pt"):
        path = eval_bleu_run["save"] / name
        with without_the_allow_list(), pytest.raises(pickle.UnpicklingError, match=NUMPY_REFUSED):
            torch.load(path, weights_only=True)
        state = torch.load(path, weights_only=True)
        counts = _bleu_meters(state)["_bleu_counts"]["sum"]
        assert isinstance(counts, np.ndarray) and counts.dtype == np.int64 and counts.shape == (4,)
        assert checkpoint_utils.load_checkpoint_to_cpu(str(path))["extra_state"]["best"] >= 0


def test_numpy_arrays_other_than_fairseqs_are_refused(tmp_path):
    """The allow-list holds int64 and float64 arrays (fairseq's BLEU counts, the attn_reg task's zeros);
    an object array (its items are arbitrary pickled objects) or another dtype is still refused. A
    checkpoint pickled under numpy 1 (numpy.core, not numpy._core) loads too."""
    buffer = io.BytesIO()
    torch.save({"counts": np.array([3, 1]), "zeros": np.zeros(4)}, buffer, _use_new_zipfile_serialization=False)
    for raw in (buffer.getvalue(), buffer.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")):
        state = torch.load(io.BytesIO(raw), weights_only=True)
        assert state["counts"].tolist() == [3, 1] and state["zeros"].dtype == np.float64
    for array, dtype in ((np.array([1, None], dtype=object), "ObjectDType"), (np.array([1], np.int32), "Int32DType")):
        buffer = io.BytesIO()
        torch.save({"note": array}, buffer)
        with pytest.raises(pickle.UnpicklingError, match=f"numpy.dtypes.{dtype}"):
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


BEST_GENERATE = ["--cpu", "--beam", "1", "--max-len-b", "5", "--required-batch-size-multiple", "1"]


def test_eval_bleu_checkpoint_generates(tiny_mt_data, eval_bleu_run, tmp_path):
    """checkpoint_best.pt of an --eval-bleu run in fairseq-generate with the plugin, and in stock
    fairseq's through attn_reg_plugin.safe_run."""
    generate = [tiny_mt_data["bin"], "--path", eval_bleu_run["save"] / "checkpoint_best.pt", *BEST_GENERATE]
    gen = run_cli("fairseq-generate", [*generate, "--user-dir", USER_DIR, "--task", "attn_reg_translation"])
    assert len(re.findall(r"^D-\d+\t", gen.stdout, flags=re.M)) == 40
    out = run_python(["-m", "attn_reg_plugin.safe_run", "fairseq-generate", *generate], tmp_path)
    assert len(re.findall(r"^D-\d+\t", out, flags=re.M)) == 40


def test_eval_bleu_checkpoint_translates_interactively(tiny_mt_data, eval_bleu_run):
    best = eval_bleu_run["save"] / "checkpoint_best.pt"
    args = [tiny_mt_data["bin"], "--user-dir", USER_DIR, "--path", best, *BEST_GENERATE]
    interactive = run_cli("fairseq-interactive", args, input="a b\n")
    assert re.search(r"^H-0\t", interactive.stdout, flags=re.M), interactive.stdout[-2000:]


def test_eval_bleu_run_resumes(tiny_mt_data, eval_bleu_run, tmp_path):
    """The same fairseq-train command again, one epoch further, from its checkpoint_last.pt."""
    save = tmp_path / "resumed"
    shutil.copytree(eval_bleu_run["save"], save)
    args = [save if str(a) == str(eval_bleu_run["save"]) else a for a in eval_bleu_run["args"]]
    resumed = run_cli("fairseq-train", [tiny_mt_data["bin"], *args, "--max-epoch", "3"])
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch 3 @ 24 updates\)", resumed.stdout)
    assert '"valid_bleu"' in resumed.stdout and (save / "checkpoint3.pt").exists()


def test_distributed_resume_broadcast_loads_safely(ad_drop_run, eval_bleu_run, tmp_path):
    """What rank 0 sends the other ranks on a distributed resume, unpickled as they do (also an
    --eval-bleu run's, whose meters hold numpy arrays)."""
    from fairseq import checkpoint_utils
    from fairseq.distributed.utils import _put_tensors_in_obj, _split_tensors_from_obj

    for path in (eval_bleu_run["save"] / "checkpoint_last.pt", _checkpoint(ad_drop_run)):
        state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
        tensors = []
        buffer = io.BytesIO()
        torch.save(_split_tensors_from_obj(state, tensors), buffer)
        received = _put_tensors_in_obj(torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu"), tensors)
        assert received["cfg"] == state["cfg"]
        assert all(torch.equal(received["model"][k], state["model"][k]) for k in state["model"])
        if path.parent == eval_bleu_run["save"]:
            assert np.array_equal(
                _bleu_meters(received)["_bleu_counts"]["sum"], _bleu_meters(state)["_bleu_counts"]["sum"]
            )
    # The wider allow-list still refuses foreign globals inside such a message.
    state["extra_state"]["note"] = ForeignClass()
    buffer = io.BytesIO()
    torch.save(_split_tensors_from_obj(state, []), buffer)
    with pytest.raises(pickle.UnpicklingError, match="test_safe_load.ForeignClass"):
        torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu")


@pytest.mark.slow
def test_fairseq_generate_refuses_tampered_checkpoint(tiny_mt_data, ad_drop_run, tmp_path):
    path, marker = _tamper(ad_drop_run, tmp_path, "shell")
    proc = run_cli(
        "fairseq-generate",
        [tiny_mt_data["bin"], "--user-dir", USER_DIR, "--path", path, "--cpu", "--beam", "1", "--max-len-b", "5"],
        expect_ok=False,
    )
    assert proc.returncode != 0
    assert "unsupported GLOBAL posix.system" in proc.stdout
    assert not marker.exists()


def test_a_checkpoint_with_a_namespace_runs_through_safe_run(tiny_mt_data, tmp_path):
    """A stock --task translation run's checkpoint pickles fairseq's argparse.Namespace: refused by
    the same averaging without the plugin, working through python -m attn_reg_plugin.safe_run."""
    save = tmp_path / "stock"
    run_cli(
        "fairseq-train",
        [tiny_mt_data["bin"], "--task", "translation", *TINY_TRANSFORMER, "--save-dir", save, "--max-epoch", "1"]
        + ["--criterion", "label_smoothed_cross_entropy", "--optimizer", "adam", "--lr", "1e-3"]
        + ["--max-tokens", "500", "--cpu", "--seed", "3", "--no-progress-bar"],
    )
    script = tmp_path / "average_checkpoints.py"
    script.write_text(AVERAGE_CHECKPOINTS, encoding="utf-8")
    averaged = tmp_path / "averaged.pt"
    inputs = [save / "checkpoint1.pt", save / "checkpoint_last.pt"]
    refused = run_python([script, *inputs, averaged], tmp_path, expect_ok=False)
    assert "Unsupported global: GLOBAL argparse.Namespace" in refused

    out = run_python(["-m", "attn_reg_plugin.safe_run", script, *inputs, averaged], tmp_path)
    assert "averaged with the plugin imported: True" in out
    # the plugin's own averaging command reads them with the allow-list: the same average
    ours = tmp_path / "ours.pt"
    run_python(["-m", "attn_reg_plugin.average_checkpoints", "--inputs", *inputs, "--output", ours], tmp_path)
    mean, same = (torch.load(p, weights_only=True)["model"] for p in (averaged, ours))
    assert all(torch.allclose(mean[k], same[k]) for k in mean)
    gen = run_python(
        [
            "-m",
            "attn_reg_plugin.safe_run",
            "fairseq-generate",
            tiny_mt_data["bin"],
            "--path",
            averaged,
            *STOCK_GENERATE,
        ],
        tmp_path,
    )
    assert re.search(STOCK_GENERATE_BLEU, gen)


def test_safe_run_names_a_tool_it_cannot_run(tmp_path, capsys):
    from attn_reg_plugin.safe_run import main

    for tool, message in (
        ("no-such-tool", "TOOL 'no-such-tool' is neither a file nor a command of this environment or on PATH"),
        ("/bin/sh", "TOOL '/bin/sh' (/bin/sh) is not a Python script"),
    ):
        with pytest.raises(SystemExit, match=re.escape(message)):
            main([tool, "--help"])
    with pytest.raises(SystemExit) as exit:
        main([])
    assert (
        exit.value.code == 2 and "usage: python -m attn_reg_plugin.safe_run TOOL [ARGS...]" in capsys.readouterr().out
    )
