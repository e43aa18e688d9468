"""docs/FAIRSEQ.md's fairseq-interactive command for raw text, run as written (its paths laid out in a
folder: the attn-reg-prepare output and the best checkpoint): sentencepiece cuts the line into the
model's pieces, and the translation comes out as text."""

import os
import re
import subprocess

import pytest

pytest.importorskip("fairseq")

from helpers import REPO, VENV_BIN, cli_env  # noqa: E402


def documented_block():
    text = (REPO / "docs" / "FAIRSEQ.md").read_text(encoding="utf-8")
    return next(b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if "fairseq-interactive" in b)


def test_the_documented_interactive_command_translates_raw_text(tiny_mt_data, logged_runs, tmp_path):
    import sentencepiece as spm

    block = documented_block()
    data_bin = re.search(r"fairseq-interactive (\S+)", block).group(1)
    model = re.search(r"--sentencepiece-model (\S+)", block).group(1)
    checkpoint = re.search(r"--path (\S+)", block).group(1)
    sentence = re.search(r'^echo "(.*?)" \|', block).group(1)
    # the layout the block names: attn-reg-prepare's output folder and fairseq-train's save dir
    out = tmp_path / os.path.dirname(data_bin)
    assert tmp_path / model == out / "spm" / "spm.model"  # where attn-reg-prepare writes it
    out.parent.mkdir(parents=True)
    out.symlink_to(tiny_mt_data["root"])
    (tmp_path / checkpoint).parent.mkdir(parents=True)
    (tmp_path / checkpoint).symlink_to(logged_runs("plain")["save"] / "checkpoint2.pt")

    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path,
        env={**cli_env(), "PATH": f"{VENV_BIN}:{os.environ['PATH']}"},
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split("\t")[0]: line.split("\t")[1:] for line in proc.stdout.splitlines() if "\t" in line}
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / model))
    # the line went in as the model's pieces (a line without --bpe would be split at spaces)...
    assert lines["S-0"] == [" ".join(sp.encode(sentence, out_type=str))]
    # ...and the translation comes out as text: the hypothesis' pieces joined back
    (_, pieces), (_, text) = lines["H-0"], lines["D-0"]
    assert pieces.strip() and "\u2581" not in text
    assert text == sp.decode(pieces.split())
