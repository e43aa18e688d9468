"""attn-reg-mt-compare and attn-reg-mt-sweep with --launcher slurm, on a real Slurm: the one-node
cluster .ci/slurm-up.sh starts (CI's .ci/run does, before make test). No stand-in for Slurm: every
run below is a job that sbatch queued, slurmd ran and sacct reports. Where sinfo is missing or does
not answer, these tests skip and say so; the launcher's option checks (at the end) run everywhere.

- a 2-method x 2-seed comparison as one job array: its results.json equals the local launcher's,
  to the digit, for the same seeds;
- a job cancelled mid-run (scancel) is named in the results as failed; the same command again
  submits only that run, which resumes from its checkpoint;
- stopping the command cancels its jobs (through submitit's scancel);
- --detach leaves the jobs to Slurm; the same command later waits for them instead of resubmitting;
- --slurm-tasks-per-node 2: one 2-rank DDP group (gloo) per job, AD-DROP's logged rate that of the
  whole job;
- --launcher local --jobs 2 (submitit's local executor, no Slurm): two runs at once.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attn_reg_plugin.sweep import compare
from attn_reg_plugin.sweep import main as sweep_main
from helpers import (
    REPO,
    TINY_MT_TRAIN,
    failed_job_logs,
    job_when_ended,
    needs_slurm,
    release_requeues,
    slurm_unavailable,
    train_epoch_stats,
)

SLURM = ["--launcher", "slurm", "--slurm-time", "10"]
pytestmark = pytest.mark.xdist_group("slurm")  # one worker runs every Slurm test: the one-node cluster has 2 CPUs


@pytest.fixture()
def one_thread(monkeypatch):
    """Every fairseq-train, here and in the jobs (sbatch passes the environment on), on one thread:
    CPU training is then the same per seed wherever it runs."""
    pytest.importorskip("submitit")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _compare_argv(data_bin, out, methods, seeds, epochs, *extra):
    return [
        str(data_bin), "--out-dir", str(out), "--methods", methods, "--seeds", seeds, "--epochs", str(epochs),
        *extra, "--", *TINY_MT_TRAIN,
    ]  # fmt: skip


def _comparable(results: dict, out: Path):
    """``results`` without what differs between two identical runs: times and the out-dir's path."""

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if "seconds" not in k}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x.replace(str(out), "OUT") if isinstance(x, str) else x

    return clean(results)


def _array_elements(job_id: str):
    """The array elements a sacct JobID stands for: 12_3 itself; 12_[1-3,5%2], elements that never started
    (cancelled while pending, sacct keeps them as one row of the array's pending range), 12_1, 12_2, 12_3
    and 12_5."""
    base, _, index = job_id.partition("_")
    if not index.startswith("["):
        return [job_id]
    elements = []
    for part in index.strip("[]").split("%")[0].split(","):
        first, _, last = part.partition("-")
        elements += [f"{base}_{i}" for i in range(int(first), int(last or first) + 1)]
    return elements


def _sacct_states(job_ids):
    """sacct's state of each job (array elements as 12_3), from the cluster's accounting."""
    rows = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(sorted({j.split("_")[0] for j in job_ids}))],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    states = {element: state for job, state in (row.split("|", 1) for row in rows) for element in _array_elements(job)}
    return {job: states.get(job, "?").split()[0] for job in job_ids}


def test_sacct_rows_of_pending_array_ranges_name_their_elements():
    assert _array_elements("12_3") == ["12_3"] and _array_elements("12") == ["12"]
    assert _array_elements("12_[1-3,5%2]") == ["12_1", "12_2", "12_3", "12_5"]
    assert _array_elements("267_[1]") == ["267_1"]


def _wait_for(condition, what: str, timeout: float = 120, seen=None):
    """Poll ``condition`` until true; ``seen()`` (if given) says in the failure what was there instead."""
    end = time.time() + timeout
    while not condition():
        assert time.time() < end, f"still waiting after {timeout} s for {what}" + (
            f"; last seen {seen()}" if seen else ""
        )
        time.sleep(0.5)


