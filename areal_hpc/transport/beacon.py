"""Trainer rank 0's sign of life, for the waits that are for its work rather than for a peer.

Some ranks wait on work that trainer rank 0 does alone and whose length no fixed bound can know:
the other trainer ranks wait for the first batch while rank 0 runs the initial evaluation and
the generators produce the batch (hours at 32B on a slow start), for the next batch during a
periodic evaluation, and before the final checkpoint during the final one; the generators wait
at the end of the job for the final checkpoint and the export. A wait like that is bounded by
rank 0's liveness, not by a number of seconds: rank 0 keeps every wait of its own bounded (its
generators' liveness, weights.timeout_s, its collectives), so while it is alive it is making
progress or will fail within those bounds, and a rank 0 that is gone (killed, stopped, its node
lost) falls silent.

    rank 0: Beacon thread ── a 1-byte message every rollout.heartbeat_s ──▶ every other rank
    others: RankWatch.check() (polled by the bounded wait) ── silent > rollout.generator_timeout_s
                                                              → CollectiveTimeout naming rank 0

The beats travel on a communicator of their own (a `Dup` of the world), so they never match
another message. The watch drains what has arrived each time it is checked; between waits the
beats queue at the receiver (a few bytes each: a 24 h job at one every 5 s is 17,280 of them per
rank, and every wait drains them). The thread makes MPI calls beside the main thread's (and
the controller's service thread's), which needs MPI_THREAD_MULTIPLE on the source: mpi4py's
default request, which an MPI may still answer lower. `thread_level_problem` checks each rank's
level against its own threads' needs before the beacon starts.

If the beacon thread itself fails (an exception in it: an MPI error on its sends), the rank
would fall silent while its main thread runs on, and the others would take it for gone with no
cause, or wait on it while it goes on. So the thread keeps the failure, and the rank ends with
one line naming it (rank, role, host, pid, the exception) and exit EXIT_BEACON_FAILED: by its
main thread at its next `stuck.progress()` (the main loops and every polling wait call it), or,
where the main thread reaches none within half the silence the others allow (`silent_s`: a long
call under `stuck.expect`, a checkpoint), by the beacon thread itself, so that the named line
comes before the others' "rank 0 is gone". It ends the way `stuck.py` ends a stuck rank (the line
logged, the output flushed, `os._exit`, the launcher ending the other ranks), but without the
stuck flag and its exit 4: those make the launchers requeue the attempt as a hang and say "a
rank was stuck", and this is an error of the rank (its MPI, or a bug), not a hang a fresh
attempt cures; exit 1, as a rank that raises (`python -m mpi4py`'s MPI_Abort code).
"""
from __future__ import annotations

import logging
import os
import threading
import time

from .. import stuck
from .mpi import CollectiveTimeout

log = logging.getLogger(__name__)

BEAT_TAG = 1
EXIT_BEACON_FAILED = 1      # the rank's exit code once its beacon thread has failed
FAIL_ENV = "AREAL_TEST_BEACON_FAIL"     # test hook: "N": the source's beacon raises at its Nth beat


class RankWatch:
    """A rank's view of the beacon's source: `check` raises once it has been silent too long.

    Args:
        comm: the beacon's communicator; source: the beacon's rank in it; host: its host name.
        silent_s: the longest silence of a live source (rollout.generator_timeout_s).
        key: the config key of `silent_s`, named in the error.
    """

    def __init__(self, comm, source: int, host: str, silent_s: float,
                 key: str = "rollout.generator_timeout_s"):
        import numpy as np
        self.comm, self.source, self.host, self.silent_s, self.key = comm, source, host, silent_s, key
        self.last_heard: float | None = None
        self.beats = 0
        self._buf = np.zeros(1, dtype=np.uint8)

    def poll(self, now: float | None = None) -> float | None:
        """Receive the beats that have arrived; the time of the newest (monotonic), or None."""
        from mpi4py import MPI
        got = False
        while self.comm.Iprobe(source=self.source, tag=BEAT_TAG):
            self.comm.Recv([self._buf, MPI.BYTE], source=self.source, tag=BEAT_TAG)
            self.beats += 1
            got = True
        if got:
            self.last_heard = time.monotonic() if now is None else now
        return self.last_heard

    def check(self, what: str, since: float, now: float | None = None) -> None:
        """Raise `CollectiveTimeout` when the source has sent no beat for `silent_s`, counted
        from the newest beat or from `since` (the wait's start), whichever is later."""
        now = time.monotonic() if now is None else now
        heard = self.poll(now)
        silent = now - max(since, heard if heard is not None else since)
        if silent > self.silent_s:
            raise CollectiveTimeout(
                f"{what}: rank {self.source} (host {self.host}), whose work this rank waits for, "
                f"sent no sign of life for {silent:.0f} s ({self.key} = {self.silent_s:g}; "
                f"{now - since:.0f} s waited): it is gone (killed, stopped, its node lost)")


