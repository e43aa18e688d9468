#!/usr/bin/env bash
# A one-node Slurm on this machine, for the launcher's tests (tests/test_mt_slurm.py): Debian's
# slurm-wlm and munge, a munge key, a slurm.conf with this host as the only node (its real CPUs and
# memory, from `slurmd -C`) in one partition, then munged, slurmctld and slurmd. Run as root.
# With accounting (slurmdbd on a local MariaDB), as on a real cluster: submitit reads how a job
# ended (COMPLETED, CANCELLED, FAILED) from sacct, which answers only with accounting.
# Idempotent: a cluster that already answers `sinfo` is left as it is. Debian/Ubuntu only.
set -euo pipefail

# Answers = the node is idle and accounting answers too (sacct reads the database through slurmdbd:
# a database gone since, e.g. its starter's session ended, leaves every job's state UNKNOWN).
if command -v sinfo >/dev/null && timeout 10 sinfo -h -o %T 2>/dev/null | grep -q idle \
    && timeout 10 sacct -n -X >/dev/null 2>&1; then
    echo "slurm-up: Slurm already answers: $(sinfo -h -o 'partition %P, %D node (%N), %c CPUs, %T')"
    exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null; then
    apt-get update -q >/dev/null  # a fresh machine's package lists may be stale or empty
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm slurmdbd munge mariadb-server >/dev/null
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
install -d -o slurm -g slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm

# slurm.conf: this host, as slurmd sees it; processes tracked without cgroups (none in a container).
host=$(hostname -s)
node=$(slurmd -C | head -1)  # NodeName=<host> CPUs=... RealMemory=...
cat >/etc/slurm/slurm.conf <<CONF
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
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
# Jobs share the node core by core; memory is not a consumable (a test job asks for none).
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# scancel's SIGTERM, then SIGKILL 5 s later: fairseq-train ends well within it.
KillWait=5
MinJobAge=300
$node
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF

# The accounting database: MariaDB on its socket only, a slurm user, and slurmdbd in front of it.
install -d -o mysql -g mysql /run/mysqld
if [ ! -d /var/lib/mysql/mysql ]; then
    mariadb-install-db --user=mysql --skip-test-db >/dev/null
fi
if ! pgrep -x mariadbd >/dev/null; then
    # In a session of its own: it outlives whatever started this script (the daemons below fork).
    setsid runuser -u mysql -- /usr/sbin/mariadbd --skip-networking --socket=/run/mysqld/mysqld.sock \
        >>/var/log/slurm/mariadb.log 2>&1 </dev/null &
    for _ in $(seq 30); do mariadb -e 'select 1' >/dev/null 2>&1 && break; sleep 1; done
fi
mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
cat >/etc/slurm/slurmdbd.conf <<CONF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=slurm
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurmdbd.pid
CONF
chown slurm:slurm /etc/slurm/slurmdbd.conf
chmod 0600 /etc/slurm/slurmdbd.conf
pgrep -x slurmdbd >/dev/null || slurmdbd
for _ in $(seq 30); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 1; done
sacctmgr -n list cluster format=cluster | grep -qw ci || sacctmgr -i add cluster ci >/dev/null

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
