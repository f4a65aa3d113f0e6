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

Sizes: pkl5 sends a message's pickle stream (arrays under 256 KiB inside it) and each larger
array as one MPI message each, with a derived datatype (BigMPI) above 2**31 - 1 bytes, so no MPI
count overflows on MPIs without MPI-4 large counts (Open MPI 4/5, Cray MPICH). A `Group` holds
one group's sequences (megabytes); the largest message is the `Partial` at a preemption (every
group in flight). These are not cut to MAX_MESSAGE_BYTES (below); the trainer's batch is.

Collectives: `bcast`, `gather` and `barrier` below are the bounded forms the ranks use instead of
the blocking mpi4py calls (see `CollectiveTimeout`); `GroupScatter` hands each group of ranks its
own part of an object (the trainer's batch: each data-parallel rank its share). `bcast` and
`GroupScatter` send a pickled payload in pieces of at most `MAX_MESSAGE_BYTES`; `TRAFFIC` counts
what this process sent and received through them.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Iterator

from .. import stuck


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


def _pkl5_info():
    """The datatype of a pkl5 message's header (its parts' sizes, int64): the header's element
    count is the number of parts that follow it."""
    from mpi4py import MPI
    return MPI.Datatype.fromcode("q")


class _Arriving:
    """The receives of one message's parts (`Channel._match`); `test()` is (done, the object)."""

    def __init__(self, comm, parts: list, source: int, tag: int):
        from mpi4py import MPI
        self.parts, self._types = parts, []
        self.reqs = [MPI.Comm.Irecv(comm, self._spec(p), source, tag) for p in parts]

    def _spec(self, buf):
        """`buf` as a receive buffer: bytes, or one element of a contiguous type above the
        largest count this MPI takes (as pkl5 sends it: the type signatures match)."""
        from mpi4py import MPI
        count = len(buf)
        # the largest count of one call: 2**63 - 1 with MPI-4's large counts, else 2**31 - 1
        if count <= (1 << (63 if MPI.Get_version() >= (4, 0) else 31)) - 1:
            return [buf, count, MPI.BYTE]
        dtype = MPI.BYTE.Create_contiguous(count).Commit()
        self._types.append(dtype)
        return [buf, 1, dtype]

    def test(self) -> tuple[bool, Any]:
        from mpi4py import MPI
        if not MPI.Request.Testall(self.reqs):
            return False, None
        for dtype in self._types:
            dtype.Free()
        return True, MPI.pickle.loads_oob(self.parts[0], self.parts[1:])


class Channel:
    """Non-blocking point-to-point messages on one communicator."""

    def __init__(self, comm):
        from mpi4py.util import pkl5
        self.comm = pkl5.Intracomm(comm)
        self._pending: list = []
        self._incoming: list = []       # (source, tag, _Arriving, monotonic t) still arriving
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
        self._reap()
        self._match(source, tag)
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

    def _match(self, source: int | None, tag: Tag | None) -> None:
        """Take the header of every message that has arrived and post the receives of its parts
        (pkl5's format: a header of int64 sizes, then the pickle and each out-of-band buffer as
        messages of their own under the same tag), never waiting for a part.

        Not with matched probes (`Improbe`/`Mprobe`, as mpi4py's pkl5 `improbe` does): over
        MPICH's OFI netmod with the tcp provider (the Slurm scripts' default), a receiver that
        made no MPI call while a few hundred messages arrived then matched a header whose part
        never came, and pkl5's blocking `Mprobe` for it never returned
        (tests/transport/test_collectives.py; BENCHMARKS.md). A plain probe then a receive of
        the probed source and tag takes the same message: only this thread receives here, and
        messages of one source and tag arrive in order."""
        import struct

        from mpi4py import MPI
        src = MPI.ANY_SOURCE if source is None else source
        tg = MPI.ANY_TAG if tag is None else int(tag)
        status, info = MPI.Status(), _pkl5_info()
        while MPI.Comm.Iprobe(self.comm, src, tg, status):
            s, t = status.Get_source(), status.Get_tag()
            n = status.Get_elements(info)
            header = bytearray(8 * n)
            MPI.Comm.Recv(self.comm, [header, info], s, t)   # arrived: returns at once
            parts = [MPI.buffer.allocate(k) for k in struct.unpack(f"{n}q", header)]
            # posted before the next probe: the parts (arrived or not) match these, in order
            self._incoming.append((s, Tag(t), _Arriving(self.comm, parts, s, t), time.monotonic()))

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


def _complete(req, comm, op: str, what: str, timeout_s: float | None, t0: float | None = None,
              alive=None) -> None:
    """Poll `req` (one request or a list) until it completes; `CollectiveTimeout` once
    `timeout_s` has passed since t0 or, with `alive` (a `beacon.RankWatch`: a wait for the work
    of the rank it watches), once that rank has fallen silent instead."""
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    t0 = time.monotonic() if t0 is None else t0
    deadline = t0 + timeout_s
    pause = 1e-4
    if isinstance(req, list):
        from mpi4py import MPI
        done = lambda: MPI.Request.Testall(req)     # noqa: E731
    else:
        done = req.Test
    while not done():
        stuck.progress()                    # waiting on peers: not this rank's hang
        if alive is not None:
            alive.check(f"{what} (MPI {op} on the {_describe(comm)})", since=t0)
        elif time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"{what}: MPI {op} on the {_describe(comm)} not complete after "
                f"{time.monotonic() - t0:.0f} s (bound {timeout_s:g} s): a rank of it is hung or "
                f"gone (stopped, killed, its node lost) or far slower than the bound allows")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)      # quick for fast collectives, ~50 polls/s when waiting


