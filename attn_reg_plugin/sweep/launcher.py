"""Where the runs run: ``--launcher local`` (this machine, ``--jobs`` runs at a time) or ``slurm`` (each
missing (cell, seed) run one element of one Slurm job array, through submitit).

A run is the same in every launcher: its command's :class:`RunKind` job (attn-reg-mt-sweep's and
-compare's :data:`MT_RUNS`: fairseq-train with its resume, then fairseq-generate and sacrebleu of the
valid and test splits; attn-reg-cls-compare's: a Hugging Face Trainer run scored on dev and test)
writes ``runs/<cell>/seed<S>/result.json``. The command then collects those files with its RunKind's
``collect``. ``local`` with ``--jobs 1`` runs them in the command's own process, one after another
(the runs' progress on the console); every other choice
submits them through submitit (``--jobs N``: its local executor, N jobs at a time) and waits.
``OUT/jobs.json`` names the jobs that were submitted, so that a later command (after ``--detach``, a
lost connection, a failure) waits for those still queued or running and resubmits only the runs that
neither finished nor are under way. Submitit's files and each job's log are in ``OUT/jobs/``.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from .options import SweepError, cell_name
from .report import write_json
from .runs import claim_run, fairseq_run_identity, finished_result, identity_conflict, run_cells, run_dir, run_seed

POLL_SECONDS = 2.0
JOB_LOG_LINES = 15  # of a failed job's log, in results.json
FINAL_STATE_SECONDS = 30.0
# A Python exception's line in a job's log (the last one says why the run failed).
PYTHON_ERROR = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Stopped)\b: ")
# submitit's last word on a checkpointable job whose requeues ran out (sacct says FAILED).
TIMED_OUT = "Job not requeued because: timed-out too many times"
# Still queued or running, as sacct says (submitit's own list); UNKNOWN too: sacct can lag a job
# submitted a moment ago, and resubmitting a live run would train it twice into the same folder.
UNFINISHED_STATES = (
    "RUNNING", "PENDING", "REQUEUED", "COMPLETING", "READY", "CONFIGURING", "RESIZING", "SUSPENDED", "PREEMPTED",
    "UNKNOWN",
)  # fmt: skip


# -- the runs a command still lacks ----------------------------------------------------------------
def missing_runs(cells: List[dict], opts, settings: dict) -> List[Tuple[dict, int]]:
    """Every (cell, seed) of this command that has not finished."""
    return [(cell, seed) for cell in cells for seed in opts.seeds if not _finished(cell, seed, opts, settings)]


def _finished(cell: dict, seed: int, opts, settings: dict) -> bool:
    return finished_result(run_dir(opts.out_dir, cell, seed), cell, settings) is not None


def _resumed(cell: dict, seed: int, opts, settings: dict) -> str:
    """A finished job's resumes (a Slurm requeue, an earlier failed job), for the console line: its
    notice is otherwise only in the job's log."""
    from .report import resumed_text

    text = resumed_text(finished_result(run_dir(opts.out_dir, cell, seed), cell, settings) or {})
    return f"; {text}" if text else ""


def signal_delay(minutes: int) -> int:
    """Seconds before a job's limit that Slurm signals it to save and requeue: 5% of the limit, at
    least 15 s (a save, and Slurm's signal resolution) and at most submitit's 90 s."""
    return min(90, max(15, minutes * 3))


