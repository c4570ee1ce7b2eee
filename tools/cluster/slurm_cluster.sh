#!/usr/bin/env bash
# A one-node Slurm cluster on localhost, with real accounting, for the tests and for trying the
# Slurm launcher on a machine without a cluster. Not for production.
#
#   bash tools/cluster/slurm_cluster.sh start [STATE_DIR]   # installs Debian's packages if missing (root), starts
#                                                    # munged, mariadbd, slurmdbd, slurmctld, slurmd
#   source STATE_DIR/env                             # SLURM_CONF for sbatch/squeue/sacct/scontrol/submitit
#   bash tools/cluster/slurm_cluster.sh stop [STATE_DIR]    # cancels the cluster's jobs, stops only the daemons
#                                                    # that `start` recorded in STATE_DIR/pids
#   bash tools/cluster/slurm_cluster.sh status [STATE_DIR]
#
# STATE_DIR (default $SPMDSPLIT_SLURM_DIR or /tmp/spmdsplit-slurm) holds every config, socket,
# database, spool, log and pid file, so nothing in /etc or /run is touched and two clusters can run
# side by side with different SPMDSPLIT_SLURM_PORT bases (ctld = base, slurmd +1, slurmdbd +2,
# mariadb +3, several nodes' slurmds +4...). Each `start` is a fresh cluster: job ids restart at 1.
#
# Why these settings (measured with Slurm 22.05 from Debian 12):
# - There is no systemd here, so every daemon is started by hand, in the foreground (-D / -F)
#   under setsid, and its pid is the one recorded.
# - proctrack/linuxproc and task/none: no cgroups needed. CPUs=4 on a 2-core machine lets 4 tasks
#   run at once; slurmd drains the node for the mismatch unless SlurmdParameters=config_overrides.
# - KillWait=5: submitit ignores SIGTERM, and the default 30 s made every cancel and requeue slow.
#   cred_expire=10 and the scheduler intervals let a requeued job start again in ~15 s, not minutes.
# - Real accounting (MariaDB + slurmdbd): without it sacct fails, submitit's job.state stays
#   UNKNOWN and the result() of a cancelled job never returns.
# - Stopped daemons can stay as zombies (nothing reaps them here), so "gone" means /proc/PID is
#   missing or its state is Z.
set -euo pipefail

cmd=${1:-}
state=$(realpath -m "${2:-${SPMDSPLIT_SLURM_DIR:-/tmp/spmdsplit-slurm}}")
base=${SPMDSPLIT_SLURM_PORT:-16817}
ctld_port=$base slurmd_port=$((base + 1)) dbd_port=$((base + 2)) db_port=$((base + 3))
host=$(hostname -s)
# SPMDSPLIT_SLURM_NODES=N > 1: N nodes on this one machine, one slurmd each (own port, spool,
# log), named spmdsplit-node0.. with NodeAddr=127.0.0.1: multi-node jobs for the tests. Those
# names resolve nowhere, so the launcher and the sbatch template take the first node's address
# from Slurm (NodeAddr) when its name does not resolve.
nnodes=${SPMDSPLIT_SLURM_NODES:-1}
if [ "$nnodes" = 1 ]; then nodes=$host; else nodes=$(seq -f "spmdsplit-node%g" 0 $((nnodes - 1))); fi
cluster=${SPMDSPLIT_SLURM_CLUSTER:-spmdsplit}
packages="slurmctld slurmd slurm-client slurmdbd munge mariadb-server mariadb-client"