LEVELS = ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")     # MPI_THREAD_*, in order


def thread_level_problem(world, source: int, hosts: list[str]) -> str | None:
    """One line if this rank's MPI thread level (MPI_Query_thread) is below what its threads
    need, else None. The source of the beacon (trainer rank 0) calls MPI from its main thread,
    the controller's service thread and the beacon at once: MULTIPLE. Every other rank calls
    MPI from its main thread alone, beside threads that do not (the engine watch, the reward
    pool's readers): FUNNELED."""
    from mpi4py import MPI
    provided = MPI.Query_thread()
    me = world.Get_rank()
    if me == source and world.Get_size() > 1:
        need, why = MPI.THREAD_MULTIPLE, ("its main thread, the controller's service thread and "
                                          "the beacon call MPI at once")
    else:
        need, why = MPI.THREAD_FUNNELED, "it calls MPI from its main thread beside other threads"
    if provided >= need:
        return None
    return (f"rank {me} (host {hosts[me]}): MPI provides thread level MPI_THREAD_"
            f"{LEVELS[provided]}, this rank needs MPI_THREAD_{LEVELS[need]} ({why}): request it "
            f"(mpi4py.rc.thread_level, MPI4PY_RC_THREAD_LEVEL=multiple) from an MPI built with "
            f"thread support")


class Beacon:
    """Collective over `world`: the source rank beats, every other rank holds a `RankWatch`
    (`watch`; None on the source). `stop()` on every rank before MPI is finalized. Made by the
    rank's main thread, which ends the rank at its next `stuck.progress()` once the source's
    thread has failed (`failure`: the line that names it). `role`: the source's role, named in
    that line (trainer rank 0 in areal_hpc.main)."""

    def __init__(self, world, source: int, hosts: list[str], interval_s: float, silent_s: float,
                 role: str = "trainer"):
        self.comm = world.Dup()
        self.comm.Set_name("beacon communicator")
        self.source, self.interval_s, self.silent_s = source, interval_s, silent_s
        self.role, self.host = role, hosts[source]
        self.is_source = self.comm.Get_rank() == source
        self.watch = None if self.is_source else RankWatch(self.comm, source, hosts[source], silent_s)
        self.failure: str | None = None
        self._main = threading.get_ident()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending: list = []
        if self.is_source and self.comm.Get_size() > 1:
            self._thread = threading.Thread(target=self._beat, name="beacon", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        import numpy as np
        from mpi4py import MPI
        one = np.ones(1, dtype=np.uint8)        # never written after this: shared by every send
        others = [r for r in range(self.comm.Get_size()) if r != self.source]
        fail_at = int(os.environ.get(FAIL_ENV) or 0)
        beats = 0
        try:
            while not self._stop.is_set():
                beats += 1
                if beats == fail_at:
                    raise MPI.Exception(MPI.ERR_OTHER)      # as an MPI error in a send would
                self._pending = [r for r in self._pending if not r.Test()]
                for r in others:
                    self._pending.append(self.comm.Isend([one, MPI.BYTE], dest=r, tag=BEAT_TAG))
                self._stop.wait(self.interval_s)
        except Exception as exc:        # noqa: BLE001 - any: the rank would fall silent unnamed
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """Keep the failure for the main thread (`stuck.progress`); end the rank from here if
        the main thread reaches no progress point within half the others' allowance."""
        who = f"rank {self.source} ({self.role}, host {self.host}, pid {os.getpid()})"
        cause = " ".join(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}".split())

        def line(how: str = "") -> str:
            return (f"{who}: its beacon thread failed ({cause}){how}: the other ranks would "
                    f"hear nothing from it and take it for gone; ending the rank "
                    f"(exit {EXIT_BEACON_FAILED})")

        log.error("the beacon thread of %s failed; its traceback:", who, exc_info=exc)
        stuck.thread_failed(self._main, line(), EXIT_BEACON_FAILED)
        self.failure = line()
        wait_s = self.silent_s / 2
        if not self._stop.wait(wait_s):
            stuck.end_rank(line(f" and its main thread reached no progress point in {wait_s:g} s"),
                           EXIT_BEACON_FAILED)

    def stop(self, join_s: float = 5.0) -> None:
        """End the beats (the source's thread joined, its sends completed or cancelled) and
        drain what arrived (elsewhere); not collective."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(join_s)
            deadline = time.monotonic() + join_s
            while self._pending and time.monotonic() < deadline:
                self._pending = [r for r in self._pending if not r.Test()]
                time.sleep(0.01)
            for r in self._pending:     # a receiver that is gone: nothing will take it
                r.Free()
            self._pending = []
        if self.watch is not None:
            self.watch.poll()