class RunJob:
    """A run's ``job`` (``job(cell, seed, opts, settings)``, a module-level function: submitit pickles
    it by name) as submitit's checkpointable callable: on the time-limit signal (Slurm sends SIGUSR2
    :func:`signal_delay` seconds before the limit) :meth:`checkpoint` waits for the job's children
    (fairseq-train saves ``checkpoint_last.pt`` on that signal and exits, :mod:`attn_reg_plugin.time_limit`;
    attn-reg-cls-compare's job trains in its own process, which saves its checkpoint before this is
    called, :class:`processes.DeferredStop`); submitit then requeues the job, which resumes as the
    job resumes. After ``--slurm-max-requeues`` requeues the run ends, named TIMEOUT."""

    def __init__(self, job: Callable[..., Optional[dict]]):
        self.job = job

    def __call__(self, cell: dict, seed: int, opts, settings: dict) -> Optional[dict]:
        result = self.job(cell, seed, opts, settings)
        ignore_time_limit_signal()
        return result

    def checkpoint(self, *args):
        import signal
        import subprocess

        import submitit

        from .processes import RUNNING, end_child

        for proc in list(RUNNING):
            proc.send_signal(signal.SIGUSR2)  # Slurm signals it too; a second one changes nothing
            try:
                proc.wait(signal_delay(args[2].slurm_time) - 5)
            except subprocess.TimeoutExpired:  # still saving as the limit nears
                end_child(proc)
        return submitit.helpers.DelayedSubmission(self, *args)


def ignore_time_limit_signal() -> None:
    """A finished run's job ignores the time-limit signal from then on. Slurm sends it at a fixed time
    before the limit, and a run may end just then: caught, it requeued a finished job; arriving as
    submitit exits, it killed the process (exit 140, SIGUSR2), and Slurm recorded the job FAILED with
    its result written. Only in the main thread (Python refuses handlers elsewhere)."""
    import signal
    import threading

    if hasattr(signal, "SIGUSR2") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def run_job(cell: dict, seed: int, opts, settings: dict) -> Optional[dict]:
    """One run, as one submitit job: each of its tasks a fairseq-train rank (:func:`ranks.rank_args`);
    rank 0 records, translates and scores, as :func:`runs.run_seed` does in a local run."""
    import os

    from ..time_limit import ENV
    from .ranks import rank_args, train_other_rank

    if opts.launcher == "slurm":
        os.environ[ENV] = "USR2"  # its fairseq-train children save on the time-limit signal
    seed_dir = run_dir(opts.out_dir, cell, seed)
    rank, distributed = rank_args(opts.train_args)
    if rank > 0:
        train_other_rank(cell, seed, opts, seed_dir, rank, distributed)
        return None
    return run_seed(cell, seed, opts, settings, seed_dir, print, distributed)


class RunKind(NamedTuple):
    """What one command's runs are, for the launcher shared by attn-reg-mt-sweep, -mt-compare and
    -cls-compare: ``job(cell, seed, opts, settings)`` runs one and writes its ``result.json`` (a
    module-level function, for submitit); ``identity(cell, seed, opts)`` is its command line, recorded
    in ``command.json`` (a folder started with another is refused); ``collect(cells, opts, settings,
    log, collect_only)`` runs what is missing in this process (``collect_only``: only reads the finished
    runs) and returns every cell's record; ``arguments`` names what an identity lists, in its refusal."""

    job: Callable[..., Optional[dict]]
    identity: Callable[..., List[str]]
    collect: Callable[..., List[dict]]
    arguments: str


MT_RUNS = RunKind(run_job, fairseq_run_identity, run_cells, "fairseq-train arguments")


# -- submitting, waiting, collecting ---------------------------------------------------------------
def _executor(opts):
    import submitit

    folder = opts.out_dir / "jobs"
    if opts.launcher == "local":
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(timeout_min=opts.slurm_time)
        return executor
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=opts.slurm_max_requeues)
    executor.update_parameters(
        job_name=f"attn-reg:{opts.out_dir.name}",
        time=opts.slurm_time,
        signal_delay_s=signal_delay(opts.slurm_time),
        ntasks_per_node=opts.slurm_tasks_per_node,
        cpus_per_task=opts.slurm_cpus_per_task,
        array_parallelism=opts.slurm_array_parallelism,
        **({"gpus_per_node": opts.slurm_gpus_per_node} if opts.slurm_gpus_per_node else {}),
        **{
            key: getattr(opts, f"slurm_{key}")
            for key in ("partition", "mem", "account", "qos")
            if getattr(opts, f"slurm_{key}")
        },
        additional_parameters=opts.sbatch,
    )
    return executor