def _wait_for_states(jobs, state: str, timeout: float = 120):
    """Until sacct says ``state`` for every job (accounting records an end a few seconds after it, more
    under load); a failure names each job's state and squeue's view."""

    def squeue():
        ids = ",".join(sorted({j.split("_")[0] for j in jobs}))
        return subprocess.run(["squeue", "-h", "-r", "-j", ids], capture_output=True, text=True).stdout.strip()

    _wait_for(
        lambda: set(_sacct_states(jobs).values()) == {state},
        f"sacct to say {state}",
        timeout,
        lambda: f"sacct {_sacct_states(jobs)}, squeue {squeue()!r}",
    )


def _epochs_done(seed_dir: Path) -> int:
    log = seed_dir / "train.log"
    return len(train_epoch_stats(log.read_text())) if log.exists() else 0


def _command(argv):
    """attn-reg-mt-compare of this checkout as its own process (so that a signal can stop it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "attn_reg_plugin.sweep.compare", *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@needs_slurm
@pytest.mark.slow  # equality across launchers is also checked without Slurm (local --jobs 2); the real
# Slurm's submit-and-collect stays in the fast suite (the cancelled-job test below)
def test_a_comparison_as_one_job_array_equals_the_local_one(tiny_mt_data, tmp_path, one_thread):
    """The Slurm command runs beside the local one (each run on one thread: the same numbers either
    way, and the test takes the time of one)."""
    local, slurm = tmp_path / "local", tmp_path / "slurm"
    command = _command(_compare_argv(tiny_mt_data["bin"], slurm, "plain,dropkey", "2", 1, *SLURM))
    assert compare.main(_compare_argv(tiny_mt_data["bin"], local, "plain,dropkey", "2", 1)) == 0
    output, _ = command.communicate(timeout=600)
    assert command.returncode == 0, output
    jobs = json.loads((slurm / "jobs.json").read_text())
    assert sorted(jobs) == ["dropkey/seed2", "plain/seed2"]
    assert len({j.split("_")[0] for j in jobs.values()}) == 1  # one array
    assert "submitted 2 run(s) as Slurm job array " in output
    _wait_for_states(list(jobs.values()), "COMPLETED")
    ours, theirs = (json.loads((out / "results.json").read_text()) for out in (slurm, local))
    assert _comparable(ours, slurm) == _comparable(theirs, local)
    assert ours["failed_runs"] == [] and len(ours["methods"]) == 2


@needs_slurm
def test_a_cancelled_job_is_named_and_the_same_command_resumes_only_it(tiny_mt_data, tmp_path, one_thread):
    """scancel of one job mid-run: the command collects the other, names the cancelled run in
    results.md and results.json and exits 1; the same command again submits that run alone, which
    resumes from its checkpoint_last.pt."""
    out = tmp_path / "cmp"
    argv = _compare_argv(tiny_mt_data["bin"], out, "plain,dropkey", "1", 8, *SLURM)
    command = _command(argv)
    dropkey = out / "runs" / "dropkey" / "seed1"
    _wait_for(lambda: _epochs_done(dropkey) >= 2, "dropkey's second epoch")
    job = json.loads((out / "jobs.json").read_text())["dropkey/seed1"]
    subprocess.run(["scancel", job], check=True)
    output, _ = command.communicate(timeout=300)
    assert command.returncode == 1, output
    assert f"dropkey/seed1: FAILED (job {job}, CANCELLED" in output, output
    # The job's Python says why: its fairseq-train ended by scancel's SIGTERM.
    assert "RuntimeError: fairseq-train failed with exit code -15" in output
    results = json.loads((out / "results.json").read_text())
    assert [(f["name"], f["seed"], f["job"], f["state"].split()[0]) for f in results["failed_runs"]] == [
        ("dropkey", 1, job, "CANCELLED")
    ]
    assert [m["name"] for m in results["methods"]] == ["plain"]
    assert f"- dropkey seed 1: job {job} CANCELLED" in (out / "results.md").read_text()
    assert results["failed_runs"][0]["log_tail"]  # the job's log's last lines, for a reader of results.json
    stopped_after = _epochs_done(dropkey)
    assert 2 <= stopped_after < 8

    lines = []
    assert compare.main(argv, log=lines.append) == 0
    assert any(line.startswith("submitted 1 run(s) as Slurm job array ") for line in lines), lines
    train_log = (dropkey / "train.log").read_text()
    assert f"Loaded checkpoint {dropkey / 'checkpoints' / 'checkpoint_last.pt'} (epoch {stopped_after + 1}" in train_log
    results = json.loads((out / "results.json").read_text())
    assert results["failed_runs"] == [] and [m["name"] for m in results["methods"]] == ["plain", "dropkey"]
    assert json.loads((dropkey / "result.json").read_text())["attempts"] == 2


@needs_slurm
def test_stopping_the_command_cancels_its_jobs(tiny_mt_data, tmp_path, one_thread):
    out = tmp_path / "cmp"
    command = _command(_compare_argv(tiny_mt_data["bin"], out, "plain,dropkey", "1", 8, *SLURM))
    _wait_for(lambda: _epochs_done(out / "runs" / "plain" / "seed1") >= 1, "plain's first epoch")
    command.send_signal(signal.SIGTERM)
    output, _ = command.communicate(timeout=120)
    assert command.returncode == 128 + signal.SIGTERM, output
    jobs = json.loads((out / "jobs.json").read_text())
    assert "stopped by SIGTERM: ended 2 job(s) cancelled: " in output, output
    _wait_for_states(list(jobs.values()), "CANCELLED")


@needs_slurm
def test_detach_leaves_the_jobs_and_the_same_command_collects_them(tiny_mt_data, tmp_path, capsys, one_thread):
    """Also: the job's options reach Slurm (squeue shows the time limit and an sbatch option given),
    and the same command with --launcher local, while the jobs run, is refused naming them (it
    trained the runs a second time, into the same folders)."""
    out = tmp_path / "cmp"
    sbatch = ["--slurm-sbatch=--comment=attn-reg-test"]  # with '=': argparse reads a lone --word as an option
    argv = _compare_argv(tiny_mt_data["bin"], out, "plain,dropkey", "1", 1, *SLURM, *sbatch)
    started = time.time()
    assert compare.main([*argv[: argv.index("--")], "--detach", *argv[argv.index("--") :]]) == 0
    assert time.time() - started < 30 and not (out / "results.json").exists()  # it did not wait
    jobs = json.loads((out / "jobs.json").read_text())
    with pytest.raises(SystemExit) as local:
        compare.main(_compare_argv(tiny_mt_data["bin"], out, "plain,dropkey", "1", 1))
    assert local.value.code == 2
    assert f"run(s) are Slurm jobs an earlier command submitted ({out / 'jobs.json'}), still queued or running" in (
        capsys.readouterr().err
    )
    queued = subprocess.run(
        ["squeue", "-h", "-r", "-j", next(iter(jobs.values())).split("_")[0], "-o", "%i %l %k"],
        capture_output=True, text=True, check=True,
    ).stdout.split("\n")  # fmt: skip
    assert sorted(line for line in queued if line) == [f"{job} 10:00 attn-reg-test" for job in sorted(jobs.values())]
    lines = []
    assert compare.main(argv, log=lines.append) == 0  # at once: the jobs are still queued or running
    assert any(line.startswith("waiting for 2 run(s) an earlier command submitted") for line in lines), "\n".join(lines)
    assert not any(line.startswith("submitted") for line in lines)
    assert json.loads((out / "jobs.json").read_text()) == jobs
    # sacct records a job's end a few seconds after its result is written.
    _wait_for_states(list(jobs.values()), "COMPLETED")
    assert [m["name"] for m in json.loads((out / "results.json").read_text())["methods"]] == ["plain", "dropkey"]


@needs_slurm
def test_an_option_sbatch_refuses_is_named_and_nothing_runs(tiny_mt_data, tmp_path, capsys, one_thread):
    out = tmp_path / "cmp"
    with pytest.raises(SystemExit) as stop:
        compare.main(
            _compare_argv(tiny_mt_data["bin"], out, "plain,dropkey", "1", 1, *SLURM, "--slurm-partition", "nosuch")
        )
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "sbatch refused the jobs, nothing was submitted (sbatch: error: invalid partition specified: nosuch" in err
    assert not (out / "jobs.json").exists() and not (out / "runs").exists()


@needs_slurm
def test_two_ranks_per_job_form_one_ddp_group(tiny_mt_data, tmp_path, one_thread, monkeypatch):
    """--slurm-tasks-per-node 2 on CPU: each task's fairseq-train is told its rank, the world size
    and the first node's address, so the two train as one gloo group (6 updates an epoch, not two
    copies of 12), and AD-DROP's logged rate is the whole job's: exactly both ranks' dropped units over
    both ranks' droppable ones (each rank's own counts written by a sitecustomize the job's processes
    import, as the environment reaches them through sbatch), and within the masks' random draws of one
    unsharded process over the same two batches per update (--update-freq 2)."""
    cell = ["--p", "0.5", "--q", "0.5", "--schedule", "always", "--epochs", "1"]
    sharded, unsharded = tmp_path / "sharded", tmp_path / "unsharded"
    counts = _count_each_ranks_ad_drop_units(tmp_path / "counting", monkeypatch)
    ranks = [*SLURM, "--slurm-tasks-per-node", "2"]
    argv = [str(tiny_mt_data["bin"]), "--out-dir", str(sharded), *cell, *ranks, "--", *TINY_MT_TRAIN]
    assert sweep_main([*argv, "--ddp-backend", "legacy_ddp"]) == 0
    monkeypatch.delenv("ATTN_REG_TEST_COUNTS")  # the unsharded run below writes none
    per_rank = {f.name: [json.loads(line) for line in f.read_text().splitlines()] for f in counts.iterdir()}
    assert sorted(per_rank) == ["rank0.jsonl", "rank1.jsonl"] and all(len(v) == 6 for v in per_rank.values())
    dropped = sum(step[0] for steps in per_rank.values() for step in steps)
    droppable = sum(step[1] for steps in per_rank.values() for step in steps)
    argv = [str(tiny_mt_data["bin"]), "--out-dir", str(unsharded), *cell, "--", *TINY_MT_TRAIN, "--update-freq", "2"]
    assert sweep_main(argv) == 0
    run = Path("runs") / "p0.5_q0.5_ga_layers-all_always" / "seed1"
    log = (sharded / run / "train.log").read_text()
    assert "'distributed_world_size': 2" in log and "'distributed_rank': 0" in log
    assert "--distributed-rank 1" in (sharded / run / "train-rank1.log").read_text().splitlines()[0]
    together, alone = (train_epoch_stats((out / run / "train.log").read_text())[1] for out in (sharded, unsharded))
    assert together["num_updates"] == alone["num_updates"] == "6"
    assert together["ad_drop_on"] == "1" and float(together["ad_drop_rate"]) == round(dropped / droppable, 4)
    assert per_rank["rank0.jsonl"] != per_rank["rank1.jsonl"]  # two ranks' own batches, both counted
    assert abs(float(together["ad_drop_rate"]) - float(alone["ad_drop_rate"])) < 0.002


# Imported by every Python process of the job (PYTHONPATH reaches them through sbatch): each rank's
# fairseq-train writes the AD-DROP units its own training steps dropped and could drop.
_COUNTING_SITECUSTOMIZE = """
import importlib.abc, importlib.util, json, os, sys