# -- large payloads in pieces ----------------------------------------------------------------------
# MPI counts are C ints: one message of 2 GiB or more needs MPI-4 large counts (or derived
# datatypes), which Open MPI 4/5 and Cray MPICH lack or get wrong. `bcast` and `GroupScatter` send
# a pickled payload as a header (its size and the piece size, 2 int64) and then pieces of at most
# MAX_MESSAGE_BYTES each. The receivers take the piece size from the header, so ranks that
# disagree on the limit still agree on the pieces.

MAX_MESSAGE_BYTES = int(os.environ.get("AREAL_MPI_MAX_MESSAGE_BYTES", 2**31 - 2**20))


@dataclass
class Traffic:
    """Payload pieces this process sent and received through `bcast` and `GroupScatter` (the
    16-byte headers not counted)."""
    sent_messages: int = 0
    sent_bytes: int = 0
    received_messages: int = 0
    received_bytes: int = 0
    largest_message: int = 0

    def count(self, nbytes: int, sent: bool) -> None:
        if sent:
            self.sent_messages += 1
            self.sent_bytes += nbytes
        else:
            self.received_messages += 1
            self.received_bytes += nbytes
        self.largest_message = max(self.largest_message, nbytes)


TRAFFIC = Traffic()


def _dumps(obj: Any):
    """`obj` pickled, as a writable uint8 array (MPI's send buffers of a bcast must be writable),
    without copying the pickle."""
    import io
    import pickle

    import numpy as np
    f = io.BytesIO()
    pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
    return np.frombuffer(f.getbuffer(), dtype=np.uint8)


def _loads(buf) -> Any:
    import pickle
    return pickle.loads(memoryview(buf))


def _header(nbytes: int):
    import numpy as np
    piece = int(MAX_MESSAGE_BYTES)
    if piece < 1:
        raise ValueError(f"MAX_MESSAGE_BYTES must be >= 1, got {piece}")
    return np.array([nbytes, piece], dtype=np.int64)


def _pieces(buf, header) -> list:
    """`buf` (uint8) cut into the views the header announces."""
    n, piece = int(header[0]), int(header[1])
    return [buf[off:off + piece] for off in range(0, n, piece)]


