"""An engine fault found and bounded (rollout/engine_guard.py), and the generator's recovery from
one (Generator._recover), on stand-ins: real child processes for the engine's, a fake engine
for the generator's bookkeeping. The real vLLM engine: tests/e2e/test_engine_restart.py."""
import contextlib
import queue
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future

import numpy as np
import psutil
import pytest

from areal_hpc.config import RunConfig
from areal_hpc.rollout.engine_guard import EngineRestartsError, EngineWatch, RestartBudget, kill_engine
from areal_hpc.rollout.gpu_memory import DeviceMemory, EngineMemoryError
from areal_hpc.rollout.generator import Generator
from areal_hpc.rollout.vllm_engine import FinishedSample
from areal_hpc.transport import messages as msgs
from areal_hpc.transport.weights import WeightGroupAddress


class _Core:
    def __init__(self):
        self.outputs_queue = queue.Queue()
        self.utility_results = {}
        self.resources = type("R", (), {"engine_dead": False})()

    def shutdown(self, timeout=None):
        pass


class _ProcEngine:
    """What EngineWatch looks at: the processes the engine started, and vLLM's client."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        self._children = [psutil.Process(self.proc.pid)]
        self._engine = type("E", (), {"engine_core": _Core()})()
        self._closed = False

    def blocked_get(self):
        """A step() waiting on the output queue, in a thread: returns what woke it."""
        got = []
        t = threading.Thread(target=lambda: got.append(self._engine.engine_core.outputs_queue.get()))
        t.start()
        return t, got


@pytest.fixture
def engine():
    e = _ProcEngine()
    yield e
    e.proc.kill()
    e.proc.wait()


def test_a_dead_engine_process_is_found_and_the_blocked_step_woken(engine):
    from vllm.v1.engine.exceptions import EngineDeadError
    watch = EngineWatch(engine, stall_s=1e6, poll_s=0.05)
    fut = Future()
    engine._engine.engine_core.utility_results[1] = fut         # a collective_rpc waiting
    waiter, got = engine.blocked_get()
    engine.proc.kill()
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    assert isinstance(got[0], EngineDeadError)
    assert isinstance(fut.exception(timeout=10), EngineDeadError)
    assert f"engine process {engine.proc.pid}" in watch.cause and "is gone" in watch.cause
    watch.close()


def test_a_stopped_engine_is_a_stall_past_the_bound_and_is_killed(engine):
    engine.proc.send_signal(signal.SIGSTOP)
    watch = EngineWatch(engine, stall_s=0.3, poll_s=0.05)
    waiter, got = engine.blocked_get()
    with watch.busy():          # the loop inside step(): no output comes
        waiter.join(timeout=60)
    assert not waiter.is_alive() and got
    assert "engine stalled" in watch.cause and "rollout.engine_stall_s = 0.3" in watch.cause
    assert not psutil.pid_exists(engine.proc.pid) or \
        psutil.Process(engine.proc.pid).status() == psutil.STATUS_ZOMBIE    # killed, stopped as it was
    watch.close()


def test_a_killed_engines_shared_memory_files_are_removed(tmp_path):
    """vLLM's EngineCore and TP workers share queues in /dev/shm files, which a killed process
    cannot remove: the kill removes the files the engine's processes mapped (read when the watch
    started, and at the kill), and no other."""
    import mmap
    import os
    import uuid
    path = f"/dev/shm/areal_test_{uuid.uuid4().hex}"
    other = f"/dev/shm/areal_test_{uuid.uuid4().hex}"
    open(other, "wb").close()           # not the engine's: stays
    shared = f"/dev/shm/areal_test_{uuid.uuid4().hex}"
    with open(shared, "w+b") as f:      # mapped by this process too (the generator's): stays
        f.truncate(4096)
        mine = mmap.mmap(f.fileno(), 4096)
    ready = tmp_path / "ready"
    code = (f"import mmap, pathlib, time\nf = open({path!r}, 'w+b'); f.truncate(4096)\n"
            f"m = mmap.mmap(f.fileno(), 4096)\ng = open({shared!r}, 'r+b')\n"
            f"n = mmap.mmap(g.fileno(), 4096)\npathlib.Path({str(ready)!r}).touch()\ntime.sleep(600)")
    e = _ProcEngine.__new__(_ProcEngine)
    e.proc = subprocess.Popen([sys.executable, "-c", code])
    e._children, e._closed = [psutil.Process(e.proc.pid)], False
    e._engine = type("E", (), {"engine_core": _Core()})()
    try:
        for _ in range(600):
            if ready.exists():
                break
            threading.Event().wait(0.05)
        watch = EngineWatch(e, stall_s=60)
        try:
            assert watch.segments == {path, shared}
            e.proc.send_signal(signal.SIGSTOP)          # a stopped engine's mapping too
            assert kill_engine(e, watch.segments) == 1
        finally:
            watch.close()
        assert e.proc.poll() is not None          # killed (psutil reaped it)
        assert not os.path.exists(path) and os.path.exists(other) and os.path.exists(shared)
    finally:
        e.proc.kill()
        mine.close()
        for f in (path, other, shared):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)


def test_no_fault_while_the_engine_is_up_and_idle(engine):
    watch = EngineWatch(engine, stall_s=5.0, poll_s=60)
    assert watch.check(now=1e12) is None            # not inside a step: no stall
    with watch.busy():
        t = watch._busy_since
        assert watch.check(now=t + 4.9) is None
        assert "no output for 5.1 s" in watch.check(now=t + 5.1)
    assert watch.check(now=1e12) is None
    watch.close()
    assert watch.cause is None and engine.proc.poll() is None


def test_vllm_marking_its_engine_dead_is_a_fault(engine):
    watch = EngineWatch(engine, stall_s=1e6, poll_s=60)
    engine._engine.engine_core.resources.engine_dead = True
    assert watch.check() == "vLLM marked its engine dead"
    watch.close()


def test_restarts_past_the_bound_end_the_job_with_one_line_naming_the_causes():
    budget = RestartBudget(2, 100.0, "generator rank 3 (host n7)")
    budget.record("engine process 11 (VLLM::EngineCore) is gone", now=0.0)
    budget.record("engine stalled", now=50.0)
    with pytest.raises(EngineRestartsError) as err:
        budget.record("vLLM marked its engine dead", now=90.0)
    line = str(err.value)
    assert "\n" not in line and line.startswith("generator rank 3 (host n7): ")
    assert "3 time(s) within 100 s, more than rollout.engine_restarts = 2" in line
    assert "is gone (90 s ago); engine stalled (40 s ago); vLLM marked its engine dead (0 s ago)" \
        in line
    assert budget.total == 2


def test_faults_older_than_the_window_no_longer_count():
    budget = RestartBudget(1, 10.0, "g")
    for t in (0.0, 11.0, 22.0, 33.0):
        budget.record("dead", now=t)
    assert budget.total == 4
    with pytest.raises(EngineRestartsError, match="more than rollout.engine_restarts = 1"):
        budget.record("dead", now=34.0)
    with pytest.raises(EngineRestartsError, match="rollout.engine_restarts = 0"):
        RestartBudget(0, 10.0, "g").record("dead", now=0.0)


# -- the generator's recovery, on a fake engine --------------------------------------------------
class _FakeEngine:
    """The VLLMEngine calls the generator makes; `fail` makes step() raise as a dead one does."""

    def __init__(self, version=0):
        self.version, self.fail, self.fail_recv = version, False, False
        self.drained, self.groups, self.aborted = [], [], []
        self.submitted, self.continued, self.loaded, self.pending = [], [], [], []
        self._children, self._closed = [], False
        self.held = False

    def hold(self):
        self.held = True

    def step(self):
        if self.fail:
            from vllm.v1.engine.exceptions import EngineDeadError
            raise EngineDeadError()
        return []

    def abort_all(self):
        out, self.pending = self.pending, []
        return out

    def submit_group(self, ids, prompt, max_new_tokens, seeds=None, **sampling):
        self.submitted.append((list(ids), seeds))

    def continue_sample(self, sample, max_new_tokens, **sampling):
        self.continued.append(sample)

    def update_weights_from_file(self, version, path):
        self.loaded.append((version, path))
        self.version = version
        return 0.0

    def update_weights(self, version, plan):
        if self.fail_recv:
            raise RuntimeError("[gloo] Timed out waiting for the broadcast")
        self.loaded.append((version, "broadcast"))
        self.version = version
        return 0.0

    def drain_weights(self, plan):
        self.drained.append(len(plan))
        return 0.0

    def init_weight_group(self, address, rank):
        self.groups.append((address.generation, rank))

    def abort(self, ids):
        self.aborted += list(ids)
        return []

    def has_unfinished(self):
        return True

    def num_running(self):
        return 0


class _Chan:
    def __init__(self):
        self.sent = []

    def send(self, msg, dest, tag):
        self.sent.append(msg)


class _Rewards:
    def __init__(self):
        self.submitted = []

    def submit(self, key, *args):
        self.submitted.append(key)

    def done(self, timeout):
        return []


def _sample(rid, tokens, reason="abort"):
    n = len(tokens)
    return FinishedSample(rid, np.array([1, 2], np.int32), np.array(tokens, np.int32),
                          np.zeros(n, np.float32), np.zeros(n, np.int32), reason, 0.0, 0.0, 0.0)


def _generator(mode="disk", restarts=3):
    cfg = RunConfig()
    cfg.weights.mode = mode
    cfg.rollout.engine_restarts = restarts
    address = WeightGroupAddress("h0", 1234, 2, "gloo")
    topo = type("Topo", (), {"rank": 1, "hosts": ["h0", "h1"], "weight_group_rank": 1,
                             "weight_group_address": lambda self, w: address})()
    engines = []

    def factory(version):
        engines.append(_FakeEngine(version))
        return engines[-1]
    gen = Generator(cfg, topo, engine=factory(0), rewards=_Rewards(), chan=_Chan(),
                    tokenizer=type("T", (), {"decode": lambda self, t, **kw: "x"})(),
                    engine_factory=factory)
    gen.guard = EngineWatch(gen.engine, stall_s=1e6, poll_s=60)
    return gen, engines


def test_a_dead_engine_is_replaced_and_its_samples_go_on_from_their_tokens():
    gen, engines = _generator()
    gen._submit("train", msgs.Prompt(5, [1, 2], 3, "math", "4"))
    gen._weights_path, engines[0].version = "/w/v2", 2
    engines[0].pending = [_sample("train:5:0", [7, 8, 9]),              # cut mid-sample
                          _sample("train:5:1", [7, 7], reason="stop")]  # finished, not returned
    engines[0].fail = True
    gen._step()
    new = engines[1]
    assert gen.engine is new and new.loaded == [(2, "/w/v2")]      # the current weights
    assert [s.request_id for s in new.continued] == ["train:5:0"]
    assert list(new.continued[0].output_tokens) == [7, 8, 9]         # its tokens kept
    assert gen.rewards.submitted == [("train", 5, 1)]               # the finished one is scored
    assert new.submitted[-1][0] == ["train:5:2"]                    # unknown to the old engine
    assert gen.restarts.total == 1
    beats = [m for m in gen.chan.sent if isinstance(m, msgs.Heartbeat)]
    assert [b.engine_down for b in beats] == [True, False]
    assert beats[-1].engine_restarts == 1 and "vLLM" in beats[-1].engine_fault


def test_the_new_engine_starts_once_the_old_ones_gpu_memory_is_back():
    gen, engines = _generator()
    events, readings = [], iter([[_gpu(2)], [_gpu(79)]])

    def read(n):
        events.append(("read", n, len(engines)))
        return next(readings)
    gen.read_gpu_memory = read
    gen.cfg.rollout.gpu_memory_utilization = 0.9
    engines[0].fail = True
    gen._step()
    assert events == [("read", 1, 1), ("read", 1, 1)] and len(engines) == 2   # then started


def test_memory_that_does_not_come_back_ends_the_rank_with_no_engine_started():
    gen, engines = _generator()
    gen.read_gpu_memory = lambda n: [_gpu(2, holders=[(77, 60 << 30, "VLLM::Worker")])]
    gen.cfg.rollout.engine_memory_wait_s = 0.001
    engines[0].fail = True
    with pytest.raises(EngineMemoryError, match=r"generator rank 1 \(host h1\): the new vLLM "
                                                r"engine cannot start.*pid 77 \(VLLM::Worker\)"):
        gen._step()
    assert len(engines) == 1


def _gpu(free_gib, holders=()):
    return DeviceMemory(0, "0", free_gib << 30, 80 << 30, tuple(holders))


def test_more_faults_than_the_bound_end_the_rank():
    gen, engines = _generator(restarts=1)
    engines[0].fail = True
    gen._step()
    engines[1].fail = True
    with pytest.raises(EngineRestartsError, match=r"generator rank 1 \(host h1\): its vLLM engine "
                                                  r"failed 2 time\(s\)"):
        gen._step()


def _acks(gen):
    return [(a.version, a.phase) for a in gen.chan.sent if isinstance(a, msgs.WeightsAck)]


def test_under_broadcast_a_new_engine_waits_for_the_weights_over_a_reformed_group():
    gen, engines = _generator(mode="broadcast")
    gen._submit("train", msgs.Prompt(5, [1, 2], 2, "math", "4"))
    engines[0].version = 3
    engines[0].pending = [_sample("train:5:0", [7, 8])]
    engines[0].fail = True
    gen._step()
    new = engines[1]
    assert gen.engine is new and new.loaded == []                  # nothing from disk
    assert gen.awaiting == 3 and _acks(gen) == [(3, "awaiting")]   # told to the controller
    assert [s.request_id for s in new.continued] == ["train:5:0"]  # kept, not stepped yet
    assert new.held                         # nor generated by vLLM's engine core meanwhile
    plan = [(0, [("w", (2,), "float32")])]
    gen._update_weights(msgs.WeightsNotice(3, plan=plan, generation=1))
    assert new.groups == [(1, 1)]           # joined the group's new generation first
    assert new.loaded == [(3, "broadcast")] and gen.awaiting is None
    assert _acks(gen)[-2:] == [(3, "started"), (3, "loaded")]


def test_a_notice_from_before_the_group_was_reformed_is_skipped():
    """Sent before this rank waited for weights (its new engine is in no group): receiving it
    would fail; the version comes again with the group's next generation."""
    gen, engines = _generator(mode="broadcast")
    gen.awaiting = 3
    gen._update_weights(msgs.WeightsNotice(3, plan=[(0, [])]))
    assert _acks(gen) == [] and engines[0].loaded == [] and gen.awaiting == 3


