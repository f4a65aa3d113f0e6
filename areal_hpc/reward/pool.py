"""Reward service: scores finished samples in worker processes, beside the generator.

The generator loop submits a sample as soon as it finishes and collects scores later, so reward
work overlaps generation::

    with RewardPool(max_workers=2) as pool:
        pool.submit((prompt_id, sample_idx), "math", text, answer)
        ...
        for key, reward, error, extras in pool.done():   # never blocks
            ...

Shape. One supervisor thread owns the workers (``python -m areal_hpc.reward.worker``, one call
at a time each) and is the only thread that starts, feeds or kills them; ``submit`` and the
threads reading the workers' pipes only put items on its inbox (``queue.SimpleQueue.put`` never
blocks). Finished results go to a list behind a lock, which ``done`` empties.

Trust. A worker runs user reward functions, so nothing it sends is trusted: its results come
back as one line of JSON each on a pipe of their own (never a pickle: the parent unpickles
nothing a worker wrote) and are checked again here as exact plain types (``_plain_result``:
a ``dict`` of ``float``/``str``, finite and bounded values, at most so many logged fields, names
of bounded length); a line that fails is refused, its call yields 0.0 with the reason and the
worker is replaced. The worker's stdout and stderr are a pipe read here: at most
``WORKER_OUTPUT_BYTES`` of it reach the job's stderr, then one line says the rest was dropped;
the worker holds no descriptor of the job's own output.

Containment (reward/contain.py; one log line at start says which holds). Each worker is pid 1 of
a PID namespace of its own: whatever it starts (a double-forked daemon, a CLONE_PARENT child, a
chain that re-spawns itself) lives in that namespace, and killing the worker through its pidfd
makes the kernel kill the whole namespace, with no list to outrun; the namespace also dies with
the thread that started it (``--pdeathsig``). Where no namespace can be made the fallback (a
subreaper, kill by list) is said in that line.

Timeouts. A Python thread cannot be stopped from outside, and a call stuck inside one long C call
(a huge integer power in sympy) can only be stopped by killing its process. So a call is handed
to an idle, ready worker only (the rest wait in our own queue), and its deadline, counted from
the hand-over, measures its own run. A call past its deadline yields reward 0.0 (counted in
``errors`` and ``timeouts``), its worker is killed and replaced; the other workers' calls go on.
Handing a call over is bounded too (the calls' pipe is non-blocking): a worker that stops reading
costs that call a timeout and is replaced. A worker that dies by itself (OOM killer, segfault, a
kill from outside) costs its call (0.0 with an error) and is replaced; each replacement is counted in ``restarts``. A worker's start-up
(imports, ~1 s) never counts against a deadline: calls go only to workers that said they are
ready. Math calls run on the worker's main thread, so math_verify's own SIGALRM bound
(reward/math.py, 3 s) works too and normally answers first; ``math_timeout_s`` is the backstop.
A code call's deadline is per test: ``len(tests) * (code_test_timeout_s + CODE_TEST_OVERHEAD_S) +
CODE_CALL_SLACK_S``; run_tests enforces the per-test limit itself and stops at the first failing
test.

Code tests run in bubblewrap sandboxes (reward/code.py, reward/sandbox.py); the parent-side files
of a test are unlinked files in a directory of the worker's own under the pool's, removed with
the worker and by ``close``. A code call whose tests could not be judged (the sandbox failed, a
test timed out) yields 0.0 *with* run_tests' error, like a call past its deadline; a wrong answer
is 0.0 with no error. ``unsafe_no_sandbox=True`` runs code unisolated (and warns).

Custom reward functions (``kind="custom"``, reward/custom.py) are imported by every worker
before it says it is ready, and run like math calls, bounded by ``fn_timeout_s``; one that
raises or returns no number yields 0.0 with the reason.

Each worker's address space is limited to ``worker_memory_mb`` (a sympy blow-up gets a
MemoryError instead of waking the node's OOM killer next to vLLM).

Call ``close()`` (or use ``with``): it kills the workers and all they started; unfinished calls
yield 0.0 with the error ``"reward pool closed"``; use ``drain()`` first to let them finish.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import math
import os
import pickle
import queue
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Hashable, NamedTuple

from areal_hpc.reward import contain, custom
from areal_hpc.reward.sandbox import child_env, warn_unsafe

log = logging.getLogger(__name__)

KINDS = ("math", "code", "custom")
CODE_TEST_OVERHEAD_S = 1.0  # interpreter start, scratch directory, on a loaded node
CODE_CALL_SLACK_S = 5.0
WORKER_START_TIMEOUT_S = 120.0
WORKER_OUTPUT_BYTES = 1 << 20     # what a worker may print, in all
MAX_ERROR_CHARS = 200
MAX_RESULT_BYTES = 64 << 10       # one result line from a worker


class RewardResult(NamedTuple):
    key: Hashable
    reward: float
    error: str | None  # None when the reward was computed; else why the call yielded 0.0
    extras: dict | None = None  # a custom function's logged fields (reward/custom.py); a code
    #                              sample's code_tests_run, code_tests_passed


@dataclass(slots=True)
class _Call:
    key: Hashable
    kind: str
    completion: str
    reference: object
    timeout_s: float
    row: dict | None = None  # the dataset row, for custom functions
    deadline: float = 0.0  # time.monotonic() seconds; set when handed to a worker


_CLOSE = object()
_seq = itertools.count()


# ---- what a worker sends, checked as plain data ----

def _reject_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def _finite(value, what: str, bound: float) -> float:
    if type(value) not in (float, int):     # exact types: bool and subclasses refused
        raise ValueError(f"{what} is a {type(value).__name__}, not a number")
    v = float(value)
    if not (math.isfinite(v) and abs(v) <= bound):
        raise ValueError(f"{what} is {v:g}, beyond ±{bound:g}")
    return v


def _plain_result(line: bytes, functions) -> tuple[int, float, str | None, dict | None]:
    """(call id, reward, error, extras) of one result line, checked as exact plain types and
    bounded values (ValueError says why not). Nothing in it is trusted: the worker ran user
    code, which can write anything on the result pipe."""
    msg = json.loads(line, parse_constant=_reject_constant)
    if type(msg) is not dict or set(msg) != {"id", "reward", "error", "extras"}:
        raise ValueError("not a result object")
    if type(msg["id"]) is not int:
        raise ValueError("no call id")
    weights = sum(abs(s.weight) for s in functions) or 1.0
    reward = _finite(msg["reward"], "reward", custom.MAX_ABS_VALUE * max(1.0, weights))
    error = msg["error"]
    if error is not None and type(error) is not str:
        raise ValueError(f"error is a {type(error).__name__}")
    extras = msg["extras"]
    if extras is not None:
        most = custom.MAX_EXTRAS * max(1, len(functions)) + len(functions)
        if type(extras) is not dict or len(extras) > most:
            raise ValueError(f"logged fields: not a dict of at most {most}")
        for k, v in extras.items():
            if type(k) is not str or not 0 < len(k) <= 2 * custom.MAX_EXTRA_NAME + 1:
                raise ValueError(f"a logged field's name is not a string of 1-"
                                 f"{2 * custom.MAX_EXTRA_NAME + 1} characters")
            _finite(v, f"logged field {k!r}", custom.MAX_ABS_VALUE)
        extras = {k: float(v) for k, v in extras.items()} or None
    return msg["id"], reward, None if error is None else error[:MAX_ERROR_CHARS], extras


# ---- one worker process, seen from the parent ----

class _Worker:
    """A worker process, its pipes, and the two threads that read them (results onto the pool's
    inbox, output capped onto the job's stderr)."""

    def __init__(self, pool: RewardPool):
        self.scratch = tempfile.mkdtemp(dir=pool._scratch_root)
        cfg = {"memory_mb": pool.worker_memory_mb, "extractor": pool.extractor,
               "code_test_timeout_s": pool.code_test_timeout_s,
               "code_memory_mb": pool.code_memory_mb, "scratch": self.scratch,
               "unsafe_no_sandbox": pool.unsafe_no_sandbox,
               "functions": [list(s) for s in pool.functions]}
        call_r, call_w = os.pipe()
        res_r, res_w = os.pipe()
        out_r, out_w = os.pipe()
        env = child_env(1 << 27, next(_seq))
        try:
            self.proc = subprocess.Popen(
                contain.wrap([sys.executable, "-m", "areal_hpc.reward.worker", str(call_r),
                              str(res_w), json.dumps(cfg)]),
                stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w, pass_fds=(call_r, res_w),
                env=env, start_new_session=True)
        finally:
            for fd in (call_r, res_w, out_w):
                os.close(fd)
        os.set_blocking(call_w, False)     # a hand-over never waits without bound (send)
        self.calls = call_w
        self.pid = contain.init_pid(self.proc)
        self.pidfd = contain.pidfd(self.pid)
        self.call: _Call | None = None
        self.call_id = -1
        self.ready = False
        self.start_deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        threading.Thread(target=self._read_results, args=(res_r, pool._inbox), daemon=True,
                         name="reward-results").start()
        threading.Thread(target=_forward_output, args=(out_r, self.pid), daemon=True,
                         name="reward-output").start()

    def _read_results(self, fd: int, inbox: queue.SimpleQueue) -> None:
        with os.fdopen(fd, "rb") as f:
            while True:
                try:
                    line = f.readline(MAX_RESULT_BYTES + 1)
                except (OSError, ValueError):
                    line = b""
                if not line:
                    inbox.put(("dead", self, None))
                    return
                if len(line) > MAX_RESULT_BYTES or not line.endswith(b"\n"):
                    inbox.put(("bad", self, f"a result line over {MAX_RESULT_BYTES} bytes"))
                    return
                inbox.put(("line", self, line))

    def send(self, call_id: int, call: _Call) -> None:
        """Hand a call over (pickle: the parent -> worker direction only). Raises what
        pickling raises, OSError if the worker is gone, TimeoutError if it does not take the
        call within the call's own timeout (a worker that stopped reading)."""
        frame = pickle.dumps((call_id, call.kind, call.completion, call.reference, call.row))
        data = memoryview(struct.pack(">Q", len(frame)) + frame)
        self.call, self.call_id = call, call_id   # from the first byte on, the call is its
        deadline = time.monotonic() + call.timeout_s
        while data:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [self.calls], [], left)[1]:
                raise TimeoutError(f"the worker did not take the call within "
                                   f"{call.timeout_s:g} s")
            try:
                data = data[os.write(self.calls, data):]
            except BlockingIOError:
                pass
        call.deadline = time.monotonic() + call.timeout_s

    def end(self) -> None:
        """Kill the worker and everything it started (reward/contain.py), remove its files."""
        if self.calls is not None:
            os.close(self.calls)
            self.calls = None
        contain.end(self.proc, self.pidfd)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        shutil.rmtree(self.scratch, ignore_errors=True)


