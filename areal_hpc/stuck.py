"""A rank alive but stuck: named, its stacks and every other rank's in the attempt's log, and the
attempt ended for a requeue.

A rank that hangs (a collective that never completes on NCCL, a wedged engine call, a deadlock)
still answers the beacon and its peers' liveness checks: its threads other than the stuck one run.
The peers then wait until their own bounds, or the job's time limit for waits bounded by trainer
rank 0's liveness, and their errors cannot say which rank is missing (an MPI collective does not
tell who arrived). So each rank's main thread reports progress, and a thread of the rank watches
it:

- **progress**: `progress()` from the main thread's loops (the generator's loop, each
  micro-batch and step of the trainer) and from every polling wait on another rank
  (`transport/mpi.py`'s bounded collectives, the controller's wait for rollouts): a rank that
  waits on a peer is not the stuck one; the peer is. Calls from other threads do not count.
- **a known long call**: `with expect(seconds, what)` around a call that may run long without
  progress under a bound of its own (joining the weight group, receiving an update, starting an
  engine, a checkpoint): the watch gives it that long, then its own bound again.
- **stuck**: no progress for `rollout.progress_timeout_s` (and past any `expect`): the watch
  writes the flag file (`AREAL_STUCK_FLAG`, the batch script's attempt directory, else
  ``<run_dir>/logs/stuck``) naming the rank, logs one line naming it (role, host, pid, what it
  last did and when), dumps the stacks of all its threads into the rank's output (the attempt's
  log), waits two polls so that every other rank, seeing the flag, dumps its own stacks under a
  line naming the stuck rank, and exits with EXIT_STUCK. The batch script requeues an attempt
  that left the flag (slurm/job.sh), as after a preemption.
- **a thread the rank needs, dead**: `thread_failed(main, line, code)` from that thread (the
  beacon's, transport/beacon.py): the main thread ends the rank at its next `progress()`
  (`end_rank`: the line logged, the output flushed, exit `code`; no flag, no requeue).
- **a stuck interpreter**: a thread that holds the GIL (a C call that never releases it) stops
  the watch thread too; `faulthandler.dump_traceback_later` (a C thread) then dumps the stacks
  and exits at the bound plus a minute.
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

EXIT_STUCK = 4                  # a rank made no progress within rollout.progress_timeout_s
FLAG_ENV = "AREAL_STUCK_FLAG"   # the flag file's path (the batch script's attempt directory)
C_MARGIN_S = 60.0               # the C-level fallback fires this long after the Python watch
KEY = "rollout.progress_timeout_s"

_watch: ProgressWatch | None = None
_config: tuple | None = None
_failed: tuple[int, str, int] | None = None     # a dead thread's (main thread ident, line, code)


def flag_path(run_dir) -> Path:
    return Path(os.environ.get(FLAG_ENV) or Path(run_dir) / "logs" / "stuck")


def progress(what: str | None = None) -> None:
    """The main thread made progress (`what`: a short label of what it did, optional). Where a
    thread the rank needs has failed (`thread_failed`), the main thread ends the rank here."""
    f = _failed
    if f is not None and threading.get_ident() == f[0]:
        end_rank(f[1], f[2])
    w = _watch
    if w is not None and threading.get_ident() == w.main:
        w.last = time.monotonic()
        if what is not None:
            w.what = what
        if w.last - w.armed_c > w.rearm_s:
            w.arm_c()


@contextlib.contextmanager
def expect(seconds: float, what: str):
    """The main thread enters a call that may run `seconds` without progress (a bound of its
    own): not stuck until that long plus the watch's bound has passed."""
    w = _watch
    if w is None or threading.get_ident() != w.main:
        yield
        return
    before = w.grace
    w.grace = (time.monotonic() + seconds, what)
    w.arm_c(extra=seconds)
    try:
        yield
    finally:
        w.grace = before
        progress(f"{what}: done")


def thread_failed(main: int, line: str, code: int) -> None:
    """A thread this rank needs has failed (`line` names the rank and the cause): the thread
    `main` (an ident: the rank's main thread) ends the rank at its next `progress()`, exit
    `code`. The first failure is kept."""
    global _failed
    if _failed is None:
        _failed = (main, line, code)


def end_rank(line: str, code: int) -> None:
    """End this rank now, from any thread: `line` logged, the output flushed, `os._exit(code)`
    (no MPI_Finalize: the launcher ends the other ranks and reports the job failed)."""
    log.error(line)
    _flush()
    os._exit(code)


