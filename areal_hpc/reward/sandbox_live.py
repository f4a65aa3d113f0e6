"""A long-running program in the code sandbox: the Python tool's interpreter (env/interpreter.py),
which lives for a whole episode and answers many cells, where ``Sandbox.run`` runs one program
to its end.

The containment is ``run``'s, built by the same code (``Sandbox.spawn``: reward/sandbox.py's
module doc): bubblewrap with its own PID, network, IPC and UTS namespaces, an unprivileged uid,
the seccomp filter, a read-only file system with a sized scratch tmpfs, a cleared environment,
and the bootstrap's limits on processes, address space, CPU time, file sizes and open files;
where the host allows it, a memory cgroup of its own. What differs, because the program lives on:

- I/O: stdin and stdout are pipes, and the program is hostile: it may stop reading, write
  garbage, close its ends, or leave a child holding them. So the parent's ends are non-blocking
  and ``read``/``write`` take a deadline: the caller never waits past it, and an ended program
  reads as ``b""``. stderr is an unlinked file (as in ``run``; bounded by ``RLIMIT_FSIZE``) that
  the parent reads back whenever it likes, after a kill too (``stderr_fd``), and where a failed
  set-up says why;
- bounds: there is no wall clock per program (the caller bounds each exchange with its
  deadlines) but a lifetime (``lifetime_s``, which also sets ``RLIMIT_CPU``), and a watchdog
  thread kills the sandbox past it or past ``memory_mb`` (the cgroup's OOM kill, or the summed
  memory of its processes, as ``run`` checks it), whether or not the caller is waiting on it;
  ``ended`` then says why ("lifetime", "memory");
- the end: ``kill`` (the caller's, or the watchdog's) kills the sandbox's pid 1 through a pidfd
  and waits until the whole PID namespace is gone, as ``run`` does at its end; ``close`` kills,
  then releases the pipes, the file and the cgroup. bwrap's ``--die-with-parent`` fires when the
  thread that started the sandbox exits: start it from a thread that outlives it (the
  environment's process has one).

Privileged mode runs every sandbox of a process as one uid (reward/sandbox.py), so sandboxes
alive at once in one process share its ``RLIMIT_NPROC``: an environment's process serves one
episode, hence one live interpreter, at a time.
"""
from __future__ import annotations

import os
import select
import subprocess
import tempfile
import threading
import time

from . import contain
from .sandbox import (KILL_GRACE_S, MAX_ERROR_CHARS, MEMORY_POLL_S, START_TIMEOUT_S, Sandbox,
                      child_pids, end_namespace, kill_sandbox, last_line, total_memory,
                      wait_started)


