"""IGA's number of steps m has one default, ADDropConfig's: the lab's runners (attn-reg-scaling,
its worker's Trainers, attn-reg-benchmark) read it from the config instead of repeating it; only
their --quick value (3) is the lab's own choice."""

import re
from pathlib import Path

import pytest

from attn_reg_lab import scaling, scaling_worker
from attn_reg_plugin.core import ADDropConfig

LAB = Path(scaling.__file__).parent


def test_the_scaling_grid_follows_the_configs_default(monkeypatch, tmp_path):
    monkeypatch.setattr(ADDropConfig.__dataclass_fields__["iga_steps"], "default", 7)
    opts = scaling.parse_args(["--out-dir", str(tmp_path)])
    assert opts.iga_steps == 7
    assert scaling.parse_args(["--out-dir", str(tmp_path), "--quick"]).iga_steps == 3  # the lab's quick choice
    assert scaling.parse_args(["--out-dir", str(tmp_path), "--iga-steps", "5"]).iga_steps == 5


def test_the_worker_trainer_follows_the_configs_default(monkeypatch):
    import attn_reg_plugin.hf as hf

    built = {}
    monkeypatch.setattr(hf, "ADDropTrainer", lambda ad_drop, **common: built.setdefault("config", ad_drop))
    monkeypatch.setattr(ADDropConfig.__dataclass_fields__["iga_steps"], "default", 7)
    scaling_worker.method_trainer("iga", {}, 32)
    assert built["config"].iga_steps == 7


def test_the_benchmark_follows_the_configs_default(monkeypatch):
    benchmark = pytest.importorskip("attn_reg_lab.benchmark")
    monkeypatch.setattr(ADDropConfig.__dataclass_fields__["iga_steps"], "default", 7)
    assert benchmark.parse_args(["--variants", "ad-drop-ga-all"]).iga_steps == 7
    assert benchmark.parse_args(["--variants", "ad-drop-ga-all", "--quick"]).iga_steps == 3


def test_no_lab_file_repeats_the_default():
    repeated = [
        f"{path.relative_to(LAB)}:{n}"
        for path in sorted(LAB.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"iga[_-]steps.*\b20\b|integrated gradients.*default 20", line)
    ]
    assert not repeated, repeated
