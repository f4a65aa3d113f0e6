"""A generator rank's watch over its vLLM engine: a fault found, the engine ended, a bound on
restarts. The generator (rollout/generator.py) starts a new engine and goes on.

vLLM's synchronous engine does not notice every fault by itself: when its EngineCore process is
killed, its monitor thread marks the client dead and closes the output socket, but a caller
blocked in `LLMEngine.step()` (waiting on the client's output queue) or in a utility call (a
weight load, `collective_rpc`) is never woken, and an EngineCore that stops (SIGSTOP, a stuck
collective) is not noticed at all. `EngineWatch` is a thread beside the loop that finds both:

- dead: the client marked the engine dead, or a process the engine started is gone (exited,
  zombie): a TP worker's death counts too;
- stalled: a `step()` (or a weight load) that has blocked for longer than
  rollout.engine_stall_s (no output while requests are unfinished; set it well above the
  longest single engine step and weight load).

Either way it kills every process the engine started (SIGKILL, which also ends a stopped
process) and wakes the blocked call with vLLM's `EngineDeadError`, so the generator's loop gets
an exception instead of waiting forever; the generator then recovers (rollout/recovery.py).
`RestartBudget` bounds the restarts: more than rollout.engine_restarts within
rollout.engine_restart_window_s ends the job with one line naming the generator and the causes.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque

log = logging.getLogger(__name__)


class EngineRestartsError(RuntimeError):
    """An engine that cannot stay up: more faults than rollout.engine_restarts allows, or a fault
    the rank cannot recover from (under weights.mode disk, no published copy of its weights)."""


def engine_dead_error() -> Exception:
    from vllm.v1.engine.exceptions import EngineDeadError
    return EngineDeadError()


def is_engine_dead(exc: BaseException) -> bool:
    from vllm.v1.engine.exceptions import EngineDeadError
    return isinstance(exc, EngineDeadError)


def engine_procs(engine) -> list:
    """The processes a VLLMEngine started, with their children (TP workers) as they are now."""
    import psutil
    procs = list(getattr(engine, "_children", []))
    for p in list(procs):
        with contextlib.suppress(psutil.Error):
            procs += p.children(recursive=True)
    return procs


def _gone(p) -> bool:
    import psutil
    try:
        return not p.is_running() or p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return True


def _cmd(p) -> str:
    import psutil
    try:
        return " ".join(" ".join(p.cmdline()).split())[:60] or p.name()    # titles are padded
    except psutil.Error:
        return "?"


def shm_segments(procs) -> set[str]:
    """The /dev/shm files `procs` map: vLLM's shared-memory queues between an EngineCore and
    its TP workers. A killed process cannot remove them (chaos: 50 left by 18 killed engines)."""
    import psutil
    found = set()
    for p in procs:
        with contextlib.suppress(psutil.Error, OSError):
            found.update(m.path for m in p.memory_maps() if m.path.startswith("/dev/shm/"))
    return found


def kill_engine(engine, segments=()) -> int:
    """SIGKILL every process `engine` started (a stopped one too), remove the shared-memory
    files they mapped (now, and `segments`: read while they were all alive), then let vLLM close
    its client; returns how many were killed. Never blocks on the engine."""
    import os

    import psutil
    procs = [p for p in engine_procs(engine) if not _gone(p)]
    # not what this process maps too (shared with the engine, not the engine's own)
    segments = (set(segments) | shm_segments(procs)) - shm_segments([psutil.Process()])
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)
    for path in segments:
        with contextlib.suppress(OSError):
            os.unlink(path)
    engine._closed = True               # its shutdown() would wait on what is gone
    with contextlib.suppress(Exception):
        engine._engine.engine_core.shutdown(timeout=5)
    return len(procs)


class EngineWatch:
    """A thread that watches one engine (see the module's doc). `busy()` around a call that
    blocks until the engine produces output (`step`); `cause` says why it fired (None: it has
    not). `close()` before the engine is replaced."""

    def __init__(self, engine, stall_s: float, poll_s: float = 0.5):
        self.engine, self.stall_s, self.poll_s = engine, stall_s, poll_s
        self.cause: str | None = None
        self._procs = engine_procs(engine)
        self._names = {p.pid: _cmd(p) for p in self._procs}     # read while they are alive
        self.segments = shm_segments(self._procs)
        self._busy_since: float | None = None
        self._bound = stall_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watch", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def busy(self, stall_s: float | None = None):
        """Around a call that waits on the engine; `stall_s`: this call's own bound, where it is
        longer than a step's (a weight receive, which its collective's timeout bounds first)."""
        self._busy_since, self._bound = time.monotonic(), stall_s or self.stall_s
        try:
            yield
        finally:
            self._busy_since = None

    def check(self, now: float | None = None) -> str | None:
        """The engine's fault now, if any (dead, or a step blocked past the bound)."""
        core = getattr(getattr(self.engine, "_engine", None), "engine_core", None)
        resources = getattr(core, "resources", None)
        gone = [p for p in self._procs if _gone(p)]
        if gone:        # not reaped here: vLLM's own monitor waits on its EngineCore
            return f"engine process {gone[0].pid} ({self._names[gone[0].pid]}) is gone"
        if resources is not None and getattr(resources, "engine_dead", False):
            return "vLLM marked its engine dead"
        since, bound = self._busy_since, self._bound
        now = time.monotonic() if now is None else now
        if since is not None and now - since > bound:
            return (f"engine stalled: no output for {now - since:.1f} s with requests unfinished "
                    f"(rollout.engine_stall_s = {self.stall_s:g}"
                    + ("" if bound == self.stall_s else f"; this call's bound {bound:g} s") + ")")
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            cause = self.check()
            if cause is not None:
                self.fire(cause)
                return

    def fire(self, cause: str) -> None:
        """End the engine and wake whatever call waits on it."""
        if self.cause is not None:
            return
        self.cause = cause
        log.warning("vLLM engine fault: %s; killing its processes", cause)
        kill_engine(self.engine, self.segments)
        core = getattr(getattr(self.engine, "_engine", None), "engine_core", None)
        queue = getattr(core, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(engine_dead_error())       # wakes a blocked step()
        for fut in list(getattr(core, "utility_results", {}).values()):
            if not fut.done():                          # a blocked collective_rpc
                with contextlib.suppress(Exception):
                    fut.set_exception(engine_dead_error())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


class RestartBudget:
    """At most `limit` restarts within any `window_s` seconds; the causes are kept for the line
    that ends the job."""

    def __init__(self, limit: int, window_s: float, who: str):
        self.limit, self.window_s, self.who = limit, window_s, who
        self.history: deque[tuple[float, str]] = deque()
        self.total = 0

    def record(self, cause: str, now: float | None = None) -> None:
        """One fault; raises `EngineRestartsError` when restarting would exceed the bound."""
        now = time.monotonic() if now is None else now
        self.history.append((now, cause))
        while self.history and now - self.history[0][0] > self.window_s:
            self.history.popleft()
        if len(self.history) > self.limit:
            causes = "; ".join(f"{c} ({now - t:.0f} s ago)" for t, c in self.history)
            raise EngineRestartsError(
                f"{self.who}: its vLLM engine failed {len(self.history)} time(s) within "
                f"{self.window_s:g} s, more than rollout.engine_restarts = {self.limit} allows "
                f"(rollout.engine_restart_window_s): {causes}; the job ends")
        self.total += 1
