"""Waits for trainer rank 0's work are bounded by its liveness (areal_hpc/transport/beacon.py),
not by the collectives' fixed bound: on a real 3-rank mpiexec job (no vLLM, no torch)."""
import re
from pathlib import Path

import pytest

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
