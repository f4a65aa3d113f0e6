"""ParallelLayout: the questions the weight path and the HF export ask of a rank's place in the
TP × PP × DP grid (pure), and the layout read back from Megatron's own groups."""
import os
import subprocess
import sys

import pytest

from areal_hpc.train.layout import ParallelLayout


def _grid(tp, pp, dp):
    return [ParallelLayout(tp, pp, dp, t, p, d)
            for d in range(dp) for p in range(pp) for t in range(tp)]


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (4, 2, 1)])
def test_one_sender_per_stage_and_one_writer(tp, pp, dp):
    grid = _grid(tp, pp, dp)
    senders = [x for x in grid if x.is_weight_sender]
    assert sorted(x.weight_stage for x in senders) == list(range(pp))     # one per stage
    gatherers = [x for x in grid if x.weight_stage is not None]
    assert len(gatherers) == tp * pp and all(x.dp_rank == 0 for x in gatherers)
    assert [x for x in grid if x.is_first] == [ParallelLayout(tp, pp, dp, 0, 0, 0)]
    assert sum(x.last_stage for x in grid) == tp * dp


def test_read_from_megatron_agrees(megatron_ws1):   # tests/train/conftest.py: tp = pp = 1
    assert ParallelLayout.read() == ParallelLayout(1, 1, 1, 0, 0, 0)


TRAINER_OF_ONE = """
import socket, sys
from mpi4py import MPI
import torch.distributed as dist
from areal_hpc.config import RunConfig
from areal_hpc.topology import TRAINER, Topology
from areal_hpc.transport.rendezvous import free_port
from areal_hpc.train.layout import trainer_layout
cfg = RunConfig().topology
cfg.n_trainers, cfg.n_generators, cfg.trainer_backend = 1, 1, "gloo"
topo = Topology(cfg=cfg, world=MPI.COMM_SELF, role_comm=MPI.COMM_SELF, rank=0, role=TRAINER,
                role_rank=0, controller_addr="127.0.0.1", trainer_port=free_port(), weight_port=0,
                local_rank=0, hosts=[socket.gethostname()])
layout = trainer_layout(topo, seed=0)
print(layout, dist.get_world_size(), dist.get_backend(), flush=True)
dist.destroy_process_group()
"""


def test_a_trainer_rank_makes_its_group_at_the_rendezvous_then_megatrons():
    """`trainer_layout`, as a trainer rank of a job runs it (in a process of its own: the groups are
    the process's): torch.distributed's group over the trainer ranks at the topology's rendezvous,
    then Megatron's groups over it, read back as the rank's layout."""
    r = subprocess.run([sys.executable, "-c", TRAINER_OF_ONE], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-1] == ("ParallelLayout(tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, "
                                         "dp_rank=0) 1 gloo")
