"""A generator's time accounting (generators.json "seconds") and the busy share read from it."""
import pytest

from areal_hpc.rollout.controller import busy_share


def test_busy_share_counts_every_second_of_the_span_but_evaluations():
    sec = {"busy": 66.0, "pause": 2.0, "eval": 14.0, "idle": 10.0, "idle_scoring": 1.0, "other": 7.0}
    assert busy_share(sec) == pytest.approx(66.0 / (66 + 2 + 10 + 1 + 7))


def test_the_loop_work_buckets_count_in_the_span():
    from areal_hpc.rollout.controller import loop_work

    sec = {"busy": 60.0, "pause": 2.0, "eval": 14.0, "idle": 10.0, "idle_scoring": 1.0,
           "submit": 3.0, "send": 2.0, "other": 2.0}
    assert busy_share(sec) == pytest.approx(60.0 / (60 + 2 + 10 + 1 + 7))
    assert loop_work(sec) == 7.0 and loop_work({"busy": 1.0, "other": 0.5}) == 0.5


def test_busy_share_of_a_file_from_before_the_loop_work_bucket():
    assert busy_share({"busy": 8.0, "pause": 1.0, "eval": 3.0, "idle": 1.0}) == pytest.approx(0.8)
    assert busy_share({"busy": 0.0, "pause": 0.0, "eval": 0.0, "idle": 0.0}) == 0.0
