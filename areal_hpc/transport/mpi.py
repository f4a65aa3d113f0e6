"""MPI messages between the controller (trainer rank 0) and the generator ranks.

Control (prompts, weight-update notices, eval requests, stop) flows controller → generator;
trajectories and eval results flow generator → controller. The messages are the dataclasses of
`areal_hpc.transport.messages` (numpy arrays inside), pickled out-of-band (pickle 5,
`mpi4py.util.pkl5`) so large token arrays are not copied into the pickle stream. The channel
itself carries any picklable object under any tag. Sends are non-blocking; the sender keeps the
requests until they complete. Receives are polled (`poll`; `idle` sleeps until a message is waiting) and completed in the
background, never a blocking call, so neither side stalls the other. The controller sends every
generator a CONTROLLER_HEARTBEAT at least every rollout.heartbeat_s; a generator that hears
nothing for rollout.generator_timeout_s ends itself (the trainer is gone).

Collectives: `bcast`, `gather` and `barrier` below are the bounded forms the ranks use instead of
the blocking mpi4py calls (see `CollectiveTimeout`).
"""
from __future__ import annotations

import time
from enum import IntEnum
from typing import Any, Iterator


class Tag(IntEnum):
    """One per message class of `areal_hpc.transport.messages` (the payloads are there)."""
    PROMPTS = 11        # controller → generator
    WEIGHTS = 12        # controller → generator
    EVAL = 13           # controller → generator
    STOP = 14           # controller → generator
    CONTROLLER_HEARTBEAT = 15   # controller → generator
    STALE_BEFORE = 16   # controller → generator
    STEPS_DONE = 17     # controller → generator
    TRAJECTORIES = 21   # generator → controller
    EVAL_RESULT = 22    # generator → controller
    STATS = 23          # generator → controller
    WEIGHTS_ACK = 24    # generator → controller
    HEARTBEAT = 25      # generator → controller
    PARTIAL = 26        # generator → controller


class Channel:
    """Non-blocking point-to-point messages on one communicator."""

    def __init__(self, comm):
        from mpi4py.util import pkl5
        self.comm = pkl5.Intracomm(comm)
        self._pending: list = []
        self._incoming: list = []       # (source, tag, pkl5 request, monotonic t) still arriving
        self._ready: list = []          # (source, tag, payload) received, not yet yielded

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
        """Yield every message that has fully arrived (source, tag, payload), without blocking.

        A message whose first part has arrived is matched and received in the background
        (`irecv`): the rest of a large message still on its way (its sender busy, or gone) never
        holds the caller; `incomplete()` lists such messages and their age. Messages from one
        source are yielded in the order they were sent."""
        from mpi4py import MPI
        src = MPI.ANY_SOURCE if source is None else source
        tg = MPI.ANY_TAG if tag is None else int(tag)
        self._reap()
        while True:
            status = MPI.Status()
            msg = self.comm.improbe(source=src, tag=tg, status=status)
            if msg is None:
                break
            self._incoming.append((status.Get_source(), Tag(status.Get_tag()), msg.irecv(),
                                   time.monotonic()))
        blocked, keep = set(), []
        for item in self._incoming:         # complete ones move to _ready, in order per source
            s = item[0]
            if s not in blocked:
                done, obj = item[2].test()
                if done:
                    self._ready.append((s, item[1], obj))
                    continue
                blocked.add(s)
            keep.append(item)
        self._incoming = keep
        while True:     # the caller may stop early (e.g. at STOP): the rest stay ready
            hit = next((i for i, (s, t, _) in enumerate(self._ready)
                        if (source is None or s == source) and (tag is None or t == tag)), None)
            if hit is None:
                return
            yield self._ready.pop(hit)

    def incomplete(self) -> list[tuple[int, Tag, float]]:
        """(source, tag, seconds since its first part arrived) of each message still arriving."""
        now = time.monotonic()
        return [(s, t, now - t0) for s, t, _, t0 in self._incoming]

    def idle(self, source: int | None = None, timeout: float = 0.05) -> bool:
        """Sleep until a message is waiting (not received) or the timeout passes."""
        from mpi4py import MPI
        src = MPI.ANY_SOURCE if source is None else source
        if self._ready:
            return True
        deadline = time.monotonic() + timeout
        while not self.comm.iprobe(source=src, tag=MPI.ANY_TAG):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True


