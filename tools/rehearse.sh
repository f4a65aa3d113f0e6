#!/usr/bin/env bash
# A dress rehearsal of a GPU recipe on this machine: the recipe's own batch script and
# slurm/site_gpu.sh, real areal_hpc.main, on the namespaced local Slurm cluster (4 fake nodes, each
# a host of its own), at the recipe's layout scaled to 2 nodes a component; preempted, requeued,
# resumed, finished, exported and audited (areal_hpc/launch/rehearse.py says what is scaled).
#   tools/rehearse.sh slurm/areal_32b.sh [--steps N] [--out DIR]
# Needs root (network namespaces) and apt-get for Slurm the first time. A few minutes a recipe.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ $# -ge 1 ] || { echo "usage: tools/rehearse.sh slurm/areal_{1_5b,7b,32b}.sh [--steps N] [--out DIR]" >&2; exit 2; }
tools/install.sh
[ -f models/tiny/config.json ] || .venv/bin/python -m areal_hpc.tiny_model --out models/tiny >&2
exports=$(AREAL_SLURM_NETNS=1 AREAL_SLURM_DBD=0 tools/local_slurm.sh up 4)
eval "$exports"
# the site file's own MPI settings, not the local cluster's client defaults
unset MPIR_CVAR_CH4_NETMOD FI_PROVIDER
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export AREAL_PYTHON=$root/.venv/bin/python
exec .venv/bin/python -m areal_hpc.launch.rehearse --model models/tiny "$@"
