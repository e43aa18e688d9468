#!/usr/bin/env bash
# A one-node Slurm on this machine, for the launcher's tests (tests/test_mt_slurm.py): Debian's
# slurm-wlm and munge, a munge key, a slurm.conf with this host as the only node (its real CPUs and
# memory, from `slurmd -C`) in one partition, then munged, slurmctld and slurmd. Run as root.
# Idempotent: a cluster that already answers `sinfo` is left as it is. Debian/Ubuntu only.
set -euo pipefail

if command -v sinfo >/dev/null && timeout 10 sinfo -h -o %T 2>/dev/null | grep -q idle; then
    echo "slurm-up: Slurm already answers: $(sinfo -h -o '%P %D %T %c CPUs')"
    exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
fi

# munge: the key slurm's daemons and commands authenticate with.
install -d -o munge -g munge -m 0700 /etc/munge
install -d -o munge -g munge -m 0755 /run/munge /var/lib/munge /var/log/munge
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged

# slurm.conf: this host, as slurmd sees it; processes tracked without cgroups (none in a container).
host=$(hostname -s)
node=$(slurmd -C | head -1)  # NodeName=<host> CPUs=... RealMemory=...
install -d -o slurm -g slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
cat >/etc/slurm/slurm.conf <<EOF
ClusterName=ci
SlurmctldHost=$host
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
# Jobs share the node core by core; memory is not a consumable (a test job asks for none).
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# scancel's SIGTERM, then SIGKILL 5 s later: fairseq-train ends well within it.
KillWait=5
MinJobAge=300
$node
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 60); do
    if timeout 5 sinfo -h -o %T 2>/dev/null | grep -q idle; then
        echo "slurm-up: $(sinfo -h -o 'partition %P, %D node (%N), %c CPUs, %T')"
        exit 0
    fi
    sleep 1
done
echo "slurm-up: the node did not come up; logs in /var/log/slurm" >&2
sinfo >&2 || true
tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