# -- bounded collectives ---------------------------------------------------------------------------
# A blocking MPI collective waits forever for a rank that is hung or gone (a launcher that does not
# tear the job down, a stopped process, a lost node). These run the non-blocking form of the
# collective and poll it against a deadline; past it they raise `CollectiveTimeout` naming the
# operation, the communicator and its size. They cannot say which rank is missing (a hanging rank
# reports nothing; an ibarrier does not tell who arrived). Every rank of the communicator must call
# the same helper at the same place: a non-blocking collective does not match a blocking one.
# An object that is not an mpi4py communicator (a test double with Barrier / bcast / gather) gets
# its own blocking call, unbounded.

DEFAULT_TIMEOUT_S = 1800.0      # set from rollout.collective_timeout_s by areal_hpc.main


class CollectiveTimeout(RuntimeError):
    """An MPI collective did not complete within its bound: a rank of the communicator is hung or
    gone. The message names the operation and the communicator."""


def set_default_timeout(timeout_s: float) -> None:
    """The bound used by `bcast`, `gather` and `barrier` when no `timeout_s` is given."""
    global DEFAULT_TIMEOUT_S
    DEFAULT_TIMEOUT_S = float(timeout_s)


def _describe(comm) -> str:
    try:
        name = comm.Get_name() or "communicator"
    except Exception:       # noqa: BLE001 - only used in a message
        name = "communicator"
    return f"{name} of {comm.Get_size()} rank(s) (this is its rank {comm.Get_rank()})"


def _complete(req, comm, op: str, what: str, timeout_s: float | None, t0: float | None = None) -> None:
    """Poll `req` until it completes; `CollectiveTimeout` once `timeout_s` has passed since t0."""
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    t0 = time.monotonic() if t0 is None else t0
    deadline = t0 + timeout_s
    pause = 1e-4
    while not req.Test():
        if time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"{what}: MPI {op} on the {_describe(comm)} not complete after "
                f"{time.monotonic() - t0:.0f} s (bound {timeout_s:g} s): a rank of it is hung or "
                f"gone (stopped, killed, its node lost) or far slower than the bound allows")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)      # quick for fast collectives, ~50 polls/s when waiting


def barrier(comm, timeout_s: float | None = None, what: str = "barrier") -> None:
    """`comm.Barrier()` bounded by `timeout_s` (default DEFAULT_TIMEOUT_S)."""
    if comm.Get_size() == 1:
        return
    if not hasattr(comm, "Ibarrier"):
        return comm.Barrier()
    _complete(comm.Ibarrier(), comm, "barrier", what, timeout_s)


def bcast(comm, obj: Any, root: int = 0, timeout_s: float | None = None, what: str = "bcast") -> Any:
    """`comm.bcast(obj, root)` (pickled objects) bounded by `timeout_s` in all: the size, then the
    bytes, each an Ibcast."""
    import pickle

    import numpy as np
    if comm.Get_size() == 1:
        return obj
    if not hasattr(comm, "Ibcast"):
        return comm.bcast(obj, root=root)
    t0 = time.monotonic()
    me = comm.Get_rank()
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if me == root else b""
    size = np.array([len(data)], dtype=np.int64)
    _complete(comm.Ibcast(size, root=root), comm, "bcast (size)", what, timeout_s, t0)
    buf = np.frombuffer(data, dtype=np.uint8).copy() if me == root else np.empty(int(size[0]), np.uint8)
    _complete(comm.Ibcast(buf, root=root), comm, "bcast", what, timeout_s, t0)
    return obj if me == root else pickle.loads(buf.tobytes())


def gather(comm, obj: Any, root: int = 0, timeout_s: float | None = None,
           what: str = "gather") -> list | None:
    """`comm.gather(obj, root)` (pickled objects) bounded by `timeout_s` in all: the sizes
    (Igather), then the bytes (Igatherv). Returns the list on `root`, None elsewhere."""
    import pickle

    import numpy as np
    if comm.Get_size() == 1:
        return [obj]
    if not hasattr(comm, "Igatherv"):
        return comm.gather(obj, root=root)
    from mpi4py import MPI
    t0 = time.monotonic()
    me, n = comm.Get_rank(), comm.Get_size()
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8).copy()
    mine = np.array([data.size], dtype=np.int64)
    sizes = np.zeros(n, dtype=np.int64) if me == root else None
    _complete(comm.Igather(mine, [sizes, MPI.INT64_T] if me == root else None, root=root),
              comm, "gather (sizes)", what, timeout_s, t0)
    if me == root:
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        recv = [out, (sizes.tolist(), displs.tolist()), MPI.BYTE]
    else:
        recv = None
    _complete(comm.Igatherv(data, recv, root=root), comm, "gather", what, timeout_s, t0)
    if me != root:
        return None
    return [pickle.loads(out[d:d + s].tobytes()) for d, s in zip(displs.tolist(), sizes.tolist())]
