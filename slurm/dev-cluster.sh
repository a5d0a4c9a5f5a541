#!/usr/bin/env bash
# meshrun's dev Slurm cluster: a real slurmctld + slurmdbd (MariaDB) + 3 fake nodes n1-n3 on this machine.
#
#   bash slurm/dev-cluster.sh up       install what is missing, write configs, start everything, wait for idle nodes
#   bash slurm/dev-cluster.sh down     stop every daemon it started (by pid file, never by name)
#   bash slurm/dev-cluster.sh status   say what runs; exit 0 only when the cluster answers
#
# Idempotent: `up` on a running cluster only checks it. Exit codes: 0 ok, 1 failure,
# 77 cannot run here (not root / no apt-get): the reason is printed and written to $UNAVAILABLE_FILE,
# and the Slurm tests turn it into a skip with that reason.
# Settings are the ones measured in docs/PLATFORM.md (fast requeue: cred_expire=5 etc.).
set -uo pipefail

STATE="${MESHRUN_SLURM_STATE:-/var/lib/meshrun-slurm}"
UNAVAILABLE_FILE="${TMPDIR:-/tmp}/meshrun-slurm-unavailable"
EXIT_UNAVAILABLE=77
NODES=(n1 n2 n3)
FIRST_PORT=17001
CLUSTER=meshrun
RUN="$STATE/run"
LOG="$STATE/log"
MYSQL_SOCK=/run/mysqld/mysqld.sock
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server numactl)
# Why each package is needed: printed before anything is installed.
declare -A WHY=(
    [munge]="authenticates the Slurm daemons and clients to each other (AuthType=auth/munge)"
    [slurmctld]="the Slurm controller: queues, schedules and requeues the jobs"
    [slurmd]="the node daemon: runs the tasks of the 3 fake nodes n1-n3"
    [slurm-client]="sbatch, srun, squeue, scontrol, sinfo, sacct: what meshrun and the tests call"
    [slurmdbd]="the accounting daemon: sacct answers for jobs that left the queue (status, requeues)"
    [mariadb-server]="the database slurmdbd keeps job accounting in"
    [numactl]="binds each rank to its NUMA node (numactl --cpunodebind/--membind)"
)