def launch(cells: List[dict], opts, settings: dict, log: Callable[[str], None], kind: RunKind) -> Optional[List[dict]]:
    """Run what is missing as jobs and wait for them (local ``--jobs 1``: the command runs them
    itself). First refused, as :class:`SweepError`: a run folder started with other arguments
    (:func:`runs.identity_conflict`), and with ``local`` a run an earlier command's Slurm job still
    holds. Returns the failed runs (name, seed, job, state, its log's last lines), or None when the
    command runs them itself or ``--detach`` left them running."""
    missing = missing_runs(cells, opts, settings)
    conflicts = [
        identity_conflict(run_dir(opts.out_dir, *run), kind.identity(*run, opts), kind.arguments) for run in missing
    ]
    if any(conflicts):  # a folder started with other arguments: refused before anything runs
        raise SweepError("; ".join(c for c in conflicts if c))
    jobs = _under_way(opts, missing, log)
    if opts.launcher == "local" and opts.jobs == 1:
        return None
    queued = [run for run in missing if _key(*run) not in jobs]
    executor = _executor(opts)
    if opts.launcher == "slurm" and queued:
        submitted = _submit_array(executor, queued, opts, settings, kind.job)
        for cell, seed in queued:  # queued is started: a later command with other arguments is refused
            claim_run(run_dir(opts.out_dir, cell, seed), kind.identity(cell, seed, opts), kind.arguments)
        jobs.update({_key(*run): job for run, job in zip(queued, submitted)})
        _record_jobs(opts.out_dir, jobs)
        array = submitted[0].job_id.split("_")[0]
        log(f"submitted {len(queued)} run(s) as Slurm job array {array}; logs in {opts.out_dir / 'jobs'}")
        queued = []
    if opts.detach:
        log(f"--detach: {len(jobs)} job(s) left to Slurm; the same command again collects them")
        return None
    return _wait(jobs, queued, {_key(*run): run for run in missing}, executor, opts, settings, log, kind.job)


def _submit_array(executor, runs: List[Tuple[dict, int]], opts, settings: dict, job: Callable) -> list:
    """``runs`` as one job array; sbatch's refusal (a partition, account or qos the cluster lacks, a
    bad ``--slurm-sbatch`` option) is a :class:`SweepError` quoting it."""
    from submitit.core.utils import FailedJobError

    try:
        with executor.batch():
            return [executor.submit(RunJob(job), cell, seed, opts, settings) for cell, seed in runs]
    except FailedJobError as e:
        raise SweepError(
            f"sbatch refused the jobs, nothing was submitted ({' '.join(str(e).split())}): check --slurm-partition, "
            "--slurm-account, --slurm-qos, --slurm-mem, --slurm-gpus-per-node and --slurm-sbatch"
        ) from None


def _key(cell: dict, seed: int) -> str:
    return f"{cell_name(cell)}/seed{seed}"


def _record_jobs(out: Path, jobs: Dict[str, object]) -> None:
    """``OUT/jobs.json``: each run's Slurm job, for a later command to wait for instead of resubmitting."""
    recorded = _recorded_jobs(out)
    recorded.update({key: job.job_id for key, job in jobs.items() if not _is_local(job)})
    write_json(out / "jobs.json", recorded)


def _recorded_jobs(out: Path) -> Dict[str, str]:
    path = out / "jobs.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _is_local(job) -> bool:
    return type(job).__name__ == "LocalJob"


