#!/usr/bin/env bash
# The body every slurm/areal_*.sh batch script shares (they hold only the #SBATCH lines and the
# site environment, then `exec bash slurm/job.sh CONFIG "$@"`, which keeps the batch shell's pid
# so that `--signal=B:USR1@...` lands here). Not submitted by itself.
#
# 1. `python -m areal_hpc.launch.env`: validate the config (a bad one fails here, exit 2), build
#    the tiny model if the recipe needs it, export the rank environment.
# 2. Check that the allocation matches the config: het group 0 = topology.n_trainers tasks,
#    het group 1 = topology.n_generators tasks.
# 3. One MPI world over both components: one `srun` in the colon form (component 0's options :
#    component 1's), so that each component gets its own `-c` (Slurm >= 22.05 does not pass
#    --cpus-per-task on to srun: without -c every rank would be bound to one core), each task
#    seeing its node's GPUs (no per-task binding: see component() below),
#    in the background so that a trapped USR1/TERM is handled at once (bash runs traps only
#    between commands); its output goes to <run dir>/logs/job-<id>/attempt-<SLURM_RESTART_COUNT>/
#    ranks.log. Each rank then checks its placement (areal_hpc/launch/placement.py: disjoint GPUs
#    per node, the cores asked for, the network interface) before any work, and the job stops
#    with one line if it is wrong.
#    `bash slurm/job.sh CONFIG --dry-run [key=value ...]` (so `sbatch slurm/areal_7b.sh --dry-run`)
#    starts the same step with the placement check alone: it prints, per node, which rank holds
#    which GPUs and cores and the interface it would use, and exits (2 on a problem).
# 4. USR1 (time limit near) or TERM: forwarded to the ranks (as USR1), which stop at the next step boundary,
#    checkpoint and exit with EXIT_PREEMPTED (= 3, areal_hpc/preemption.py). Then this script requeues
#    the job (`scontrol requeue`) and exits 0; the next attempt runs the same command in the same
#    run dir and resumes from the checkpoint. Other exit codes end the job with that code.
#    Not in a loop: an attempt that ends without a newer checkpoint than it started from (a signal
#    during start-up, a failure before the first checkpoint) counts in a row, and after
#    AREAL_MAX_ATTEMPTS_WITHOUT_CHECKPOINT (3) such attempts the job ends (exit 1) with one line
#    saying so instead of being requeued again; an attempt that wrote one resets the count.
# AREAL_TRAINER_ENV (slurm/site_gpu.sh): K=V words set on het component 0's command alone, the
# trainer ranks' (Megatron's CUDA_DEVICE_MAX_CONNECTIONS=1), not on the vLLM engines.
set -uo pipefail
EXIT_PREEMPTED=3   # areal_hpc/preemption.py EXIT_PREEMPTED: the ranks checkpointed after a signal

say() { echo "[job $(date +%T)] $*"; }
config=${1:?usage: bash slurm/job.sh CONFIG [--dry-run] [key=value ...]}
shift
dry_run=
if [ "${1:-}" = --dry-run ]; then dry_run=1; shift; export AREAL_DRY_RUN=1; fi   # preflight: disk warns
[ -f slurm/job.sh ] || { say "error: submit from the repository root (cwd is $PWD)"; exit 2; }
if [ -n "${AREAL_PYTHON:-}" ]; then py=$AREAL_PYTHON
elif [ -x .venv/bin/python ]; then py=$PWD/.venv/bin/python
else py=$(command -v python3 || command -v python); fi
attempt=${SLURM_RESTART_COUNT:-0}
say "job ${SLURM_JOB_ID:-?} attempt $attempt on $(hostname -s): ${SLURM_HET_SIZE:-1} het component(s)," \
    "trainers on ${SLURM_JOB_NODELIST_HET_GROUP_0:-?} (${SLURM_NTASKS_HET_GROUP_0:-?} tasks)," \
    "generators on ${SLURM_JOB_NODELIST_HET_GROUP_1:-?} (${SLURM_NTASKS_HET_GROUP_1:-?} tasks)"

