"""Liveness both ways, as pure logic on the real watcher objects: a generator ends itself when the
controller falls silent; the controller sends its heartbeat at the configured interval, names a
generator whose message has been arriving too long, and reports a service thread that does not
end."""
import threading

import pytest

from areal_hpc.config import RunConfig
from areal_hpc.rollout.liveness import (ControllerLostError, ControllerWatch, GeneratorLostError,
                                        GeneratorWatch, Pacer, ServiceThread)
from areal_hpc.transport.mpi import Tag


def _generator_watch(timeout=20.0, join=100.0):
    cfg = RunConfig()
    cfg.rollout.generator_timeout_s = timeout
    cfg.weights.join_timeout_s = join
    return ControllerWatch(cfg.rollout, cfg.weights, rank=1, hosts=["trainer-node", "gen-node"],
                           t_start=1000.0)


def test_generator_gives_the_trainer_its_start_up_allowance():
    watch = _generator_watch()
    watch.check(now=1000.0 + 99)       # trainer still loading: fine
    with pytest.raises(ControllerLostError) as e:
        watch.check(now=1000.0 + 101)
    msg = str(e.value)
    assert "controller (rank 0, host trainer-node) silent for 101 s since this generator started" in msg
    assert "weights.join_timeout_s = 100" in msg and "the trainer is gone; exiting" in msg


class _Beacon:
    """A stand-in for transport.beacon.RankWatch: `poll` returns the newest beat's time."""

    def __init__(self, beats):
        self.beats, self.polls = beats, 0

    def poll(self, now):
        self.polls += 1
        heard = [b for b in self.beats if b <= now]
        return max(heard) if heard else None


def test_before_the_first_message_rank_0s_beacon_keeps_a_long_start_up_alive():
    """Trainer rank 0 building its model and loading a checkpoint for longer than
    weights.join_timeout_s is waited for while its beacon beats; once it falls silent for
    rollout.generator_timeout_s the generator ends, naming that key. The beacon is polled on
    every check (its beats must not pile up in MPI's queue)."""
    beacon = _Beacon([1000.0 + 5 * k for k in range(60)])      # beats until 1295
    cfg = RunConfig()
    cfg.rollout.generator_timeout_s, cfg.weights.join_timeout_s = 20.0, 100.0
    watch = ControllerWatch(cfg.rollout, cfg.weights, rank=1, hosts=["trainer-node", "gen-node"],
                            t_start=1000.0, beacon=beacon)
    watch.check(now=1000.0 + 250)      # past join_timeout_s, but rank 0 beats
    watch.check(now=1295.0 + 19)
    with pytest.raises(ControllerLostError) as e:
        watch.check(now=1295.0 + 21)
    assert "silent for 21 s since its beacon's last beat (rollout.generator_timeout_s = 20)" in str(e.value)
    watch.heard(now=1400.0)
    watch.check(now=1410.0)
    assert beacon.polls == 4        # once a check, also after the first message


def test_generator_ends_when_the_controller_falls_silent():
    watch = _generator_watch()
    watch.heard(now=2000.0)
    watch.check(now=2019.0)
    with pytest.raises(ControllerLostError) as e:
        watch.check(now=2021.0)
    msg = str(e.value)
    assert msg.startswith("generator rank 1 (host gen-node): controller (rank 0, host "
                          "trainer-node) silent for 21 s (rollout.generator_timeout_s = 20)")
    # a message from it half arrived (its later ones wait behind it) is named
    from areal_hpc.transport.mpi import Tag
    with pytest.raises(ControllerLostError) as e:
        watch.check(now=2021.0, incomplete=[(0, Tag.CONTROLLER_HEARTBEAT, 19.6), (2, Tag.PROMPTS, 3.0)])
    assert "(rollout.generator_timeout_s = 20); a CONTROLLER_HEARTBEAT message from it has been " \
           "arriving for 20 s: the trainer is gone" in str(e.value)


