"""Waits for trainer rank 0's work are bounded by its liveness (areal_hpc/transport/beacon.py),
not by the collectives' fixed bound: on a real 3-rank mpiexec job (no vLLM, no torch); a beacon
thread that fails ends its rank with one line naming it (2-rank jobs)."""
import os
import re
from pathlib import Path

import pytest

from areal_hpc.transport.beacon import EXIT_BEACON_FAILED, FAIL_ENV

pytestmark = pytest.mark.slow     # starts MPI worlds (tests/conftest.py)

WORKER = Path(__file__).with_name("beacon_worker.py")


def test_work_longer_than_the_bound_is_waited_for_while_rank_0_is_alive(run_distributed):
    out = run_distributed(WORKER, 3, "work", timeout=120)
    assert sorted(re.findall(r"rank (\d) OK", out)) == ["0", "1", "2"], out[-3000:]


def test_a_silent_rank_0_fails_the_waits_naming_it(run_distributed):
    out = run_distributed(WORKER, 3, "gone", timeout=120, check=False)
    hits = re.findall(r"rank (\d) TIMEOUT ([\d.]+) (.*?)(?=rank \d (?:TIMEOUT|COMPLETED)|\n|$)", out)
    assert sorted(r for r, _, _ in hits) == ["1", "2"], out[-3000:]
    for _, seconds, message in hits:
        assert 2.0 <= float(seconds) < 6.0, (seconds, message)     # SILENT = 2 s, beats 0.2 s
        assert "the batch" in message and "rank 0 (host host-a)" in message, message
        assert "rollout.generator_timeout_s = 2" in message, message


@pytest.mark.parametrize("level", ["multiple", "serialized"])
def test_a_thread_level_below_what_a_ranks_threads_need_is_named(run_distributed, level):
    """mpi4py asks MPICH for the level MPI4PY_RC_THREAD_LEVEL names: under MULTIPLE every rank
    passes; under SERIALIZED trainer rank 0 (the beacon's source, three threads calling MPI)
    is refused with one line, and rank 1 (MPI from its main thread alone) passes."""
    out = run_distributed(WORKER, 2, "levels", timeout=120,
                          env={**os.environ, "MPI4PY_RC_THREAD_LEVEL": level})
    # (a CI run beside a CPU-bound process found no rank 1 line: the two ranks' lines, printed at
    # once, came out as one; they are printed one after another now, and read line by line)
    got = dict(re.findall(r"^rank (\d) LEVEL (\d (?:ok|.*))$", out, re.M))
    assert got.get("1") == ("3 ok" if level == "multiple" else "2 ok"), out[-3000:]
    if level == "multiple":
        assert got.get("0") == "3 ok", out[-3000:]
    else:
        assert got.get("0") == ("2 rank 0 (host host-a): MPI provides thread level "
                            "MPI_THREAD_SERIALIZED, this rank needs MPI_THREAD_MULTIPLE (its main "
                            "thread, the controller's service thread and the beacon call MPI at "
                            "once): request it (mpi4py.rc.thread_level, "
                            "MPI4PY_RC_THREAD_LEVEL=multiple) from an MPI built with thread "
                            "support"), out[-3000:]


@pytest.mark.parametrize("how", ["main", "idle"])
def test_a_failed_beacon_thread_ends_its_rank_naming_it(run_distributed, how):
    """Rank 0's beacon thread raises an MPI error at its third beat (beacon.FAIL_ENV). `main`:
    its main thread, at its next `stuck.progress()`, ends the rank with one line naming it and
    the exception (the others allow 60 s of silence: the beacon thread's own fallback would
    wait 30). `idle`: its main thread reaches no progress point, and the beacon thread ends the
    rank after half the others' 2 s. Either way the job fails, and rank 0 lives no further."""
    proc = run_distributed.start(WORKER, 2, "fails", how, env={FAIL_ENV: "3"})
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        run_distributed.stop(proc)
    assert proc.returncode != 0, out[-3000:]
    assert "NOT ENDED" not in out, out[-3000:]
    line = (r"^\[rank 0\] areal_hpc\.stuck: rank 0 \(trainer, host host-a, pid \d+\): its beacon "
            r"thread failed \(mpi4py\.MPI\.Exception: Other MPI error\)"
            + ("" if how == "main" else
               r" and its main thread reached no progress point in 1 s")
            + r": the other ranks would hear nothing from it and take it for gone; ending the "
              rf"rank \(exit {EXIT_BEACON_FAILED}\)$")
    assert len(re.findall(line, out, re.M)) == 1, out[-3000:]
    assert "raise MPI.Exception(MPI.ERR_OTHER)" in out, out[-3000:]     # its traceback, logged