CRITERION = "attn_reg_plugin.fairseq_plugin.ad_drop_criterion"


def _counted(module):
    forward = module.ADDropCriterionMixin.forward

    def counted(self, model, sample, reduce=True):
        loss, size, log = forward(self, model, sample, reduce)
        if model.training and "ad_drop_dropped" in log:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
            with open(os.path.join(OUT, f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps([int(log["ad_drop_dropped"]), int(log["ad_drop_droppable"])]) + "\\n")
        return loss, size, log

    module.ADDropCriterionMixin.forward = counted


class _WhenImported(importlib.abc.MetaPathFinder):
    # Wraps the criterion when fairseq's --user-dir imports it: importing it here, before fairseq-train
    # configures its logging, would change the log's format.
    def find_spec(self, name, path, target=None):
        if name != CRITERION:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _counted(module)

        spec.loader.exec_module = exec_module
        return spec


OUT = os.environ.get("ATTN_REG_TEST_COUNTS")
if OUT and os.path.basename(sys.argv[0]) == "fairseq-train":
    sys.meta_path.insert(0, _WhenImported())
"""


def _count_each_ranks_ad_drop_units(folder: Path, monkeypatch) -> Path:
    """A sitecustomize on PYTHONPATH that makes each rank's fairseq-train write its own counts to
    ``folder/counts/rank<R>.jsonl`` (one line per training step); returns that folder."""
    counts = folder / "counts"
    counts.mkdir(parents=True)
    (folder / "sitecustomize.py").write_text(_COUNTING_SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("ATTN_REG_TEST_COUNTS", str(counts))
    return counts


@needs_slurm
def test_a_run_longer_than_the_time_limit_saves_is_requeued_and_completes(tiny_mt_data, tmp_path, one_thread):
    """--slurm-time 1, Slurm's least, for a run of about 2 minutes of training (80 epochs once finished in
    28 s, before the signal came, on two quiet cores: the test must not race it). Slurm signals the job
    15 s before its limit (submitit's default, 90 s, is longer than the whole job: it ended every
    run in 3-5 s, FAILED), up to a minute early (its resolution); fairseq-train saves checkpoint_last.pt there
    and exits, and submitit requeues the job (the same job id, Slurm's Restarts); it resumes from
    the checkpoint and completes. (Its requeues spent, a run is named TIMEOUT: tested without Slurm
    below.)"""
    out, cell = tmp_path / "sweep", "p0.5_q0.5_ga_layers-all_always"
    run, key = out / "runs" / cell / "seed1", f"{cell}/seed1"
    argv = [
        str(tiny_mt_data["bin"]), "--out-dir", str(out), "--p", "0.5", "--q", "0.5", "--schedule", "always",
        "--epochs", "150", "--launcher", "slurm", "--slurm-time", "1", "--slurm-max-requeues", "30",
        "--", *TINY_MT_TRAIN,
    ]  # fmt: skip
    lines = []
    done = threading.Event()
    helper = threading.Thread(target=release_requeues, args=(out, key, done), daemon=True)
    helper.start()
    try:
        status = sweep_main(argv, log=lines.append)
    finally:
        done.set()
    assert status == 0, "\n".join(lines + failed_job_logs(out))
    job = json.loads((out / "jobs.json").read_text())[key]
    attempts = json.loads((run / "attempts.json").read_text())
    ends = [a["end"] for a in attempts]
    assert ends[-1] == "finished" and set(ends[:-1]) == {"saved and requeued at the Slurm job's time limit"}, ends
    # Signalled 15 s before the 1-minute limit, not 90 s (which ended it in 3-5 s, unsaved); Slurm
    # may send it up to a minute early, its resolution: each attempt saved some epochs.
    assert attempts[0]["seconds"] > 10 and attempts[1]["resumed_from_epoch"] > 1, attempts
    log = (run / "train.log").read_text()
    assert log.count("attn_reg: saved checkpoint_last.pt on the job's time-limit signal") >= 1
    assert log.count("Loaded checkpoint") >= 1
    result = json.loads((run / "result.json").read_text())
    assert result["epochs"] == 150 and len(result["resumed_at_epochs"]) >= 1
    md = (out / "results.md").read_text()
    assert f"- {cell} seed 1: resumed at epoch " in md and "give --rebuild-batches after '--'" in md
    console = "\n".join(lines)  # the resume's notice, not only in the job's log
    assert f"{key}: finished (job {job}); resumed at epoch " in console and "--rebuild-batches" in console, console
    shown = job_when_ended(job)
    # A requeue while it translates (after training) is not a training attempt: at least one per save.
    restarts = int(shown.split("Restarts=", 1)[1].split()[0])
    assert "JobState=COMPLETED" in shown and restarts >= len(ends) - 1, shown


def test_a_run_whose_requeues_ran_out_is_named_timeout(tmp_path):
    """submitit's last word on a checkpointable job signalled once more than --slurm-max-requeues
    allows (sacct says FAILED) names the run TIMEOUT, with the limit and the requeues; its
    attempt's end in attempts.json says so."""
    from attn_reg_plugin.sweep import launcher, runs

    log = tmp_path / "17_0_log.err"
    log.write_text(
        "submitit WARNING (2026-11-28 04:03:58,091) - Caught signal SIGUSR2 on vm: this job is timed-out.\n"
        "submitit INFO (2026-11-28 04:04:00,101) - Job not requeued because: timed-out too many times.\n"
    )
    job = type("Job", (), {"job_id": "17", "state": "FAILED", "paths": type("P", (), {"stderr": log})})()
    job.get_info = lambda mode="standard": {"State": "FAILED"}
    opts = type("Opts", (), {"slurm_time": 1, "slurm_max_requeues": 0, "out_dir": tmp_path})()
    failure = launcher._failure({"method": "plain", "args": []}, 1, job, opts, {})
    assert failure["state"] == "TIMEOUT (after 0 requeue(s) at the 1-minute limit)", failure
    from submitit.core.utils import UncompletedJobError

    spent = UncompletedJobError("Job not requeued because: timed-out too many times.")
    assert runs._attempt_end(spent) == "saved at the Slurm job's time limit, not requeued: --slurm-max-requeues spent"
    assert runs._attempt_end(SystemExit(0)) == "saved and requeued at the Slurm job's time limit"


def test_a_job_whose_requeue_raised_is_waited_for_until_it_finishes(tmp_path, monkeypatch):
    """CI, a run at the time limit: the job's `scontrol requeue` was ended by the requeue itself
    (SIGTERM), so submitit wrote that error as the job's result (done) while Slurm ran the job again;
    the command named the run FAILED (state REQUEUED) and its result came later. A done job that
    sacct has queued or running again is waited for: here REQUEUED, PENDING, RUNNING, then COMPLETED
    with its result written, and the run is finished, not failed."""
    from attn_reg_plugin.sweep import launcher

    states = ["REQUEUED", "PENDING", "RUNNING", "COMPLETED"]
    job = type("SlurmJob", (), {"job_id": "7_0", "paths": type("P", (), {"stderr": tmp_path / "7_0_log.err"})})()
    job.done = lambda: True  # the error's result file exists from the first look on
    job.get_info = lambda mode="standard": {"State": states.pop(0) if len(states) > 1 else states[0]}
    type(job).state = property(lambda self: states[0])
    monkeypatch.setattr(launcher, "POLL_SECONDS", 0.0)
    monkeypatch.setattr(launcher, "_finished", lambda *run: states == ["COMPLETED"])
    monkeypatch.setattr(launcher, "_resumed", lambda *run: "")
    lines = []
    opts = type("Opts", (), {"jobs": 1})()
    failed = launcher._wait({"plain/seed1": job}, [], {"plain/seed1": ({}, 1)}, None, opts, {}, lines.append, None)
    assert failed == [] and lines == ["[1/1] plain/seed1: finished (job 7_0)"], (failed, lines)


def test_a_finished_runs_job_ignores_the_time_limit_signal():
    """A run that ends as Slurm's time-limit signal comes: the job neither requeues nor dies of it while
    submitit exits (CI saw a finished run's job end FAILED, exit 140: killed by SIGUSR2). RunJob ignores
    the signal once the run has returned, not before (a running job must still save and requeue)."""
    from attn_reg_plugin.sweep import launcher

    kept = signal.getsignal(signal.SIGUSR2)
    seen = []

    def job(cell, seed, opts, settings):
        seen.append(signal.getsignal(signal.SIGUSR2))
        return {"done": seed}

    try:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        assert launcher.RunJob(job)({}, 3, None, {}) == {"done": 3}
        assert seen == [signal.SIG_DFL] and signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR2)  # ignored: this process goes on
    finally:
        signal.signal(signal.SIGUSR2, kept)