def _isend_bytes(comm, data, dest: int, tag: int) -> list:
    """Post the header and the pieces of `data` (uint8) to `dest`; the requests to complete."""
    header = _header(data.size)
    reqs = [comm.Isend(header, dest=dest, tag=tag)]
    for part in _pieces(data, header):
        reqs.append(comm.Isend(part, dest=dest, tag=tag))
        TRAFFIC.count(part.size, sent=True)
    return reqs


def _recv_bytes(comm, source: int, tag: int, what: str, timeout_s: float | None, t0: float,
                alive=None):
    """What `_isend_bytes` sent from `source` (uint8), bounded by `timeout_s` since t0; with
    `alive`, the wait for its start by the sender's liveness instead (`_complete`)."""
    import numpy as np
    header = np.zeros(2, dtype=np.int64)
    _complete(comm.Irecv(header, source=source, tag=tag), comm, "recv (size)", what, timeout_s, t0,
              alive=alive)
    t0 = time.monotonic() if alive is not None else t0     # the bytes follow the header at once
    buf = np.empty(int(header[0]), dtype=np.uint8)
    parts = _pieces(buf, header)
    _complete([comm.Irecv(p, source=source, tag=tag) for p in parts], comm, "recv", what,
              timeout_s, t0)
    for p in parts:
        TRAFFIC.count(p.size, sent=False)
    return buf


def barrier(comm, timeout_s: float | None = None, what: str = "barrier", alive=None) -> None:
    """`comm.Barrier()` bounded by `timeout_s` (default DEFAULT_TIMEOUT_S), or by the liveness
    of the rank `alive` watches (a wait for that rank's work: `_complete`)."""
    if comm.Get_size() == 1:
        return
    if not hasattr(comm, "Ibarrier"):
        return comm.Barrier()
    _complete(comm.Ibarrier(), comm, "barrier", what, timeout_s, alive=alive)


def bcast(comm, obj: Any, root: int = 0, timeout_s: float | None = None, what: str = "bcast",
          alive=None) -> Any:
    """`comm.bcast(obj, root)` (pickled objects) bounded by `timeout_s` in all: the header (size,
    piece size), then the bytes in pieces of at most MAX_MESSAGE_BYTES, each an Ibcast. With
    `alive`, the wait for the header is bounded by the liveness of the rank it watches instead
    (a wait for that rank's work: `_complete`)."""
    if comm.Get_size() == 1:
        return obj
    if not hasattr(comm, "Ibcast"):
        return comm.bcast(obj, root=root)
    me = comm.Get_rank()
    buf = _bcast_bytes(comm, _dumps(obj) if me == root else None, root, timeout_s, what,
                       alive=alive)
    return obj if me == root else _loads(buf)


def _bcast_bytes(comm, data, root: int, timeout_s: float | None, what: str,
                 t0: float | None = None, alive=None):
    """`data` (uint8, on root) on every rank of `comm`: the header, then the pieces. With
    `alive`, the wait for the header is bounded by that rank's liveness (`_complete`)."""
    import numpy as np
    t0 = time.monotonic() if t0 is None else t0
    me = comm.Get_rank()
    header = _header(data.size) if me == root else np.zeros(2, dtype=np.int64)
    _complete(comm.Ibcast(header, root=root), comm, "bcast (size)", what, timeout_s, t0,
              alive=alive)
    t0 = time.monotonic() if alive is not None else t0     # the bytes follow the header at once
    buf = data if me == root else np.empty(int(header[0]), dtype=np.uint8)
    parts = _pieces(buf, header)
    _complete([comm.Ibcast(p, root=root) for p in parts], comm, "bcast", what, timeout_s, t0)
    for p in parts:
        TRAFFIC.count(p.size, sent=me == root)
    return buf


def gather(comm, obj: Any, root: int = 0, timeout_s: float | None = None,
           what: str = "gather") -> list | None:
    """`comm.gather(obj, root)` (pickled objects) bounded by `timeout_s` in all: the sizes
    (Igather), then the bytes (Igatherv). Returns the list on `root`, None elsewhere.

    One message of all ranks' bytes, not cut into pieces: for small objects (flags, RNG states,
    checksums, weight specs), well below MAX_MESSAGE_BYTES in all."""
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


