"""Run under a launcher as 4 ranks: `mpiexec -n 4 python -m mpi4py
tests/transport/rank_death_worker.py OUT_DIR CASE` (or `srun -n 4 ... python -m mpi4py ...`).

What the other ranks of an MPI job can still do once one rank dies (SIGKILL). Rank 3, the victim,
dies while ranks 0-2, the survivors, are in CASE:
  idle  doing nothing with it;
  recv  rank 0 waiting in a receive from it (blocking Recv in a thread, bounded from outside),
        rank 1 polling an Irecv from it, rank 2 polling a `Channel` of areal_hpc/transport/mpi.py;
  send  rank 0 polling an Isend of 4 MiB to it (rendezvous: it needs the receiver), rank 1
        sending a `Channel` message of 4 MiB and `flush`ing it, rank 2 an eager Isend of 8 bytes;
  coll  every survivor in a bounded barrier of areal_hpc/transport/mpi.py on the world with it.
Then each survivor tries, every wait bounded: p2p with another survivor, a barrier and an
allreduce on `alive` (a communicator of the survivors made by Split before the death), a barrier
on the world (with the dead rank), a communicator of the survivors made after the death
(Create_group: collective over its members alone) and a barrier on it, MPIX_Comm_get_failed on
the world, and last MPIX_Comm_shrink of the world (in a thread: it may never return).

Each rank appends one JSON line per event to OUT_DIR/rank<R>.jsonl, flushed and fsynced at once
(the launcher may kill the process at any moment): {"rank", "event", "outcome", "detail", "s"},
outcome one of ok / error / timeout / info. The victim writes its pid (`pid`) and, just before its
SIGKILL, `dying`; a survivor waits for the victim's pid to be gone before the part after the
death, and ends with `done` and os._exit(0) (MPI_Finalize with a dead rank is not attempted)."""
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from areal_hpc.transport import mpi as coll

VICTIM = 3
EXPECT_S = 5.0     # a wait that involves the dead rank: how long it may take to fail
GUARD_S = 60.0     # a wait among survivors, or for an event: a failure guard only
BIG = 4 * 2**20    # bytes: well above every netmod's eager limit
T0 = time.monotonic()


