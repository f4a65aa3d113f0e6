"""Who is who: roles, ranks and communicators, built once from the config and the MPI world.

World ranks [0, n_trainers) are trainer ranks (Slurm het group 0); ranks
[n_trainers, n_trainers + n_generators) are generator ranks (het group 1). Trainer rank 0 (world
rank 0) also hosts the controller. The Topology is passed down explicitly; nothing here runs at
import time.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import ConfigError, TopologyConfig
from .transport.mpi import bcast
from .transport.rendezvous import reserve_port

if TYPE_CHECKING:
    from .transport.weights import WeightGroupAddress

TRAINER, GENERATOR = "trainer", "generator"
CONTROLLER_RANK = 0


def host_address() -> str:
    """An address other nodes can reach this host on (AREAL_HOST_ADDR overrides)."""
    if os.environ.get("AREAL_HOST_ADDR"):
        return os.environ["AREAL_HOST_ADDR"]
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return "127.0.0.1"


def check_world(cfg: TopologyConfig, world_size: int) -> None:
    need = cfg.n_trainers + cfg.n_generators
    if world_size != need:
        raise ConfigError(
            f"MPI world has {world_size} rank(s) but the config asks for {need} "
            f"({cfg.n_trainers} trainer + {cfg.n_generators} generator); "
            f"launch with mpiexec -n {need} (or set topology.n_trainers / topology.n_generators)")


@dataclass
class Topology:
    cfg: TopologyConfig
    world: Any                  # MPI.Intracomm over all ranks
    role_comm: Any              # MPI.Intracomm over the ranks of this role
    rank: int                   # world rank
    role: str
    role_rank: int
    controller_addr: str        # host of trainer rank 0 (torch.distributed rendezvous)
    trainer_port: int           # rendezvous of the trainer-only default process group
    weight_port: int            # rendezvous of the weight group {stage senders} ∪ generator engines
    local_rank: int             # rank among this role's ranks on this node (launch.placement)
    hosts: list                 # host name of every world rank (names a rank in error messages)
    engine_tp: int = 1          # vLLM workers per generator engine (rollout.engine_tp); each
                                # joins the weight group
    local_size: int = 1         # ranks of this role on this node
    # trainer rank 0's liveness on the other ranks (a transport.beacon.RankWatch; None on rank 0
    # and without a beacon): bounds their waits for its work (areal_hpc.main starts the beacon)
    controller_alive: Any = None

    @classmethod
    def build(cls, cfg: TopologyConfig, world, engine_tp: int = 1,
              timeout_s: float | None = None) -> "Topology":
        """Collective over `world`. The first collective, the rendezvous broadcast, is bounded by
        `timeout_s` (default: rollout.collective_timeout_s via transport.mpi): a rank that never
        starts (or hangs importing) fails the others with a message instead of hanging them;
        the few collectives after it follow at once."""
        check_world(cfg, world.Get_size())
        rank = world.Get_rank()
        role = TRAINER if rank < cfg.n_trainers else GENERATOR
        rendezvous = (host_address(), reserve_port(), reserve_port()) if rank == CONTROLLER_RANK else None
        addr, tport, wport = bcast(world, rendezvous, root=CONTROLLER_RANK, timeout_s=timeout_s,
                                   what="start-up: the rendezvous from rank 0 (did every rank start?)")
        role_comm = world.Split(0 if role == TRAINER else 1, rank)
        role_comm.Set_name(f"{role} communicator")       # named in collective timeouts
        # Ranks of this role on this node, by Slurm node name: fake nodes of a local cluster (and
        # containers) share a host, where MPI's shared-memory split would count them as one node.
        local_rank, local_size = local_index(role_comm.allgather(node_name()), role_comm.Get_rank())
        hosts = world.allgather(socket.gethostname())
        return cls(cfg=cfg, world=world, role_comm=role_comm, rank=rank, role=role,
                   role_rank=role_comm.Get_rank(), controller_addr=addr, trainer_port=tport,
                   weight_port=wport, local_rank=local_rank, hosts=hosts, engine_tp=engine_tp,
                   local_size=local_size)

    @property
    def is_controller(self) -> bool:
        return self.rank == CONTROLLER_RANK

    @property
    def generator_ranks(self) -> list[int]:
        n = self.cfg.n_trainers
        return list(range(n, n + self.cfg.n_generators))

    @property
    def weight_group_size(self) -> int:
        """One sender per pipeline stage plus every vLLM worker of every generator."""
        return self.cfg.pp + self.cfg.n_generators * self.engine_tp

    @property
    def weight_group_rank(self) -> int:
        """Weight-group rank of this generator's first vLLM worker (stage senders are [0, pp))."""
        assert self.role == GENERATOR
        return self.cfg.pp + self.role_rank * self.engine_tp

    def weight_group_address(self, weights) -> WeightGroupAddress:
        """The weight group's address for this job (`weights`: the run's weights section)."""
        from .transport.weights import WeightGroupAddress   # torch: the launcher imports this module
        return WeightGroupAddress(self.controller_addr, self.weight_port, self.weight_group_size,
                                  self.cfg.weight_backend, weights.timeout_s, weights.join_timeout_s)


def node_name(env=None) -> str:
    """The Slurm node this task runs on (SLURMD_NODENAME; fake nodes of a local cluster share a
    host name), else the host name."""
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def local_index(nodes: list[str], me: int) -> tuple[int, int]:
    """(index of rank `me` among the ranks on its node, ranks on that node), from every rank's
    node name in rank order."""
    mine = nodes[me]
    return sum(1 for n in nodes[:me] if n == mine), nodes.count(mine)
