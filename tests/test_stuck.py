"""A rank alive but stuck (areal_hpc/stuck.py) in a real 3-rank MPI world: it names itself,
its stacks and every other rank's reach the output, the flag file names it, the world ends; a
long call under `expect` is not stuck."""
from pathlib import Path

import pytest

from areal_hpc import stuck

WORKER = Path(__file__).parent / "stuck_worker.py"


def test_a_stuck_rank_is_named_with_every_ranks_stacks_and_the_world_ends(run_distributed,
                                                                            tmp_path):
    flag = tmp_path / "logs" / "stuck"
    out = run_distributed(WORKER, 3, flag, "hang", timeout=180, check=False)
    named = "rank 2 (generator, host node2, pid "
    line = next((x for x in out.splitlines() if named in x and "made no progress" in x), None)
    assert line and "rollout.progress_timeout_s = 3" in line and "it is stuck" in line, out[-4000:]
    assert flag.read_text().startswith(named)
    # its own stacks: the loop it hangs in; the others' after a line naming it, in their wait
    assert 'line' in out and "in hang_here" in out, out[-4000:]
    for r in (0, 1):
        assert f"[rank {r}] areal_hpc.stuck: {named}" in out, out[-4000:]
        assert f"the stacks of rank {r} (trainer, host node{r}" in out, out[-4000:]
    assert out.count("in _complete") >= 2, out[-4000:]       # ranks 0 and 1: the bounded barrier
    assert "not stuck" not in out


def test_a_long_call_under_expect_is_not_stuck(run_distributed, tmp_path):
    flag = tmp_path / "stuck"
    out = run_distributed(WORKER, 3, flag, "expect", timeout=180)
    assert out.count("not stuck") == 3 and "made no progress" not in out, out[-4000:]
    assert not flag.exists()


def test_overdue_counts_from_the_last_progress_and_past_an_expect(tmp_path):
    w = stuck.ProgressWatch(100.0, 0, "trainer", "h", tmp_path / "f", poll_s=1000)
    try:
        t = w.last
        assert w.overdue(t + 99) is None and w.overdue(t + 101) == pytest.approx(101)
        w.grace = (t + 50, "a load")            # an expected call to t + 50: bound counted after it
        assert w.overdue(t + 149) is None and w.overdue(t + 151) == pytest.approx(151)
    finally:
        w.close()
