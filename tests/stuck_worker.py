"""An MPI world for tests/test_stuck.py: `mpiexec -n 3 python -m mpi4py tests/stuck_worker.py
FLAG MODE`. Every rank's progress watch (bound 3 s) is armed after a first barrier.
- hang: rank 2 stops making progress (`hang_here`, a Python loop); ranks 0 and 1 wait for it in a
  bounded barrier, which is progress of theirs.
- expect: every rank runs 6 s without progress inside `stuck.expect(10, ...)`, then ends."""
import logging
import sys
import time
from pathlib import Path

from mpi4py import MPI

from areal_hpc import stuck
from areal_hpc.transport import mpi as coll

world = MPI.COMM_WORLD
rank = world.Get_rank()
logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
flag, mode = Path(sys.argv[1]), sys.argv[2]
stuck.configure(3.0, rank, "generator" if rank == 2 else "trainer", f"node{rank}", flag)
coll.barrier(world, timeout_s=120, what="start")
stuck.arm()


def hang_here():
    while True:
        time.sleep(0.05)


if mode == "hang":
    if rank == 2:
        hang_here()
    coll.barrier(world, timeout_s=120, what="the end (rank 2 never comes)")
elif mode == "expect":
    with stuck.expect(10, "a long load"):
        time.sleep(6)
    coll.barrier(world, timeout_s=120, what="the end")
    stuck.stop()
    print(f"rank {rank}: not stuck", flush=True)
