"""attn-reg-mt-sweep never misleads (issue 42, part 3), on stand-in fairseq children
(tests/fake_fairseq.py: the sweep's own logic at a fraction of a second per run):

- SIGTERM, SIGINT or SIGKILL of the sweep ends its fairseq-train child; a second sweep on a
  running one's --out-dir is refused naming it, a dead one's lock taken over;
- a resumed run says from which epoch, and its record covers every attempt's epochs and time;
- skipped AD-DROP steps are counted, a mostly-skipped or diverged cell flagged and not ranked, and
  no "raise --epochs" hint for a diverged run;
- results accumulate over commands; one seed reads "n/a"; a weak best cell says why; the heatmap
  is centred on plain; translations are length-bounded by default.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fake_fairseq
import pytest

from attn_reg_plugin import sweep
from attn_reg_plugin.sweep import runs as sweep_runs

REFS = [f"the {a} cat sees the {b} dog again today." for a in ("big", "small", "old", "new") for b in ("red", "white")]
CELL_A, CELL_B, CELL_C = (f"p{p}_q0.3_ga_layers-all_always" for p in ("0.2", "0.5", "0.8"))
# The sweep in a process of its own, on the stand-in children.
WRAPPER = """
import json, sys
from attn_reg_plugin import sweep
from attn_reg_plugin.sweep import runs
exes = json.loads(sys.argv[1])
runs.fairseq_command = lambda name: exes[name]
sweep.check_fairseq_args = lambda *a: None
sys.exit(sweep.main(sys.argv[2:]))
"""


def _data_bin(root: Path) -> Path:
    """Just the files the sweep checks: dictionaries of 10 types, empty binaries."""
    data_bin = root / "data-bin"
    data_bin.mkdir()
    for lang in ("tr", "en"):
        (data_bin / f"dict.{lang}.txt").write_text("".join(f"w{i} 1\n" for i in range(10)))
        for split in ("train", "valid"):
            for ext in ("bin", "idx"):
                (data_bin / f"{split}.tr-en.{lang}.{ext}").write_bytes(b"")
    return data_bin


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    """``fake["plan"](**plan)`` sets the children's plan; ``fake["argv"](out, ...)`` a sweep command line."""
    data_bin = _data_bin(tmp_path)
    plan_path = tmp_path / "plan.json"
    exes = fake_fairseq.install(tmp_path / "bin", plan_path)
    monkeypatch.setattr(sweep_runs, "fairseq_command", lambda name: exes[name])
    monkeypatch.setattr(sweep, "check_fairseq_args", lambda *a: None)

    def plan(**kwargs):
        fake_fairseq.write_plan(plan_path, refs=REFS, **kwargs)

    def argv(out, *extra, p="0.2", seeds="1", epochs="3"):
        return [
            str(data_bin), "--out-dir", str(out), "--p", p, "--q", "0.3", "--schedule", "always",
            "--epochs", epochs, "--seeds", seeds, *extra, "--", "--arch", "transformer", "--cpu",
        ]  # fmt: skip

    plan()
    return {"plan": plan, "argv": argv, "exes": exes}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # an orphan's zombie may wait for a PID 1 that never reaps


