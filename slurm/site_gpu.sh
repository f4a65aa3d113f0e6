#!/usr/bin/env bash
# Site environment for the GPU recipes: slurm/areal_{1_5b,7b,32b}.sh source this in the batch
# shell before slurm/job.sh starts the ranks (srun passes the environment on to every task).
# Edit once per cluster; a value the user already exported wins over each default here.
#
# Software: activate the GPU environment (environment.yml) here or before sbatch, e.g.
#   module load cuda/13.0     # if the site wants one: the wheels are CUDA 13.0 (torch 2.13.0,
#                             # vLLM 0.32.0) and bring its runtime; TransformerEngine's build
#                             # (setup.cfg's `te` extra) needs a CUDA 13 nvcc
#   source "$HOME/miniforge3/bin/activate" areal_hpc
export AREAL_PYTHON=${AREAL_PYTHON:-$(command -v python3)}
# srun's MPI plugin for the site MPI that mpi4py was built against: pmi2 (MPICH, Cray MPICH,
# Intel MPI) or pmix (Open MPI). slurm/job.sh refuses a plugin this srun does not have
# (srun --mpi=list) before any rank starts.
export AREAL_SRUN_MPI=${AREAL_SRUN_MPI:-pmi2}
# MPICH under pmi2 speaks PMI-1, which Slurm's pmi2 plugin reads in one read() of at most 1 KiB
# per request; over UCX (the pip wheel's default netmod) MPICH sends a node's business cards as
# ~1 KiB lines back to back, and at 8 ranks per node a cut one fails the start-up ("mpi/pmi2:
# value not properly terminated"; slurm/job.sh names it). So for an MPICH that also has OFI (the
# wheel) the default is MPIR_CVAR_CH4_NETMOD=ofi: short addresses, one small put, and what the
# tests start at 8 ranks per node (areal_hpc/launch/mpi_env.py; Cray MPICH, Intel MPI, Open MPI
# get nothing), with OFI's provider FI_PROVIDER=tcp (libfabric's own pick, `sockets`, hung MPI's
# start-up in the 32B rehearsal) on MPI's interface FI_TCP_IFACE, NCCL_SOCKET_IFNAME's first
# match; on a node with EFA or Slingshot, whose NCCL OFI plugin shares the process's libfabric
# and its FI_PROVIDER filter, that fabric's provider (efa, cxi) instead. Set your own to replace
# them: a PMI-2 client that starts under this srun, or UCX under pmix, or another provider:
# export MPIR_CVAR_PMI_VERSION=2
# export FI_PROVIDER=efa     # or cxi, verbs
# (applied below, once the fabric's interfaces are set)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# Variables for the trainer ranks alone (slurm/job.sh sets them on het component 0's command, not
# on the vLLM engines): Megatron orders TP/SP communication behind compute kernels with a single
# CUDA work queue. A space-separated list of K=V.
export AREAL_TRAINER_ENV=${AREAL_TRAINER_ENV-CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}}
# A rank whose NCCL peer died raises instead of hanging in a collective; srun's
# --kill-on-bad-exit then ends the step, and the job can be resubmitted from its checkpoint.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# The fabric: set for the site (InfiniBand HCAs, the interface NCCL bootstraps on, the one gloo
# binds). Each rank checks at start that NCCL_SOCKET_IFNAME matches an interface of its node
# (NCCL's syntax: prefixes, '=' exact, '^' exclude) and that every name in GLOO_SOCKET_IFNAME
# (gloo's: exact names, comma-separated) is an interface with an address there; `sbatch
# slurm/areal_7b.sh --dry-run` prints, per rank, what each matched. Unset, NCCL picks an interface
# itself ("auto" in that table), and gloo (Megatron's data-parallel groups on the trainer ranks)
# binds the address the host name resolves to: a job whose trainers span hosts whose names
# resolve to loopback (Debian's 127.0.1.1) is refused at start; then set it.
# export NCCL_IB_HCA=mlx5
# export NCCL_SOCKET_IFNAME=ib0
# export GLOO_SOCKET_IFNAME=ib0
# MPI's defaults (above), after NCCL_SOCKET_IFNAME: MPI's tcp interface follows it.
eval "$("$AREAL_PYTHON" -m areal_hpc.launch.mpi_env)"
# torch.distributed rendezvous address of trainer rank 0 (default: its host name's address). A
# job on several hosts whose rank 0 resolves to a loopback address (Debian's 127.0.1.1 entry in
# /etc/hosts) is refused at start; then set it, e.g.
# export AREAL_HOST_ADDR=$(hostname -I | cut -d' ' -f1)
# The NVIDIA driver must be R580 or newer (the CUDA 13 wheels): checked on every rank at start.