def _under_way(opts, missing: List[Tuple[dict, int]], log: Callable[[str], None]) -> Dict[str, object]:
    """The missing runs' Slurm jobs that an earlier command submitted and that are still queued or running."""
    recorded = _recorded_jobs(opts.out_dir)
    wanted = {_key(*run) for run in missing} & set(recorded)
    if not wanted:
        return {}
    try:
        import submitit
    except ImportError:  # --launcher local without the cluster extra: it cannot ask Slurm about them
        raise SweepError(
            f"{opts.out_dir / 'jobs.json'} names run(s) of this command as Slurm jobs an earlier command submitted ("
            + ", ".join(f"{k}: job {recorded[k]}" for k in sorted(wanted))
            + "): collect them with --launcher slurm (pip install 'attn_reg_plugin[cluster]'), or delete jobs.json "
            "once they have ended"
        ) from None
    jobs = {key: submitit.SlurmJob(folder=opts.out_dir / "jobs", job_id=recorded[key]) for key in sorted(wanted)}
    submitit.SlurmJob.watcher.update()  # one sacct call for them all
    alive = {key: job for key, job in jobs.items() if job.state.upper() in UNFINISHED_STATES}
    if alive and opts.launcher == "local":  # it would train them a second time, into the same folders
        raise SweepError(
            f"--launcher local: {len(alive)} of this command's run(s) are Slurm jobs an earlier command submitted "
            f"({opts.out_dir / 'jobs.json'}), still queued or running as sacct says: "
            + ", ".join(f"{k} (job {j.job_id}, {j.state})" for k, j in alive.items())
            + ". Collect them with the same command and --launcher slurm (it waits for them), or wait for "
            "them to end (or scancel them) and run this command again"
        )
    if alive:
        log(
            f"waiting for {len(alive)} run(s) an earlier command submitted: "
            + ", ".join(f"{k} (job {j.job_id})" for k, j in alive.items())
        )
    return alive


def _wait(
    jobs: dict, queued: list, runs: dict, executor, opts, settings: dict, log: Callable[[str], None], job: Callable
) -> List[dict]:
    """Wait for ``jobs`` (by run, ``runs`` the (cell, seed) of each), submitting ``queued`` local runs
    as ``--jobs`` allows; each finished run is logged, a failed one returned. Anything that interrupts the wait (Ctrl-C, SIGTERM) cancels every
    job still queued or running (scancel through submitit) before it goes on."""
    from .processes import SweepStopped

    pending, failed, done, total = dict(jobs), [], 0, len(jobs) + len(queued)
    try:
        while pending or queued:
            while queued and len(pending) < opts.jobs:
                cell, seed = queued.pop(0)
                pending[_key(cell, seed)] = executor.submit(RunJob(job), cell, seed, opts, settings)
            for key, submitted in list(pending.items()):
                if not submitted.done() or _back_in_the_queue(submitted):
                    continue
                del pending[key]
                done += 1
                failure = _failure(*runs[key], submitted, opts, settings)
                if failure is None:
                    resumed = _resumed(*runs[key], opts, settings)
                    log(f"[{done}/{total}] {key}: finished (job {submitted.job_id}){resumed}")
                else:
                    failed.append(failure)
                    log(
                        f"[{done}/{total}] {key}: FAILED (job {submitted.job_id}, {failure['state']}): "
                        f"{failure['error']}; log {failure['log']}"
                    )
            if pending or queued:
                time.sleep(POLL_SECONDS)
    except BaseException as e:
        cancelled, refused = cancel_jobs(list(pending.values()))
        if isinstance(e, SweepStopped) and cancelled:
            e.ended.append(f"{len(cancelled)} job(s) cancelled: " + ", ".join(cancelled))
        if isinstance(e, SweepStopped) and refused:
            e.ended.append(f"{len(refused)} job(s) NOT cancelled (scancel them yourself): " + "; ".join(refused))
        raise
    return failed


CANCEL_TRIES = 3


