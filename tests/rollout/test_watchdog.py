"""GeneratorWatch.check: which generators are reported as lost, and how (pure logic)."""
import pytest

from areal_hpc.config import RunConfig
from areal_hpc.rollout.liveness import GeneratorLostError, GeneratorWatch
from areal_hpc.transport.messages import Heartbeat

IN_FLIGHT = {1: 0, 2: 3}


def _watch(timeout=30.0, join=100.0):
    cfg = RunConfig()
    cfg.rollout.generator_timeout_s = timeout
    cfg.weights.join_timeout_s = join
    return GeneratorWatch(cfg.rollout, cfg.weights, [1, 2], ["a", "b", "c"], t_start=1000.0)


def test_starting_generators_get_the_join_allowance():
    watch = _watch()
    watch.check(IN_FLIGHT, now=1000.0 + 99)              # still starting vLLM: fine
    with pytest.raises(GeneratorLostError) as e:
        watch.check(IN_FLIGHT, now=1000.0 + 101)
    msg = str(e.value)
    assert "generator rank 1 (host b) has not reported" in msg
    assert "generator rank 2 (host c) has not reported" in msg
    assert "weights.join_timeout_s = 100" in msg


def test_silent_generator_is_named_with_its_last_report():
    watch = _watch()
    watch.heard(1, now=1200.0)
    watch.heard(2, now=1150.0)
    watch.report(2, Heartbeat(version=7, running=12, tokens=5))
    watch.check(IN_FLIGHT, now=1179.0)
    with pytest.raises(GeneratorLostError) as e:
        watch.check(IN_FLIGHT, now=1181.0)
    msg = str(e.value)
    assert "rank 1" not in msg               # heard 19 s ago: alive
    assert "generator rank 2 (host c) silent for 31.0 s" in msg
    assert "3 prompt(s) in flight" in msg and "version 7, 12 request(s) running" in msg