def test_a_scancel_the_controller_refuses_is_retried_then_named(tmp_path):
    """A busy slurmctld answers scancel with an error; submitit's unchecked cancel dropped it and the
    command said "cancelled" of a job still running. Each job's scancel is checked: a refusal is
    tried again, and one refused every time is named, not counted as cancelled. The scancel here is
    a script refusing the first N calls per job (N from the job id's suffix)."""
    pytest.importorskip("submitit")
    from submitit.slurm.slurm import SlurmJob

    from attn_reg_plugin.sweep import launcher

    scancel = tmp_path / "scancel"
    scancel.write_text(
        "#!/bin/sh\n"
        f'n=$(cat "{tmp_path}/$1" 2>/dev/null || echo 0); echo $((n + 1)) > "{tmp_path}/$1"\n'
        'if [ "$n" -lt "${1#*r}" ]; then echo "scancel: error: Socket timed out on send/recv operation" >&2; exit 1; fi\n'
    )
    scancel.chmod(0o755)
    jobs = [SlurmJob(tmp_path, job_id) for job_id in ("5r0", "6r2", "7r9")]
    for job in jobs:
        job._cancel_command = str(scancel)  # submitit runs [_cancel_command, job_id]
    cancelled, refused = launcher.cancel_jobs(jobs, tries=3, pause_s=0)
    assert cancelled == ["5r0", "6r2"]
    assert (
        len(refused) == 1
        and refused[0].startswith("7r9: Command '['")
        and "returned non-zero exit status 1" in refused[0]
    )
    assert [int((tmp_path / j).read_text()) for j in ("5r0", "6r2", "7r9")] == [1, 3, 3]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="--jobs 2 needs 2 cores")
