"""ParallelLayout: the questions the weight path and the HF export ask of a rank's place in the
TP × PP × DP grid (pure), and the layout read back from Megatron's own groups."""
import pytest

from areal_hpc.train.layout import ParallelLayout


def _grid(tp, pp, dp):
    return [ParallelLayout(tp, pp, dp, t, p, d)
            for d in range(dp) for p in range(pp) for t in range(tp)]


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (4, 2, 1)])
def test_one_sender_per_stage_and_one_writer(tp, pp, dp):
    grid = _grid(tp, pp, dp)
    senders = [x for x in grid if x.is_weight_sender]
    assert sorted(x.weight_stage for x in senders) == list(range(pp))     # one per stage
    gatherers = [x for x in grid if x.weight_stage is not None]
    assert len(gatherers) == tp * pp and all(x.dp_rank == 0 for x in gatherers)
    assert [x for x in grid if x.is_first] == [ParallelLayout(tp, pp, dp, 0, 0, 0)]
    assert sum(x.last_stage for x in grid) == tp * dp


def test_read_from_megatron_agrees(megatron_ws1):   # tests/train/conftest.py: tp = pp = 1
    assert ParallelLayout.read() == ParallelLayout(1, 1, 1, 0, 0, 0)
