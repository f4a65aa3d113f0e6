"""Payloads larger than one MPI message: `bcast` and `GroupScatter` cut them into pieces of at
most MAX_MESSAGE_BYTES, here lowered to 1 KiB, on a real 4-rank mpiexec job."""
import json
import re
from pathlib import Path

import pytest


pytestmark = pytest.mark.slow     # starts MPI / torch.distributed worlds or processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("chunks_worker.py")
LIMIT = 1024


def test_large_payloads_go_in_pieces_below_the_limit(run_distributed):
    out = run_distributed(WORKER, 4, env={"AREAL_MPI_MAX_MESSAGE_BYTES": str(LIMIT)}, timeout=300,
                          check=False)
    reports = {int(m[0]): json.loads(m[1]) for m in re.findall(r"rank (\d) OK (\{.*?\})", out)}
    assert sorted(reports) == [0, 1, 2, 3], out[-3000:]
    for rank, rep in reports.items():
        assert rep["limit"] == LIMIT
        # every buffer handed to MPI (each one message) is at most the limit; each bcast of
        # about 125 KiB was one header and ceil(bytes / limit) pieces
        assert rep["largest"] <= LIMIT and rep["traffic_largest"] <= LIMIT, rep
        assert rep["bcast_largest"] == LIMIT, rep
        assert rep["bcast_messages"] == rep["bcast_expected_messages"] > 4 * 100, rep
        # a rank receives the three payloads it is not the root of, intact (checked there)
        assert rep["bcast_received"] == rep["bcast_expected_received"] > 3 * 100_000, rep
        for name in ("interleaved", "blocks", "one"):
            # root keeps its own part; every other rank receives its group's part, only that
            received, part = rep[f"{name}_received"], rep[f"{name}_part_bytes"]
            assert received == (0 if rank == 0 else part), (name, rep)
    # group 1's part is about twice group 0's: rank 1 (interleaved) and rank 3 (both) get it
    assert reports[1]["interleaved_part_bytes"] > 1.8 * reports[2]["interleaved_part_bytes"]
    assert reports[3]["blocks_part_bytes"] > 1.8 * reports[1]["blocks_part_bytes"]
