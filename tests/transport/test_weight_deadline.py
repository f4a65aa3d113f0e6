"""The weight update on NCCL's terms, with a fake communicator: a work's `wait()` returns at once
and never raises (it only orders a stream), and a collective waiting on a dead member completes
only when the group is aborted. Each member then waits for every bucket on the host against
weights.timeout_s (`finish`), aborts the group past it and raises `WireTimeout`; the sender stops
posting buckets, a receiver hands vLLM no bucket that has not arrived, and the publisher sends
the version again over the group's next generation. The gloo path runs the same code for real
(tests/transport/test_weight_regroup.py, tests/e2e/test_engine_restart.py)."""
import os
import threading

import pytest
import torch

from areal_hpc.config import WeightSyncConfig
from areal_hpc.transport import weights as wsync
from areal_hpc.transport.weights import WireTimeout, broadcast_stage, dtype_to_str, finish, plan_stages
from areal_hpc.transport.weights import broadcast as bc

BOUND_S = 0.3


class NcclLikeGroup:
    """A weight group as NCCL's host sees it. `dead_at`: the first bucket (0-based) a dead member
    holds up; it and every later one complete only once the group is aborted, and then with an
    error (as NCCL's work does after ncclCommAbort). Records posts, aborts and what arrived."""

    def __init__(self, dead_at=None, incoming=None):
        self.dead_at, self.incoming = dead_at, list(incoming or [])
        self.posted, self.aborts, self.arrived = [], 0, []
        self.aborted = threading.Event()

    def broadcast(self, flat, root):
        k = len(self.posted)
        self.posted.append(k)
        group = self

        class Work:
            def is_completed(self):
                if group.dead_at is not None and k >= group.dead_at:
                    return group.aborted.is_set()
                return True

            def wait(self):             # NCCL: orders the stream, returns at once
                if group.dead_at is not None and k >= group.dead_at and group.aborted.is_set():
                    raise RuntimeError("NCCL communicator was aborted")
                if group.incoming:
                    flat.copy_(group.incoming[k])
                group.arrived.append(k)

        return Work()

    def abort(self):
        self.aborts += 1
        self.aborted.set()


class Pending:
    """A work that completes after `polls` looks, optionally with an error."""

    def __init__(self, polls, error=None):
        self.polls, self.error, self.looks, self.waited = polls, error, 0, False

    def is_completed(self):
        self.looks += 1
        return self.looks > self.polls

    def wait(self):
        self.waited = True
        if self.error is not None:
            raise self.error


def _sd():
    g = torch.Generator().manual_seed(3)
    return {f"l{i}.w": torch.randn(4, 8, generator=g) for i in range(10)}


def _plan(sd):
    return plan_stages([[(k, v.shape, dtype_to_str(v.dtype)) for k, v in sd.items()]], 4 * 8 * 4)


def test_finish_waits_for_completion_on_the_host_then_returns():
    group, work = NcclLikeGroup(), Pending(polls=5)
    finish(work, 10.0, group, "bucket 0")
    assert work.looks == 6 and work.waited and group.aborts == 0


def test_finish_raises_the_error_a_completed_work_carries_without_aborting():
    group, work = NcclLikeGroup(), Pending(polls=1, error=RuntimeError("peer closed"))
    with pytest.raises(RuntimeError, match="peer closed"):
        finish(work, 10.0, group, "bucket 0")
    assert group.aborts == 0


def test_finish_past_its_bound_aborts_the_group_and_names_the_bucket_and_key():
    group, work = NcclLikeGroup(), Pending(polls=10**9)
    with pytest.raises(WireTimeout, match=r"bucket 3 of 9: not complete after 0.3 s "
                                          r"\(weights.timeout_s\).*aborted"):
        finish(work, BOUND_S, group, "bucket 3 of 9")
    assert group.aborts == 1 and not work.waited
    assert isinstance(WireTimeout("x"), TimeoutError)


def test_finish_without_a_bound_is_the_backends_wait():
    work = Pending(polls=10**9)
    finish(work, None, NcclLikeGroup(), "bucket 0")
    assert work.waited and work.looks == 0


@pytest.mark.parametrize("dead_at", [0, 4, 9])
def test_the_sender_stops_at_a_dead_member_and_aborts_the_group(dead_at):
    sd = _sd()
    plan = _plan(sd)
    assert len(plan) == 10
    group = NcclLikeGroup(dead_at=dead_at)
    with pytest.raises(WireTimeout, match=f"weight bucket {dead_at} of 10"):
        broadcast_stage(group, plan, 0, sd.items(), "cpu", BOUND_S)
    assert group.aborts == 1
    # at most two buckets in flight: nothing posted beyond the stuck one's next
    assert group.posted == list(range(min(dead_at + 2, len(plan))))


def test_the_sender_without_a_bound_would_not_see_the_dead_member():
    """What the host saw before `finish`: on NCCL every wait returns, so the sender reports the
    update sent while a member never got it (the device then waits until the watchdog)."""
    sd = _sd()
    group = NcclLikeGroup(dead_at=4)
    stats = broadcast_stage(group, _plan(sd), 0, sd.items(), "cpu")
    assert stats.num_buckets == 10 and group.aborts == 0


class _Worker:
    rank = 0
    device = torch.device("cpu")

    def __init__(self, group, timeout_s):
        self._weight_group, self._weight_timeout_s = group, timeout_s
        self.loaded = []

    def reload_weights(self, weights_iterator):
        for name, t in weights_iterator:
            self.loaded.append((name, t.clone()))


