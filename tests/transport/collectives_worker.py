"""Run under `mpiexec -n 3 python -m mpi4py tests/transport/collectives_worker.py SCENARIO`.

Prints one line per rank: `rank R OK ...`, or `rank R TIMEOUT <seconds> <message>`."""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from areal_hpc.transport import mpi as coll

BOUND = 2.0


def main(scenario: str) -> None:
    comm = MPI.COMM_WORLD.Dup()
    comm.Set_name("test communicator")
    me, n = comm.Get_rank(), comm.Get_size()
    if scenario == "ok":
        big = {"a": np.arange(300_000, dtype=np.float32), "s": "x" * 1000}
        for root in range(n):
            got = coll.bcast(comm, big if me == root else None, root=root, timeout_s=BOUND)
            assert np.array_equal(got["a"], big["a"]) and got["s"] == big["s"]
        parts = coll.gather(comm, {"rank": me, "data": list(range(me * 1000))}, root=1,
                            timeout_s=BOUND)
        if me == 1:
            assert [p["rank"] for p in parts] == list(range(n))
            assert [len(p["data"]) for p in parts] == [r * 1000 for r in range(n)]
        else:
            assert parts is None
        coll.barrier(comm, BOUND)
        assert coll.bcast(comm, None, root=0, timeout_s=BOUND) is None
        _channel_order(comm)
        _channel_half_message(comm.Dup())
        print(f"rank {me} OK", flush=True)
        comm.Free()
        return
    if scenario == "burst":
        _channel_burst(comm)
        print(f"rank {me} OK", flush=True)
        return
    # a rank that does not arrive: `late` (the last rank, or the root for bcast) sleeps past BOUND
    op = scenario
    late = 0 if op == "bcast" else n - 1
    if me == late:
        time.sleep(BOUND + 4)
        print(f"rank {me} LATE", flush=True)
        os._exit(0)
    t0 = time.monotonic()
    try:
        if op == "barrier":
            coll.barrier(comm, BOUND, what="the test barrier")
        elif op == "bcast":
            coll.bcast(comm, None, root=0, timeout_s=BOUND, what="the test bcast")
        elif op == "gather":
            coll.gather(comm, me, root=0, timeout_s=BOUND, what="the test gather")
    except coll.CollectiveTimeout as exc:
        print(f"rank {me} TIMEOUT {time.monotonic() - t0:.2f} {exc}", flush=True)
    else:
        print(f"rank {me} COMPLETED", flush=True)
    # mpiexec ends the whole job once one rank exits without MPI_Finalize: stay until every
    # rank has reported
    time.sleep(max(0.0, t0 + BOUND + 6 - time.monotonic()))
    os._exit(0)


def _channel_order(comm) -> None:
    """Rank 1 sends rank 0 a large message then small ones: rank 0's polls never block, and
    yield them complete and in order."""
    chan = coll.Channel(comm)
    if comm.Get_rank() == 1:
        chan.send({"i": 0, "a": np.ones(20_000_000 // 4, np.float32)}, 0, coll.Tag.TRAJECTORIES)
        for i in range(1, 4):
            chan.send({"i": i}, 0, coll.Tag.HEARTBEAT)
        assert chan.flush(timeout=30)
    elif comm.Get_rank() == 0:
        got, longest, deadline = [], 0.0, time.monotonic() + 30
        while len(got) < 4 and time.monotonic() < deadline:
            t = time.monotonic()
            got += [(tag, msg["i"]) for _, tag, msg in chan.poll()]
            longest = max(longest, time.monotonic() - t)
            chan.idle(timeout=0.01)
        assert [i for _, i in got] == [0, 1, 2, 3], got
        assert got[0][0] == coll.Tag.TRAJECTORIES and chan.incomplete() == []
        print(f"rank 0 channel: longest poll {longest * 1000:.1f} ms", flush=True)
    comm.Barrier()


def _channel_half_message(comm) -> None:
    """Rank 1 sends rank 0 the header of a message whose part never follows (a sender that
    died between them): rank 0's polls still return at once, name it in `incomplete()`, and
    take rank 2's message. (mpi4py's pkl5 `improbe` would wait in a blocking Mprobe forever.)"""
    chan = coll.Channel(comm)
    if comm.Get_rank() == 1:
        comm.Send([np.array([5], np.int64), MPI.LONG_LONG], dest=0, tag=int(coll.Tag.PARTIAL))
    elif comm.Get_rank() == 2:
        comm.Barrier()                  # after rank 1's header has been matched
        chan.send({"i": 2}, 0, coll.Tag.HEARTBEAT)
        assert chan.flush(timeout=30)
    if comm.Get_rank() == 0:
        got, longest, deadline = [], 0.0, time.monotonic() + 30
        while not chan.incomplete() and time.monotonic() < deadline:
            list(chan.poll())
            chan.idle(timeout=0.01)
        comm.Barrier()
        while not got and time.monotonic() < deadline:
            t = time.monotonic()
            got += [(src, msg["i"]) for src, _, msg in chan.poll()]
            longest = max(longest, time.monotonic() - t)
            chan.idle(timeout=0.01)
        assert got == [(2, 2)], got
        stuck = chan.incomplete()
        assert [(s, t) for s, t, _ in stuck] == [(1, coll.Tag.PARTIAL)], stuck
        print(f"rank 0 half message: longest poll {longest * 1000:.1f} ms, stuck {stuck[0][2]:.1f} s",
              flush=True)
    elif comm.Get_rank() == 1:
        comm.Barrier()


BURST = 300


def _channel_burst(comm) -> None:
    """Rank 0 sends rank 1 BURST messages (with an out-of-band array every tenth) while rank 1
    makes no MPI call for 5 s: rank 1 then receives every one, in order."""
    chan = coll.Channel(comm)
    if comm.Get_rank() == 0:
        for i in range(BURST):
            chan.send({"i": i, "a": np.full(70_000 if i % 10 == 0 else 1, i, np.float32)}, 1,
                      coll.Tag.CONTROLLER_HEARTBEAT)
            time.sleep(4.0 / BURST)
        assert chan.flush(timeout=60)
    elif comm.Get_rank() == 1:
        time.sleep(5.0)
        got, deadline = [], time.monotonic() + 60
        while len(got) < BURST and time.monotonic() < deadline:
            got += [(msg["i"], float(msg["a"][-1])) for _, _, msg in chan.poll(source=0)]
            chan.idle(source=0, timeout=0.01)
        assert got == [(i, float(i)) for i in range(BURST)], (len(got), got[-3:], chan.incomplete())
        print(f"rank 1 burst: {len(got)} of {BURST} in order", flush=True)
    comm.Barrier()


if __name__ == "__main__":
    main(sys.argv[1])
