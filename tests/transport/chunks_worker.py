"""Run under `mpiexec -n 4 python -m mpi4py tests/transport/chunks_worker.py` with
AREAL_MPI_MAX_MESSAGE_BYTES set (the test sets 1024).

Every MPI call the helpers make goes through `Spy`, a pass-through wrapper of the real
communicator that writes down the byte size of each buffer handed to Ibcast / Isend / Irecv (one
MPI message each). Prints one line per rank: `rank R OK {json}` with what it saw."""
import json

import numpy as np
from mpi4py import MPI

from areal_hpc.transport import mpi as coll

BOUND = 60.0


class Spy:
    """The real communicator, with the size of every buffer given to Ibcast / Isend / Irecv
    written to `sizes` (communicators split from it are watched too)."""

    def __init__(self, comm, sizes: list):
        self._comm, self.sizes = comm, sizes

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _note(self, buf) -> None:
        self.sizes.append(memoryview(buf).nbytes)

    def Ibcast(self, buf, root=0):
        self._note(buf)
        return self._comm.Ibcast(buf, root=root)

    def Isend(self, buf, dest, tag=0):
        self._note(buf)
        return self._comm.Isend(buf, dest=dest, tag=tag)

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        self._note(buf)
        return self._comm.Irecv(buf, source=source, tag=tag)

    def Split(self, color=0, key=0):
        sub = self._comm.Split(color, key)
        return sub if sub == MPI.COMM_NULL else Spy(sub, self.sizes)


def payload(seed: int, n: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"seed": seed, "a": rng.random(n).astype(np.float32), "s": "x" * (n % 977),
            "tokens": [rng.integers(0, 1000, rng.integers(1, 50)) for _ in range(n // 100)]}


def same(x: dict, y: dict) -> bool:
    return (x["seed"] == y["seed"] and np.array_equal(x["a"], y["a"]) and x["s"] == y["s"]
            and len(x["tokens"]) == len(y["tokens"])
            and all(np.array_equal(p, q) for p, q in zip(x["tokens"], y["tokens"])))


def main() -> None:
    limit = coll.MAX_MESSAGE_BYTES
    sizes: list[int] = []
    base = MPI.COMM_WORLD.Dup()
    base.Set_name("test communicator")
    comm = Spy(base, sizes)
    me, n = comm.Get_rank(), comm.Get_size()
    report = {"limit": limit}

    # bcast: from every root, a payload of about 125 KiB (about 125 pieces)
    for root in range(n):
        want = payload(root, 20_000 + root)
        got = coll.bcast(comm, want if me == root else None, root=root, timeout_s=BOUND)
        assert same(got, want), f"bcast from {root} arrived changed"
    report["bcast_messages"], report["bcast_largest"] = len(sizes), max(sizes)
    report["bcast_received"] = coll.TRAFFIC.received_bytes
    pickled = [len(coll._dumps(payload(root, 20_000 + root))) for root in range(n)]
    report["bcast_expected_messages"] = sum(1 + -(-b // limit) for b in pickled)  # header, pieces
    report["bcast_expected_received"] = sum(b for root, b in enumerate(pickled) if root != me)

    # GroupScatter: two groups, interleaved (dp2 x pp2: dp rank = rank % 2) and in blocks
    # (dp2 x tp2: dp rank = rank // 2), each group's part of a different size; one group (dp1)
    for name, group, groups in (("interleaved", me % 2, 2), ("blocks", me // 2, 2),
                                ("one", 0, 1)):
        route = coll.GroupScatter(comm, group, timeout_s=BOUND)
        parts = {g: payload(100 + g, 10_000 * (g + 1)) for g in range(groups)} if me == 0 else None
        before = coll.TRAFFIC.received_bytes
        got = route.scatter(parts, timeout_s=BOUND, what=f"test scatter {name}")
        assert same(got, payload(100 + group, 10_000 * (group + 1))), f"{name}: wrong part"
        report[f"{name}_received"] = coll.TRAFFIC.received_bytes - before
        report[f"{name}_part_bytes"] = len(coll._dumps(got))
        if me == 0:
            assert route.groups == list(range(groups))
        route.free()
    report["messages"], report["largest"] = len(sizes), max(sizes)
    report["traffic_largest"] = coll.TRAFFIC.largest_message
    print(f"rank {me} OK {json.dumps(report)}", flush=True)
    base.Free()


if __name__ == "__main__":
    main()
