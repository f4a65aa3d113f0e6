import os
import signal
import tempfile
import threading
import time

import psutil
import pytest

from areal_hpc.reward.pool import RewardPool, RewardResult

# sympy evaluates the tower until math_verify's alarm (3 s, main thread only) stops it
HANGS = "\\boxed{9^{9^{9^{9}}}}"
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_TESTS = [{"input": "1 2", "output": "3"}, {"input": "5 7", "output": "12"}]
ONE_PASSED = {"code_tests_run": 1.0, "code_tests_passed": 1.0}     # a code call's logged fields


def gone(proc: psutil.Process) -> bool:
    # An orphan killed here stays a zombie: this container's init does not reap.
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def pool():
    # the bounds are failure guards here, far above a call's time on a busy box (a math call took
    # over 10 s, the default, at a load of ~9 on 2 cores and came back as a timeout)
    with RewardPool(max_workers=2, math_timeout_s=60.0, code_test_timeout_s=30.0) as p:
        yield p


def test_math_and_code_through_the_pool(pool):
    calls = {
        "half": ("math", "so \\boxed{0.5}", "1/2", 1.0),
        "frac": ("math", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        "four": ("math", "\\boxed{4}", "4", 1.0),
        "wrong": ("math", "\\boxed{5}", "4", 0.0),
        "no box": ("math", "4", "4", 0.0),
        "code ok": ("code", f"```python\n{ADD}```", ADD_TESTS, 1.0),
        "code wrong": ("code", "input()\nprint(3)", ADD_TESTS, 0.0),
        "code error": ("code", "1/0", ADD_TESTS, 0.0),
    }
    # a code sample's tests run (up to the first failure) and passed: what the sandbox judged
    ran = {"code ok": (2, 2), "code wrong": (2, 1), "code error": (1, 0)}
    errors_before = pool.stats()["errors"]
    for key, (kind, completion, reference, _) in calls.items():
        pool.submit(key, kind, completion, reference)
    results = pool.drain(timeout=60)
    assert sorted(results) == sorted(
        RewardResult(key, reward, None, {"code_tests_run": ran[key][0], "code_tests_passed":
                                         ran[key][1]} if key in ran else None)
        for key, (_, _, _, reward) in calls.items())
    assert pool.unfinished == 0
    assert pool.stats()["errors"] == errors_before


def test_done_never_blocks_and_waits_only_when_asked(pool):
    assert pool.done() == []
    start = time.monotonic()
    assert pool.done(timeout=0.2) == []
    assert 0.15 < time.monotonic() - start < 30       # it waited, and returned (the upper bound: a guard)
    pool.submit(7, "math", "\\boxed{7}", "7")
    assert pool.done(timeout=30) == [RewardResult(7, 1.0, None)]


def test_a_reference_that_does_not_pickle_is_an_error_not_a_crash(pool):
    errors_before = pool.stats()["errors"]
    pool.submit("lock", "code", "print(1)", [threading.Lock()])
    pool.submit("after", "math", "\\boxed{1}", "1")
    assert sorted(pool.drain(timeout=60)) == [
        RewardResult("after", 1.0, None),
        RewardResult("lock", 0.0, "TypeError: cannot pickle '_thread.lock' object")]
    assert pool.stats()["errors"] == errors_before + 1


def test_unknown_kind_is_refused(pool):
    with pytest.raises(ValueError, match="unknown reward kind 'chess'"):
        pool.submit(1, "chess", "e4", "e5")


def test_a_stuck_math_call_times_out_and_the_pool_keeps_serving():
    with RewardPool(max_workers=2, math_timeout_s=1.0) as pool:
        pool.submit("warm", "math", "\\boxed{1}", "1")
        assert pool.drain(timeout=60) == [RewardResult("warm", 1.0, None)]
        workers = [psutil.Process(pid) for pid in pool.worker_pids()]
        # A slow, innocent code call runs beside the stuck one: only the stuck call's worker is
        # killed, the innocent call finishes where it runs.
        start = time.monotonic()
        pool.submit("innocent", "code", "import time\ntime.sleep(1.5)\nprint(3)",
                    [{"input": "", "output": "3"}])
        pool.submit("stuck", "math", HANGS, "4")
        # math_verify's own alarm (3 s) would answer 0.0 without an error; the pool's 1 s first.
        assert pool.done(timeout=30) == [RewardResult("stuck", 0.0, "timeout after 1 s")]
        assert time.monotonic() - start < 2.5
        assert pool.drain(timeout=60) == [RewardResult("innocent", 1.0, None, ONE_PASSED)]
        assert sorted(gone(w) for w in workers) == [False, True]
        pool.submit("next", "math", "\\boxed{3}", "3")
        assert pool.drain(timeout=60) == [RewardResult("next", 1.0, None)]
        assert pool.stats() == {"calls": 4, "errors": 1, "timeouts": 1, "restarts": 1}
        assert len(set(pool.worker_pids()) - {w.pid for w in workers}) == 1


def test_a_dead_worker_costs_its_call_and_the_pool_keeps_serving(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the pool's scratch goes
    with RewardPool(max_workers=1, code_test_timeout_s=30.0) as pool:
        pool.submit("sleeper", "code", "import time\ntime.sleep(60)", [{"input": "", "output": ""}])
        wait_until(lambda: pool.worker_pids())
        worker = psutil.Process(pool.worker_pids()[0])
        wait_until(lambda: worker.children())  # the test program is running
        program = worker.children()[0]
        [dead_scratch] = next(tmp_path.iterdir()).iterdir()
        os.kill(worker.pid, signal.SIGKILL)  # as the OOM killer would
        assert pool.drain(timeout=30) == [
            RewardResult("sleeper", 0.0, "reward worker process died")]
        wait_until(lambda: gone(program), 5.0)  # its PID namespace died with it
        pool.submit("next", "math", "\\boxed{\\frac{1}{2}}", "0.5")
        assert pool.drain(timeout=60) == [RewardResult("next", 1.0, None)]
        assert pool.stats() == {"calls": 2, "errors": 1, "timeouts": 0, "restarts": 1}
        assert not dead_scratch.exists()  # the dead worker's test directory is gone
    assert list(tmp_path.iterdir()) == []


def test_close_leaves_no_processes_and_fails_unfinished_calls(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    def descendants():
        # multiprocessing's resource tracker lives as long as this process, by design.
        found = set()
        for p in psutil.Process().children(recursive=True):
            try:
                if "resource_tracker" not in " ".join(p.cmdline()):
                    found.add(p)
            except psutil.Error:   # gone, or a zombie: nothing left running
                pass
        return found

    before = descendants()
    pool = RewardPool(max_workers=2, code_test_timeout_s=30.0)
    pool.submit("quick", "math", "\\boxed{2}", "2")
    assert pool.drain(timeout=60) == [RewardResult("quick", 1.0, None)]
    for key in ("sleeper 1", "sleeper 2"):
        pool.submit(key, "code", "import time\ntime.sleep(60)", [{"input": "", "output": ""}])
    # Per worker: unshare, the worker (pid 1 of its namespace), and for its sleeping test:
    # bwrap, bwrap's pid 1 in the sandbox, the program.
    wait_until(lambda: len(descendants() - before) == 10)
    ours = descendants() - before
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < 5.0
    assert sorted(pool.done()) == [RewardResult("sleeper 1", 0.0, "reward pool closed"),
                                   RewardResult("sleeper 2", 0.0, "reward pool closed")]
    wait_until(lambda: all(gone(p) for p in ours), 5.0)
    assert descendants() - before == set()
    assert list(tmp_path.iterdir()) == []  # scratch directories of the killed tests included
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("late", "math", "\\boxed{1}", "1")
    pool.close()  # idempotent


@pytest.mark.parametrize("line, why", [
    (b'{"id": 1, "reward": NaN, "error": null, "extras": null}', "NaN is not a finite number"),
    (b'{"id": 1, "reward": 1e400, "error": null, "extras": null}', "reward is inf"),
    (b'{"id": 1, "reward": true, "error": null, "extras": null}', "reward is a bool"),
    (b'{"id": 1, "reward": "1", "error": null, "extras": null}', "reward is a str"),
    (b'{"id": 1, "reward": 1e7, "error": null, "extras": null}', "beyond"),
    (b'{"id": "1", "reward": 1, "error": null, "extras": null}', "no call id"),
    (b'{"id": 1, "reward": 1, "error": 3, "extras": null}', "error is a int"),
    (b'{"id": 1, "reward": 1, "error": null, "extras": null, "more": 1}', "not a result"),
    (b'[1, 1.0, null, null]', "not a result"),
    (b'{"id": 1, "reward": 1, "error": null, "extras": {"a": [1]}}', "is a list"),
    (b'{"id": 1, "reward": 1, "error": null, "extras": {"": 1}}', "name"),
    (('{"id": 1, "reward": 1, "error": null, "extras": {"%s": 1}}' % ("n" * 200)).encode(),
     "name"),
    (('{"id": 1, "reward": 1, "error": null, "extras": {%s}}'
      % ", ".join(f'"k{i}": 1' for i in range(40))).encode(), "at most 16"),
])
def test_a_result_line_is_checked_as_exact_plain_types(line, why):
    from areal_hpc.reward.pool import _plain_result
    with pytest.raises(ValueError, match=why):
        _plain_result(line, ())


def test_a_plain_result_passes_and_a_long_error_is_cut():
    from areal_hpc.reward.pool import MAX_ERROR_CHARS, _plain_result
    line = b'{"id": 7, "reward": 0, "error": "%s", "extras": {"a": 2}}' % (b"e" * 1000)
    assert _plain_result(line, ()) == (7, 0.0, "e" * MAX_ERROR_CHARS, {"a": 2.0})


def test_without_a_pid_namespace_the_pool_still_scores_and_says_so(monkeypatch, caplog):
    """Where no PID namespace can be made (no unshare, user namespaces off), workers run plain,
    their leftovers killed by list; the pool says which at start."""
    import logging

    from areal_hpc.reward import contain

    monkeypatch.setattr(contain, "namespace_prefix", lambda: ([], "no PID namespace (test)"))
    caplog.set_level(logging.INFO, logger="areal_hpc.reward.pool")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with RewardPool(max_workers=1) as pool:
        pool.submit("m", "math", "\\boxed{2}", "2")
        pool.submit("c", "code", "print(int(input()) + 1)", [{"input": "1", "output": "2"}])
        assert sorted(pool.drain(timeout=120)) == [RewardResult("c", 1.0, None, ONE_PASSED),
                                                   RewardResult("m", 1.0, None)]
        [pid] = pool.worker_pids()
        assert psutil.Process(pid).ppid() == os.getpid()     # the worker itself, no unshare
    assert [r.message for r in caplog.records if "no PID namespace (test)" in r.message]
    def running() -> set:
        found = set()
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.add(p.pid)
            except psutil.Error:
                pass
        return found
    wait_until(lambda: running() <= before, 10.0)


def test_close_writes_nothing_onto_the_jobs_output(capfd):
    """Ending the workers is silent: unshare, killed after its pid 1, would print
    'sigprocmask unblock failed' at every job's end."""
    with RewardPool(max_workers=2) as p:
        p.submit(1, "math", r"\boxed{42}", "42")
        assert [r.reward for r in p.drain(timeout=120)] == [1.0]
        capfd.readouterr()
    out, err = capfd.readouterr()
    assert "sigprocmask" not in err and "unshare" not in err, err