def test_local_jobs_run_at_once(tiny_mt_data, tmp_path, one_thread):
    """--launcher local --jobs 2: the two runs train at the same time (submitit's local jobs), and are
    collected as the command's own loop collects them."""
    out = tmp_path / "cmp"
    assert compare.main(_compare_argv(tiny_mt_data["bin"], out, "plain,dropkey", "1", 1, "--jobs", "2")) == 0
    attempts = {
        name: json.loads((out / "runs" / name / "seed1" / "attempts.json").read_text())[0]
        for name in ("plain", "dropkey")
    }
    starts = sorted(time.mktime(time.strptime(a["started"], "%Y-%m-%d %H:%M:%S")) for a in attempts.values())
    assert starts[1] - starts[0] < min(a["seconds"] for a in attempts.values())  # one began before the other ended
    assert any((out / "jobs").glob("*_0_log.out"))  # submitit's local jobs ran them
    results = json.loads((out / "results.json").read_text())
    assert results["failed_runs"] == [] and [m["name"] for m in results["methods"]] == ["plain", "dropkey"]


# -- the launcher's options, refused before anything runs (no Slurm needed) -----------------------
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--jobs", "0"], "--jobs must be an integer from 1 to this machine's"),
        (["--jobs", str((os.cpu_count() or 1) + 1)], "--jobs must be an integer from 1 to this machine's"),
        (["--slurm-partition", "gpu"], "--slurm-partition: options of --launcher slurm"),
        (["--detach"], "--detach: options of --launcher slurm"),
        (["--launcher", "slurm", "--jobs", "2"], "--jobs is --launcher local's"),
        (["--launcher", "slurm", "--slurm-time", "0"], "--slurm-time must be an integer >= 1, got 0"),
        (["--launcher", "slurm", "--slurm-max-requeues", "-1"], "--slurm-max-requeues must be an integer >= 0"),
        (["--slurm-max-requeues", "1"], "--slurm-max-requeues: options of --launcher slurm"),
        (
            ["--launcher", "slurm", "--slurm-array-parallelism", "0"],
            "--slurm-array-parallelism must be an integer >= 1",
        ),
        (["--launcher", "slurm", "--slurm-sbatch", "constraint=volta"], "--slurm-sbatch takes sbatch's long options"),
        (
            ["--launcher", "slurm", "--slurm-tasks-per-node", "2"],
            "--slurm-tasks-per-node 2 with --cpu: give --ddp-backend",
        ),
        (["--launcher", "cluster"], "argument --launcher: invalid choice: 'cluster'"),
    ],
)
def test_bad_launcher_options_are_refused_before_anything_runs(tiny_mt_data, tmp_path, capsys, extra, message):
    out = tmp_path / "cmp"
    with pytest.raises(SystemExit) as stop:
        compare.main(_compare_argv(tiny_mt_data["bin"], out, "plain,dropkey", "1", 1, *extra))
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_several_ranks_without_gpus_or_cpu_are_refused_before_anything_runs(tiny_mt_data, tmp_path, capsys):
    """Without --cpu fairseq's ranks take nccl, which a node without GPUs lacks: every job failed
    in 5 s ("Distributed package doesn't have NCCL built in") and collecting resubmitted them."""
    out = tmp_path / "cmp"
    gpu_train = [a for a in TINY_MT_TRAIN if a != "--cpu"]
    argv = [
        str(tiny_mt_data["bin"]),
        "--out-dir",
        str(out),
        "--methods",
        "plain,dropkey",
        "--seeds",
        "1",
        "--epochs",
        "1",
    ]
    with pytest.raises(SystemExit) as stop:
        compare.main([*argv, "--launcher", "slurm", "--slurm-tasks-per-node", "2", "--", *gpu_train])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--slurm-tasks-per-node 2 without GPUs: give --slurm-gpus-per-node" in err and "--cpu" in err, err
    assert not out.exists()