def configure(bound_s: float, rank: int, role: str, host: str, flag: Path) -> None:
    """What `arm` starts (areal_hpc.main, once the rank knows its place). Trainer rank 0 removes
    a flag an earlier attempt left (before its loop, so before any rank can be stuck in one)."""
    global _config
    _config = (bound_s, rank, role, host, Path(flag))
    if rank == 0:
        Path(flag).unlink(missing_ok=True)


def arm() -> None:
    """Start the configured watch from the calling (main) thread: the trainer's and the
    generator's loops call it as they begin. Nothing when unconfigured or off."""
    if _config is not None and _config[0] and _watch is None:
        start(*_config)


def start(bound_s: float, rank: int, role: str, host: str, flag: Path,
          poll_s: float | None = None) -> ProgressWatch | None:
    """The rank's watch, from the calling (main) thread; None when `bound_s` is 0 (off)."""
    global _watch
    if not bound_s:
        return None
    if _watch is not None:
        _watch.close()
    _watch = ProgressWatch(bound_s, rank, role, host, flag, poll_s)
    return _watch


def stop() -> None:
    """The watch stopped (if any) and the configuration (and a `thread_failed`) forgotten."""
    global _watch, _config, _failed
    w, _watch, _config, _failed = _watch, None, None, None
    if w is not None:
        w.close()


class ProgressWatch:
    def __init__(self, bound_s: float, rank: int, role: str, host: str, flag: Path,
                 poll_s: float | None = None):
        self.bound_s, self.rank, self.role, self.host = float(bound_s), rank, role, host
        self.flag = Path(flag)
        self.poll_s = poll_s if poll_s is not None else min(5.0, self.bound_s / 10)
        self.main = threading.get_ident()
        self.last = time.monotonic()
        self.started = time.time()          # a flag older than this is an earlier attempt's
        self.what = "start"
        self.grace: tuple[float, str] | None = None
        self.rearm_s = min(60.0, self.bound_s / 4)
        self.armed_c = 0.0
        self.peer_dumped = False
        self._stop = threading.Event()
        self.arm_c()
        self._thread = threading.Thread(target=self._run, name="areal-progress-watch", daemon=True)
        self._thread.start()

    def name(self) -> str:
        return f"rank {self.rank} ({self.role}, host {self.host}, pid {os.getpid()})"

    def arm_c(self, extra: float = 0.0) -> None:
        """(Re-)arm the C-level fallback: it runs even when this thread cannot."""
        self.armed_c = time.monotonic()
        faulthandler.dump_traceback_later(self.bound_s + extra + C_MARGIN_S, exit=True,
                                          file=sys.stderr)

    def close(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 1)

    def overdue(self, now: float) -> float | None:
        """Seconds without progress when past the bound (and past any `expect`), else None."""
        idle = now - self.last
        if idle <= self.bound_s:
            return None
        if self.grace is not None and now <= self.grace[0] + self.bound_s:
            return None
        return idle

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            if not self.peer_dumped and self._flag_is_new():
                self._dump_for_peer()
            idle = self.overdue(now)
            if idle is not None:
                self._fire(idle, now)
                return

    def _flag_is_new(self) -> bool:
        try:
            return self.flag.stat().st_mtime >= self.started - 1.0
        except OSError:
            return False

    def _dump_for_peer(self) -> None:
        self.peer_dumped = True
        try:
            who = self.flag.read_text(errors="replace").splitlines()[0]
        except (OSError, IndexError):
            who = "another rank"
        log.error("%s; the stacks of %s's threads follow", who, self.name())
        _dump()

    def _fire(self, idle: float, now: float) -> None:
        doing = self.what if self.grace is None else f"{self.grace[1]} (expected to end " \
            f"{now - self.grace[0]:.0f} s ago)"
        line = (f"{self.name()} made no progress for {idle:.0f} s ({KEY} = {self.bound_s:g}; "
                f"last: {doing}): it is stuck")
        try:
            self.flag.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.flag, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(line + "\n")
        except FileExistsError:
            self.peer_dumped = True      # another rank named itself first: this one is stuck too
        except OSError as exc:
            log.error("cannot write the stuck flag %s: %s", self.flag, exc)
        log.error("%s; the stacks of its threads follow, then every other rank's; ending the "
                  "attempt (exit %d) for a requeue", line, EXIT_STUCK)
        _dump()
        time.sleep(2 * self.poll_s + 1)          # the other ranks see the flag and dump theirs
        os._exit(EXIT_STUCK)


def _flush() -> None:
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    sys.stdout.flush()
    sys.stderr.flush()


def _dump() -> None:
    _flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