def _wait(condition, seconds: float) -> bool:
    end = time.time() + seconds
    while time.time() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_stopped_or_killed_sweep_ends_its_child_and_resumes_whole(fake, tmp_path, capsys, sig):
    pids, marker = tmp_path / "pids", tmp_path / "hung"
    pids.mkdir()
    fake["plan"](hang_after_epoch=1, hang_marker=str(marker), pid_dir=str(pids))
    out = tmp_path / "sweep"
    argv = fake["argv"](out)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, json.dumps(fake["exes"]), *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    child = None
    try:
        assert _wait(lambda: marker.exists() or proc.poll() is not None, 60) and proc.poll() is None, (
            proc.stderr.read() if proc.poll() is not None else "no child"
        )
        child = int(marker.read_text())
        time.sleep(2.5)  # this attempt's time must count in the record (saved every second)
        if sig == signal.SIGTERM:  # meanwhile a second sweep there is refused, naming the running one
            with pytest.raises(SystemExit):
                sweep.main(argv)
            err = capsys.readouterr().err
            assert f"is in use by a running sweep (PID {proc.pid}, started" in err and "attn-reg-mt-sweep" in err
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
        assert _wait(lambda: not _alive(child), 5), f"fairseq-train (PID {child}) outlived the sweep"
        if sig != signal.SIGKILL:
            assert proc.returncode == 128 + sig
            assert f"stopped by {sig.name}: ended fairseq-train (PID {child})" in err
    finally:
        for pid in (proc.pid, child):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()

    capsys.readouterr()
    assert sweep.main(argv) == 0  # the same command again
    printed = capsys.readouterr().out
    assert ("taking over the lock of a sweep that no longer runs" in printed) == (sig == signal.SIGKILL)
    assert f"resuming {CELL_A} seed 1 from epoch 2" in printed
    # Without --rebuild-batches fairseq's resumed batches differ from an uninterrupted run's: said so.
    assert "its batches from here on are not an uninterrupted run's: give --rebuild-batches" in printed
    (run,) = json.loads((out / "results.json").read_text())["cells"][0]["runs"]
    assert run["epochs"] == 3 and run["missing_epochs"] == [] and run["valid_loss"] == pytest.approx(4.7)
    assert run["attempts"] == 2 and run["train_seconds"] >= 1.5  # the killed attempt's time counts
    attempts = json.loads((out / "runs" / CELL_A / "seed1" / "attempts.json").read_text())
    assert attempts[0]["end"] == ("the sweep died" if sig == signal.SIGKILL else f"stopped by {sig.name}")
    assert attempts[1]["resumed_from_epoch"] == 2 and attempts[1]["end"] == "finished"
    assert not (out / "sweep.lock").exists()


def test_skipped_and_diverged_cells_are_flagged_and_not_ranked(fake, tmp_path, capsys):
    # p 0.5: every AD-DROP step skipped; p 0.8: the valid loss explodes. Both translate perfectly
    # (the best BLEU) and neither may be named best.
    fake["plan"](
        cells={CELL_B: {"ad_drop_skipped": [10, 10, 10]}, CELL_C: {"valid_loss": [4.9, 40.0, 1.03e10]}},
        hyps={"plain": "drop:3", CELL_A: "drop:4", CELL_B: "ref", CELL_C: "ref"},
    )
    out = tmp_path / "sweep"
    assert sweep.main(fake["argv"](out, "--plain", p="0.2,0.5,0.8")) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    cells = {c["name"]: c for c in results["cells"]}
    assert cells[CELL_A]["ad_drop_skipped"] == 0 and cells[CELL_B]["ad_drop_skipped"] == 30
    assert cells[CELL_B]["ad_drop_skipped_share"] == 1.0 and cells["plain"]["ad_drop_skipped"] is None
    assert cells[CELL_B]["flags"] == [
        "AD-DROP skipped in 100% of its steps (30 skipped: non-finite attribution target, the plain loss "
        "used): not ranked as regularized"
    ]
    assert cells[CELL_C]["flags"][0].startswith("diverged (seed 1: valid loss 40 at epoch 2 (bound 7.61")
    assert results["best"]["name"] == CELL_A and not cells[CELL_A]["flags"]
    table = (out / "results.md").read_text()
    assert f"best on valid: {CELL_A} (p 0.2, q 0.3)" in table
    row = next(line for line in table.splitlines() if line.startswith(f"| {CELL_B} |"))
    assert "| 30 (100%) |" in row and "AD-DROP skipped in 100% of its steps" in row
    assert "diverged (seed 1" in next(line for line in table.splitlines() if line.startswith(f"| {CELL_C} |"))
    assert f"diverged: {CELL_C}: their training blew up" in printed

    # A sweep whose only cell diverged (BLEU 0) is not told it is too short.
    fake["plan"](cells={CELL_C: {"valid_loss": [4.9, 40.0, 1.03e10]}}, hyps={CELL_C: "junk"})
    assert sweep.main(fake["argv"](tmp_path / "diverged", p="0.8")) == 0
    printed = capsys.readouterr().out
    assert f"diverged: {CELL_C}" in printed and "raise --epochs" not in printed
    assert "best on valid: none: no AD-DROP cell can be ranked" in printed