say() { echo "dev-cluster: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

unavailable() {
    # Loud on purpose: a silent skip hides that the Slurm tests did not run.
    local reason="$1"
    {
        echo "############################################################"
        echo "# dev Slurm cluster UNAVAILABLE: $reason"
        echo "# The Slurm integration tests will be SKIPPED."
        echo "############################################################"
    } >&2
    echo "$reason" >"$UNAVAILABLE_FILE" 2>/dev/null || true
    exit "$EXIT_UNAVAILABLE"
}

# --- process helpers (pid files only) --------------------------------------------------------
pid_alive() {
    # Zombies linger here (PID 1 reaps slowly): a process in state Z counts as dead.
    local pid="$1"
    [[ -n "$pid" && -r "/proc/$pid/status" ]] || return 1
    ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status"
}

pid_dead() { ! pid_alive "$1"; }

pidfile_alive() {
    local f="$1"
    [[ -s "$f" ]] && pid_alive "$(tr -dc 0-9 <"$f")"
}

wait_for() {
    # wait_for SECONDS DESCRIPTION CMD...: poll CMD every 0.2 s.
    local limit="$1" what="$2"; shift 2
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
    return 0
}

stop_pidfile() {
    local name="$1" f="$2"
    if ! pidfile_alive "$f"; then
        rm -f "$f"
        return 0
    fi
    local pid
    pid="$(tr -dc 0-9 <"$f")"
    say "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_for 20 "$name exit" pid_dead "$pid"; then
        say "$name did not stop after 20 s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

# --- install ---------------------------------------------------------------------------------
missing_packages() {
    local p missing=()
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    echo "${missing[@]:-}"
}

install_missing() {
    local missing
    missing="$(missing_packages)"
    if [[ -z "${missing// /}" ]]; then
        say "system packages already installed: ${PACKAGES[*]}"
        return 0
    fi
    command -v apt-get >/dev/null || unavailable "packages missing ($missing) and no apt-get on this machine"
    local p
    say "installing these system packages with apt-get (what the dev Slurm cluster needs):"
    for p in $missing; do
        say "  $p: ${WHY[$p]:-needed by the dev cluster}"
    done
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >"$LOG/apt.log" 2>&1 || { tail -5 "$LOG/apt.log" >&2; unavailable "apt-get update failed (no network or no apt sources?)"; }
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing >>"$LOG/apt.log" 2>&1 \
        || { tail -20 "$LOG/apt.log" >&2; unavailable "apt-get install $missing failed (see $LOG/apt.log)"; }
}

# --- configuration ---------------------------------------------------------------------------
write_configs() {
    local host last_port nodelist
    host="$(hostname -s)"
    last_port=$((FIRST_PORT + ${#NODES[@]} - 1))
    nodelist="n[1-${#NODES[@]}]"
    mkdir -p "$STATE/ctld" "$RUN" "$LOG" /etc/slurm
    for n in "${NODES[@]}"; do mkdir -p "$STATE/d/$n"; done

    local before=""
    [[ -f "$STATE/slurm.conf" ]] && before="$(cat "$STATE/slurm.conf")"
    cat >"$STATE/slurm.conf" <<EOF
# Written by slurm/dev-cluster.sh; edits are overwritten by the next 'up'.
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=bf_interval=1,sched_interval=2
JobRequeue=1
ReturnToService=2
KillWait=5
# The three nodes share this machine's cores with everything else on it: under a heavy load a step's processes
# can outlast Slurm's default wait after their SIGKILL, and Slurm then drains the node ("Kill task failed"),
# which leaves the next two-node job pending (docs/PLATFORM.md).
UnkillableStepTimeout=180
MinJobAge=120
MailProg=/bin/true
NodeName=$nodelist NodeHostname=$host NodeAddr=127.0.0.1 Port=[$FIRST_PORT-$last_port] CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=$nodelist Default=YES MaxTime=INFINITE State=UP
EOF
    # A controller already running reads a changed slurm.conf only when told to (cmd_up).
    CONF_CHANGED=0
    [[ "$before" == "$(cat "$STATE/slurm.conf")" ]] || CONF_CHANGED=1
    cat >"$STATE/slurmdbd.conf" <<EOF
# Written by slurm/dev-cluster.sh.
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StoragePort=3306
StorageUser=slurm
StoragePass=meshrun-dev
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$STATE/slurmdbd.conf"
    # Client commands (sinfo, sbatch, submitit) look here; the files live in the state dir.
    ln -sfn "$STATE/slurm.conf" /etc/slurm/slurm.conf
    ln -sfn "$STATE/slurmdbd.conf" /etc/slurm/slurmdbd.conf

    # The fake node names must resolve: MASTER_ADDR is the first node's name.
    local n
    for n in "${NODES[@]}"; do
        grep -Eq "^[^#]*[[:space:]]$n([[:space:]]|\$)" /etc/hosts || echo "127.0.0.1 $n" >>/etc/hosts
    done
}

# --- daemons ---------------------------------------------------------------------------------
start_munge() {
    local f=/run/munge/munged.pid
    pidfile_alive "$f" && return 0
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge: /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    if [[ ! -s /etc/munge/munge.key ]]; then
        say "creating munge key"
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge: /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    fi
    runuser -u munge -- /usr/sbin/munged --pid-file="$f" || die "munged did not start (see /var/log/munge/munged.log)"
    wait_for 10 munged pidfile_alive "$f" || die "munged did not write $f"
}

start_mariadb() {
    local f="$RUN/mysql/mariadb.pid" datadir="$STATE/mysql"
    if ! pidfile_alive "$f"; then
        # mariadbd runs as mysql: its pid file and log live in directories mysql owns.
        mkdir -p /run/mysqld "$RUN/mysql" "$LOG/mysql" && chown mysql: /run/mysqld "$RUN/mysql" "$LOG/mysql"
        if [[ ! -d "$datadir/mysql" ]]; then
            say "initialising MariaDB in $datadir"
            mkdir -p "$datadir" && chown mysql: "$datadir"
            mariadb-install-db --user=mysql --datadir="$datadir" --auth-root-authentication-method=socket \
                >"$LOG/mariadb-install.log" 2>&1 || die "mariadb-install-db failed (see $LOG/mariadb-install.log)"
        fi
        # Own datadir and pid file, no TCP: nothing else on the machine is touched.
        /usr/sbin/mariadbd --user=mysql --datadir="$datadir" --socket="$MYSQL_SOCK" --pid-file="$f" \
            --skip-networking --innodb-buffer-pool-size=16M --log-error="$LOG/mysql/mariadb.log" \
            </dev/null >/dev/null 2>&1 &
        wait_for 60 mariadb mariadb --socket="$MYSQL_SOCK" -e 'select 1' || die "MariaDB does not answer (see $LOG/mysql/mariadb.log)"
    fi
    mariadb --socket="$MYSQL_SOCK" -e "
        CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'meshrun-dev';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" || die "cannot create the accounting database"
}

start_slurmdbd() {
    local f="$RUN/slurmdbd.pid"
    pidfile_alive "$f" && return 0
    /usr/sbin/slurmdbd || die "slurmdbd did not start (see $LOG/slurmdbd.log)"
    wait_for 30 slurmdbd sacctmgr -n list cluster || die "slurmdbd does not answer (see $LOG/slurmdbd.log)"
    sacctmgr -n list cluster format=cluster | grep -qw "$CLUSTER" \
        || sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster failed"
}

start_slurmctld() {
    # A second slurmctld KILLS the running one: only start when the pid file says none runs.
    local f="$RUN/slurmctld.pid"
    pidfile_alive "$f" && return 1
    /usr/sbin/slurmctld || die "slurmctld did not start (see $LOG/slurmctld.log)"
    wait_for 30 slurmctld scontrol ping || die "slurmctld does not answer (see $LOG/slurmctld.log)"
    return 0
}

start_slurmd() {
    local n="$1" f="$RUN/slurmd-$1.pid"
    pidfile_alive "$f" && return 0
    /usr/sbin/slurmd -N "$n" || die "slurmd -N $n did not start (see $LOG/slurmd-$n.log)"
}

cancel_leftovers() {
    # Jobs recovered from an earlier controller would hold the nodes until their time limit.
    local ids
    ids="$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')"
    if [[ -n "${ids// /}" ]]; then
        say "cancelling leftover jobs: $ids"
        # shellcheck disable=SC2086
        scancel $ids 2>/dev/null || true
    fi
}

nodes_idle() {
    local want="${#NODES[@]}" idle
    idle="$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | awk '$2=="idle"' | sort -u | wc -l)"
    [[ "$idle" -ge "$want" ]]
}

resume_nodes() {
    # Nodes drained or down from an earlier session (a test that killed a node, a stale reason).
    local bad
    bad="$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | awk '$2 ~ /^(down|drain|drng|fail)/ {print $1}' | sort -u | paste -sd, -)"
    if [[ -n "$bad" ]]; then
        say "resuming nodes: $bad"
        scontrol update NodeName="$bad" State=RESUME 2>/dev/null || true
    fi
}

cmd_up() {
    [[ "$(id -u)" -eq 0 ]] || unavailable "not root (uid $(id -u)): the dev cluster needs root to install packages and run slurmd"
    mkdir -p "$STATE" "$RUN" "$LOG" 2>/dev/null || unavailable "cannot create $STATE"
    install_missing
    write_configs
    start_munge
    start_mariadb
    start_slurmdbd
    local cold=0
    start_slurmctld && cold=1
    if ((!cold && CONF_CHANGED)); then
        say "slurm.conf changed: scontrol reconfigure"
        scontrol reconfigure || die "scontrol reconfigure failed (see $LOG/slurmctld.log)"
    fi
    local n
    for n in "${NODES[@]}"; do start_slurmd "$n"; done
    ((cold)) && cancel_leftovers
    if ! wait_for 30 "idle nodes" nodes_idle; then
        resume_nodes
        wait_for 30 "idle nodes" nodes_idle || {
            sinfo -N >&2
            die "nodes not idle after 60 s (see $LOG/slurmd-*.log and $LOG/slurmctld.log)"
        }
    fi
    rm -f "$UNAVAILABLE_FILE"
    say "up: $(sinfo -h -p debug -o '%P %D nodes %t' | paste -sd' ')"
}

cmd_down() {
    local n
    for n in "${NODES[@]}"; do stop_pidfile "slurmd $n" "$RUN/slurmd-$n.pid"; done
    stop_pidfile slurmctld "$RUN/slurmctld.pid"
    stop_pidfile slurmdbd "$RUN/slurmdbd.pid"
    stop_pidfile mariadb "$RUN/mysql/mariadb.pid"
    stop_pidfile munged /run/munge/munged.pid
    say "down"
}

cmd_status() {
    local ok=0 n f
    for f in /run/munge/munged.pid "$RUN/mysql/mariadb.pid" "$RUN/slurmdbd.pid" "$RUN/slurmctld.pid" \
        $(for n in "${NODES[@]}"; do echo "$RUN/slurmd-$n.pid"; done); do
        if pidfile_alive "$f"; then
            echo "running  $(basename "$f" .pid) (pid $(tr -dc 0-9 <"$f"))"
        else
            echo "stopped  $(basename "$f" .pid)"
            ok=1
        fi
    done
    if scontrol ping >/dev/null 2>&1; then
        sinfo -N -p debug 2>/dev/null
    else
        echo "controller: not answering"
        ok=1
    fi
    return "$ok"
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
