"""A generator's time accounting (generators.json "seconds" and "engine_s"), pure: the clock is
injected (`now`), so the rules are tested without an engine, MPI or real time.

The span runs from the first training prompt until the run's last batch is taken (STEPS_DONE;
else the stop): what follows (the last step, the final evaluation, the trainer saving the
policy) is not the generator's time to account for. Within it, every second goes to one bucket:
generating (busy), paused for weight updates, evaluating, idle with nothing to generate (η bound
reached) or idle while the reward pool still scores finished samples (idle_scoring), and the
loop's own work (LOOP_WORK: submit, send, other; "other" is what no other bucket holds, filled
in when the span ends), so that the buckets add up to the span.

The engine's occupancy (`engine_s`): vLLM's EngineCore generates in its own process while the
loop does anything else (messages, submitting, scores), so the loop's "busy" bucket understates
how long the engine had work. `tick(busy)` is called as the loop turns and after each message:
the time since the last tick counts if the engine had training work then, and whether it has
work from now on is `busy`. Outside an evaluation the engine holds only training requests, and
its state changes only in the loop's calls (submit, step, abort, load), each followed by a
tick: exact to one loop turn. Weight loads and evaluations are ticked with count=False.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

BUCKETS = ("busy", "pause", "eval", "idle", "idle_scoring", "submit", "send", "other")


class GenClock:
    def __init__(self, now: Callable[[], float] = time.monotonic):
        self.now = now
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.engine_s = 0.0
        self.started = False
        self.t_started = 0.0
        self.t_ended: float | None = None
        self._occupied_since: float | None = None

    @property
    def in_span(self) -> bool:
        return self.started and self.t_ended is None

    def start(self) -> None:
        """The first training prompt arrived (later calls change nothing)."""
        if not self.started:
            self.started, self.t_started = True, self.now()

    def end(self) -> None:
        """The span ends (at STEPS_DONE, or the stop; once): "other" takes what of it no other
        bucket holds."""
        if self.in_span:
            self.t_ended = self.now()
            timed = sum(v for k, v in self.seconds.items() if k != "other")
            self.seconds["other"] = max(0.0, self.t_ended - self.t_started - timed)

    def count(self, what: str, seconds: float) -> None:
        """Into bucket `what`, within the span."""
        if self.in_span:
            self.seconds[what] += seconds

    @contextmanager
    def timed(self, what: str):
        t0 = self.now()
        yield
        self.count(what, self.now() - t0)

    def tick(self, busy: bool, count: bool = True) -> None:
        """The occupancy clock (module docstring): `busy` = the engine has training work now."""
        now = self.now()
        if count and self._occupied_since is not None and self.in_span:
            self.engine_s += now - self._occupied_since
        self._occupied_since = now if busy else None
