"""Preemption signals: remember that one arrived; the trainer acts on it at the next step boundary.

Slurm announces the end of an allocation with a signal (`--signal=B:USR1@<seconds>` forwarded by
the batch script, SIGTERM at cancel or requeue). A handler only sets a flag; trainer rank 0 looks
at it between steps (and while waiting for rollouts), and then every rank checkpoints and exits with
`EXIT_PREEMPTED`, which the batch script turns into a requeue.

Child processes (vLLM engines, reward workers, checkpoint writers) must not die from USR1 (its
default action) while the job checkpoints: start them inside `shield_children()`.
"""
from __future__ import annotations

import contextlib
import logging
import signal

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 3          # areal_hpc.main's exit code after a preemption checkpoint

# A plain flag: a handler must not take locks (threading.Event.set does), or a second signal
# arriving while the first handler holds the lock deadlocks the process.
_requested = False
_signals: list[int] = []


def _number(name: str) -> int:
    return int(getattr(signal, f"SIG{name}"))


def _handler(signum, frame) -> None:
    global _requested
    if not _requested:
        # Logging from a handler can deadlock on the logging lock; a flag and os.write are safe.
        import os
        os.write(2, f"[areal_hpc] signal {signal.Signals(signum).name}: checkpoint and stop at "
                    f"the next step boundary\n".encode())
    _requested = True


def install(names) -> None:
    """Handle these signals (names without SIG, e.g. ["USR1", "TERM"]) by setting the flag."""
    _signals[:] = [_number(n) for n in names]
    for num in _signals:
        signal.signal(num, _handler)


# Signals a child process must outlive: it keeps them blocked for good (blocked signals stay
# blocked across fork and exec). SIGTERM is left alone: stopping engines relies on it, and Slurm
# follows it with SIGKILL anyway.
_SHIELDED = ("USR1", "USR2")


@contextlib.contextmanager
def shield_children(term: bool = False):
    """Start child processes inside this block: they never act on USR1/USR2 (they stay pending),
    while this process receives them as soon as the block ends (nothing is lost). With `term`,
    SIGTERM too: for the checkpoint writers, which a preemption's TERM to every process of the
    job (Slurm's preemption, `scontrol requeue`) must not kill before the checkpoint it asks for
    is written; SIGKILL still ends them at the end of the grace period."""
    if term:
        # multiprocessing starts its resource tracker at the first spawn and then unblocks
        # SIGINT and SIGTERM in this process (CPython bpo-33613): have it running first.
        from multiprocessing import resource_tracker
        resource_tracker.ensure_running()
    nums = {_number(n) for n in _SHIELDED + (("TERM",) if term else ())}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, nums)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def requested() -> bool:
    return _requested


def request() -> None:
    """Ask for a stop as a signal would (tests, or a controller deciding to stop)."""
    global _requested
    _requested = True


def reset() -> None:
    global _requested
    _requested = False
