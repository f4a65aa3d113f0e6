"""Project objects of a job of one trainer rank in the test's own process, for tests of what a
trainer rank does without starting a job: its `Topology` (rank 0, the controller, over
MPI.COMM_SELF), and a `Trainer` made of the parts a test gives (`Trainer.__init__` builds the
Megatron model, the controller with its generators and the weight group: a whole job), whose
methods are the real ones."""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

from areal_hpc.config import RunConfig
from areal_hpc.storage.run_dir import RunDir
from areal_hpc.topology import TRAINER, Topology
from areal_hpc.train.layout import ParallelLayout
from areal_hpc.train.lead import Follower
from areal_hpc.train.trainer import Trainer
from areal_hpc.transport import mpi as coll


def one_rank_topology(cfg: RunConfig) -> Topology:
    """The topology of a job of one trainer rank, this process, whose torch.distributed world and
    Megatron groups a test made already (`megatron_model.single_process`, the `megatron_ws1`
    fixture): its layout is `ParallelLayout.read()`."""
    return Topology(cfg=cfg.topology, world=MPI.COMM_SELF, role_comm=MPI.COMM_SELF, rank=0,
                    role=TRAINER, role_rank=0, controller_addr="127.0.0.1", trainer_port=0,
                    weight_port=0, local_rank=0, hosts=[socket.gethostname()])


@dataclass
class StandInActor:
    """What a Trainer reads of its `Actor` besides training: the rank's layout, and what a
    checkpoint saves and loads (None: a test that loads nothing into them)."""
    layout: ParallelLayout = field(default_factory=lambda: ParallelLayout(1, 1, 1, 0, 0, 0))
    model: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None


class TrainerOfParts(Trainer):
    """A `Trainer` of one rank built from `cfg`, `topo`, an actor and a lead (default a
    `Follower`, no controller) as `Trainer.__init__` keeps them, at version 0."""

    def __init__(self, cfg: RunConfig, topo: Topology, actor, lead: Follower | None = None):
        self.cfg, self.topo, self.actor, self.run_dir = cfg, topo, actor, RunDir(cfg.run_dir)
        self.lead = lead if lead is not None else Follower()
        self.version = 0
        self.shares = coll.GroupScatter(topo.role_comm, group=actor.layout.dp_rank,
                                        timeout_s=cfg.rollout.collective_timeout_s,
                                        what="the trainer's batch route")