def test_a_weight_broadcast_that_stops_arriving_means_the_trainer_is_gone():
    watch = _generator_watch()
    watch.weights.timeout_s = 20.0
    gloo = RuntimeError("Call to collective_rpc method failed: Worker failed with error '[...] "
                        "Timed out waiting 20000ms for recv operation to complete'")
    with pytest.raises(ControllerLostError) as e:
        watch.weights_failed(4, False, 20.3, gloo)
    assert str(e.value) == ("generator rank 1 (host gen-node): weights v4 from the trainer (rank 0, "
                            "host trainer-node) not received in 20 s (weights.timeout_s = 20): the "
                            "trainer is gone; exiting")
    assert e.value.__cause__ is gloo
    # Any other failure (a bad file, a shape mismatch) is the caller's to re-raise as it is.
    watch.weights_failed(4, True, 0.2, RuntimeError("timed out reading the file"))
    watch.weights_failed(4, False, 0.2, RuntimeError("size mismatch for layer 3"))


def test_controller_heartbeat_every_interval():
    beats = Pacer(2.0)
    assert [beats.due(now=t) for t in (100.0, 101.0, 102.5, 103.0, 104.5)] == \
        [True, False, True, False, True]     # within heartbeat_s of the last one: nothing


def test_a_message_arriving_too_long_names_its_generator():
    cfg = RunConfig()
    cfg.rollout.generator_timeout_s = 30.0
    watch = GeneratorWatch(cfg.rollout, cfg.weights, [1, 2], ["a", "b", "c"], t_start=1000.0)
    watch.heard(1, now=1100.0)
    watch.heard(2, now=1100.0)
    with pytest.raises(GeneratorLostError) as e:
        watch.check({1: 0, 2: 0}, [(2, Tag.TRAJECTORIES, 31.0), (1, Tag.HEARTBEAT, 1.0)],
                    now=1110.0)
    msg = str(e.value)
    assert "a TRAJECTORIES message from generator rank 2 (host c) has been arriving for 31 s" in msg
    assert "rank 1" not in msg


def test_service_thread_that_does_not_end_is_reported():
    release = threading.Event()

    def stuck(stop):
        release.wait(10)

    service = ServiceThread(stuck, "controller")
    service.start()
    try:
        with pytest.raises(RuntimeError) as e:
            service.stop(join_s=0.2)
        assert "the controller service thread did not end within 0.2 s" in str(e.value)
        assert "in stuck" in str(e.value) or "release.wait" in str(e.value)
    finally:
        release.set()


def test_service_thread_error_is_surfaced_once_it_ends():
    woken = []

    def fails(stop):
        raise ValueError("the log is full")

    service = ServiceThread(fails, "controller", on_error=lambda: woken.append(1))
    service.start()
    with pytest.raises(RuntimeError, match="controller service thread failed") as e:
        service.stop(join_s=5)
    assert isinstance(e.value.__cause__, ValueError) and woken == [1]


def test_a_generator_restarting_its_engine_gets_the_start_up_allowance():
    """A generator whose last report says its engine is down (being replaced after a fault) may
    be silent for weights.join_timeout_s, the time to start vLLM; once it is up again, for
    rollout.generator_timeout_s. Its restarts and live engines are counted for the step line."""
    from areal_hpc.transport import messages as msgs
    cfg = RunConfig()
    cfg.rollout.generator_timeout_s, cfg.weights.join_timeout_s = 20.0, 100.0
    watch = GeneratorWatch(cfg.rollout, cfg.weights, [1, 2], ["t", "g1", "g2"], t_start=0.0)
    for g in (1, 2):
        watch.heard(g, now=10.0)
        watch.report(g, msgs.Heartbeat(3, 4, 500))
    watch.report(1, msgs.Heartbeat(3, 0, 500, engine_restarts=1, engine_down=True,
                                   engine_fault="engine stalled"))
    assert watch.engines() == (1, 1)
    watch.heard(2, now=100.0)
    watch.check({1: 2, 2: 2}, now=10.0 + 99)            # restarting: still within its allowance
    with pytest.raises(GeneratorLostError, match=r"generator rank 1 \(host g1\) silent for 101.0 s "
                                                 r"\(weights.join_timeout_s: restarting its engine"):
        watch.check({1: 2, 2: 2}, now=10.0 + 101)
    watch.report(1, msgs.Heartbeat(3, 4, 600, engine_restarts=1))
    assert watch.engines() == (1, 2) and watch.bound(1) == 20.0
