"""A trainer rank's place in the Megatron grid (TP × PP × DP), in one object.

Megatron keeps its process groups in module globals (`parallel_state`), and its model code reads
them there. This project reads ranks and sizes from a `ParallelLayout` instead: created once per
trainer rank from the job's `Topology` (`trainer_layout`, which also creates the trainer ranks'
torch.distributed group and Megatron's groups over it), passed to the Actor, and asked the
questions the weight path and the checkpoint writers need (which stage's weights this rank
gathers, whether it sends them, whether it writes the HF export). torch and Megatron are imported
inside the functions that use them: the record itself needs neither (its questions are pure,
tests/train/test_layout.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..topology import TRAINER, Topology
from ..transport import mpi as coll
from ..transport.rendezvous import rendezvous_store


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @classmethod
    def create(cls, tp: int, pp: int, seed: int, backend: str | None = None) -> "ParallelLayout":
        """Create Megatron's groups (and RNG states) over the default process group, which spans
        the trainer ranks only; dp = trainer ranks / (tp * pp)."""
        from .megatron_model import init_megatron_parallel     # Megatron: only when it starts
        init_megatron_parallel(tp, pp, seed, backend)
        return cls.read()

    @classmethod
    def read(cls) -> "ParallelLayout":
        """The layout of the groups Megatron already has."""
        from megatron.core import parallel_state as ps
        return cls(tp=ps.get_tensor_model_parallel_world_size(),
                   pp=ps.get_pipeline_model_parallel_world_size(),
                   dp=ps.get_data_parallel_world_size(),
                   tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp_rank=ps.get_pipeline_model_parallel_rank(),
                   dp_rank=ps.get_data_parallel_rank())

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def weight_stage(self) -> int | None:
        """The pipeline stage whose weights this rank gathers for the generators, or None
        (data-parallel replicas other than the first take no part)."""
        return self.pp_rank if self.dp_rank == 0 else None

    @property
    def is_weight_sender(self) -> bool:
        """This rank sends its stage's weights (dp = tp = 0); its TP peers gather along."""
        return self.dp_rank == 0 and self.tp_rank == 0

    @property
    def is_first(self) -> bool:
        """dp = tp = pp = 0: the rank that writes what every rank computed (the HF export)."""
        return self.dp_rank == 0 and self.tp_rank == 0 and self.pp_rank == 0

    # Megatron's groups, for collectives over them.
    @staticmethod
    def tp_group():
        from megatron.core import parallel_state as ps
        return ps.get_tensor_model_parallel_group()

    @staticmethod
    def pp_group():
        from megatron.core import parallel_state as ps
        return ps.get_pipeline_model_parallel_group()

    @staticmethod
    def dp_group():
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_group()

    @staticmethod
    def pp_last_rank() -> int:
        """The global rank of this pipeline's last stage (a broadcast's source)."""
        from megatron.core import parallel_state as ps
        return ps.get_pipeline_model_parallel_last_rank()


def trainer_layout(topo: Topology, seed: int) -> ParallelLayout:
    """This trainer rank's Megatron layout: the default process group over the trainer ranks
    (`init_trainer_process_group`), then Megatron's TP × PP × DP groups over it (`topology.tp`,
    `topology.pp`)."""
    init_trainer_process_group(topo)
    t = topo.cfg
    return ParallelLayout.create(t.tp, t.pp, seed, backend=t.trainer_backend)


def init_trainer_process_group(topo: Topology) -> None:
    """torch.distributed's default group over the trainer ranks only (Megatron builds on it), at
    the rendezvous trainer rank 0 broadcast (`Topology.build`). Its collectives are bounded by
    rollout.collective_timeout_s, as every collective among the trainer ranks (torch's own
    default is 10 min on NCCL: shorter than a 32B checkpoint's write-time skew can be)."""
    import torch
    import torch.distributed as dist
    assert topo.role == TRAINER
    if topo.cfg.device == "cuda":
        # launch.placement narrowed CUDA_VISIBLE_DEVICES to this rank's one GPU.
        torch.cuda.set_device(0)
    n = topo.cfg.n_trainers
    store = rendezvous_store(topo.controller_addr, topo.trainer_port, n, topo.role_rank == 0,
                             timedelta(minutes=30))
    dist.init_process_group(backend=topo.cfg.trainer_backend, store=store, rank=topo.role_rank,
                            world_size=n, timeout=timedelta(seconds=coll.DEFAULT_TIMEOUT_S))
