"""Reward service: scores finished samples in worker processes, beside the generator.

The generator loop submits a sample as soon as it finishes and collects scores later, so reward
work overlaps generation::

    with RewardPool(max_workers=2) as pool:
        pool.submit((prompt_id, sample_idx), "math", text, answer)
        ...
        for key, reward, error, extras in pool.done():   # never blocks
            ...

Shape. One supervisor thread owns a ``ProcessPoolExecutor`` (spawn context) and is the only
thread that touches it; ``submit`` and the futures' done-callbacks only put items on its inbox
(``queue.SimpleQueue.put`` never blocks, so a callback fired by the executor's own thread, under
its locks, cannot deadlock against us). Finished results go to a list behind a lock, which
``done`` empties.

Timeouts. A Python thread cannot be stopped from outside, and a signal reaches Python code only
between bytecodes, so a call stuck inside one long C call (a huge integer power in sympy) can only
be stopped by killing its process; ``ProcessPoolExecutor`` can't stop one task. So:

- at most ``max_workers`` calls are handed to the executor at a time (the rest wait in our own
  queue): every handed-over call has a worker to itself, and its deadline, counted from the
  hand-over, measures its own run, not time spent queueing behind others;
- when a call passes its deadline it yields reward 0.0 (counted in ``errors`` and ``timeouts``);
  the supervisor kills every worker of the executor and their children (psutil), drops the
  executor, and hands the other running calls, innocent, to a fresh executor from the start (the
  reward functions are pure, so running one twice is harmless);
- a worker that dies by itself (OOM killer, segfault, a kill from outside) breaks the executor:
  the calls running then yield 0.0 with an error (the culprit is unknown, so none is retried),
  and the next call gets a fresh executor.

A fresh executor starts its workers (spawn + imports, ~1 s) before any call is handed over, so
start-up time never counts against a deadline. Math calls run on the worker's main thread, so
math_verify's own SIGALRM bound (reward/math.py, 3 s) works too and normally answers first;
``math_timeout_s`` is the backstop. A code call's deadline is per test: ``len(tests) *
(code_test_timeout_s + CODE_TEST_OVERHEAD_S) + CODE_CALL_SLACK_S``; run_tests enforces the
per-test limit itself and stops at the first failing test.

Code tests run in bubblewrap sandboxes (reward/code.py, reward/sandbox.py); the parent-side files
of a test (source, stdin, stdout, stderr) are unlinked files in a directory of the pool's own,
emptied whenever workers are killed and removed by ``close``. A code call whose tests could not
be judged (the sandbox failed, a test timed out) yields 0.0 *with* run_tests' error, like a call
past its deadline; a wrong answer is 0.0 with no error. ``unsafe_no_sandbox=True`` runs code
unisolated (and warns).

Custom reward functions (``kind="custom"``, reward/custom.py) are imported by every worker
before it takes a call, and run like math calls: on the worker's main thread, bounded by
``fn_timeout_s``; one that raises or returns no number yields 0.0 with the reason.

Each worker's address space is limited to ``worker_memory_mb`` (a sympy blow-up gets a
MemoryError instead of waking the node's OOM killer next to vLLM).

Call ``close()`` (or use ``with``): ``concurrent.futures`` joins its executors at interpreter exit
and would wait for a stuck worker. ``close`` kills the workers; unfinished calls yield 0.0 with
the error ``"reward pool closed"``; use ``drain()`` first to let them finish.
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing
import os
import queue
import resource
import shutil
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Hashable, NamedTuple

import psutil

from areal_hpc.reaper import become_subreaper, kill_descendants
from areal_hpc.reward import custom
from areal_hpc.reward.code import run_tests
from areal_hpc.reward.math import math_reward
from areal_hpc.reward.sandbox import warn_unsafe

log = logging.getLogger(__name__)

KINDS = ("math", "code", "custom")
CODE_TEST_OVERHEAD_S = 1.0  # interpreter start, scratch directory, on a loaded node
CODE_CALL_SLACK_S = 5.0
WORKER_START_TIMEOUT_S = 120.0
WORKER_OUTPUT_BYTES = 1 << 20     # what a worker running user functions may print, in all
MAX_ERROR_CHARS = 200


class RewardResult(NamedTuple):
    key: Hashable
    reward: float
    error: str | None  # None when the reward was computed; else why the call yielded 0.0
    extras: dict | None = None  # a custom function's logged fields (reward/custom.py)


@dataclass(slots=True)
class _Call:
    key: Hashable
    kind: str
    completion: str
    reference: object
    timeout_s: float
    row: dict | None = None  # the dataset row, for custom functions
    deadline: float = 0.0  # time.monotonic() seconds; set when handed to the executor


_CLOSE = object()
_WAKE = object()


# ---- worker side (module-level functions: spawn pickles them by name) ----

def _init_worker(memory_mb: int, all_ready, functions=()) -> None:
    if functions:
        # Whatever a reward function starts stays this worker's descendant, even a daemon that
        # forks twice (re-parented here, not to init): killed and reaped after its call
        # (_score), killed with the worker. (Math and code calls leave nothing: code runs in a
        # PID namespace that dies with its test.)
        become_subreaper()
        _cap_output(WORKER_OUTPUT_BYTES)
    if memory_mb > 0:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = memory_mb << 20
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        # Soft limit only: run_tests' children set their own (lower or higher) limit.
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    math_reward("\\boxed{\\frac{1}{2}}", "0.5")  # math_verify builds its parsers on first use
    for spec in functions:  # imported before any deadline runs (checked at start-up already)
        custom.load(spec.spec)
    # No worker takes a task before all are ready (see RewardPool._start_executor).
    all_ready.wait(WORKER_START_TIMEOUT_S)


def _cap_output(limit: int) -> None:
    """This worker's stdout and stderr (a user function's prints, its children's) through a pipe
    that a thread forwards to the job's stderr, `limit` bytes in all, then one line saying the
    rest is dropped: a function that prints without end does not flood the job's output."""
    r, w = os.pipe()
    out = os.dup(2)
    os.dup2(w, 1)
    os.dup2(w, 2)
    os.close(w)

    def forward() -> None:
        left = limit
        while chunk := os.read(r, 1 << 16):
            if left > 0:
                os.write(out, chunk[:left])
                left -= len(chunk)
                if left <= 0:
                    os.write(out, f"\n[reward worker {os.getpid()}: output past {limit} bytes "
                                  "dropped]\n".encode())

    threading.Thread(target=forward, name="output-cap", daemon=True).start()