def test_a_run_of_another_world_size_in_the_same_out_dir_is_refused(tiny_mt_data, tmp_path, capsys, monkeypatch):
    """The ranks per run are a setting (sweep.json, results.json's settings): an update sums every
    rank's batches, so 2 ranks are not the 1-rank runs an out-dir holds."""
    from attn_reg_plugin.sweep import launcher

    monkeypatch.setattr(launcher, "launch_and_collect", lambda *a: None)  # settings recorded, nothing run
    out = tmp_path / "cmp"
    ddp = ["--ddp-backend", "legacy_ddp"]
    assert compare.main([*_compare_argv(tiny_mt_data["bin"], out, "plain,dropkey", "1", 1), *ddp]) == 0
    saved = json.loads((out / "sweep.json").read_text())
    assert saved.pop("world_size") == 1
    (out / "sweep.json").write_text(json.dumps(saved))  # an out-dir made before world_size was recorded: 1 rank
    assert compare.main([*_compare_argv(tiny_mt_data["bin"], out, "plain,dropkey", "1", 1), *ddp]) == 0
    submitted = []
    monkeypatch.setattr(launcher, "_submit_array", lambda *a: submitted.append(a))
    ranks = ["--launcher", "slurm", "--slurm-tasks-per-node", "2"]
    with pytest.raises(SystemExit) as stop:
        compare.main([*_compare_argv(tiny_mt_data["bin"], out, "plain,dropkey", "1", 1, *ranks), *ddp])
    assert stop.value.code == 2 and not submitted
    assert "world_size: 1 then, 2 now" in capsys.readouterr().err


def test_help_shows_the_launcher_options(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--help"])
    text = capsys.readouterr().out
    for option in ("--launcher {local,slurm}", "--jobs", "--detach", "--slurm-partition", "--slurm-time",
                   "--slurm-gpus-per-node", "--slurm-tasks-per-node", "--slurm-cpus-per-task", "--slurm-mem",
                   "--slurm-account", "--slurm-qos", "--slurm-sbatch", "--slurm-array-parallelism"):  # fmt: skip
        assert option in text


def test_without_sinfo_the_slurm_tests_say_why_they_skip(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no sinfo on it
    assert slurm_unavailable().startswith("no Slurm here: sinfo is not installed")