def test_results_accumulate_one_seed_has_no_spread_and_the_heatmap_centres_on_plain(fake, tmp_path, capsys):
    # valid BLEU: plain 5.1; p 0.2 66.9 at seed 1, 18.2 at seed 2; p 0.5 18.2
    fake["plan"](hyps={"plain": "drop:3", f"{CELL_A}/seed1": "drop:5", f"{CELL_A}/seed2": "drop:4", CELL_B: "drop:4"})
    out = tmp_path / "sweep"
    assert sweep.main(fake["argv"](out, "--plain", p="0.2,0.5")) == 0
    first = json.loads((out / "results.json").read_text())
    table = (out / "results.md").read_text()
    assert "± n/a" in table and "± 0.00" not in table and first["cells"][0]["valid_bleu_sd"] is None
    assert "- caution: one seed per cell: no seed spread" in table
    plain = first["plain"]["valid_bleu"]
    drawn = first["heatmap"]
    assert drawn["center"] == 0.0 and drawn["vmin"] == -drawn["vmax"] and drawn["vmax"] >= 1.0
    assert drawn["shows"].startswith(f"valid BLEU − plain's {plain:.2f}") and drawn["plain_valid_bleu"] == plain
    assert Path(drawn["path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = (out / "runs" / CELL_A / "seed1" / "generate-valid.log").read_text()
    assert "--max-len-a 1.2 --max-len-b 10" in log  # bounded by default

    # A narrower grid with a second seed adds to the results; nothing run before is dropped.
    capsys.readouterr()
    assert sweep.main(fake["argv"](out, p="0.2", seeds="1,2")) == 0
    printed = capsys.readouterr().out
    assert f"{CELL_A} seed 1: kept" in printed and f"{CELL_A} seed 2: training" in printed
    results = json.loads((out / "results.json").read_text())
    assert [(c["name"], c["seeds"]) for c in results["cells"]] == [("plain", [1]), (CELL_A, [1, 2]), (CELL_B, [1])]
    assert results["grid"]["p"] == [0.2, 0.5] and results["grid"]["seeds"] == [1, 2]
    table = (out / "results.md").read_text()
    assert f"| {CELL_B} | 1 |" in table and f"| {CELL_A} | 1,2 |" in table
    spread = results["seed_spread"]
    assert spread == results["cells"][1]["valid_bleu_sd"] > 0
    caveats = " ".join(results["best_caveats"])
    assert f"within the seed spread (sd {spread:.2f}): not a finding" in caveats and "different seeds" in caveats


def test_weak_bleu_says_so_beside_the_best_cell(fake, tmp_path):
    fake["plan"](hyps={CELL_A: "long", CELL_B: "junk"})
    assert sweep.main(fake["argv"](tmp_path / "long", p="0.2,0.5", epochs="2")) == 0
    results = json.loads((tmp_path / "long" / "results.json").read_text())
    assert results["best"]["name"] == CELL_A and results["best"]["length_ratio"] == pytest.approx(5.0, abs=0.01)
    assert any("hypotheses are 5.00 x the references' length" in c for c in results["best_caveats"])

    fake["plan"](hyps={CELL_A: "junk"})
    assert sweep.main(fake["argv"](tmp_path / "zero", epochs="2")) == 0
    table = (tmp_path / "zero" / "results.md").read_text()
    assert "- caution: valid BLEU near 0 (0.00): the models do not translate yet" in table


def test_the_length_bound_is_stated_and_the_users_own_is_used(fake, tmp_path, capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--help"])
    assert "--max-len-a" in capsys.readouterr().out
    assert sweep.main(fake["argv"](tmp_path / "own", "--max-len-a", "0", "--max-len-b", "50", epochs="2")) == 0
    log = (tmp_path / "own" / "runs" / CELL_A / "seed1" / "generate-valid.log").read_text()
    assert "--max-len-a 0 --max-len-b 50" in log and "--max-len-a 1.2" not in log
    with pytest.raises(SystemExit):
        sweep.main(fake["argv"](tmp_path / "o", "--generate-args", "--max-len-b 5"))
    assert "--max-len-b in --generate-args: give it as the sweep's own --max-len-b" in capsys.readouterr().err
