"""The options of where the runs run (``--launcher``, ``--jobs``, ``--detach``, the Slurm job's), declared
once for attn-reg-mt-sweep and attn-reg-mt-compare and checked before anything runs. What they do is
:mod:`.launcher` (and :mod:`.ranks` for several ranks per job); this module imports neither."""

from __future__ import annotations

import argparse
import os
import shlex
from typing import Dict

LAUNCHERS = ("local", "slurm")
# Distributed training on CPU: fairseq's pytorch_ddp passes device_ids, which torch refuses for a
# CPU module; these two wrap it without.
CPU_DDP_BACKENDS = ("legacy_ddp", "no_c10d")


# What --slurm-tasks-per-node sets: fairseq-train's ranks (attn-reg-mt-sweep and -compare).
FAIRSEQ_RANKS_HELP = "fairseq-train ranks per job, >= 1 (default 1): one DDP group, rank from SLURM_PROCID"


def add_launcher_options(ap: argparse.ArgumentParser, ranks_help: str = FAIRSEQ_RANKS_HELP) -> None:
    """``--launcher``, ``--jobs``, ``--detach`` and the Slurm job's options (attn-reg-mt-sweep and -compare;
    attn-reg-cls-compare with its own ``ranks_help``, what one job's tasks are there)."""
    group = ap.add_argument_group(
        "where the runs run", "local: this machine; slurm: one Slurm job per run, as one job array (submitit)"
    )
    group.add_argument("--launcher", choices=LAUNCHERS, default="local", help="local (default) or slurm")
    group.add_argument(
        "--jobs", type=int, default=1, metavar="N", help="local: runs at a time, 1 to this machine's cores (default 1)"
    )
    group.add_argument(
        "--detach",
        action="store_true",
        help="slurm: submit and exit, jobs left running; the same command later collects them",
    )
    _add_slurm_options(group, ranks_help)


def _add_slurm_options(group, ranks_help: str) -> None:
    """The Slurm job's options (``--launcher slurm``'s)."""
    group.add_argument(
        "--slurm-partition", metavar="NAME", help="sbatch --partition (default: the cluster's default partition)"
    )
    group.add_argument(
        "--slurm-time",
        type=int,
        default=24 * 60,
        metavar="MINUTES",
        help="minutes per job, >= 1 (default 1440); a run still training then saves its checkpoint and is "
        "requeued (Slurm signals it 5%% of the limit before, 15 to 90 s)",
    )
    group.add_argument(
        "--slurm-max-requeues",
        type=int,
        default=3,
        metavar="N",
        help="requeues of a run at the time limit, >= 0 (default 3); a run that needs more ends as TIMEOUT",
    )
    group.add_argument("--slurm-gpus-per-node", type=int, default=0, metavar="N", help="GPUs per job, >= 0 (default 0)")
    group.add_argument(
        "--slurm-tasks-per-node",
        type=int,
        default=1,
        metavar="N",
        help=ranks_help,
    )
    group.add_argument(
        "--slurm-cpus-per-task", type=int, default=1, metavar="N", help="CPUs per rank, >= 1 (default 1)"
    )
    group.add_argument(
        "--slurm-mem", metavar="SIZE", help="sbatch --mem, memory per node, e.g. 32G (default: the cluster's)"
    )
    group.add_argument("--slurm-account", metavar="NAME", help="sbatch --account")
    group.add_argument("--slurm-qos", metavar="NAME", help="sbatch --qos")
    group.add_argument(
        "--slurm-sbatch",
        default="",
        metavar="OPTIONS",
        help="further sbatch options, one string after '=': --slurm-sbatch='--constraint=volta32gb --exclude=node7'",
    )
    group.add_argument(
        "--slurm-array-parallelism",
        type=int,
        default=256,
        metavar="N",
        help="jobs of the array run at once, >= 1 (default 256)",
    )


SLURM_ONLY = (
    "partition",
    "time",
    "max_requeues",
    "gpus_per_node",
    "tasks_per_node",
    "cpus_per_task",
    "mem",
    "account",
    "qos",
)