def test_a_worker_failure_is_a_reply_so_every_worker_replies():
    """vLLM's executor stops reading replies at the first failed worker (the rest would answer
    the next call): the engine's calls go through `reported`, which returns the failure."""
    from areal_hpc.rollout.vllm_ext import reported

    class Worker:
        rank = 1

        def recv_weights(self, plan):
            raise RuntimeError("[gloo] Connection closed by peer")

        def init_weight_group(self, address, rank):
            return rank + self.rank
    assert reported(Worker(), "init_weight_group", {}, 2) == 3
    assert reported(Worker(), "recv_weights", []) == {
        "areal_worker_error": "worker 1: RuntimeError: [gloo] Connection closed by peer"}


def test_a_version_already_running_is_taken_off_the_wire_without_loading():
    gen, engines = _generator(mode="broadcast")
    engines[0].version = 2
    gen._update_weights(msgs.WeightsNotice(2, plan=[(0, [])], generation=4))
    assert engines[0].groups == [(4, 1)] and engines[0].drained == [1] and engines[0].loaded == []
    assert _acks(gen) == [(2, "started"), (2, "loaded")]


def test_a_broadcast_that_fails_on_a_live_engine_waits_for_the_version_again():
    gen, engines = _generator(mode="broadcast")
    engines[0].fail_recv = True
    gen._update_weights(msgs.WeightsNotice(5, plan=[(0, [])]))      # no raise: the job goes on
    assert gen.awaiting == 5 and len(engines) == 1 and gen.restarts.total == 0
    assert _acks(gen) == [(5, "started"), (5, "awaiting")]
    engines[0].fail_recv = False
    gen._update_weights(msgs.WeightsNotice(5, plan=[(0, [])], generation=1))
    assert engines[0].loaded == [(5, "broadcast")] and gen.awaiting is None


