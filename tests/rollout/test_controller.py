"""The controller (rollout/controller.py) on a real two-rank MPI world, with a fake generator on
rank 1 (tests/rollout/controller_worker.py): prompts out, groups in and logged, batches of B
groups within η, trained rows marked, weight acknowledgements, an evaluation, the Stop."""
import json
from pathlib import Path

WORKER = Path(__file__).with_name("controller_worker.py")


def test_controller_over_mpi_with_a_fake_generator(tmp_path, run_distributed):
    out = run_distributed(WORKER, 2, tmp_path, timeout=300)
    assert "controller OK" in out, out[-4000:]
    rep = json.loads((tmp_path / "report.json").read_text())
    assert [b["stale"] for b in rep["batches"]][:1] == [0]     # the first batch: version 0 only
    assert all(len(b["prompt_ids"]) == 2 for b in rep["batches"])
    assert rep["eval"]["accuracy"] == 1.0 and rep["eval"]["samples"] == 3 * 2
    assert rep["generators"] == [1]
    st = rep["state"]
    assert st["version"] == 4 and st["rollout_rows"] == rep["log_rows"]
    # every prompt handed out is trained, buffered or was in flight at the stop
    buffered = len(st["buffer_group_ends"])
    assert st["cursor_consumed"] == 4 * 2 + buffered + len(st["inflight_prompt_ids"])
