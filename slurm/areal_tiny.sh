#!/usr/bin/env bash
# The tiny CPU recipe (configs/tiny_cpu.yaml) as one heterogeneous Slurm job, e.g. on the local
# cluster of tools/local_slurm.sh. Submit from the repository root:
#   eval "$(tools/local_slurm.sh up)"
#   sbatch slurm/areal_tiny.sh [key=value ...]        # overrides go to the config
# Component 0 runs topology.n_trainers trainer ranks, component 1 topology.n_generators generator
# ranks (1 + 1 here; change the task counts below with the topology). Components never share a
# node, so the cluster needs at least two. A requeued attempt appends to the same output file.
#SBATCH --job-name=areal-tiny
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --time=01:00:00
#SBATCH --nodes=1 --ntasks-per-node=1 --cpus-per-task=1
#SBATCH hetjob
#SBATCH --time=01:00:00
#SBATCH --nodes=1 --ntasks-per-node=1 --cpus-per-task=1
exec bash slurm/job.sh configs/tiny_cpu.yaml "$@"