def cancel_jobs(jobs: list, tries: int = CANCEL_TRIES, pause_s: float = 2.0) -> Tuple[List[str], List[str]]:
    """Cancel each submitit job (scancel for a Slurm job), checking that it worked: a busy
    slurmctld answers scancel with an error ("Socket timed out"), which submitit's unchecked cancel
    would drop, leaving the job running after the command said it was cancelled. Each refusal is
    retried ``tries - 1`` times; returns (the cancelled jobs' ids, "id: why" for the rest)."""
    cancelled, refused = [], []
    for job in jobs:
        for attempt in range(tries):
            try:
                job.cancel(check=True)
            except (OSError, subprocess.CalledProcessError) as error:
                if attempt == tries - 1:
                    refused.append(f"{job.job_id}: {error}")
                else:
                    time.sleep(pause_s)
            else:
                cancelled.append(str(job.job_id))
                break
    return cancelled, refused


def _failure(cell: dict, seed: int, job, opts, settings: dict) -> Optional[dict]:
    """None when the job's run finished; else what the results say of it."""
    if _finished(cell, seed, opts, settings):
        return None
    log_path = Path(job.paths.stderr)
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines() if log_path.exists() else []
    errors = [line for line in lines if PYTHON_ERROR.match(line)]
    state = _final_state(job)
    if any(TIMED_OUT in line for line in lines):  # submitit ended it after its last requeue
        state = f"TIMEOUT (after {opts.slurm_max_requeues} requeue(s) at the {opts.slurm_time}-minute limit)"
    return {
        "name": cell_name(cell),
        "seed": seed,
        "job": job.job_id,
        "state": state,
        "error": errors[-1] if errors else "no Python error in its log",
        "log": str(log_path),
        "log_tail": lines[-JOB_LOG_LINES:],
    }


def _back_in_the_queue(job) -> bool:
    """Whether a Slurm job submitit calls done is queued or running again, as sacct says. submitit
    calls a job done once its result file exists, and a job's time-limit requeue can write one: its
    ``scontrol requeue`` is a child of the job, which the requeue itself ends (SIGTERM), so the call
    raises after it took effect and submitit records that error as the job's result while Slurm runs
    the job again. Such a job is waited for. UNKNOWN is not waited on: sacct may never know the job."""
    if _is_local(job):
        return False
    job.get_info(mode="force")
    return job.state.upper() in UNFINISHED_STATES and job.state.upper() != "UNKNOWN"


def _final_state(job) -> str:
    """How the job ended, as sacct says once it knows (it lags the job's end by a few seconds; a job
    whose Python wrote its error is done for submitit before that)."""
    deadline = time.time() + FINAL_STATE_SECONDS
    while True:
        job.get_info(mode="force")
        state = job.state
        if state.upper() not in UNFINISHED_STATES or _is_local(job) or time.time() > deadline:
            return state
        time.sleep(1.0)


def launch_and_collect(
    cells: List[dict], opts, settings: dict, log: Callable[[str], None], kind: RunKind
) -> Optional[List[dict]]:
    """The records of every cell after the launcher ran ``kind``'s missing runs (``opts.failed_runs``:
    the runs whose jobs failed); None after ``--detach``; [] when no run has finished."""
    failed = launch(cells, opts, settings, log, kind)
    if opts.detach:
        return None
    opts.failed_runs = failed or []
    return kind.collect(cells, opts, settings, log, collect_only=failed is not None)


def launch_and_report(
    ap,
    cells: List[dict],
    opts,
    settings: dict,
    log: Callable[[str], None],
    kind: RunKind,
    report: Callable,
    report_failures: bool = False,
) -> int:
    """The three commands' run under their lock: :func:`launch_and_collect`, then ``report(records,
    started)`` (results.md and results.json); the exit status (1 when a job failed or none finished).
    When no run has finished and jobs failed, ``report_failures`` calls ``report([], started)`` too
    (results naming the failed runs, ``opts.failed_runs``); without it, nothing is written."""
    started = time.time()
    try:
        records = launch_and_collect(cells, opts, settings, log, kind)
    except SweepError as e:
        ap.error(str(e))
    if records is None:  # --detach
        return 0
    if not records and not (report_failures and opts.failed_runs):  # every job failed
        log("no run has finished, so there are no results yet: the same command again submits the failed runs")
        return 1
    report(records, started)
    return 1 if opts.failed_runs or not records else 0