class LiveSandbox:
    """``LiveSandbox(program, lifetime_s=, memory_mb=)`` starts ``program`` (Python source) in a
    fresh sandbox and returns once it runs (or ``sandbox_error`` says why not; it never raises
    for that). ``write``/``read`` talk to it within deadlines, ``kill`` ends it, ``close``
    releases it; a context manager closes."""

    def __init__(self, program: str | bytes, lifetime_s: float = 300.0, memory_mb: int = 512,
                 sandbox: Sandbox | None = None):
        if isinstance(program, str):
            program = program.encode("utf-8", "surrogateescape")
        self.lifetime_s, self.memory_mb = lifetime_s, memory_mb
        self.sandbox_error: str | None = None
        self.ended: str | None = None          # why it was killed: "lifetime", "memory", ...
        self.proc: subprocess.Popen | None = None
        self.stdin = self.stdout = self._ns_fd = None
        self._stderr = None
        self._group = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._closed = False
        self.born = time.monotonic()
        ok, reason = Sandbox.available()       # (checked once per process)
        if not ok:
            self.sandbox_error = f"sandbox unavailable: {reason}"
            return
        sandbox = sandbox or Sandbox()
        status_r = None
        try:
            self._group = contain.MemoryGroup(memory_mb << 20)
            self._stderr = tempfile.TemporaryFile(dir=sandbox.tmp_dir)
            in_r, self.stdin = os.pipe()
            try:
                self.stdout, out_w = os.pipe()
                try:   # RLIMIT_CPU from the lifetime: a process's CPU time over its whole life
                    self.proc, status_r = sandbox.spawn(program, in_r, out_w, self._stderr,
                                                        lifetime_s, memory_mb, self._group)
                finally:
                    os.close(out_w)
            finally:
                os.close(in_r)
            os.set_blocking(self.stdin, False)
            os.set_blocking(self.stdout, False)
            state = wait_started(self.proc, status_r, START_TIMEOUT_S)
            if state != "ok":
                self._fail(state)
                return
            self._ns_fd = next(map(contain.pidfd, child_pids(self.proc.pid)), None)
            self.born = time.monotonic()       # the lifetime counts from the program's start
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name="sandbox-watchdog")
            self._watchdog.start()
        except Exception as e:   # no scratch directory, no fds, no processes left...
            self.sandbox_error = f"sandbox error: {type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
            self.kill()
        finally:
            if status_r is not None:
                os.close(status_r)

    def _fail(self, state: str) -> None:
        """Set-up failed (``state``: "ended" or "slow"): say why, as ``run`` does."""
        self.kill()
        if state == "slow":
            why = f"not set up within {START_TIMEOUT_S:g} s"
        else:
            why = last_line(self.read_stderr(1 << 20)) or f"bwrap exit code {self.proc.returncode}"
        self.sandbox_error = f"sandbox failed: {why}"[:MAX_ERROR_CHARS]

    @property
    def pid(self) -> int | None:
        """bwrap's pid on this host (the sandbox's processes are its descendants)."""
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return (self.sandbox_error is None and self.ended is None and self.proc is not None
                and self.proc.poll() is None)

    def returncode(self) -> int | None:
        """The program's exit code once it has ended (-N: killed by signal N), else None."""
        code = None if self.proc is None else self.proc.poll()
        return -(code - 128) if code is not None and code > 128 else code

    def over_memory(self) -> bool:
        return self.ended == "memory" or (self._group is not None and self._group.oom_killed())

    def write(self, data: bytes, deadline: float) -> None:
        """All of ``data`` to the program's stdin. TimeoutError at ``deadline`` (monotonic);
        BrokenPipeError once the program can no longer read it."""
        view = memoryview(data)
        while view:
            if not self._wait(self.stdin, select.POLLOUT, deadline):
                raise BrokenPipeError("the sandbox has ended")
            try:
                view = view[os.write(self.stdin, view):]
            except BlockingIOError:
                continue

    def read(self, limit: int, deadline: float) -> bytes:
        """Up to ``limit`` bytes of the program's stdout as soon as there are any; ``b""`` once
        it has ended (EOF, exited, killed) and nothing is left; TimeoutError at ``deadline``."""
        while True:
            ready = self._wait(self.stdout, select.POLLIN, deadline)
            try:
                return os.read(self.stdout, limit)
            except BlockingIOError:
                if not ready:       # ended: nothing buffered, maybe a child still holds the pipe
                    return b""

    def _wait(self, fd: int, event: int, deadline: float) -> bool:
        """True once ``fd`` is ready for ``event``; False if the sandbox has ended meanwhile."""
        poll = select.poll()
        poll.register(fd, event)
        while True:
            if self.proc is None or self.proc.poll() is not None or self.ended is not None:
                return bool(poll.poll(0))
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            if poll.poll(max(1, int(min(left, MEMORY_POLL_S) * 1000))):
                return True

    def read_stderr(self, limit: int) -> bytes:
        """The first ``limit`` bytes of the program's stderr file (readable after a kill too)."""
        return b"" if self._stderr is None else os.pread(self._stderr.fileno(), limit, 0)

    @property
    def stderr_fd(self) -> int | None:
        return None if self._stderr is None else self._stderr.fileno()

    def _watch(self) -> None:
        """Kill the sandbox past its lifetime or its memory, waiting or not; see the module doc."""
        import psutil

        while not self._stop.wait(MEMORY_POLL_S):
            if self.proc.poll() is not None:
                return
            why = None
            if self._group.oom_killed():
                why = "memory"
            elif time.monotonic() - self.born > self.lifetime_s:
                why = "lifetime"
            else:
                try:
                    tree = psutil.Process(self.proc.pid).children(recursive=True)
                except psutil.Error:
                    continue
                limit = self.memory_mb << 20
                if total_memory(tree, "rss") > limit and total_memory(tree, "pss") > limit:
                    why = "memory"
            if why is not None:
                self.kill(why)
                return

    def kill(self, why: str = "killed") -> None:
        """End the sandbox and everything in it; returns once they are gone (bounded).
        ``ended`` keeps the first reason given."""
        with self._lock:
            if self.ended is None:
                self.ended = why
            if self.proc is None or self._closed:
                return
            end_namespace(self._ns_fd)              # pid 1 through its pidfd: the whole namespace
            kill_sandbox(self.proc)       # bwrap, should it still be there
            try:
                self.proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Kill, then release the pipes, the stderr file and the cgroup (a second close does
        nothing)."""
        self._stop.set()
        self.kill("closed")
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self.stdin, self.stdout, self._ns_fd):
                if fd is not None:
                    os.close(fd)
            self.stdin = self.stdout = self._ns_fd = None
            if self._stderr is not None:
                self._stderr.close()
                self._stderr = None
            if self._group is not None:
                self._group.remove()

    def __enter__(self) -> LiveSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
