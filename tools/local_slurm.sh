#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for the tests and for trying the slurm/ scripts:
# several slurmd (fake nodes node1..nodeN) on localhost, slurmctld, and slurmdbd + MariaDB so that
# sacct works (submitit needs it to see failed or cancelled jobs). No systemd: every daemon is
# started by hand, with its state, logs and pid file under one folder.
#
#   tools/local_slurm.sh up [N]     install the Debian packages if missing (root), start the daemons
#                                   (N fake nodes, default 4, CPUs = nproc each), wait until all are
#                                   idle; prints `export SLURM_CONF=...` on stdout. Idempotent.
#   tools/local_slurm.sh down       cancel the jobs, stop only the daemons this script started
#   tools/local_slurm.sh status     sinfo + squeue (exit 1 when the controller is not up)
#   eval "$(tools/local_slurm.sh up)"; sbatch --wait slurm/areal_tiny.sh
#
# Environment: AREAL_SLURM_DIR (state; default <repo>/.cache/slurm), AREAL_SLURM_PORT (first of 20
# ports, up to 9 nodes; default derived from the state folder, so that two checkouts on one machine
# run two clusters side by side), AREAL_SLURM_DBD=0 (no slurmdbd/MariaDB: faster, but no sacct).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${AREAL_SLURM_DIR:-$root/.cache/slurm}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
port=${AREAL_SLURM_PORT:-$((10000 + $(cksum <<<"$dir" | cut -d' ' -f1) % 1000 * 20))}
with_dbd=${AREAL_SLURM_DBD:-1}
etc=$dir/etc run=$dir/run log=$dir/log
conf=$etc/slurm.conf
host=$(hostname -s)
export SLURM_CONF=$conf
# The daemons get a clean environment: nothing of the caller's shell (venv, test markers) leaks
# into them or, through them, into the jobs' step daemons.
daemon_env=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin SLURM_CONF="$conf" HOME=/root LANG=C.UTF-8)

say() { echo "[local_slurm] $*" >&2; }
die() { say "error: $*"; exit 1; }

# --- packages --------------------------------------------------------------------------------
packages=(slurmd slurmctld slurm-client munge)
commands=(slurmd slurmctld sbatch munged)
if [ "$with_dbd" = 1 ]; then packages+=(slurmdbd mariadb-server); commands+=(slurmdbd mariadbd); fi

missing_commands() {
  local c
  for c in "${commands[@]}"; do command -v "$c" >/dev/null || PATH=$PATH:/usr/sbin command -v "$c" >/dev/null || echo "$c"; done
}