class GroupScatter:
    """Every rank of `comm` gets the part of an object meant for its group, and only that part.

    The trainer's batch: the group is the data-parallel rank, so the TP/PP peers of one
    data-parallel rank get the same share and no rank receives another's. Built once,
    collectively over `comm` (two `Split`s and a bounded gather): the ranks of each group form a
    communicator (`peers`) whose first rank is the group's leader (`root` in its own group), and
    the leaders one (`leaders`, `root` first). `scatter` then sends each other group's part,
    pickled, point to point from `root` to that group's leader, in pieces of at most
    MAX_MESSAGE_BYTES; each leader broadcasts those bytes within its group (as `bcast` does, in
    pieces too). Every step is non-blocking and bounded by `timeout_s` in all, like the
    collectives above.
    """

    def __init__(self, comm, group: int, root: int = 0, timeout_s: float | None = None,
                 what: str = "group scatter"):
        from mpi4py import MPI
        self.comm, self.group, self.root = comm, int(group), root
        self.single = comm.Get_size() == 1
        self.peers = self.leaders = None
        self.leader_of: dict[int, int] = {}     # on root: group -> its leader's rank in `leaders`
        if self.single:
            self.leader_of = {self.group: 0}
            return
        me = comm.Get_rank()
        key = 0 if me == root else me + 1       # root first in its group and among the leaders
        self.peers = comm.Split(self.group, key)
        leader = self.peers.Get_rank() == 0
        leaders = comm.Split(0 if leader else MPI.UNDEFINED, key)
        self.leaders = leaders if leader else None
        name = comm.Get_name() or "communicator"
        self.peers.Set_name(f"{name}, group {self.group}")
        if leader:
            self.leaders.Set_name(f"{name}, group leaders")
            groups = gather(self.leaders, self.group, root=0, timeout_s=timeout_s,
                            what=f"{what}: the groups of the leaders")
            if me == root:
                self.leader_of = {g: r for r, g in enumerate(groups)}
                if len(self.leader_of) != len(groups):
                    raise ValueError(f"{what}: a group has two leaders: {groups}")

    @property
    def groups(self) -> list[int]:
        """On root: every group, in ascending order."""
        return sorted(self.leader_of)

    def scatter(self, parts, timeout_s: float | None = None, what: str = "group scatter",
                alive=None) -> Any:
        """On root, `parts[g]` for every group g (a list or a dict); elsewhere ignored. Returns
        this rank's group's part (root's own part is not copied). `alive` (a `beacon.RankWatch`
        of root, on the other ranks): their wait for root to start sending is bounded by root's
        liveness instead of `timeout_s` (root may first work for hours: the trainer's first
        batch comes after the initial evaluation); the bytes then follow within `timeout_s`."""
        if self.single:
            return parts[self.group]
        t0 = time.monotonic()
        if self.comm.Get_rank() == self.root:
            reqs = []
            for g, r in self.leader_of.items():
                if r != 0:
                    reqs += _isend_bytes(self.leaders, _dumps(parts[g]), r, tag=0)
            mine = parts[self.group]
            if self.peers.Get_size() > 1:
                _bcast_bytes(self.peers, _dumps(mine), 0, timeout_s, what, t0)
            _complete(reqs, self.leaders, "send", what, timeout_s, t0)
            return mine
        data = None     # a leader forwards the bytes it received, unpickled once, at the end
        if self.leaders is not None:
            data = _recv_bytes(self.leaders, 0, 0, what, timeout_s, t0, alive=alive)
            t0 = time.monotonic()
        if self.peers.Get_size() > 1:   # a leader that is not root: as long as root, then bounded
            data = _bcast_bytes(self.peers, data, 0, timeout_s, what, t0, alive=alive)
        return _loads(data)

    def free(self) -> None:
        """Free the two communicators (collective over `comm`)."""
        for c in (self.peers, self.leaders):
            if c is not None:
                c.Free()
        self.peers = self.leaders = None
