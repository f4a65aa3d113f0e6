"""Run under `mpiexec -n 3 python -m mpi4py tests/transport/beacon_worker.py SCENARIO`.

Rank 0 does long work (longer than the collectives' bound) before it hands out a batch with
`GroupScatter` (rank 1 its group's leader, rank 2 that leader's peer), before a barrier and
before a broadcast (as of a weight update's outcome);
the others wait for it bounded by its beacon. Scenarios: `work` (rank 0 alive: every wait
completes), `gone` (rank 0's beacon stops, as when it is killed or stopped: the waits fail
naming it). Prints `rank R OK`, or `rank R TIMEOUT <seconds> <message>`. `levels`: each rank
prints its MPI thread level and `thread_level_problem`'s verdict. `fails` (2 ranks, run with
beacon.FAIL_ENV set): rank 0's beacon thread raises; with `main`, rank 0's main thread calls
`stuck.progress()` as its loops do (it ends the rank there); with `idle`, it reaches no progress
point (the beacon thread ends the rank itself). Rank 0 prints `rank 0 NOT ENDED` if it lives on."""
import logging
import os
import sys
import time

from mpi4py import MPI

from areal_hpc import stuck
from areal_hpc.transport import mpi as coll
from areal_hpc.transport.beacon import Beacon, thread_level_problem

BOUND = 1.5         # the collectives' fixed bound (rollout.collective_timeout_s)
SILENT = 2.0        # rank 0's silence that counts as gone (rollout.generator_timeout_s)
WORK = 3 * BOUND    # rank 0's work before it sends


def main(scenario: str) -> None:
    world = MPI.COMM_WORLD
    me = world.Get_rank()
    if scenario == "levels":        # this rank's thread level against its threads' needs
        problem = thread_level_problem(world, 0, ["host-a", "host-b"])
        for turn in range(world.Get_size()):      # one after another: no line inside another's
            if turn == me:
                print(f"rank {me} LEVEL {MPI.Query_thread()} {problem or 'ok'}", flush=True)
            world.Barrier()
        return
    if scenario == "fails":
        fails(world, me, sys.argv[2])
        return
    coll.set_default_timeout(BOUND)
    beacon = Beacon(world, 0, ["host-a", "host-b", "host-c"], interval_s=0.2, silent_s=SILENT)
    comm = world.Dup()
    comm.Set_name("trainer communicator")
    shares = coll.GroupScatter(comm, group=0 if me == 0 else 1, timeout_s=BOUND)
    if scenario == "work":
        if me == 0:
            time.sleep(WORK)
        got = shares.scatter(["for group 0", "for group 1"] if me == 0 else None, timeout_s=BOUND,
                             what="the batch", alive=beacon.watch)
        assert got == ("for group 0" if me == 0 else "for group 1"), got
        if me == 0:
            time.sleep(WORK)
        coll.barrier(comm, BOUND, what="the end", alive=beacon.watch)
        if me == 0:
            time.sleep(WORK)
        outcome = coll.bcast(comm, "done" if me == 0 else None, root=0, timeout_s=BOUND,
                             what="the outcome", alive=beacon.watch)
        assert outcome == "done", outcome
        beacon.stop()
        if me > 0:
            assert beacon.watch.beats >= WORK / 0.2 / 2, beacon.watch.beats
        print(f"rank {me} OK waited for {3 * WORK:.1f} s of work with a bound of {BOUND:g} s",
              flush=True)
        shares.free()
        comm.Free()
        return
    assert scenario == "gone"
    t0 = time.monotonic()
    if me == 0:
        beacon.stop()           # silent from here on, as a stopped or killed rank is
        time.sleep(SILENT + 6)
        os._exit(0)
    try:
        shares.scatter(None, timeout_s=BOUND, what="the batch", alive=beacon.watch)
    except coll.CollectiveTimeout as exc:
        print(f"rank {me} TIMEOUT {time.monotonic() - t0:.2f} {exc}", flush=True)
    else:
        print(f"rank {me} COMPLETED", flush=True)
    # mpiexec ends the job once one rank exits without MPI_Finalize: stay until all reported
    time.sleep(max(0.0, t0 + SILENT + 5 - time.monotonic()))
    os._exit(0)


def fails(world, me: int, how: str) -> None:
    """Rank 0's beacon thread raises (beacon.FAIL_ENV). `main`: the others allow 60 s of silence
    (the beacon thread would end the rank itself after 30), and rank 0's main thread reaches a
    progress point every 10 ms. `idle`: 2 s (1 s), and the main thread reaches none."""
    logging.basicConfig(level=logging.WARNING, format=f"[rank {me}] %(name)s: %(message)s")
    beacon = Beacon(world, 0, ["host-a", "host-b"], interval_s=0.2,
                    silent_s=60.0 if how == "main" else 2.0)
    if me == 0:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:         # the rank ends well before (a few beats)
            if how == "main":
                stuck.progress()
            time.sleep(0.01)
        print(f"rank 0 NOT ENDED ({beacon.failure})", flush=True)
        os._exit(0)
    world.Barrier()             # waits for rank 0, which never comes: ended with it


if __name__ == "__main__":
    main(sys.argv[1])