@pytest.mark.parametrize("dead_at", [0, 5])
def test_a_receiver_never_loads_a_bucket_that_has_not_arrived(dead_at):
    from areal_hpc.rollout.vllm_ext import WeightSyncExtension

    sd = _sd()
    plan = _plan(sd)
    incoming = [torch.cat([sd[n].reshape(-1) for n, _, _ in b]) for _, b in plan]
    group = NcclLikeGroup(dead_at=dead_at, incoming=incoming)
    w = _Worker(group, BOUND_S)
    with pytest.raises(WireTimeout, match=f"weight bucket {dead_at} of 10"):
        WeightSyncExtension.recv_weights(w, plan)
    names = list(sd)
    assert [n for n, _ in w.loaded] == names[:dead_at]     # one tensor per bucket here
    for n, t in w.loaded:
        assert torch.equal(t, sd[n])
    assert group.aborts == 1
    assert group.posted == list(range(min(dead_at + 2, len(plan))))   # no drain after it


def test_the_nccl_group_is_made_with_errors_raised_not_the_process_ended(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    with bc.nccl_errors_raised():
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    with bc.nccl_errors_raised():
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    assert bc.WATCHDOG_GRACE_S > 0      # the watchdog acts after the host's deadline


class _Notifier:
    """Trainer rank 0's controller as the publisher sees it: the generators settle with every
    one waiting for the version after a failed send (their receives timed out too)."""
    collects_acks = True

    def __init__(self):
        self.generation, self.notices, self.causes = 0, [], []

    def regroup(self, force=False):
        if not force:
            return None
        self.generation += 1
        return self.generation

    def send_weights_notice(self, version, *, plan=None, path=None, generation=None):
        self.notices.append((version, generation))

    def wait_weights_acks(self, version, timeout_s, cause=None):
        self.causes.append(cause)
        return cause is not None        # sent again while the last send failed


class _Actor:
    weight_stage, is_weight_sender, device = 0, True, "cpu"

    def __init__(self, sd):
        self.sd = sd

    def iter_hf_weights(self):
        return iter(self.sd.items())


class _Comm:
    def Get_rank(self):
        return 0


def test_a_member_dead_inside_an_update_then_the_version_sent_again_over_the_next_generation(
        monkeypatch):
    """The publisher's state machine on NCCL's terms: generation 0's broadcast stops at a dead
    member, the host's deadline aborts it, the generators settle waiting, the group's next
    generation is formed (the old one closed first) and the whole version goes out again."""
    from dataclasses import replace

    from areal_hpc.train import weight_publisher as wp

    sd = _sd()
    plan = _plan(sd)
    incoming = [torch.cat([sd[n].reshape(-1) for n, _, _ in b]) for _, b in plan]
    monkeypatch.setattr(wp.coll, "bcast", lambda comm, obj, root, **kw: obj)
    groups, closed = [], []

    def join(address, rank):
        groups.append((address.generation, NcclLikeGroup(incoming=incoming)))
        return groups[-1][1]

    monkeypatch.setattr(wp.wsync, "init_weight_group", join)
    monkeypatch.setattr(wp.wsync, "close_weight_group", lambda g: closed.append(g))
    first = NcclLikeGroup(dead_at=6, incoming=incoming)
    notifier = _Notifier()
    cfg = WeightSyncConfig(mode="broadcast", timeout_s=BOUND_S, bucket_mb=1)
    address = wsync.WeightGroupAddress("127.0.0.1", 1, 3, "nccl", timeout_s=BOUND_S)
    pub = wp.WeightPublisher(cfg, _Actor(sd), _Comm(), pp=1, collective_timeout_s=5.0,
                             weight_dir="unused", group=first, notifier=notifier,
                             address=replace(address))
    pub._plan = plan
    pub.publish(7)
    assert first.aborts == 1 and first.posted == [0, 1, 2, 3, 4, 5, 6, 7]
    assert isinstance(notifier.causes[0], WireTimeout) and notifier.causes[1] is None
    assert notifier.notices == [(7, None), (7, 1)]
    assert closed == [first] and [g for g, _ in groups] == [1]
    again = groups[0][1]
    assert again.arrived == list(range(10)) and again.aborts == 0


def test_a_generator_whose_engine_is_down_at_a_publish_is_not_broadcast_to():
    """Rank 0 knows an engine is down (its heartbeat said so): the update forms the group's next
    generation, which the new engine joins once up, instead of a broadcast that would wait on
    the dead engine's workers until weights.timeout_s."""
    from areal_hpc.rollout.controller import Controller
    from areal_hpc.transport.messages import Heartbeat

    class Topo:
        generator_ranks = [2, 3]

    class Watch:
        last_report = {2: Heartbeat(0, 0, 0), 3: Heartbeat(0, 0, 0)}

    class Ctl:
        _cond = threading.Condition()
        topo, watch, weight_acks, weight_generation = Topo(), Watch(), wsync.AckTracker({2: "a", 3: "b"}), 0

    ctl = Ctl()
    assert Controller.regroup(ctl) is None and ctl.weight_generation == 0
    Watch.last_report[3] = Heartbeat(0, 0, 0, engine_down=True)
    assert Controller.regroup(ctl) == 1
    Watch.last_report[3] = Heartbeat(0, 0, 0)
    assert Controller.regroup(ctl) is None
    assert Controller.regroup(ctl, force=True) == 2
