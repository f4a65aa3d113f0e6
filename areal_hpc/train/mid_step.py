"""Rank 0's judgement during a step that a preemption signal caught: stop it now (its start
state is restored, its batch goes back to the buffer, a checkpoint is written) or let it finish?
`MidStepJudge` holds what it knows of the time things take in this attempt, and decides with
`preemption.mid_step_verdict`. Pure: its clock and the job's end are injected, no I/O, no MPI
(the collective part is `Trainer._should_stop`)."""
from __future__ import annotations

import logging
import time
from typing import Callable

from ..preemption import MID_STEP_MARGIN_S, mid_step_verdict

log = logging.getLogger(__name__)


class MidStepJudge:
    """`job_end(signal_at)` gives (the job's end as a clock time, where from) or (None, ""),
    asked once; `clock` is that clock (time.time)."""

    def __init__(self, job_end: Callable[[float], tuple[float | None, str]],
                 clock: Callable[[], float] = time.time):
        self._job_end_of, self._clock = job_end, clock
        self._job_end: tuple[float | None, str] | None = None
        self.checkpoint_s = 0.0         # the last checkpoint written, else the resume's load
        self.last_step_s: float | None = None   # the last step's training time
        self.last_publish_s = 0.0       # the last weight update
        self.why = ""                   # why the step was stopped midway
        self._told = -1                 # the step whose going on was logged

    def stop(self, version: int, signal_at: float, done: int, total: int, minibatch_s: float) -> bool:
        """Stop step `version` now? A signal came at `signal_at`; `done` of `total` minibatches
        took `minibatch_s`. The rest of the step: the minibatches left at the mean time of those
        done (before any: the last step's time, unknown in an attempt's first step) plus the last
        weight update."""
        if self._job_end is None:
            self._job_end = self._job_end_of(signal_at)
        end, src = self._job_end
        rest = minibatch_s / done * (total - done) if done else self.last_step_s
        if rest is not None:
            rest += self.last_publish_s
        now = self._clock()
        stop, left = mid_step_verdict(pending=True, now=now, job_end=end, rest_s=rest,
                                      checkpoint_s=self.checkpoint_s)
        if stop:
            self.why = (f"a preemption signal came {now - signal_at:.0f} s ago and the rest of "
                        f"the step needs ~{rest:.0f} s, but {left:.0f} s are left before the "
                        f"job's end ({src}) less the checkpoint ({self.checkpoint_s:.0f} s) and "
                        f"a {MID_STEP_MARGIN_S:.0f} s margin")
        elif self._told != version:     # once a step: why it goes on
            self._told = version
            log.info("preemption signal pending during step %d: the step goes on (%s); the stop "
                     "comes at its end", version,
                     "the job's end is unknown" if end is None else
                     "its time is not known yet" if rest is None else
                     f"~{rest:.0f} s needed, {left:.0f} s left")
        return stop
