#!/usr/bin/env bash
# configs/qwen2_5_1_5b_math.yaml on a GPU cluster: 16 nodes x 8 GPUs as one heterogeneous job, 3/4
# of the GPUs generating (AReaL's split). Edit slurm/site_gpu.sh for the site first; submit from
# the repository root:
#   sbatch slurm/areal_1_5b.sh [key=value ...]
# Component 0: 32 trainer ranks (topology.n_trainers; tp1 x pp2 x dp16), one GPU each, on 4 nodes.
# Component 1: 96 generator ranks (topology.n_generators), one vLLM engine per GPU, on 12 nodes.
# The task counts must match the config's topology (tests/launch/test_slurm.py checks it): change
# both together. Each attempt runs up to --time; SIGUSR1 900 s before the limit makes the ranks
# checkpoint, and slurm/job.sh requeues the job, which resumes in the same run dir.
# `sbatch slurm/areal_1_5b.sh --dry-run` places every rank and prints which GPUs and cores each holds.
# --mem (per node of each component): the host memory `python -m areal_hpc.plan memory
#   configs/qwen2_5_1_5b_math.yaml` plans a node (areal_hpc/plan/host_memory.py; a trainer node's
#   step snapshot and checkpoint staging are ~25 GiB of pinned memory), in whole GiB; rerun it
#   after changing the config (tests/plan/test_host_memory.py fails if a value here is below it).
#SBATCH --job-name=areal-1_5b
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@900
#SBATCH --time=24:00:00
#SBATCH --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=12 --exclusive
#SBATCH --mem=96G
#SBATCH hetjob
#SBATCH --time=24:00:00
#SBATCH --nodes=12 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=12 --exclusive
#SBATCH --mem=59G
source slurm/site_gpu.sh || exit 2
exec bash slurm/job.sh configs/qwen2_5_1_5b_math.yaml "$@"