log() { echo "slurm_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

alive() {  # alive PID: the process exists and is not a zombie
    local s
    [ -r "/proc/$1/stat" ] || return 1
    s=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$s" ] && [ "$s" != Z ] && [ "$s" != X ]
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...: retries COMMAND until it succeeds
    local timeout=$1 deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || { log "$what not ready after ${timeout}s; logs in $state/log"; tail -n 20 "$state"/log/*.log >&2 || true; return 1; }
        sleep 0.1
    done
}

spawn() {  # spawn NAME COMMAND...: starts a foreground daemon in its own session, records its pid
    local name=$1
    shift
    setsid "$@" </dev/null >>"$state/log/$name.out" 2>&1 &
    local pid=$!
    echo "$pid $name" >>"$state/pids"
    sleep 0.05
    alive "$pid" || { tail -n 20 "$state/log/$name.out" "$state/log/$name.log" >&2 2>/dev/null || true; die "$name exited at once"; }
}

install_packages() {
    local missing=""
    for b in slurmctld slurmd slurmdbd sbatch munged mariadbd mariadb-install-db; do
        command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing="$missing $b"
    done
    [ -z "$missing" ] && return 0
    [ "$(id -u)" = 0 ] || die "missing$missing; run as root once (apt-get install $packages)"
    log "installing $packages"
    export DEBIAN_FRONTEND=noninteractive
    # Package scripts try to start the services; policy-rc.d (no init system here) refuses, fine.
    apt-get install -y -q --no-install-recommends $packages >"${TMPDIR:-/tmp}/spmdsplit-slurm-apt.log" 2>&1 || {
        apt-get update -q >/dev/null 2>&1
        apt-get install -y -q --no-install-recommends $packages >"${TMPDIR:-/tmp}/spmdsplit-slurm-apt.log" 2>&1
    } || die "apt-get install failed: see ${TMPDIR:-/tmp}/spmdsplit-slurm-apt.log"
}

write_configs() {
    cat >"$state/slurm.conf" <<EOF
ClusterName=$cluster
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$state/munge/munge.socket,cred_expire=10
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/slurmd/%n
SlurmctldPidFile=$state/run/slurmctld.pid
SlurmdPidFile=$state/run/slurmd-%n.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$dbd_port
# Connections to slurmdbd (sacct, sacctmgr, slurmctld) take their munge socket from here.
AccountingStoragePass=$state/munge/munge.socket
JobCompType=jobcomp/none
MailProg=/bin/true
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=3600
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=1
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    local i=0 name port
    for name in $nodes; do
        # One node: slurmd on SlurmdPort. Several: each its own Port after the others' ports.
        port=$([ "$nnodes" = 1 ] && echo "$slurmd_port" || echo $((base + 4 + i)))
        echo "NodeName=$name NodeAddr=127.0.0.1 Port=$port CPUs=4 State=UNKNOWN" >>"$state/slurm.conf"
        i=$((i + 1))
    done
    # slurmdbd refuses a config that others can read (it holds the database password).
    (umask 077 && cat >"$state/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$state/munge/munge.socket
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$dbd_port
SlurmUser=root
PidFile=$state/run/slurmdbd.pid
LogFile=$state/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    )
    echo "export SLURM_CONF=$state/slurm.conf" >"$state/env"
}

db() { mariadb --no-defaults -S "$state/mysql/mysqld.sock" -u root "$@"; }

start() {
    local t0=$SECONDS
    if [ -s "$state/pids" ]; then
        while read -r pid name; do
            alive "$pid" && die "$name (pid $pid) from an earlier start is still running: stop first"
        done <"$state/pids"
    fi
    install_packages
    # A start that fails half-way stops what it started (the pids recorded so far).
    trap '[ "${up:-}" = 1 ] || { log "start failed; stopping what it started"; stop || true; }' EXIT
    # Fresh state each start; a non-empty folder is wiped only if it is one of ours.
    if [ -d "$state" ] && [ -n "$(ls -A "$state")" ]; then
        [ -e "$state/.spmdsplit-slurm" ] || die "$state is not empty and not a cluster state dir; pick another"
        rm -rf "$state"
    fi
    mkdir -p "$state"/{log,run,ctld,slurmd,munge,mysql/data}
    chmod 0755 "$state"
    # munged and mariadbd run as their own users: they must be able to reach the state dir
    # (pytest's and mktemp's folders are private to root).
    for user in munge mysql; do
        setpriv --reuid="$user" --regid="$user" --init-groups test -x "$state" ||
            die "the $user user cannot enter $state: pick a state dir under a folder others may enter (e.g. /tmp)"
    done
    : >"$state/pids"
    : >"$state/.spmdsplit-slurm"
    write_configs

    # munge: own key and socket in the state dir. munged refuses to run as root and insists that
    # its key, socket dir and log are the munge user's and not writable by others.
    chown munge:munge "$state/munge"
    chmod 0755 "$state/munge"
    setpriv --reuid=munge --regid=munge --init-groups mungekey --create --keyfile="$state/munge/munge.key" --bits=1024
    spawn munged setpriv --reuid=munge --regid=munge --init-groups munged -F \
        --socket="$state/munge/munge.socket" --key-file="$state/munge/munge.key" \
        --pid-file="$state/munge/munged.pid" --log-file="$state/munge/munged.log" --seed-file="$state/munge/munged.seed"
    wait_for 10 munged munge -n -S "$state/munge/munge.socket"

    # MariaDB for slurmdbd: TCP on 127.0.0.1 (slurmdbd 22.05 cannot be given a unix socket path);
    # mariadbd drops to the mysql user, which must own the data, pid and log dir.
    chown -R mysql:mysql "$state/mysql"
    mariadb-install-db --no-defaults --user=mysql --datadir="$state/mysql/data" \
        --auth-root-authentication-method=socket --skip-test-db >"$state/log/mariadb-install.out" 2>&1 \
        || { tail -n 20 "$state/log/mariadb-install.out" >&2; die "mariadb-install-db failed"; }
    spawn mariadbd mariadbd --no-defaults --user=mysql --datadir="$state/mysql/data" \
        --socket="$state/mysql/mysqld.sock" --pid-file="$state/mysql/mysqld.pid" --log-error="$state/mysql/error.log" \
        --port="$db_port" --bind-address=127.0.0.1 --skip-log-bin --innodb-buffer-pool-size=32M
    wait_for 30 mariadbd db -e "select 1"
    db -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
           GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"

    export SLURM_CONF=$state/slurm.conf
    # slurmdbd has no -f: it reads slurmdbd.conf beside $SLURM_CONF.
    spawn slurmdbd slurmdbd -D
    wait_for 30 slurmdbd sacctmgr -n list cluster
    # Registered before slurmctld starts, so its first connection finds the cluster.
    sacctmgr -i add cluster "$cluster" >/dev/null
    spawn slurmctld slurmctld -D -i -f "$state/slurm.conf"
    wait_for 30 slurmctld scontrol ping
    local name
    for name in $nodes; do
        mkdir -p "$state/slurmd/$name"
        spawn slurmd slurmd -D -N "$name" -f "$state/slurm.conf"
    done
    wait_for 30 "slurmd (every node idle)" nodes_idle
    up=1
    log "up in $((SECONDS - t0))s: $(echo $nodes) with 4 CPUs each, partition debug; source $state/env (SLURM_CONF=$state/slurm.conf)"
}

nodes_idle() { [ "$(sinfo -h -N -o %t 2>/dev/null | grep -c '^idle$')" = "$nnodes" ]; }

stop() {
    [ -s "$state/pids" ] || { log "nothing recorded in $state/pids"; return 0; }
    export SLURM_CONF=$state/slurm.conf
    # Jobs first, while slurmd can still end their tasks (slurmd stopping leaves them running).
    if scontrol ping >/dev/null 2>&1; then
        local jobs
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            local deadline=$((SECONDS + 15))
            while [ -n "$(squeue -h -o %i 2>/dev/null)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
        fi
    fi
    local failed=0
    # Reverse start order: slurmd, slurmctld, slurmdbd, mariadbd, munged.
    while read -r pid name; do
        alive "$pid" || continue
        # The pid is ours only if it still runs the program we started (pids get reused).
        grep -qa -- "${name}" "/proc/$pid/cmdline" 2>/dev/null || { log "pid $pid is no longer $name; left alone"; continue; }
        kill -TERM "$pid" 2>/dev/null || true
        local deadline=$((SECONDS + 10))
        while alive "$pid" && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
        if alive "$pid"; then
            log "$name (pid $pid) ignored SIGTERM; SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            sleep 0.5
            alive "$pid" && { log "$name (pid $pid) still running"; failed=1; }
        fi
    done < <(tac "$state/pids")
    [ $failed = 0 ] || die "some daemons did not stop"
    : >"$state/pids"
    log "stopped"
}

status() {
    [ -s "$state/pids" ] || { echo "not running ($state)"; return 1; }
    local down=0
    while read -r pid name; do
        if alive "$pid"; then echo "$name: pid $pid"; else echo "$name: pid $pid gone"; down=1; fi
    done <"$state/pids"
    SLURM_CONF=$state/slurm.conf sinfo || down=1
    return $down
}

case "$cmd" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status [STATE_DIR]" >&2; exit 2 ;;
esac
