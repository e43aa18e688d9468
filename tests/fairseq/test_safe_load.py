"""Checkpoints written by fairseq-train with the plugin load with torch's safe unpickler
(``weights_only=True``, the torch >= 2.6 default) through the plugin's allow-list, and a
checkpoint carrying any other global is refused: loading never needs blanket pickle trust."""

import io
import os
import pickle

import pytest
import torch

pytest.importorskip("fairseq")

import attn_reg_plugin.fairseq_plugin  # noqa: E402,F401  (the allow-list, as --user-dir installs it)
from helpers import USER_DIR, run_cli  # noqa: E402


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


def test_checkpoint_needs_only_the_allow_listed_class(ad_drop_run):
    path = _checkpoint(ad_drop_run)
    # Nothing outside the allow-list (argparse.Namespace is the one class fairseq needs).
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


def test_distributed_resume_broadcast_loads_safely(ad_drop_run, tmp_path):
    """What rank 0 sends the other ranks on a distributed resume, unpickled as they do."""
    from fairseq import checkpoint_utils
    from fairseq.distributed.utils import _put_tensors_in_obj, _split_tensors_from_obj

    state = checkpoint_utils.load_checkpoint_to_cpu(str(_checkpoint(ad_drop_run)))
    tensors = []
    buffer = io.BytesIO()
    torch.save(_split_tensors_from_obj(state, tensors), buffer)
    received = _put_tensors_in_obj(torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu"), tensors)
    assert received["cfg"] == state["cfg"]
    assert all(torch.equal(received["model"][k], state["model"][k]) for k in state["model"])
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