install_packages() {
  [ -z "$(missing_commands)" ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    die "missing $(missing_commands | tr '\n' ' '); install as root: apt-get install ${packages[*]}"
  fi
  say "installing ${packages[*]} (once, about a minute)"
  # No init system here: keep the packages' postinst from starting system-wide munged/mariadb;
  # this script runs its own, under $dir.
  local policy=/usr/sbin/policy-rc.d ours=
  if [ ! -e $policy ]; then printf '#!/bin/sh\nexit 101\n' >$policy; chmod +x $policy; ours=1; fi
  local rc=0
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${packages[@]}"; } >"$dir/apt.log" 2>&1 || rc=$?
  [ -n "$ours" ] && rm -f $policy
  [ $rc = 0 ] || { tail -20 "$dir/apt.log" >&2; die "apt-get failed (full log: $dir/apt.log)"; }
}

# --- processes we own: one pid file each; a pid counts only if it still runs that program -------
alive() {    # alive PIDFILE PROGRAM
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1   # a daemon removes its own pid file as it exits
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$2"
}

stop() {     # stop PIDFILE PROGRAM
  local pid i
  if alive "$1" "$2"; then
    pid=$(cat "$1" 2>/dev/null) || true
    kill "$pid" 2>/dev/null || true
    for i in $(seq 50); do alive "$1" "$2" || break; sleep 0.2; done
    if alive "$1" "$2"; then kill -9 "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$1"
}

wait_for() { # wait_for SECONDS WHAT COMMAND...
  local t=$1 what=$2 deadline=$((SECONDS + $1)); shift 2
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "$what did not come up in ${t}s (logs: $log)"
    sleep 0.2
  done
}

# --- configuration -------------------------------------------------------------------------------
nodes_of() { sed -n 's/^NodeName=\(node[0-9]*\) .*/\1/p' "$conf" 2>/dev/null; }

write_conf() {   # write_conf N -> $conf.new
  local n=$1 cpus mem i
  cpus=$(nproc)
  mem=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
  {
    echo "# Written by tools/local_slurm.sh: $n fake nodes on this host. Edits are overwritten."
    echo "ClusterName=areal_local"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmctldPort=$port"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "AuthInfo=socket=$run/munge.socket"
    echo "CredType=cred/munge"
    echo "StateSaveLocation=$dir/state"
    echo "SlurmdSpoolDir=$dir/spool/%n"
    echo "SlurmctldPidFile=$run/slurmctld.pid"
    echo "SlurmdPidFile=$run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$log/slurmctld.log"
    echo "SlurmdLogFile=$log/slurmd-%n.log"
    echo "TmpFS=$dir/tmp/%n"                       # fake nodes must not share pmix's tmp dirs
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    # Heterogeneous jobs are started only by the backfill scheduler: run it every second.
    echo "SchedulerType=sched/backfill"
    echo "SchedulerParameters=bf_interval=1,sched_interval=2"
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "JobRequeue=1"
    echo "KillWait=5"
    echo "MpiDefault=none"
    echo "InactiveLimit=0"
    if [ "$with_dbd" = 1 ]; then
      echo "AccountingStorageType=accounting_storage/slurmdbd"
      echo "AccountingStorageHost=127.0.0.1"
      echo "AccountingStoragePort=$((port + 2))"
      echo "AccountingStoragePass=$run/munge.socket"   # with slurmdbd: the munge socket to use
    else
      echo "AccountingStorageType=accounting_storage/none"
    fi
    for i in $(seq "$n"); do
      echo "NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port + 10 + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } >"$conf.new"
}

# --- daemons ---------------------------------------------------------------------------------------
start_munge() {
  alive "$run/munged.pid" munged && return 0
  if [ ! -s "$etc/munge.key" ]; then
    (umask 077; dd if=/dev/urandom of="$etc/munge.key" bs=1024 count=1 status=none)
  fi
  rm -f "$run/munge.socket" "$run/munge.socket.lock"
  "${daemon_env[@]}" munged --force --socket="$run/munge.socket" --key-file="$etc/munge.key" \
    --pid-file="$run/munged.pid" --log-file="$log/munged.log" --seed-file="$dir/munge.seed"
  wait_for 10 munged sh -c "munge -S '$run/munge.socket' -n | unmunge -S '$run/munge.socket'"
}

mysql_root() { mariadb --socket="$run/mysqld.sock" -u root "$@"; }

start_db() {
  [ "$with_dbd" = 1 ] || return 0
  if ! alive "$run/mysqld.pid" mariadbd; then
    if [ ! -d "$dir/db/mysql" ]; then
      say "initialising the accounting database in $dir/db"
      mariadb-install-db --user=root --datadir="$dir/db" --skip-test-db >"$log/mariadb-install.log" 2>&1 \
        || die "mariadb-install-db failed ($log/mariadb-install.log)"
    fi
    setsid "${daemon_env[@]}" mariadbd --no-defaults --user=root --datadir="$dir/db" \
      --socket="$run/mysqld.sock" --pid-file="$run/mysqld.pid" --port=$((port + 3)) \
      --bind-address=127.0.0.1 --skip-name-resolve --log-error="$log/mariadb.log" \
      --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
    wait_for 60 mariadb mysql_root -e "select 1"
  fi
  if [ ! -s "$etc/db.pass" ]; then
    (umask 077; od -An -N16 -tx1 /dev/urandom | tr -d ' \n' >"$etc/db.pass")
  fi
  local pass; pass=$(cat "$etc/db.pass")
  mysql_root -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
                 ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
                 GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
  (umask 077; cat >"$etc/slurmdbd.conf" <<EOF
# Written by tools/local_slurm.sh
AuthType=auth/munge
AuthInfo=socket=$run/munge.socket
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$((port + 2))
SlurmUser=root
LogFile=$log/slurmdbd.log
PidFile=$run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((port + 3))
StorageUser=slurm
StoragePass=$pass
StorageLoc=slurm_acct_db
EOF
  )
  if ! alive "$run/slurmdbd.pid" slurmdbd; then
    "${daemon_env[@]}" slurmdbd   # finds slurmdbd.conf beside $SLURM_CONF
    wait_for 30 slurmdbd sacctmgr -n show cluster
  fi
  # The controller registers itself only if its cluster is known to the database.
  sacctmgr -n -P show cluster format=cluster | grep -qx areal_local \
    || sacctmgr -i add cluster areal_local >/dev/null
}

start_slurm() {
  local n
  mkdir -p "$dir/state"
  if ! alive "$run/slurmctld.pid" slurmctld; then
    # -c: a fresh controller, no jobs from an earlier session of this folder.
    "${daemon_env[@]}" slurmctld -c -f "$conf"
    wait_for 30 slurmctld scontrol ping
  fi
  for n in $(nodes_of); do
    mkdir -p "$dir/spool/$n" "$dir/tmp/$n"
    alive "$run/slurmd-$n.pid" slurmd || "${daemon_env[@]}" slurmd -f "$conf" -N "$n"
  done
}

all_idle() {
  local states
  states=$(sinfo -h -N -o '%t' 2>/dev/null) || return 1
  [ -n "$states" ] && ! grep -qv '^idle$' <<<"$states"
}

up() {
  local n=${1:-4} i
  [[ $n =~ ^[0-9]+$ && $n -ge 2 && $n -le 9 ]] \
    || die "need 2 to 9 nodes (a hetjob's components never share one), got $n"
  install_packages
  mkdir -p "$etc" "$run" "$log"
  write_conf "$n"
  if [ -f "$conf" ] && ! cmp -s "$conf" "$conf.new"; then
    say "configuration changed: restarting the daemons"
    down
  fi
  mv "$conf.new" "$conf"
  start_munge
  start_db
  start_slurm
  for i in $(seq 150); do
    all_idle && break
    # A node left down or drained by an earlier run: return it to service once.
    if [ "$i" = 25 ]; then scontrol update nodename="$(nodes_of | paste -sd,)" state=resume 2>/dev/null || true; fi
    sleep 0.2
  done
  all_idle || { sinfo >&2 || true; die "nodes are not idle after 30s (logs: $log)"; }
  say "$n nodes idle; logs in $log"
  echo "export SLURM_CONF=$conf"
}

stop_slurm() {
  local f
  for f in "$run"/slurmd-*.pid; do [ -e "$f" ] && stop "$f" slurmd; done
  stop "$run/slurmctld.pid" slurmctld
}

down() {
  local i
  if alive "$run/slurmctld.pid" slurmctld; then
    # Jobs first, while slurmd still runs to kill their steps.
    squeue -h -o %A 2>/dev/null | xargs -r scancel 2>/dev/null || true
    for i in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  stop_slurm
  stop "$run/slurmdbd.pid" slurmdbd
  stop "$run/mysqld.pid" mariadbd
  stop "$run/munged.pid" munged
  say "stopped"
}

status() {
  alive "$run/slurmctld.pid" slurmctld || { say "not running (state in $dir)"; return 1; }
  sinfo
  squeue
  echo "export SLURM_CONF=$conf"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  status) status ;;
  *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