class Log:
    def __init__(self, out: Path, rank: int):
        self.f = open(out / f"rank{rank}.jsonl", "a")
        self.rank = rank

    def __call__(self, event: str, outcome: str, detail="") -> None:
        line = {"rank": self.rank, "event": event, "outcome": outcome, "detail": str(detail)[:300],
                "s": round(time.monotonic() - T0, 3)}
        self.f.write(json.dumps(line) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def _error(exc: BaseException) -> str:
    if isinstance(exc, MPI.Exception):
        return f"MPI error class {exc.Get_error_class()}: {exc.Get_error_string().strip()}"
    return f"{type(exc).__name__}: {exc}"


def wait(log: Log, event: str, reqs, bound: float) -> str:
    """Poll `reqs` (a list of MPI requests) until done, an MPI error, or `bound` seconds."""
    t0 = time.monotonic()
    try:
        while not MPI.Request.Testall(reqs):
            if time.monotonic() - t0 > bound:
                log(event, "timeout", f"not complete after {bound:g} s")
                return "timeout"
            time.sleep(0.005)
    except MPI.Exception as exc:
        log(event, "error", f"after {time.monotonic() - t0:.2f} s: {_error(exc)}")
        return "error"
    log(event, "ok", f"{time.monotonic() - t0:.2f} s")
    return "ok"


def attempt(log: Log, event: str, fn) -> None:
    """A call that returns at once or raises (no wait in it)."""
    try:
        log(event, "ok", fn())
    except Exception as exc:     # noqa: BLE001 - what it raises is the finding
        log(event, "error", _error(exc))


def start(fn) -> dict:
    """Make a blocking call in a thread (it may never return): `finish` waits for it, bounded."""
    result = {}

    def call():
        try:
            result["ok"] = fn()
        except Exception as exc:     # noqa: BLE001 - what it raises is the finding
            result["error"] = _error(exc)

    threading.Thread(target=call, daemon=True).start()
    return result


def finish(log: Log, event: str, result: dict, bound: float = EXPECT_S) -> None:
    t0 = time.monotonic()
    while not result and time.monotonic() - t0 < bound:
        time.sleep(0.01)
    if not result:
        log(event, "timeout", f"still blocked after {bound:g} s more")
    else:
        (outcome, detail), = result.items()
        if isinstance(detail, MPI.Comm):
            detail = f"a communicator of {detail.Get_size()} rank(s)"
        log(event, outcome, detail)


def gone(pid: int) -> bool:
    """The victim's process has ended (a zombie counts: it is dead, its parent not yet told)."""
    try:
        os.kill(pid, 0)
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:     # ProcessLookupError, or /proc/PID gone (ENOENT, ESRCH) while reaped
        return True


def victim_pid(out: Path, log: Log) -> int:
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        for line in (out / f"rank{VICTIM}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "pid":
                return int(rec["detail"])
        time.sleep(0.05)
    log("victim pid", "timeout", "never written")
    os._exit(3)


def wait_for_death(pid: int, log: Log) -> None:
    deadline = time.monotonic() + GUARD_S
    while not gone(pid):
        if time.monotonic() > deadline:
            log("victim died", "timeout", f"pid {pid} still alive after {GUARD_S:g} s")
            os._exit(3)
        time.sleep(0.02)
    log("victim died", "info", pid)


def victim(world, case: str, how: str, log: Log) -> None:
    log("pid", "info", os.getpid())
    # the survivors each tell the victim they are in place (a small eager message, tag 9)
    for r in range(VICTIM):
        buf = np.zeros(1, np.int64)
        wait(log, f"ready from rank {r}", [world.Irecv(buf, source=r, tag=9)], GUARD_S)
    log("dying", "info", f"{case}, {how}")
    if how == "exit":
        os._exit(1)
    os.kill(os.getpid(), signal.SIGKILL)


def survivor(world, alive, case: str, out: Path, log: Log) -> None:
    me = world.Get_rank()
    pid = victim_pid(out, log)
    ready = np.array([me], np.int64)
    keep = [ready]  # buffers that must outlive the call that posted them
    # first: a large message would hold this one up behind it on a stream netmod (OFI tcp)
    world.Isend(ready, dest=VICTIM, tag=9)      # completes (eager) whether or not it is received
    if case == "recv":
        if me == 0:
            buf = np.zeros(BIG, np.uint8)
            blocked = start(lambda: world.Recv(buf, source=VICTIM, tag=1) or "received")
        elif me == 1:
            buf = np.zeros(BIG, np.uint8)
            req = world.Irecv(buf, source=VICTIM, tag=1)
            keep.append(buf)
        else:
            chan = coll.Channel(world)
    elif case == "send":
        if me == 0:
            buf = np.ones(BIG, np.uint8)
            req = world.Isend(buf, dest=VICTIM, tag=1)
            keep.append(buf)
        elif me == 1:
            chan = coll.Channel(world)
            chan.send(np.ones(BIG, np.uint8), VICTIM, coll.Tag.TRAJECTORIES)
        else:
            buf = np.ones(1, np.int64)
            req = world.Isend(buf, dest=VICTIM, tag=1)
            keep.append(buf)
    if case == "coll":
        t0 = time.monotonic()
        try:
            coll.barrier(world, EXPECT_S, what="the case barrier")
            log("case: barrier with the victim", "ok", f"{time.monotonic() - t0:.2f} s")
        except coll.CollectiveTimeout as exc:
            log("case: barrier with the victim", "timeout", exc)
        except MPI.Exception as exc:
            log("case: barrier with the victim", "error", _error(exc))
    wait_for_death(pid, log)
    if case == "recv":
        if me == 0:
            finish(log, "case: blocking Recv from the victim", blocked)
        elif me == 1:
            wait(log, "case: Irecv from the victim", [req], EXPECT_S)
        else:
            t0, got = time.monotonic(), None
            try:
                while got is None and time.monotonic() - t0 < EXPECT_S:
                    got = next(chan.poll(source=VICTIM), None)
                    time.sleep(0.01)
                log("case: Channel.poll from the victim", "ok" if got else "timeout",
                    got or f"nothing after {EXPECT_S:g} s, no error")
            except MPI.Exception as exc:
                log("case: Channel.poll from the victim", "error", _error(exc))
    elif case == "send":
        if me == 1:
            try:
                flushed = chan.flush(timeout=EXPECT_S)
                log("case: Channel.flush to the victim", "ok" if flushed else "timeout",
                    "flushed" if flushed else f"not flushed after {EXPECT_S:g} s, no error")
            except MPI.Exception as exc:
                log("case: Channel.flush to the victim", "error", _error(exc))
        else:
            wait(log, f"case: Isend of {'4 MiB' if me == 0 else '8 bytes'} to the victim", [req],
                 EXPECT_S)
    after_death(world, alive, log)


def after_death(world, alive, log: Log) -> None:
    me = world.Get_rank()
    # p2p among survivors: each sends its right neighbour (in 0..2) 4 MiB and a small message
    right, left = (me + 1) % VICTIM, (me - 1) % VICTIM
    big_out, big_in = np.full(BIG, me, np.uint8), np.zeros(BIG, np.uint8)
    small_out, small_in = np.array([me], np.int64), np.zeros(1, np.int64)
    if wait(log, "p2p among survivors", [world.Isend(big_out, dest=right, tag=2),
                                         world.Irecv(big_in, source=left, tag=2),
                                         world.Isend(small_out, dest=right, tag=3),
                                         world.Irecv(small_in, source=left, tag=3)], GUARD_S) == "ok":
        assert big_in[0] == left and small_in[0] == left
    wait(log, "barrier on alive", [alive.Ibarrier()], GUARD_S)
    total = np.zeros(1, np.int64)
    if wait(log, "allreduce on alive", [alive.Iallreduce(np.array([me + 1], np.int64), total)],
            GUARD_S) == "ok":
        assert int(total[0]) == 6, total
    wait(log, "barrier on the world", [world.Ibarrier()], EXPECT_S)
    # a communicator of the survivors made after the death (collective over them alone)
    made = start(lambda: world.Create_group(world.Get_group().Excl([VICTIM]), tag=7))
    finish(log, "Create_group of the survivors after the death", made, GUARD_S)
    if isinstance(made.get("ok"), MPI.Comm):
        wait(log, "barrier on the group made after the death", [made["ok"].Ibarrier()], GUARD_S)
    attempt(log, "MPIX_Comm_get_failed on the world", lambda: _failed(world))
    # the survivors meet once more before the part that may abort them
    wait(log, "barrier on alive before shrink", [alive.Ibarrier()], GUARD_S)
    log("shrink", "info", "calling MPIX_Comm_shrink")
    finish(log, "MPIX_Comm_shrink of the world",
           start(lambda: f"a communicator of {world.Shrink().Get_size()}"))
    wait(log, "barrier on alive at the end", [alive.Ibarrier()], GUARD_S)
    log("done", "info", "")
    os._exit(0)


def _failed(world) -> str:
    group = world.Get_failed()
    ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world.Get_group())
    return f"failed world ranks {ranks}"


def main(out: Path, case: str, how: str) -> None:
    world = MPI.COMM_WORLD.Dup()
    world.Set_name("world")
    me = world.Get_rank()
    log = Log(out, me)
    faults = open(out / f"rank{me}.fault", "w")
    faulthandler.enable(faults)     # a crash's Python stack; SIGUSR2: where it is now
    faulthandler.register(signal.SIGUSR2, faults)
    alive = world.Split(0 if me != VICTIM else MPI.UNDEFINED, me)
    if me == VICTIM:
        victim(world, case, how, log)
    else:
        alive.Set_name("alive")
        log("start", "info", f"{MPI.Get_library_version().splitlines()[0]}; errhandler "
            f"{'return' if world.Get_errhandler() == MPI.ERRORS_RETURN else 'other'}")
        survivor(world, alive, case, out, log)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "kill")