def _worker_pid() -> int:
    return os.getpid()


def _score(kind: str, completion: str, reference, code_test_timeout_s: float,
           code_memory_mb: int, scratch_root: str, unsafe_no_sandbox: bool = False,
           extractor: str = "boxed", functions=(), row: dict | None = None
           ) -> tuple[float, str | None, dict | None]:
    """(reward, error, extras): error is None when the reward was computed (a wrong answer
    included), else why it could not be (a code test's sandbox failure or timeout, a custom
    function that raised or returned no number; reward 0.0)."""
    if kind == "math":
        return math_reward(completion, reference, extractor), None, None
    if kind == "custom":
        try:
            reward, extras = custom.score(functions, completion, reference, row)
        except Exception as e:  # the user's function: a counted error, never a dead worker
            return 0.0, f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS], None
        finally:
            kill_descendants()  # a process the call left behind does not outlive it
        return reward, None, extras or None
    res = run_tests(completion, reference, timeout_s=code_test_timeout_s,
                    memory_mb=code_memory_mb, stop_on_first_failure=True,
                    scratch_root=scratch_root, unsafe_no_sandbox=unsafe_no_sandbox)
    return res["reward"], res["error"], None


# ---- parent side ----

class RewardPool:
    """Scores ``math``, ``code`` and ``custom`` samples in ``max_workers`` processes; see the
    module docstring.

    Thread-safe: ``submit``, ``done``, ``drain``, ``stats`` and ``worker_pids`` may be called
    from any thread.
    """

    def __init__(self, max_workers: int = 2, *, math_timeout_s: float = 10.0,
                 code_test_timeout_s: float = 5.0, code_memory_mb: int = 512,
                 worker_memory_mb: int = 4096, unsafe_no_sandbox: bool = False,
                 extractor: str = "boxed", functions=(), fn_timeout_s: float = 10.0):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.math_timeout_s = math_timeout_s
        self.code_test_timeout_s = code_test_timeout_s
        self.code_memory_mb = code_memory_mb
        self.worker_memory_mb = worker_memory_mb
        self.unsafe_no_sandbox = unsafe_no_sandbox
        self.extractor = extractor
        self.functions = tuple(functions)  # custom.Spec of reward.fn / reward.functions
        self.fn_timeout_s = fn_timeout_s
        if unsafe_no_sandbox:
            warn_unsafe()

        # Shared with callers, behind _lock.
        self._lock = threading.Condition()
        self._results: list[RewardResult] = []
        self._unfinished = 0
        self._stats = {"calls": 0, "errors": 0, "timeouts": 0, "restarts": 0}
        self._pids: list[int] = []
        self._closed = False

        # Supervisor thread only.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: collections.deque[_Call] = collections.deque()
        self._running: dict = {}  # Future -> _Call
        self._executor: ProcessPoolExecutor | None = None
        # Code tests' scratch directories: a killed worker leaves its own behind.
        self._scratch_root = tempfile.mkdtemp(prefix="areal_reward_")

        self._supervisor = threading.Thread(target=self._supervise, name="reward-pool",
                                            daemon=True)
        self._supervisor.start()

    # ---- public API ----

    def submit(self, key: Hashable, kind: str, completion: str, reference,
               row: dict | None = None) -> None:
        """Queue one sample; its result comes back from ``done()`` under ``key``.

        ``kind="math"``: ``reference`` is the answer string (reward/math.py).
        ``kind="code"``: ``reference`` is the list of ``{"input", "output"}`` tests
        (reward/code.py). ``kind="custom"``: the pool's ``functions`` score it, given
        ``reference`` and the dataset ``row`` (reward/custom.py). Never blocks; raises
        ValueError for an unknown kind (or custom without functions) and RuntimeError after
        ``close()``.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown reward kind {kind!r}, expected one of {KINDS}")
        if kind == "custom" and not self.functions:
            raise ValueError("reward kind 'custom' needs the pool's functions (reward.fn)")
        if kind == "math":
            timeout_s = self.math_timeout_s
        elif kind == "custom":
            timeout_s = self.fn_timeout_s
        else:
            n_tests = len(reference) if isinstance(reference, (list, tuple)) else 1
            timeout_s = (n_tests * (self.code_test_timeout_s + CODE_TEST_OVERHEAD_S)
                         + CODE_CALL_SLACK_S)
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            self._unfinished += 1
            self._stats["calls"] += 1
            # Under the lock, so that every accepted call is on the inbox before close's _CLOSE.
            self._inbox.put(_Call(key, kind, completion, reference, timeout_s, row))

    def done(self, timeout: float = 0.0) -> list[RewardResult]:
        """Results finished since the last call, in finishing order.

        Returns at once (possibly ``[]``) unless ``timeout > 0`` and nothing is ready: then waits
        up to ``timeout`` seconds for at least one result.
        """
        with self._lock:
            if timeout > 0:
                self._lock.wait_for(lambda: self._results, timeout)
            results, self._results = self._results, []
            return results

    def drain(self, timeout: float | None = None) -> list[RewardResult]:
        """Wait until every submitted call has finished (or ``timeout`` s), then ``done()``."""
        with self._lock:
            self._lock.wait_for(lambda: self._unfinished == 0, timeout)
            results, self._results = self._results, []
            return results

    @property
    def unfinished(self) -> int:
        """Calls submitted and not yet finished (collected or not)."""
        with self._lock:
            return self._unfinished

    def stats(self) -> dict[str, int]:
        """``calls``: submitted; ``errors``: results with an error (reward 0.0 not computed),
        ``timeouts`` included; ``timeouts``: calls killed at their deadline; ``restarts``:
        executors replaced (after a timeout or a dead worker)."""
        with self._lock:
            return dict(self._stats)

    def worker_pids(self) -> list[int]:
        """Pids of the current worker processes (diagnostics; empty until they have started)."""
        with self._lock:
            return list(self._pids)

    def close(self) -> None:
        """Kill the workers (and their children) and stop; idempotent. Unfinished calls yield
        0.0 with the error ``"reward pool closed"``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._inbox.put(_CLOSE)
        self._supervisor.join()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- supervisor thread ----

    def _supervise(self) -> None:
        try:
            while True:
                try:
                    item = self._inbox.get(timeout=self._seconds_to_next_deadline())
                except queue.Empty:
                    item = None
                if item is _CLOSE:
                    break
                if isinstance(item, _Call):
                    self._pending.append(item)
                self._collect_finished()
                self._expire_overdue()
                self._dispatch()
        except BaseException:
            log.exception("reward pool supervisor failed; failing all unfinished calls")
            with self._lock:
                self._closed = True
        finally:
            self._stop_executor()
            while True:  # calls not picked up yet (only after a failure: close's _CLOSE is last)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Call):
                    self._pending.append(item)
            for call in itertools.chain(self._running.values(), self._pending):
                self._finish(call, 0.0, "reward pool closed")
            self._running.clear()
            self._pending.clear()
            shutil.rmtree(self._scratch_root, ignore_errors=True)

    def _seconds_to_next_deadline(self) -> float | None:
        if not self._running:
            return None
        return max(0.0, min(c.deadline for c in self._running.values()) - time.monotonic())

    def _finish(self, call: _Call, reward: float, error: str | None, timeout: bool = False,
                extras: dict | None = None):
        with self._lock:
            self._results.append(RewardResult(call.key, reward, error, extras))
            self._unfinished -= 1
            self._stats["errors"] += error is not None
            self._stats["timeouts"] += timeout
            self._lock.notify_all()

    def _collect_finished(self) -> None:
        finished = [f for f in self._running if f.done()]
        if any(isinstance(f.exception(), BrokenProcessPool) for f in finished):
            # The executor is unusable; what was still running in it died with it.
            log.warning("a reward worker died; starting fresh workers")
            finished = list(self._running)
            self._restart()
        for fut in finished:
            call = self._running.pop(fut)
            if fut.cancelled() or not fut.done():
                error = "reward worker process died"
            elif isinstance(fut.exception(), BrokenProcessPool):
                error = "reward worker process died"
            elif fut.exception() is not None:  # e.g. a reference that does not pickle
                error = f"{type(fut.exception()).__name__}: {fut.exception()}"[:MAX_ERROR_CHARS]
            else:
                reward, error, extras = fut.result()
                self._finish(call, float(reward), error, extras=extras)
                continue
            self._finish(call, 0.0, error)

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        overdue = [f for f, call in self._running.items()
                   if call.deadline <= now and not f.done()]
        if not overdue:
            return
        expired = [self._running.pop(f) for f in overdue]
        for call in expired:
            log.warning("reward call %r (%s) passed its %g s deadline; killing the workers",
                        call.key, call.kind, call.timeout_s)
        # Killing the stuck worker breaks the executor, so the calls still running there are
        # lost through no fault of their own: they run again, first, on fresh workers.
        self._pending.extendleft(reversed(list(self._running.values())))
        self._running.clear()
        self._restart()
        for call in expired:
            self._finish(call, 0.0, f"timeout after {call.timeout_s:g} s", timeout=True)

    def _dispatch(self) -> None:
        while self._pending and len(self._running) < self.max_workers:
            if self._executor is None and not self._start_executor():
                return
            call = self._pending.popleft()
            try:
                fut = self._executor.submit(_score, call.kind, call.completion, call.reference,
                                            self.code_test_timeout_s, self.code_memory_mb,
                                            self._scratch_root, self.unsafe_no_sandbox,
                                            self.extractor, self.functions, call.row)
            except BrokenProcessPool:  # a worker died while idle
                self._pending.appendleft(call)
                self._restart()
                continue
            call.deadline = time.monotonic() + call.timeout_s
            self._running[fut] = call
            fut.add_done_callback(self._wake)

    def _wake(self, _future) -> None:
        self._inbox.put(_WAKE)

    def _start_executor(self) -> bool:
        """Start workers and wait until each has imported the reward code. On failure every
        waiting call yields 0.0 with the reason (the next submit tries again)."""
        ctx = multiprocessing.get_context("spawn")
        executor = ProcessPoolExecutor(
            self.max_workers, mp_context=ctx, initializer=_init_worker,
            initargs=(self.worker_memory_mb, ctx.Barrier(self.max_workers), self.functions))
        error = None
        try:
            # 3.11 spawns one worker per submit while none is idle: this starts all of them.
            # Their initializers meet at the barrier, so once any probe has run, every worker
            # is ready; without it one fast worker could run all probes while another is still
            # importing, and the first calls' deadlines would include that import.
            probes = [executor.submit(_worker_pid) for _ in range(self.max_workers)]
            finished, _ = wait(probes, timeout=WORKER_START_TIMEOUT_S)
            failed = [p.exception() for p in finished if p.exception() is not None]
            if failed:
                error = f"{type(failed[0]).__name__}: {failed[0]}"
            elif len(finished) < len(probes):
                error = f"not started within {WORKER_START_TIMEOUT_S:g} s"
        except Exception as e:  # e.g. spawn refusing to start from an unguarded __main__
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            error = f"reward workers failed to start: {error}"[:MAX_ERROR_CHARS]
            log.error(error)
            self._kill(executor)
            while self._pending:
                self._finish(self._pending.popleft(), 0.0, error)
            return False
        self._executor = executor
        with self._lock:
            self._pids = sorted(_processes(executor))
        return True

    def _restart(self) -> None:
        self._stop_executor()
        with self._lock:
            self._stats["restarts"] += 1

    def _stop_executor(self) -> None:
        if self._executor is not None:
            self._kill(self._executor)
            self._executor = None
            # No worker is left to use the scratch directories: start the root afresh.
            shutil.rmtree(self._scratch_root, ignore_errors=True)
            try:
                os.mkdir(self._scratch_root, 0o700)
            except OSError as e:  # code calls will then fail with "sandbox error"
                log.error("cannot recreate %s: %s", self._scratch_root, e)
        with self._lock:
            self._pids = []

    @staticmethod
    def _kill(executor: ProcessPoolExecutor) -> None:
        """SIGKILL the executor's workers and everything they started, then reap the workers.

        The children (code tests, in sessions of their own) are found before the workers die:
        afterwards they belong to init. Killing first, then ``shutdown(wait=True)``, never waits
        on a stuck task: the executor sees dead workers, fails their futures and joins them.
        """
        victims = []
        for pid in _processes(executor):
            try:
                worker = psutil.Process(pid)
                victims += [worker, *worker.children(recursive=True)]
            except psutil.Error:
                pass
        for proc in victims:
            try:
                proc.kill()  # psutil checks the pid still names the same process
            except psutil.Error:
                pass
        executor.shutdown(wait=True, cancel_futures=True)


def _processes(executor: ProcessPoolExecutor) -> list[int]:
    # ProcessPoolExecutor has no public way to reach its workers before Python 3.14
    # (terminate_workers/kill_workers); _processes is {pid: Process}, None after shutdown.
    return list(getattr(executor, "_processes", None) or {})