def check_launcher(ap, opts) -> None:
    """The launcher's options, each in its range and with its launcher; bad ones are ``ap.error``
    before anything runs. Sets ``opts.sbatch`` (``--slurm-sbatch`` as submitit's parameters)."""
    cores = os.cpu_count() or 1
    if not 1 <= opts.jobs <= cores:
        ap.error(f"--jobs must be an integer from 1 to this machine's {cores} cores, got {opts.jobs}")
    for option, low in (
        ("time", 1),
        ("max_requeues", 0),
        ("gpus_per_node", 0),
        ("tasks_per_node", 1),
        ("cpus_per_task", 1),
    ):
        value = getattr(opts, f"slurm_{option}")
        if value < low:
            ap.error(f"--slurm-{option.replace('_', '-')} must be an integer >= {low}, got {value}")
    if opts.slurm_array_parallelism < 1:
        ap.error(f"--slurm-array-parallelism must be an integer >= 1, got {opts.slurm_array_parallelism}")
    opts.sbatch = _sbatch_options(ap, opts.slurm_sbatch)
    given = [
        f"--slurm-{o.replace('_', '-')}"
        for o in SLURM_ONLY
        if getattr(opts, f"slurm_{o}") != ap.get_default(f"slurm_{o}")
    ]
    given += ["--slurm-sbatch"] * bool(opts.sbatch) + ["--detach"] * opts.detach
    if opts.launcher == "local" and given:
        ap.error(f"{', '.join(given)}: options of --launcher slurm (this command runs --launcher local)")
    if opts.launcher == "slurm" and opts.jobs != 1:
        ap.error("--jobs is --launcher local's; with slurm, --slurm-array-parallelism bounds the jobs at once")
    if opts.launcher == "slurm" or opts.jobs > 1:
        try:
            import submitit  # noqa: F401
        except ImportError:
            option = "--launcher slurm" if opts.launcher == "slurm" else f"--jobs {opts.jobs}"
            ap.error(f"{option} needs submitit: pip install 'attn_reg_plugin[cluster]'")


def world_size(opts) -> int:
    """A run's fairseq-train ranks: ``--slurm-tasks-per-node`` with slurm, else ``--distributed-world-size``
    after '--' (1 when not given)."""
    if opts.launcher == "slurm":
        return opts.slurm_tasks_per_node
    args = list(opts.train_args)
    given = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--distributed-world-size"]
    given += [a.split("=", 1)[1] for a in args if a.startswith("--distributed-world-size=")]
    return int(given[-1]) if given and given[-1].isdigit() else 1


def with_world_size(saved: dict) -> dict:
    """Settings recorded before the world size was one of them, as 1 rank's: what every local run
    and every Slurm run of the default --slurm-tasks-per-node was (a --distributed-world-size
    after '--' is in their train_args, so it still tells)."""
    if "world_size" in saved or "train_args" not in saved:
        return saved
    train_args = saved["train_args"]
    return {**saved, "world_size": world_size(argparse.Namespace(launcher="local", train_args=train_args))}


def _sbatch_options(ap, text: str) -> Dict[str, object]:
    """``'--constraint=volta --exclusive'`` as submitit's ``slurm_additional_parameters``."""
    options: Dict[str, object] = {}
    for word in shlex.split(text):
        if not word.startswith("--") or len(word) < 3:
            ap.error(f"--slurm-sbatch takes sbatch's long options, --name or --name=value; got {word!r}")
        name, _, value = word[2:].partition("=")
        options[name] = value if value else True
    return options


def check_ranks(ap, opts) -> None:
    """Several ranks per job on CPU need a DDP backend that wraps a CPU module: refused otherwise,
    before anything is submitted."""
    if opts.slurm_tasks_per_node == 1:
        return
    if "--cpu" not in opts.train_args and opts.slurm_gpus_per_node == 0:
        ap.error(
            f"--slurm-tasks-per-node {opts.slurm_tasks_per_node} without GPUs: give --slurm-gpus-per-node "
            f"(one GPU per rank: {opts.slurm_tasks_per_node}), or --cpu after '--' for CPU ranks over gloo"
        )
    if "--cpu" not in opts.train_args:
        return
    args = list(opts.train_args)
    backend = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--ddp-backend"), None)
    backend = next((a.split("=", 1)[1] for a in args if a.startswith("--ddp-backend=")), backend)
    if backend not in CPU_DDP_BACKENDS:
        ap.error(
            f"--slurm-tasks-per-node {opts.slurm_tasks_per_node} with --cpu: give --ddp-backend "
            f"{' or '.join(CPU_DDP_BACKENDS)} after '--' (fairseq's pytorch_ddp cannot wrap a CPU model); got {backend}"
        )
