#!/usr/bin/env bash
# Site environment for the GPU recipes: slurm/areal_{1_5b,7b,32b}.sh source this in the batch
# shell before slurm/job.sh starts the ranks (srun passes the environment on to every task).
# Edit once per cluster; a value the user already exported wins over each default here.
#
# Software: activate the GPU environment (environment.yml) here or before sbatch, e.g.
#   module load cuda/12.4
#   source "$HOME/miniforge3/bin/activate" areal_hpc
export AREAL_PYTHON=${AREAL_PYTHON:-$(command -v python3)}
# srun's MPI plugin for the site MPI that mpi4py was built against: pmi2 (MPICH, Cray MPICH,
# Intel MPI) or pmix (Open MPI). slurm/job.sh refuses a plugin this srun does not have
# (srun --mpi=list) before any rank starts.
export AREAL_SRUN_MPI=${AREAL_SRUN_MPI:-pmi2}
# MPICH under pmi2 speaks PMI-1 by default, which Slurm's pmi2 plugin reads in one read() of at
# most 1 KiB per request; with UCX and many ranks per node MPICH sends its business cards as
# many ~1 KiB lines back to back, and a cut one fails the start-up ("mpi/pmi2: value not properly
# terminated"; slurm/job.sh names it). If your MPICH's PMI-2 client starts under this srun, use
# it; else OFI's short addresses make one small put (what the local test cluster does):
# export MPIR_CVAR_PMI_VERSION=2
# export MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=verbs   # or tcp
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# Megatron orders TP/SP communication behind compute kernels with a single CUDA work queue.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# A rank whose NCCL peer died raises instead of hanging in a collective; srun's
# --kill-on-bad-exit then ends the step, and the job can be resubmitted from its checkpoint.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# The fabric: set for the site (InfiniBand HCAs, the interface NCCL bootstraps on). Each rank
# checks at start that NCCL_SOCKET_IFNAME matches an interface of its node (NCCL's syntax:
# prefixes, '=' exact, '^' exclude) and `sbatch slurm/areal_7b.sh --dry-run` prints, per rank,
# the interfaces it matched; unset, NCCL picks one itself ("auto" in that table).
# export NCCL_IB_HCA=mlx5
# export NCCL_SOCKET_IFNAME=ib0
# torch.distributed rendezvous address of trainer rank 0 (default: its host name's address). A
# job on several hosts whose rank 0 resolves to a loopback address (Debian's 127.0.1.1 entry in
# /etc/hosts) is refused at start; then set it, e.g.
# export AREAL_HOST_ADDR=$(hostname -I | cut -d' ' -f1)
# The NVIDIA driver must be R580 or newer (the CUDA 13 wheels): checked on every rank at start.
