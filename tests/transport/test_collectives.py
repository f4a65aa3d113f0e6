"""Bounded MPI collectives (areal_hpc.transport.mpi.bcast / gather / barrier) and the Channel's
background receive, on a real 3-rank mpiexec job (no vLLM, no torch)."""
import re
from pathlib import Path

import pytest


pytestmark = pytest.mark.slow     # starts MPI / torch.distributed worlds or processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("collectives_worker.py")


@pytest.fixture
def run(run_distributed):
    return lambda scenario: run_distributed(WORKER, 3, scenario, timeout=120, check=False)


def test_bounded_collectives_and_channel_work(run):
    out = run("ok")
    assert sorted(re.findall(r"rank (\d) OK", out)) == ["0", "1", "2"], out[-3000:]
    assert "channel: longest poll" in out and "rank 0 half message: longest poll" in out, out[-3000:]


def test_the_channel_takes_a_burst_over_the_ofi_tcp_netmod(run_distributed):
    """The Slurm scripts' MPI path (MPICH over OFI's tcp provider; NOLOCAL keeps it between
    ranks on one node): 300 messages arrive while the receiver makes no MPI call. With mpi4py's
    pkl5 `improbe` (matched probes) the receiver then matched a header whose part never came
    and hung in `Mprobe`; the channel's plain probes take every message, in order."""
    out = run_distributed(WORKER, 2, "burst", timeout=180, check=False,
                          env={"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
                               "MPIR_CVAR_NOLOCAL": "1"})
    assert "rank 1 burst: 300 of 300 in order" in out, out[-3000:]
    assert sorted(re.findall(r"rank (\d) OK", out)) == ["0", "1"], out[-3000:]


@pytest.mark.parametrize("op", ["barrier", "bcast", "gather"])
def test_a_missing_rank_times_out_with_a_message(op, run):
    out = run(op)
    # mpiexec forwards each rank's output in chunks, so one rank's line may run into another's:
    # a report ends where the next one starts, not at a newline
    hits = re.findall(r"rank (\d) TIMEOUT ([\d.]+) (.*?)(?=rank \d (?:TIMEOUT|LATE|COMPLETED)|\n|$)", out)
    # every rank that arrived waits in vain (bcast: the late rank is the root), except that a
    # non-root's part of a gather may complete without the late rank
    ranks = sorted(r for r, _, _ in hits)
    expected = {"barrier": [["0", "1"]], "bcast": [["1", "2"]], "gather": [["0", "1"], ["0"]]}[op]
    assert ranks in expected, out[-3000:]
    for _, seconds, message in hits:
        assert 2.0 <= float(seconds) < 5.0, (seconds, message)
        assert f"the test {op}" in message
        assert "test communicator of 3 rank(s)" in message
        assert "bound 2 s" in message and "hung or gone" in message


class _Double:
    """A communicator test double (as tests/train/test_checkpoint.py uses): blocking calls only."""

    def __init__(self, size):
        self.size, self.calls = size, []

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return 0

    def Barrier(self):
        self.calls.append("Barrier")

    def bcast(self, obj, root=0):
        self.calls.append("bcast")
        return obj

    def gather(self, obj, root=0):
        self.calls.append("gather")
        return [obj]


def test_one_rank_needs_no_communication_and_a_double_gets_its_blocking_calls():
    from areal_hpc.transport import mpi as coll
    one = _Double(1)
    assert coll.bcast(one, {"x": 1}) == {"x": 1} and coll.gather(one, 5) == [5]
    coll.barrier(one)
    assert one.calls == []
    two = _Double(2)
    assert coll.bcast(two, 7) == 7 and coll.gather(two, 8) == [8]
    coll.barrier(two)
    assert two.calls == ["bcast", "gather", "Barrier"]
