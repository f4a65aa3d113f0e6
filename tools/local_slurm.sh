#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for the tests and for trying the slurm/ scripts:
# several slurmd (fake nodes node1..nodeN) on localhost, slurmctld, and slurmdbd + MariaDB so that
# sacct works (submitit needs it to see failed or cancelled jobs). No systemd: every daemon is
# started by hand, with its state, logs and pid file under one folder.
#
#   tools/local_slurm.sh up [N]     install the Debian packages if missing (root), start the daemons
#                                   (N fake nodes, default 4), wait until all are idle; prints
#                                   the client's `export SLURM_CONF=...` (and MPICH's netmod,
#                                   client_env below) on stdout. Idempotent.
#   tools/local_slurm.sh down       cancel the jobs, stop only the daemons this script started
#   tools/local_slurm.sh status     sinfo + squeue (exit 1 when the controller is not up)
#   eval "$(tools/local_slurm.sh up)"; sbatch --wait slurm/areal_tiny.sh
#
# A simulated GPU cluster: each fake node advertises AREAL_SLURM_GPUS GPUs (default 8) as GRES
# `gpu`, backed by placeholder character devices (mknod, major 195 as NVIDIA's) that gres.conf
# names, and AREAL_SLURM_CPUS cores (default 128, as a 2 x 64-core GPU node; more than this host
# has, which `SlurmdParameters=config_overrides` allows) and 2 TiB of memory (the recipes' --mem).
# Slurm then does what a real GPU cluster
# does: sets CUDA_VISIBLE_DEVICES / SLURM_STEP_GPUS per task from --gpus-per-task or --gpu-bind,
# the whole node's list otherwise, and refuses a step that asks for more CPUs or GPUs than its
# allocation holds. Cores are not bound (a fake count cannot be bound to 2 real cores), so what
# a test checks is the allocation each step got, not the affinity. GPU devices are: with cgroup
# v1's devices controller on the host (and not under AREAL_SLURM_NETNS), TaskPlugin=task/cgroup
# with ConstrainDevices=yes, so a task opens only the placeholder devices of the GPUs it was given.
# AREAL_SLURM_GPUS=0: plain CPU nodes (also what happens without root: no mknod).
#
# Environment: AREAL_SLURM_DIR (state; default <repo>/.cache/slurm), AREAL_SLURM_PORT (first of 20
# ports, up to 9 nodes; default derived from the state folder, so that two checkouts on one machine
# run two clusters side by side), AREAL_SLURM_DBD=0 (no slurmdbd/MariaDB: faster, but no sacct).
#
# AREAL_SLURM_NETNS=1 (opt-in, root, `unshare` + `ip`): every fake node is a host of its own, so that
# nothing in a job works only because all ranks share one host name and loopback. slurmd nodeK runs
# in its own network, UTS and mount namespaces: host name nodeK, address <subnet>.(10+K) on eth0 (a
# veth pair to a bridge in the root namespace, which holds <subnet>.1, where slurmctld is reached),
# and its own /etc/hosts (bind-mounted in that node's mount namespace only) naming every node and
# the controller, and its own /proc/sys/kernel/random/boot_id (else UCX, the MPICH wheel's netmod,
# takes all fake nodes for one host and uses shared memory between them, not the network). Its
# steps and tasks inherit all of that. The subnet is AREAL_SLURM_SUBNET (a /24, default
# 10.251.X.0/24 with X from the state folder, as the ports are, so that clusters of two checkouts,
# or one left up, do not meet on one bridge; refused if an interface here already uses it); no route leaves it (no
# default route: vLLM's get_ip() warns and takes 0.0.0.0 for its in-node queue). State
# folder AREAL_SLURM_NETNS_DIR (default <repo>/.cache/slurm-netns; not AREAL_SLURM_DIR, which
# names the default cluster's), so it runs beside the default cluster; `down` also
# removes the namespaces, veths and bridge it made (and only those).
#   AREAL_SLURM_NETNS=1 tools/local_slurm.sh up 4      (same for status, down)
# MPI there: the pip mpich wheel (ch4 with UCX, the default netmod, and OFI) finds eth0 by itself,
# UCX as tcp/eth0 between nodes, OFI as tcp;ofi_rxm on the node's address; no interface hint is
# needed. To pin one: UCX_NET_DEVICES=eth0, or MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
netns=${AREAL_SLURM_NETNS:-0}
if [ "$netns" = 1 ]; then dir=${AREAL_SLURM_NETNS_DIR:-$root/.cache/slurm-netns}
else dir=${AREAL_SLURM_DIR:-$root/.cache/slurm}; fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
port=${AREAL_SLURM_PORT:-$((10000 + $(cksum <<<"$dir" | cut -d' ' -f1) % 1000 * 20))}
# Job ids, like the ports, from the state folder: two clusters on one host (the default and the
# namespaced one, or two checkouts') must not both run a job 11. MPICH names a node's
# shared-memory segment after the PMI job name (<job>.<step>) and the node's index; a second
# cluster's job of the same id meets the first's segment in the one /dev/shm, and MPI_Init fails
# ("MPIDI_POSIX_comm_bootstrap: Out of memory"). A range of 60,000 ids each, under MaxJobId.
first_job=$(($(cksum <<<"$dir" | cut -d' ' -f1) % 1000 * 60000 + 1))
with_dbd=${AREAL_SLURM_DBD:-1}
gpus=${AREAL_SLURM_GPUS:-8}
fake_cpus=${AREAL_SLURM_CPUS:-128}
etc=$dir/etc run=$dir/run log=$dir/log
conf=$etc/slurm.conf
host=$(hostname -s)
export SLURM_CONF=$conf
# Addresses: the controller's and node K's as the other daemons reach them.
ctl_addr=127.0.0.1
node_host() { echo "$host"; }
node_addr() { echo 127.0.0.1; }
if [ "$netns" = 1 ]; then
  subnet=${AREAL_SLURM_SUBNET:-10.251.$((20 + $(cksum <<<"$dir" | cut -d' ' -f1) % 200)).0/24}
  [[ $subnet =~ ^(10|172|192)\.[0-9]{1,3}\.[0-9]{1,3}\.0/24$ ]] \
    || { echo "[local_slurm] error: AREAL_SLURM_SUBNET must be a private /24 like 10.251.7.0/24, got $subnet" >&2; exit 1; }
  net=${subnet%.0/24}                    # the first three octets
  octet=${net##*.}
  bridge=areal${octet}br                 # our link names (at most 15 characters)
  veth_of() { echo "areal${octet}n${1#node}"; }
  ctl_addr=$net.1
  node_host() { echo "$1"; }
  node_addr() { echo "$net.$((10 + ${1#node}))"; }
fi
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
  # One apt-get at a time: the plain and the namespaced cluster may come up at once (the tests
  # run them on two pytest workers), and dpkg's lock fails the second instead of waiting.
  exec 8>"${TMPDIR:-/tmp}/areal-local-slurm-apt.lock"
  flock -w 900 8 || die "another local_slurm.sh has been installing packages for 900 s"
  if [ -z "$(missing_commands)" ]; then exec 8>&-; return 0; fi
  say "installing ${packages[*]} (once, about a minute)"
  # No init system here: keep the packages' postinst from starting system-wide munged/mariadb;
  # this script runs its own, under $dir.
  local policy=/usr/sbin/policy-rc.d ours=
  if [ ! -e $policy ]; then printf '#!/bin/sh\nexit 101\n' >$policy; chmod +x $policy; ours=1; fi
  local rc=0
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${packages[@]}"; } >"$dir/apt.log" 2>&1 || rc=$?
  [ -n "$ours" ] && rm -f $policy
  exec 8>&-
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

# The placeholder GPU devices: /dev-like char devices under $dir/dev (gres.conf's File=). slurmd
# refuses regular files (steps then get an empty CUDA_VISIBLE_DEVICES) and duplicates.
make_gpu_devices() {   # make_gpu_devices -> sets gpus=0 when they cannot be made
  local i f
  [ "$gpus" -gt 0 ] || return 0
  mkdir -p "$dir/dev"
  for i in $(seq 0 $((gpus - 1))); do
    f=$dir/dev/nvidia$i
    [ -c "$f" ] && continue
    rm -f "$f"
    if ! mknod "$f" c 195 "$i" 2>/dev/null; then
      say "cannot mknod $f (not root?): the fake nodes get no GPUs"
      gpus=0
      return 0
    fi
  done
}

write_conf() {   # write_conf N -> $conf.new (and $etc/gres.conf.new)
  local n=$1 cpus mem i gres= task_plugin
  cpus=$fake_cpus
  mem=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
  if [ "$gpus" -gt 0 ]; then
    # A GPU node's memory (2 TiB), as its cores are a GPU node's: the recipes ask for their
    # planned --mem (areal_hpc/plan/host_memory.py), which Slurm refuses on a node configured
    # with less. Not consumed (CR_Core), so nothing is reserved on this host.
    mem=2097152
    gres=" Gres=gpu:$gpus"
    {
      echo "# Written by tools/local_slurm.sh: placeholder GPU devices, not real ones."
      echo "AutoDetect=off"
      echo "NodeName=node[1-$n] Name=gpu File=$dir/dev/nvidia[0-$((gpus - 1))]"
    } >"$etc/gres.conf.new"
  else
    echo "# Written by tools/local_slurm.sh: no GPUs." >"$etc/gres.conf.new"
  fi
  # Device cgroups, as GPU sites set them (ConstrainDevices=yes): a task may open the GPU device
  # files of the GPUs it was given and no other (EPERM; an allowed placeholder gives ENXIO, no
  # driver). Cores and memory are not constrained (fake counts). On the simulated GPU nodes of
  # the plain cluster, where the host has cgroup v1's devices controller; not on the netns one.
  task_plugin=task/none
  if [ "$gpus" -gt 0 ] && [ "$netns" != 1 ] && [ -d /sys/fs/cgroup/devices ]; then
    task_plugin=task/cgroup
    printf '%s\n' "# Written by tools/local_slurm.sh." "CgroupPlugin=cgroup/v1" \
      "CgroupMountpoint=/sys/fs/cgroup" "ConstrainDevices=yes" "ConstrainCores=no" \
      "ConstrainRAMSpace=no" >"$etc/cgroup.conf"
  fi
  {
    echo "# Written by tools/local_slurm.sh: $n fake nodes on this host. Edits are overwritten."
    echo "ClusterName=areal_local"
    echo "SlurmctldHost=$host($ctl_addr)"
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
    echo "TaskPlugin=$task_plugin"
    echo "JobAcctGatherType=jobacct_gather/none"
    [ "$gpus" -gt 0 ] && echo "GresTypes=gpu"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    # Heterogeneous jobs are started only by the backfill scheduler: run it every second.
    echo "SchedulerType=sched/backfill"
    echo "SchedulerParameters=bf_interval=1,sched_interval=2"
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "JobRequeue=1"
    echo "FirstJobId=$first_job"
    echo "KillWait=5"
    echo "MpiDefault=none"
    echo "InactiveLimit=0"
    if [ "$with_dbd" = 1 ]; then
      echo "AccountingStorageType=accounting_storage/slurmdbd"
      echo "AccountingStorageHost=$ctl_addr"
      echo "AccountingStoragePort=$((port + 2))"
      echo "AccountingStoragePass=$run/munge.socket"   # with slurmdbd: the munge socket to use
    else
      echo "AccountingStorageType=accounting_storage/none"
    fi
    for i in $(seq "$n"); do
      echo "NodeName=node$i NodeHostname=$(node_host "node$i") NodeAddr=$(node_addr "node$i") Port=$((port + 10 + i)) CPUs=$cpus RealMemory=$mem$gres State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } >"$conf.new"
}

# --- AREAL_SLURM_NETNS=1: one set of namespaces per fake node ------------------------------------
# A holder process (argv[0] areal-netns-nodeK, pid in $run/netns-nodeK.pid) keeps node K's network,
# UTS and mount namespaces; slurmd is started in them with nsenter. The bridge is ours if
# $run/bridge-<name> says so; the veths go with their namespace.
ns_pid() { cat "$run/netns-$1.pid" 2>/dev/null; }
ns_alive() { alive "$run/netns-$1.pid" "areal-netns-$1"; }
in_ns() { local n=$1; shift; nsenter -t "$(ns_pid "$n")" --net --uts --mount -- "$@"; }

netns_check() {
  [ "$(id -u)" = 0 ] || die "AREAL_SLURM_NETNS=1 needs root (network namespaces)"
  local c
  for c in unshare nsenter ip; do command -v "$c" >/dev/null || die "AREAL_SLURM_NETNS=1 needs $c"; done
}

write_hosts() {   # write_hosts N: one hosts file for every node (the same names everywhere)
  local i
  {
    echo "# Written by tools/local_slurm.sh (AREAL_SLURM_NETNS=1): bind-mounted over /etc/hosts"
    echo "# in the fake nodes' mount namespaces only."
    echo "127.0.0.1 localhost"
    echo "::1 localhost ip6-localhost ip6-loopback"
    echo "$ctl_addr $host"
    for i in $(seq "$1"); do echo "$(node_addr "node$i") node$i"; done
  } >"$etc/hosts"
}

netns_up() {      # netns_up N: the bridge, then node K's namespaces, veth, address, host name
  local n=$1 i node pid veth
  netns_check
  write_hosts "$n"
  if ! ip link show "$bridge" >/dev/null 2>&1; then
    if [ -n "$(ip -o -4 addr show | awk -v p="$net." 'index($4, p) == 1')" ]; then
      die "$subnet is already used on this machine (ip -br addr): set AREAL_SLURM_SUBNET to a free /24"
    fi
    ip link add "$bridge" type bridge
    touch "$run/bridge-$bridge"
    ip addr add "$ctl_addr/24" dev "$bridge"
    ip link set "$bridge" up
  elif [ ! -e "$run/bridge-$bridge" ]; then
    die "a link $bridge exists that this cluster did not make (state in $dir): not touching it"
  fi
  for i in $(seq "$n"); do
    node=node$i veth=$(veth_of "node$i")
    ns_alive "$node" && continue
    stop "$run/slurmd-$node.pid" slurmd           # still in the namespaces of a holder that died
    rm -f "$run/netns-$node.pid"
    ip link del "$veth" 2>/dev/null || true        # left from a holder that died
    # --propagation private: the /etc/hosts bind mount stays inside this node's mount namespace.
    setsid unshare --net --uts --mount --propagation private \
      bash -c 'echo $$ >"$0"; exec -a "areal-netns-$1" sleep infinity' "$run/netns-$node.pid" "$node" \
      </dev/null >/dev/null 2>&1 &
    wait_for 10 "namespace of $node" ns_alive "$node"
    pid=$(ns_pid "$node")
    ip link add "$veth" type veth peer name "$veth"p
    ip link set "$veth" master "$bridge"
    ip link set "$veth" up
    ip link set "$veth"p netns "$pid"
    # A boot id of its own, as a separate machine has: UCX (the MPICH wheel's netmod) takes processes
    # with one boot id for one host and would pass messages between the fake nodes through shared
    # memory, never over their network.
    cat /proc/sys/kernel/random/uuid >"$run/boot_id-$node"
    in_ns "$node" sh -c "hostname '$node' && mount --bind '$etc/hosts' /etc/hosts \
      && mount --bind '$run/boot_id-$node' /proc/sys/kernel/random/boot_id && ip link set lo up \
      && ip link set '${veth}p' name eth0 && ip addr add '$(node_addr "$node")/24' dev eth0 && ip link set eth0 up" \
      || die "could not set up the namespaces of $node"
  done
}

netns_down() {    # the holders (and whatever still runs in their namespaces), veths, our bridge
  local f node ns pid p
  for f in "$run"/netns-node*.pid; do
    [ -e "$f" ] || continue
    node=${f##*/netns-}; node=${node%.pid}
    if ns_alive "$node"; then
      pid=$(ns_pid "$node")
      ns=$(readlink "/proc/$pid/ns/net")
      # Processes left in this node's network namespace (a step daemon of a cancelled job).
      for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$p" != "$pid" ] && [ "$(readlink "/proc/$p/ns/net" 2>/dev/null)" = "$ns" ] && kill "$p" 2>/dev/null || true
      done
    fi
    stop "$f" "areal-netns-$node"
    ip link del "$(veth_of "$node")" 2>/dev/null || true
    rm -f "$run/boot_id-$node"
  done
  if [ -e "$run/bridge-$bridge" ]; then
    ip link del "$bridge" 2>/dev/null || true
    rm -f "$run/bridge-$bridge"
  fi
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
DbdAddr=$ctl_addr
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
    alive "$run/slurmd-$n.pid" slurmd && continue
    if [ "$netns" = 1 ]; then in_ns "$n" "${daemon_env[@]}" slurmd -f "$conf" -N "$n"
    else "${daemon_env[@]}" slurmd -f "$conf" -N "$n"; fi
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
  make_gpu_devices
  write_conf "$n"
  if [ -f "$conf" ] && { ! cmp -s "$conf" "$conf.new" || ! cmp -s "$etc/gres.conf" "$etc/gres.conf.new"; }; then
    say "configuration changed: restarting the daemons"
    down
  fi
  mv "$etc/gres.conf.new" "$etc/gres.conf"
  mv "$conf.new" "$conf"
  if [ "$netns" = 1 ]; then netns_up "$n"; fi
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
  say "$n nodes idle ($fake_cpus CPUs, $gpus GPUs each); logs in $log"
  client_env
}

# What a client of this cluster exports. The MPICH wheel runs over OFI tcp here: over UCX (its
# default) a rank's business card is ~900 bytes, which MPICH's PMI-1 client puts as several lines
# back to back, and Slurm 22.05's pmi2 plugin reads a PMI-1 request in one read() of at most 1 KiB,
# parsing a line cut at the read's end as a request of its own ("mpi/pmi2: value not properly
# terminated"): the step hangs or aborts, more often the busier the box (traced with 8 ranks per
# node; the tiny job's 1 per node failed the same way). OFI's tcp address is 16 bytes: one short
# put for the whole step (slurm/site_gpu.sh makes OFI the GPU recipes' default). The namespaced
# cluster too: its tiny job failed so over UCX in CI, and PMI-2 (MPIR_CVAR_PMI_VERSION=2) does
# not start with this wheel under Slurm 22.05's plugin (MPIR_pmi_init: internal error). Its
# cross-host traffic (MPI, the rendezvous, the weight broadcast) still crosses the nodes' eth0.
client_env() {
  echo "export SLURM_CONF=$conf"
  echo "export MPIR_CVAR_CH4_NETMOD=ofi"
  echo "export FI_PROVIDER=tcp"
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
  if [ "$netns" = 1 ]; then netns_down; fi
  say "stopped"
}

status() {
  alive "$run/slurmctld.pid" slurmctld || { say "not running (state in $dir)"; return 1; }
  sinfo
  squeue
  if [ "$netns" = 1 ]; then
    local node
    for node in $(nodes_of); do
      if ns_alive "$node"; then
        echo "$node: namespaces of pid $(ns_pid "$node"), $(in_ns "$node" hostname) $(in_ns "$node" ip -br -4 addr show eth0 | awk '{print $3}')"
      else
        echo "$node: no namespaces"
      fi
    done
  fi
  client_env
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  status) status ;;
  *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