def test_an_evaluation_met_while_waiting_for_weights_leaves_its_unfinished_prompts_out():
    gen, engines = _generator(mode="broadcast")
    gen.awaiting = 2
    gen._evaluate(msgs.EvalRequest([msgs.Prompt(0, [1, 2], 2, "math", "4")]))
    assert engines[0].aborted == ["eval:0:0", "eval:0:1"]
    result, = [m for m in gen.chan.sent if isinstance(m, msgs.EvalResult)]
    assert result.results == [] and ("eval", 0) not in gen.groups


def test_a_fault_during_a_weight_load_loads_that_version_into_the_new_engine():
    gen, engines = _generator()

    def dead(version, path):
        from vllm.v1.engine.exceptions import EngineDeadError
        raise EngineDeadError()
    engines[0].update_weights_from_file = dead
    gen._update_weights(msgs.WeightsNotice(4, path="/w/v4"))
    assert engines[1].loaded == [(4, "/w/v4")]
    acks = [m for m in gen.chan.sent if isinstance(m, msgs.WeightsAck)]
    assert [(a.version, a.phase) for a in acks] == [(4, "started"), (4, "loaded")]


def test_an_error_that_is_not_an_engine_fault_is_raised():
    gen, engines = _generator()
    engines[0].step = lambda: 1 / 0
    with pytest.raises(ZeroDivisionError):
        gen._step()
    assert len(engines) == 1 and gen.restarts.total == 0
