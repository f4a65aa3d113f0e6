"""Preemption signals: remember that one arrived (and when); the trainer acts on it at the next
step boundary, or midway through a step that cannot finish in time (`mid_step_verdict`).

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
import os
import signal
import time

from . import slurm_job

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 3          # areal_hpc.main's exit code after a preemption checkpoint

# A plain flag: a handler must not take locks (threading.Event.set does), or a second signal
# arriving while the first handler holds the lock deadlocks the process.
_requested = False
_requested_at: float | None = None     # time.time() of the first signal (or request)
_signals: list[int] = []
_STARTED = time.time()                  # about when this attempt began (checkpoint.time_limit_s)


def _number(name: str) -> int:
    return int(getattr(signal, f"SIG{name}"))


def _handler(signum, frame) -> None:
    global _requested, _requested_at
    if not _requested:
        _requested_at = time.time()
        # Logging from a handler can deadlock on the logging lock; a flag and os.write are safe.
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


def requested_at() -> float | None:
    """time.time() when the first signal (or `request`) came; None when none has."""
    return _requested_at if _requested else None


def request(at: float | None = None) -> None:
    """Ask for a stop as a signal would (tests, or a controller deciding to stop); `at`: when the
    signal came (default now)."""
    global _requested, _requested_at
    if not _requested or at is not None:
        _requested_at = time.time() if at is None else at
    _requested = True


def reset() -> None:
    global _requested, _requested_at
    _requested, _requested_at = False, None


# -- stopping mid-step -----------------------------------------------------------------------------
# Seconds kept free before the job's end beyond the checkpoint's own time: stopping the
# generators (their in-flight work into the buffer), writing the rollout log, exiting.
MID_STEP_MARGIN_S = 60.0

# Test hook, read here only: "STEP:K" raises the preemption flag on trainer rank 0 once K
# minibatches of training step STEP have run (tests/e2e/test_mid_step_stop.py).
TEST_HOOK_ENV = "AREAL_TEST_PREEMPT_MID_STEP"


def test_hook() -> tuple[int, int] | None:
    """(step, minibatches) of the `TEST_HOOK_ENV` test hook, or None."""
    value = os.environ.get(TEST_HOOK_ENV, "")
    if not value:
        return None
    step, k = value.split(":")
    return int(step), int(k)


# Test hook, read here only: "VERSION:TOKENS:PATH" holds a generator rank once it has the weights
# of VERSION (or a later version, where none of its samples had tokens in between) and a sample
# has TOKENS tokens: it writes PATH and generates nothing
# more until the controller stops it (tests/e2e/test_repeat.py then sends the preemption signal:
# a preemption that finds a sample mid-generation every time, whatever else the box runs). It
# holds once: with PATH written, a later attempt (a requeued Slurm job keeps its environment)
# runs free.
HOLD_HOOK_ENV = "AREAL_TEST_HOLD_MID_GENERATION"


def hold_hook() -> tuple[int, int, str] | None:
    """(version, tokens, path) of the `HOLD_HOOK_ENV` test hook, or None (unset, or spent)."""
    value = os.environ.get(HOLD_HOOK_ENV, "")
    if not value:
        return None
    version, tokens, path = value.split(":", 2)
    return None if os.path.exists(path) else (int(version), int(tokens), path)


def job_end(cfg, signal_at: float | None, env=None) -> tuple[float | None, str]:
    """(the job's end as time.time(), where from), or (None, "") when unknown: the earliest of
    SLURM_JOB_END_TIME, the attempt's start (SLURM_JOB_START_TIME, else this process's) +
    checkpoint.time_limit_s, and the signal's time + its lead (checkpoint.signal_lead_s, else the
    batch script's --signal: `slurm_job.job_clock`)."""
    env = os.environ if env is None else env
    ck = cfg.checkpoint
    found = []
    end = env.get("SLURM_JOB_END_TIME", "")
    if end.isdigit():
        found.append((float(end), "SLURM_JOB_END_TIME"))
    if ck.time_limit_s > 0:
        start = env.get("SLURM_JOB_START_TIME", "")
        found.append(((float(start) if start.isdigit() else _STARTED) + ck.time_limit_s,
                      "checkpoint.time_limit_s"))
    if signal_at is not None:
        lead, src = ck.signal_lead_s, "checkpoint.signal_lead_s"
        if lead <= 0 and env.get("SLURM_JOB_ID"):
            _, _, lead, src = slurm_job.job_clock(cfg, env)
        if lead and lead > 0:
            found.append((signal_at + lead, f"the signal + {src}"))
    return min(found) if found else (None, "")


def mid_step_verdict(*, pending: bool, now: float, job_end: float | None, rest_s: float | None,
                     checkpoint_s: float, margin_s: float = MID_STEP_MARGIN_S
                     ) -> tuple[bool, float | None]:
    """(stop the step now, seconds left for the rest of it): stop when a preemption signal is
    pending and the rest of the step (`rest_s`) is not expected to end before the job's end less
    the checkpoint's time and a margin. The job's end or the rest unknown: finish the step (the
    stop comes at its boundary, as without mid-step stops)."""
    if not pending or job_end is None or rest_s is None:
        return False, None
    left = job_end - now - checkpoint_s - margin_s
    return rest_s > left, left
