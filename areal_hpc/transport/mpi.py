"""MPI messages between the controller (trainer rank 0) and the generator ranks.

Control (prompts, weight-update notices, eval requests, stop) flows controller → generator;
trajectories and eval results flow generator → controller. Messages are pickled dicts with numpy
arrays, sent out-of-band (pickle 5, `mpi4py.util.pkl5`) so large token arrays are not copied into
the pickle stream. Sends are non-blocking; the sender keeps the requests until they complete.
Receives are polled (`poll`; `idle` sleeps until a message is waiting), never a blocking
collective, so neither side stalls the other.
"""
from __future__ import annotations

import time
from enum import IntEnum
from typing import Any, Iterator


class Tag(IntEnum):
    PROMPTS = 11        # controller → generator: list of prompt dicts to generate groups for
    WEIGHTS = 12        # controller → generator: {"version", "plan"} (a broadcast follows) or
                        # {"version", "path"} (a safetensors directory to load)
    EVAL = 13           # controller → generator: {"version", "prompts", "samples"}
    STOP = 14           # controller → generator: finish
    TRAJECTORIES = 21   # generator → controller: one scored group (list of trajectory dicts)
    EVAL_RESULT = 22    # generator → controller: {"version", "results": [...]}
    STATS = 23          # generator → controller: {"rank", "tokens", ...} at stop
    WEIGHTS_ACK = 24    # generator → controller: {"version", "phase": "started"|"loaded", ...}
    HEARTBEAT = 25      # generator → controller: {"version", "running", "tokens"} every
                        # rollout.heartbeat_s while its loop runs (liveness)


class Channel:
    """Non-blocking point-to-point messages on one communicator."""

    def __init__(self, comm):
        from mpi4py.util import pkl5
        self.comm = pkl5.Intracomm(comm)
        self._pending: list = []

    def send(self, obj: Any, dest: int, tag: Tag) -> None:
        self._pending.append(self.comm.isend(obj, dest=dest, tag=int(tag)))
        self._reap()

    def _reap(self) -> None:
        self._pending = [r for r in self._pending if not r.test()[0]]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every send has been received; False if timed out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            self._reap()
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def poll(self, source: int | None = None, tag: Tag | None = None) -> Iterator[tuple[int, Tag, Any]]:
        """Yield every message already arrived (source, tag, payload), without blocking."""
        from mpi4py import MPI
        src = MPI.ANY_SOURCE if source is None else source
        tg = MPI.ANY_TAG if tag is None else int(tag)
        self._reap()
        while True:
            status = MPI.Status()
            msg = self.comm.improbe(source=src, tag=tg, status=status)
            if msg is None:
                return
            yield status.Get_source(), Tag(status.Get_tag()), msg.recv()

    def idle(self, source: int | None = None, timeout: float = 0.05) -> bool:
        """Sleep until a message is waiting (not received) or the timeout passes."""
        from mpi4py import MPI
        src = MPI.ANY_SOURCE if source is None else source
        deadline = time.monotonic() + timeout
        while not self.comm.iprobe(source=src, tag=MPI.ANY_TAG):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True
