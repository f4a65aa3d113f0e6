"""A generator's time accounting (GeneratorStats.seconds, generators.json) and the shares read
from it."""
import pytest

from areal_hpc.transport.messages import GeneratorStats


def _stats(seconds, engine_s=0.0):
    return GeneratorStats(rank=1, tokens=10, seconds=seconds, version=3, reward={}, engine_s=engine_s)


def test_busy_share_counts_every_second_of_the_span_but_evaluations():
    st = _stats({"busy": 66.0, "pause": 2.0, "eval": 14.0, "idle": 10.0, "idle_scoring": 1.0, "other": 7.0})
    assert st.busy_share() == pytest.approx(66.0 / (66 + 2 + 10 + 1 + 7))
    assert st.span_s() == 86.0 and st.idle_s() == 11.0


def test_the_loop_work_buckets_count_in_the_span():
    st = _stats({"busy": 60.0, "pause": 2.0, "eval": 14.0, "idle": 10.0, "idle_scoring": 1.0,
                 "submit": 3.0, "send": 2.0, "other": 2.0})
    assert st.busy_share() == pytest.approx(60.0 / (60 + 2 + 10 + 1 + 7))
    assert st.loop_work() == 7.0 and _stats({"busy": 1.0, "other": 0.5}).loop_work() == 0.5


def test_busy_share_of_a_file_from_before_the_loop_work_bucket():
    assert _stats({"busy": 8.0, "pause": 1.0, "eval": 3.0, "idle": 1.0}).busy_share() == pytest.approx(0.8)
    assert _stats({"busy": 0.0, "pause": 0.0, "eval": 0.0, "idle": 0.0}).busy_share() == 0.0


def test_engine_share_is_capped_at_the_whole_span():
    assert _stats({"busy": 8.0, "idle": 2.0}, engine_s=9.0).engine_share() == pytest.approx(0.9)
    assert _stats({"busy": 8.0, "idle": 2.0}, engine_s=12.0).engine_share() == 1.0
    assert _stats({"eval": 5.0}, engine_s=1.0).engine_share() == 0.0