signal=
srun_pid=
forward() {
  signal=$1
  if [ -n "$srun_pid" ]; then
    say "SIG$1: asking the ranks to checkpoint at the next step boundary"
    # Always as USR1: srun passes USR1 on to the tasks, but takes a TERM as "cancel the step"
    # and has them killed after KillWait, before the checkpoint the signal asks for.
    kill -USR1 "$srun_pid" 2>/dev/null || true
  fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

# The run's newest checkpoint: its newest step_<8 digits> folder with a manifest (areal_hpc/
# storage/checkpoint.py writes the manifest last), "" when there is none.
newest_checkpoint() {
  local d newest=
  for d in "$AREAL_RUN_DIR"/checkpoints/step_*; do
    [[ ${d##*/} =~ ^step_[0-9]+$ ]] && [ -f "$d/manifest.json" ] && newest=${d##*/}
  done
  echo "$newest"
}
max_stalled=${AREAL_MAX_ATTEMPTS_WITHOUT_CHECKPOINT:-3}
requeue() {
  local now count=0 file=$AREAL_RUN_DIR/logs/job-$SLURM_JOB_ID/attempts-without-checkpoint
  now=$(newest_checkpoint)
  if [ "$now" = "$started_from" ]; then count=$(($(cat "$file" 2>/dev/null || echo 0) + 1)); fi
  mkdir -p "${file%/*}" && echo "$count" >"$file"
  if [ "$count" -ge "$max_stalled" ]; then
    say "error: $1, but $count attempt(s) in a row ended without a new checkpoint (newest:" \
        "${now:-none}): not requeueing job $SLURM_JOB_ID again (AREAL_MAX_ATTEMPTS_WITHOUT_CHECKPOINT=$max_stalled)"
    exit 1
  fi
  say "$1: requeueing job $SLURM_JOB_ID; the next attempt resumes from ${now:-the start (no checkpoint yet)}"
  scontrol requeue "$SLURM_JOB_ID" || say "scontrol requeue failed (a cancelled job is not requeued)"
  exit 0
}

# vLLM's compile cache on each node's own disk: launch/env.py's default (the repository's
# .cache/vllm, kept by the local launcher) is on the shared file system at a site, where every
# generator node would compile into it at once. A VLLM_CACHE_ROOT the job or the site set wins.
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-${SLURM_TMPDIR:-${TMPDIR:-/tmp}}/areal_hpc-vllm-cache-$(id -u)}
exports=$("$py" -m areal_hpc.launch.env "$config" "$@") || exit $?
eval "$exports"
if [ "${SLURM_HET_SIZE:-1}" != 2 ] || [ "${SLURM_NTASKS_HET_GROUP_0:-}" != "$AREAL_N_TRAINERS" ] \
   || [ "${SLURM_NTASKS_HET_GROUP_1:-}" != "$AREAL_N_GENERATORS" ]; then
  say "error: the config wants a heterogeneous job of $AREAL_N_TRAINERS trainer + $AREAL_N_GENERATORS" \
      "generator task(s); this allocation has ${SLURM_HET_SIZE:-1} component(s) with" \
      "${SLURM_NTASKS_HET_GROUP_0:-?} + ${SLURM_NTASKS_HET_GROUP_1:-?} tasks: fix the #SBATCH lines"
  exit 2
fi
started_from=$(newest_checkpoint)
[ -z "$signal" ] || requeue "SIG$signal before the ranks started"

mpi=${AREAL_SRUN_MPI:-pmi2}
if ! srun --mpi=list 2>&1 | grep -qx "[[:space:]]*$mpi"; then
  say "error: AREAL_SRUN_MPI=$mpi is not an MPI plugin of this srun (srun --mpi=list:" \
      "$(srun --mpi=list 2>&1 | tail -n +2 | tr -s '\n\t ' ' '))"
  exit 2
fi
mpi_vars=$(env | grep -E '^(MPIR_CVAR|FI|UCX|I_MPI|OMPI_MCA|PMIX_MCA)_' | sort | paste -sd ' ')
say "MPI: srun --mpi=$mpi; ${mpi_vars:-no MPIR_CVAR_/FI_/UCX_/I_MPI_/OMPI_MCA_ variables set}"
read -ra trainer_env <<<"${AREAL_TRAINER_ENV:-}"
for kv in "${trainer_env[@]}"; do
  [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || { say "error: AREAL_TRAINER_ENV holds '$kv', not K=V"; exit 2; }
done
run0=("$py")   # het component 0's program: the trainer ranks' variables go on its command line
[ ${#trainer_env[@]} = 0 ] || run0=(env "${trainer_env[@]}" "$py")
# Each component's GPUs: tasks per node x GPUs per task must fit the GPUs per node it was given
# (--gpus-per-node), or ranks would share a GPU (or srun would refuse the step mid-way).
role=(trainer generator)
for k in 0 1; do
  need=$AREAL_GPUS_PER_TRAINER; [ $k = 0 ] || need=$AREAL_GPUS_PER_GENERATOR
  [ "$need" -gt 0 ] || continue
  have=$(printenv "SLURM_GPUS_PER_NODE_HET_GROUP_$k" || true); have=${have##*:}
  tasks=$(printenv "SLURM_TASKS_PER_NODE_HET_GROUP_$k" || true); tasks=${tasks%%(*}
  if [ -z "$have" ] || [ "$((${tasks:-1} * need))" -gt "$have" ]; then
    say "error: het component $k (${role[$k]}s) runs ${tasks:-?} task(s) per node x $need GPU(s) each" \
        "but has ${have:-no} GPU(s) per node: fix --ntasks-per-node / --gpus-per-node in the #SBATCH lines"
    exit 2
  fi
done
# Each component's step options: its cores per task. No per-task GPU binding (--gpus-per-task):
# on a site with ConstrainDevices=yes a task bound to its GPUs can open no other, so NCCL loses
# P2P/NVLink between the TP/DP ranks of a node, and Slurm renumbers each task's GPUs from 0, so
# the ranks of a node cannot tell theirs apart. Each task sees its node's GPUs and takes its own
# by local rank (areal_hpc/launch/placement.py; the dry run shows it), an engine's TP workers
# within its task's share.
component() {   # component K
  local cpt
  cpt=$(printenv "SLURM_CPUS_PER_TASK_HET_GROUP_$1" || true)
  echo "--het-group=$1 --mpi=$mpi --kill-on-bad-exit=1 --label${cpt:+ --cpus-per-task=$cpt}"
}
if [ "$AREAL_GPUS_PER_TRAINER" -gt 0 ]; then
  say "GPUs: each task sees its node's GPUs and takes its own by local rank ($AREAL_GPUS_PER_TRAINER" \
      "per trainer, $AREAL_GPUS_PER_GENERATOR per generator; no per-task binding: NCCL keeps P2P/NVLink" \
      "between a node's ranks under ConstrainDevices=yes)"
fi
# shellcheck disable=SC2046   # word splitting of the options is intended
read -ra opts0 <<<"$(component 0)"
read -ra opts1 <<<"$(component 1)"
if [ -n "$dry_run" ]; then
  say "dry run: the placement of every rank (srun ${opts0[*]} : ${opts1[*]})"
  rank=(-m mpi4py -m areal_hpc.launch.placement "$config" "$@")
  srun "${opts0[@]}" "${run0[@]}" "${rank[@]}" : "${opts1[@]}" "$py" "${rank[@]}"
  exit $?
fi
logs=$AREAL_RUN_DIR/logs/job-$SLURM_JOB_ID/attempt-$attempt
mkdir -p "$logs"
say "ranks' output: $logs/ranks.log (srun ${opts0[*]} : ${opts1[*]})"
# A rank that makes no progress for rollout.progress_timeout_s writes this file naming itself,
# every rank's stacks go to ranks.log, and the attempt ends (areal_hpc/stuck.py): requeued below.
export AREAL_STUCK_FLAG=$logs/stuck
rank=(-m mpi4py -m areal_hpc.main "$config" "$@")
srun "${opts0[@]}" "${run0[@]}" "${rank[@]}" : "${opts1[@]}" "$py" "${rank[@]}" >"$logs/ranks.log" 2>&1 &
srun_pid=$!
# `wait` returns early (> 128) when a trapped signal arrives; wait again until srun has ended.
while :; do
  wait "$srun_pid"
  rc=$?
  kill -0 "$srun_pid" 2>/dev/null || break
done
say "ranks ended with exit code $rc"
# `python -m mpi4py` turns a non-zero exit into MPI_Abort unless the rank finalized MPI first; srun
# then reports the killed step as 137, not 3. After a forwarded signal any failure counts as a
# stop: the next attempt resumes from the newest valid checkpoint either way.
if [ "$rc" = "$EXIT_PREEMPTED" ] || { [ -n "$signal" ] && [ "$rc" != 0 ]; }; then
  requeue "preempted (exit code $rc${signal:+ after SIG$signal})"
fi
if [ "$rc" != 0 ] && [ -s "$logs/stuck" ]; then
  say "$(head -n 1 "$logs/stuck") (every rank's stacks: $logs/ranks.log)"
  requeue "a rank was stuck (exit code $rc)"
fi
if [ "$rc" != 0 ]; then
  say "last lines of $logs/ranks.log:"
  tail -n 40 "$logs/ranks.log"
  # Slurm's pmi2 plugin reads a PMI-1 request in one read() of at most 1 KiB: MPICH's long
  # business-card puts (UCX, many ranks per node), sent back to back, arrive cut (site_gpu.sh).
  if grep -q "mpi/pmi2: value not properly terminated" "$logs/ranks.log"; then
    say "error: MPI start-up failed in srun's pmi2 plugin (cut PMI-1 requests): run MPICH with" \
        "MPIR_CVAR_PMI_VERSION=2, over OFI (MPIR_CVAR_CH4_NETMOD=ofi), or AREAL_SRUN_MPI=pmix"
  fi
fi
exit "$rc"
