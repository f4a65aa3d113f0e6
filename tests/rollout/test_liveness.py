"""Liveness both ways, as pure logic: a generator ends itself when the controller falls silent;
the controller sends its heartbeat at the configured interval, names a generator whose message
has been arriving too long, and reports a service thread that does not end."""
import threading
from types import SimpleNamespace

import pytest

from areal_hpc.config import RunConfig
from areal_hpc.rollout.controller import Controller
from areal_hpc.rollout.generator import ControllerLostError, Generator
from areal_hpc.transport.messages import ControllerBeat
from areal_hpc.transport.mpi import Tag


def _generator(timeout=20.0, join=100.0):
    cfg = RunConfig()
    cfg.rollout.generator_timeout_s = timeout
    cfg.weights.join_timeout_s = join
    return SimpleNamespace(cfg=cfg, _t_loop=1000.0, _heard=None,
                           topo=SimpleNamespace(rank=1, hosts=["trainer-node", "gen-node"]))


def test_generator_gives_the_trainer_its_start_up_allowance():
    gen = _generator()
    Generator._check_controller(gen, now=1000.0 + 99)       # trainer still loading: fine
    with pytest.raises(ControllerLostError) as e:
        Generator._check_controller(gen, now=1000.0 + 101)
    msg = str(e.value)
    assert "controller (rank 0, host trainer-node) silent for 101 s since this generator started" in msg
    assert "weights.join_timeout_s = 100" in msg and "the trainer is gone; exiting" in msg


def test_generator_ends_when_the_controller_falls_silent():
    gen = _generator()
    gen._heard = 2000.0
    Generator._check_controller(gen, now=2019.0)
    with pytest.raises(ControllerLostError) as e:
        Generator._check_controller(gen, now=2021.0)
    msg = str(e.value)
    assert msg.startswith("generator rank 1 (host gen-node): controller (rank 0, host "
                          "trainer-node) silent for 21 s (rollout.generator_timeout_s = 20)")


def test_a_weight_broadcast_that_stops_arriving_means_the_trainer_is_gone():
    gen = _generator()
    gen.cfg.weights.timeout_s = 20.0
    gloo = RuntimeError("Call to collective_rpc method failed: Worker failed with error '[...] "
                        "Timed out waiting 20000ms for recv operation to complete'")
    with pytest.raises(ControllerLostError) as e:
        Generator._weights_failed(gen, 4, False, 20.3, gloo)
    assert str(e.value) == ("generator rank 1 (host gen-node): weights v4 from the trainer (rank 0, "
                            "host trainer-node) not received in 20 s (weights.timeout_s = 20): the "
                            "trainer is gone; exiting")
    assert e.value.__cause__ is gloo
    # Any other failure (a bad file, a shape mismatch) is the caller's to re-raise as it is.
    Generator._weights_failed(gen, 4, True, 0.2, RuntimeError("timed out reading the file"))
    Generator._weights_failed(gen, 4, False, 0.2, RuntimeError("size mismatch for layer 3"))


class _Chan:
    def __init__(self, incomplete=()):
        self.sent, self._incomplete = [], list(incomplete)

    def send(self, obj, dest, tag):
        self.sent.append((dest, tag, obj))

    def incomplete(self):
        return self._incomplete


def _controller(chan=None):
    cfg = RunConfig()
    cfg.rollout.heartbeat_s = 2.0
    cfg.rollout.generator_timeout_s = 30.0
    return SimpleNamespace(cfg=cfg, chan=chan or _Chan(), version=3, _last_beat=0.0,
                           _t_start=1000.0, last_heard={1: 1100.0, 2: 1100.0}, last_report={},
                           in_flight={1: 0, 2: 0},
                           topo=SimpleNamespace(generator_ranks=[1, 2], hosts=["a", "b", "c"]))


def test_controller_heartbeat_every_interval_to_every_generator():
    ctl = _controller()
    Controller._beat(ctl, now=100.0)
    Controller._beat(ctl, now=101.0)       # within heartbeat_s: nothing
    Controller._beat(ctl, now=102.5)
    assert [(d, t) for d, t, _ in ctl.chan.sent] == [(1, Tag.CONTROLLER_HEARTBEAT),
                                                     (2, Tag.CONTROLLER_HEARTBEAT)] * 2
    assert ctl.chan.sent[0][2] == ControllerBeat(version=3)


def test_a_message_arriving_too_long_names_its_generator():
    from areal_hpc.rollout.controller import GeneratorLostError
    ctl = _controller(_Chan([(2, Tag.TRAJECTORIES, 31.0), (1, Tag.HEARTBEAT, 1.0)]))
    with pytest.raises(GeneratorLostError) as e:
        Controller.check_generators(ctl, now=1110.0)
    msg = str(e.value)
    assert "a TRAJECTORIES message from generator rank 2 (host c) has been arriving for 31 s" in msg
    assert "rank 1" not in msg


def test_service_thread_that_does_not_end_is_reported():
    release = threading.Event()

    def stuck():
        release.wait(10)

    thread = threading.Thread(target=stuck, daemon=True)
    thread.start()
    ctl = SimpleNamespace(_service=thread, _service_stop=threading.Event(), _service_error=None)
    try:
        with pytest.raises(RuntimeError) as e:
            Controller._stop_service(ctl, join_s=0.2)
        assert "did not end within 0.2 s" in str(e.value)
        assert "in stuck" in str(e.value) or "release.wait" in str(e.value)
        assert ctl._service_stop.is_set()
    finally:
        release.set()
        thread.join()
