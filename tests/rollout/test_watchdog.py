"""Controller.check_generators: which generators are reported as lost, and how (pure logic)."""
from types import SimpleNamespace

import pytest

from areal_hpc.config import RunConfig
from areal_hpc.rollout.controller import Controller, GeneratorLostError
from areal_hpc.transport.messages import Heartbeat


def _controller(**rollout):
    cfg = RunConfig()
    cfg.rollout.generator_timeout_s = rollout.get("timeout", 30.0)
    cfg.weights.join_timeout_s = rollout.get("join", 100.0)
    return SimpleNamespace(cfg=cfg, _t_start=1000.0, last_heard={}, last_report={},
                           in_flight={1: 0, 2: 3},
                           topo=SimpleNamespace(generator_ranks=[1, 2], hosts=["a", "b", "c"]))


def check(ctl, now):
    Controller.check_generators(ctl, now=now)


def test_starting_generators_get_the_join_allowance():
    ctl = _controller()
    check(ctl, 1000.0 + 99)              # still starting vLLM: fine
    with pytest.raises(GeneratorLostError) as e:
        check(ctl, 1000.0 + 101)
    msg = str(e.value)
    assert "generator rank 1 (host b) has not reported" in msg
    assert "generator rank 2 (host c) has not reported" in msg
    assert "weights.join_timeout_s = 100" in msg


def test_silent_generator_is_named_with_its_last_report():
    ctl = _controller()
    ctl.last_heard = {1: 1200.0, 2: 1150.0}
    ctl.last_report = {2: Heartbeat(version=7, running=12, tokens=5)}
    check(ctl, 1179.0)
    with pytest.raises(GeneratorLostError) as e:
        check(ctl, 1181.0)
    msg = str(e.value)
    assert "rank 1" not in msg               # heard 19 s ago: alive
    assert "generator rank 2 (host c) silent for 31.0 s" in msg
    assert "3 prompt(s) in flight" in msg and "version 7, 12 request(s) running" in msg
