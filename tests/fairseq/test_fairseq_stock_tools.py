"""fairseq's own checkpoint tools on the plugin's checkpoints, in processes that never import the plugin
(docs/CHECKPOINTS.md "fairseq's own tools"): averaging, fairseq-generate --task translation without
--user-dir, and scoring a generate output with the sacrebleu command. (A checkpoint that still pickles
an argparse.Namespace through attn_reg_plugin.safe_run: test_safe_load.py.)"""

import json
import os
import re
import subprocess

import pytest
import torch

pytest.importorskip("fairseq")

from helpers import (  # noqa: E402
    AVERAGE_CHECKPOINTS,
    REPO,
    STOCK_GENERATE,
    STOCK_GENERATE_BLEU,
    VENV_BIN,
    run_cli,
    run_python,
)


def test_average_and_generate_without_the_plugin(logged_runs, tiny_mt_data, tmp_path):
    script = tmp_path / "average_checkpoints.py"
    script.write_text(AVERAGE_CHECKPOINTS, encoding="utf-8")
    for name in ("plain", "ad_drop", "attendout"):
        save = logged_runs(name)["save"]
        averaged = tmp_path / f"{name}.pt"
        out = run_python([script, save / "checkpoint1.pt", save / "checkpoint2.pt", averaged], tmp_path)
        assert "averaged with the plugin imported: False" in out
        first, second, mean = (
            torch.load(p, weights_only=True)["model"]
            for p in (save / "checkpoint1.pt", save / "checkpoint2.pt", averaged)
        )
        key = "encoder.layers.0.self_attn.q_proj.weight"
        assert torch.allclose(mean[key], (first[key] + second[key]) / 2) and not torch.equal(first[key], second[key])

        gen = run_cli("fairseq-generate", [tiny_mt_data["bin"], "--path", averaged, *STOCK_GENERATE])
        assert "'user_dir': None" in gen.stdout and "attn_reg_plugin" not in gen.stdout  # stock fairseq only
        assert re.search(STOCK_GENERATE_BLEU, gen.stdout), gen.stdout[-2000:]
        assert len(re.findall(r"^D-\d+\t", gen.stdout, flags=re.M)) == 40  # no sentence lost
    (tmp_path / "gen.out").write_text(gen.stdout, encoding="utf-8")

    # The documented sacrebleu commands on the last gen.out give fairseq-generate's own score.
    text = (REPO / "docs" / "CHECKPOINTS.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if "sacrebleu ref.txt" in b)
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path,
        env={**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout
    score = json.loads(proc.stdout)
    bleu, verbose = re.search(STOCK_GENERATE_BLEU, gen.stdout).groups()
    assert (f"{score['score']:.2f}", score["verbose_score"]) == (bleu, verbose)
    assert score["verbose_score"].endswith("ref_len = 361)")  # all 40 references, in corpus order
