"""A run's fairseq-train ranks in a Slurm job of several tasks (``--slurm-tasks-per-node N``): one DDP
group, each task told its place explicitly.

fairseq's own Slurm inference does not form the group on every node: without
``--distributed-world-size`` each task trains alone (two silent copies, both logging
``distributed_world_size: 1``), and with it a CPU node's rank 1 dies in ``torch.cuda.set_device``
while rank 0 waits forever. So each task passes ``--distributed-rank`` from SLURM_PROCID, the world
size from SLURM_NTASKS and a ``tcp://`` init method on the job's first node (as submitit's
JobEnvironment reads them), with ``--distributed-no-spawn``: fairseq's inference is then skipped,
on CPU and GPU nodes alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence, Tuple

from ..prepare import fairseq_command
from .options import option_name

# The group's port on the first node, from the job's id: every task of a job computes the same,
# and two jobs sharing a node (an array) almost never collide.
PORT_BASE, PORT_SPAN = 20000, 20000


def rank_args(train_args: Sequence[str]) -> Tuple[int, List[str]]:
    """``(this task's rank, the fairseq-train options that place it in the job's DDP group)``;
    ``(0, [])`` outside a job of several tasks."""
    import submitit

    try:
        env = submitit.JobEnvironment()
    except RuntimeError:  # not in a submitit job
        return 0, []
    if env.num_tasks == 1:
        return 0, []
    port = PORT_BASE + int(env.raw_job_id) % PORT_SPAN
    args = [
        "--distributed-world-size", str(env.num_tasks), "--distributed-rank", str(env.global_rank),
        "--distributed-init-method", f"tcp://{env.hostnames[0]}:{port}", "--distributed-no-spawn",
        "--device-id", str(env.local_rank),
    ]  # fmt: skip
    if "--cpu" in train_args and "--distributed-backend" not in map(option_name, train_args):
        args += ["--distributed-backend", "gloo"]  # nccl, fairseq's default, needs GPUs
    return env.global_rank, args


def train_other_rank(cell: dict, seed: int, opts, seed_dir: Path, rank: int, distributed: List[str]) -> None:
    """fairseq-train of rank ``rank`` > 0, its output in ``train-rank<R>.log`` (fairseq logs from rank 0;
    the others write warnings and errors). Rank 0 records the run and scores it; a run already
    trained (a resubmission that only scores) starts no rank."""
    from ..time_limit import EXIT_CODE
    from .processes import run_child
    from .records import diverged_in
    from .runs import train_command

    if (seed_dir / "trained.json").exists():
        return
    cmd = [fairseq_command("fairseq-train"), *train_command(cell, seed, opts, seed_dir / "checkpoints"), *distributed]
    log = seed_dir / f"train-rank{rank}.log"
    try:
        run_child(cmd, log)
    except RuntimeError as e:
        if f"exit code {EXIT_CODE};" in str(e):  # saved on the time-limit signal: rank 0 requeues the job
            raise SystemExit(EXIT_CODE) from None
        # A diverged run ends every rank; rank 0 records it. Anything else fails the job.
        if diverged_in(log.read_text(encoding="utf-8", errors="replace")) is None:
            raise