def _forward_output(fd: int, pid: int) -> None:
    """The worker's stdout and stderr (a user function's prints, its children's) onto the job's
    stderr, WORKER_OUTPUT_BYTES in all, then one line saying the rest is dropped; read to the end
    so that a writer never blocks on a full pipe."""
    left = WORKER_OUTPUT_BYTES
    with os.fdopen(fd, "rb", buffering=0) as f:
        while chunk := f.read(1 << 16):
            if left > 0:
                try:
                    os.write(2, chunk[:left])
                    if left <= len(chunk):
                        os.write(2, f"\n[reward worker {pid}: output past {WORKER_OUTPUT_BYTES} "
                                    "bytes dropped]\n".encode())
                except OSError:
                    pass
                left -= len(chunk)


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
        self._workers: list[_Worker] = []
        self._start_failed: str | None = None   # set until the next submit
        # Code tests' scratch directories, one per worker, removed with it.
        self._scratch_root = tempfile.mkdtemp(prefix="areal_reward_")
        # one line: which bounds hold here (a warning where a fallback stands in)
        full = contain.memory_base() is not None and bool(contain.namespace_prefix()[0])
        log.log(logging.INFO if full else logging.WARNING, "reward pool: %s", contain.bound())

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
                    self._start_failed = None
                elif item is not None:
                    self._on_worker(*item)
                self._expire_overdue()
                self._dispatch()
        except BaseException:
            log.exception("reward pool supervisor failed; failing all unfinished calls")
            with self._lock:
                self._closed = True
        finally:
            running = [w.call for w in self._workers if w.call is not None]
            for w in self._workers:
                w.end()
            self._workers.clear()
            with self._lock:
                self._pids = []
            while True:  # calls not picked up yet (only after a failure: close's _CLOSE is last)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Call):
                    self._pending.append(item)
            for call in itertools.chain(running, self._pending):
                self._finish(call, 0.0, "reward pool closed")
            self._pending.clear()
            shutil.rmtree(self._scratch_root, ignore_errors=True)

    def _seconds_to_next_deadline(self) -> float | None:
        times = [w.call.deadline if w.call is not None else w.start_deadline
                 for w in self._workers if w.call is not None or not w.ready]
        if not times:
            return None
        return max(0.0, min(times) - time.monotonic())

    def _finish(self, call: _Call, reward: float, error: str | None, timeout: bool = False,
                extras: dict | None = None):
        with self._lock:
            self._results.append(RewardResult(call.key, reward, error, extras))
            self._unfinished -= 1
            self._stats["errors"] += error is not None
            self._stats["timeouts"] += timeout
            self._lock.notify_all()

    def _on_worker(self, what: str, worker: _Worker, data) -> None:
        """A line, a refusal or an end-of-file from a worker's result pipe."""
        if worker not in self._workers:
            return                      # from a worker already ended
        if what == "line" and not worker.ready:
            try:
                ok = json.loads(data) == {"ready": True}
            except ValueError:
                ok = False
            if ok:
                worker.ready = True
                return
            what, data = "bad", "no ready line first"
        if what == "line":
            try:
                call_id, reward, error, extras = _plain_result(data, self.functions)
                if worker.call is None or call_id != worker.call_id:
                    raise ValueError("a result for no call of this worker")
            except (ValueError, RecursionError) as e:
                what, data = "bad", str(e)[:120]
            else:
                call, worker.call = worker.call, None
                self._finish(call, reward, error, extras=extras)
                return
        # "bad" (the worker broke the protocol: user code wrote on its pipe) or "dead"
        if what == "bad":
            log.warning("reward worker %d: result refused (%s); replacing it", worker.pid, data)
            why = f"reward worker result refused: {data}"
        elif worker.ready:
            log.warning("a reward worker died; starting a fresh one")
            why = "reward worker process died"
        else:
            code = worker.proc.poll()
            why = f"reward workers failed to start: exit code {code}"
            log.error(why)
            self._start_failed = why
        self._replace(worker, why)

    def _replace(self, worker: _Worker, why: str, timeout: bool = False) -> None:
        """End `worker`, fail its call with `why`; a fresh worker comes at the next dispatch."""
        self._workers.remove(worker)
        call = worker.call
        worker.end()
        with self._lock:
            self._pids = [w.pid for w in self._workers]
            self._stats["restarts"] += worker.ready
        if call is not None:
            self._finish(call, 0.0, why, timeout=timeout)
        if self._start_failed:
            while self._pending:
                self._finish(self._pending.popleft(), 0.0, self._start_failed[:MAX_ERROR_CHARS])

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.call is not None and w.call.deadline <= now:
                log.warning("reward call %r (%s) passed its %g s deadline; killing its worker",
                            w.call.key, w.call.kind, w.call.timeout_s)
                self._replace(w, f"timeout after {w.call.timeout_s:g} s", timeout=True)
            elif not w.ready and w.start_deadline <= now:
                self._start_failed = (f"reward workers failed to start: not started within "
                                      f"{WORKER_START_TIMEOUT_S:g} s")
                log.error(self._start_failed)
                self._replace(w, self._start_failed)

    def _dispatch(self) -> None:
        if not self._pending or self._start_failed:
            return
        while len(self._workers) < self.max_workers:
            try:
                self._workers.append(_Worker(self))
            except Exception as e:   # no fork, no fds: every waiting call gets the reason
                self._start_failed = (f"reward workers failed to start: "
                                      f"{type(e).__name__}: {e}")[:MAX_ERROR_CHARS]
                log.error(self._start_failed)
                while self._pending:
                    self._finish(self._pending.popleft(), 0.0, self._start_failed)
                return
            with self._lock:
                self._pids = [w.pid for w in self._workers]
        replaced = False
        for w in list(self._workers):       # (_replace may remove one)
            if not self._pending:
                break
            if w.ready and w.call is None:
                call = self._pending.popleft()
                try:
                    w.send(next(_seq), call)
                except TimeoutError as e:   # the worker is stuck: it goes, the call with it
                    self._replace(w, f"timeout: {e}", timeout=True)
                    replaced = True
                except OSError:       # the worker is gone or closed its end: it goes, the
                    w.call = None     # call waits for another
                    self._pending.appendleft(call)
                    self._replace(w, "reward worker process died")
                    replaced = True
                except Exception as e:  # e.g. a reference that does not pickle
                    self._finish(call, 0.0, f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS])
        if replaced:
            self._dispatch()        # start the replacements now (not ready: nothing is sent)
