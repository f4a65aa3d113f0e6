"""Liveness both ways, and the controller's service thread: small objects with no MPI in them.

    controller                                   generator
    GeneratorWatch: each generator heard from    ControllerWatch: the controller heard from
      within rollout.generator_timeout_s (before   within rollout.generator_timeout_s (before
      its first report: weights.join_timeout_s),   its first message: weights.join_timeout_s);
      no message arriving for longer                a weight broadcast that stops arriving
      → GeneratorLostError naming each one          → ControllerLostError: this rank ends
    Pacer: its ControllerBeat at most every       (its Heartbeat at most every heartbeat_s,
      rollout.heartbeat_s                           by a Pacer too)

Every check takes `now` (monotonic seconds), so that tests drive the clock.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable

from ..topology import CONTROLLER_RANK

log = logging.getLogger(__name__)


class GeneratorLostError(RuntimeError):
    """A generator stopped reporting while the trainer waits on rollouts."""


class ControllerLostError(RuntimeError):
    """The controller (trainer rank 0) fell silent: the trainer is gone or hung; this rank ends."""


class Pacer:
    """`due(now)` is true at most once every `interval_s`."""

    def __init__(self, interval_s: float):
        self.interval_s, self._last = interval_s, None

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self._last is not None and now - self._last < self.interval_s:
            return False
        self._last = now
        return True


class GeneratorWatch:
    """The controller's view of its generators' liveness.

    Args:
        rollout, weights: the run's config sections (generator_timeout_s, join_timeout_s).
        hosts: every world rank's host name; generators: the generator ranks.
        t_start: when the job started (monotonic), for the allowance before a first report.
    """

    def __init__(self, rollout, weights, generators: Iterable[int], hosts: list[str],
                 t_start: float | None = None):
        self.rollout, self.weights = rollout, weights
        self.generators, self.hosts = list(generators), hosts
        self.t_start = time.monotonic() if t_start is None else t_start
        self.last_heard: dict[int, float] = {}      # generator rank → monotonic time
        self.last_report: dict = {}                 # generator rank → its newest Heartbeat

    def heard(self, rank: int, now: float | None = None) -> None:
        self.last_heard[rank] = time.monotonic() if now is None else now

    def report(self, rank: int, heartbeat) -> None:
        self.last_report[rank] = heartbeat

    def bound(self, rank: int) -> float:
        """How long generator `rank` may be silent: rollout.generator_timeout_s, or, while it
        restarts its vLLM engine (its last report says the engine is down), the allowance for
        starting one, weights.join_timeout_s, if that is longer."""
        last = self.last_report.get(rank)
        timeout = self.rollout.generator_timeout_s
        return max(timeout, self.weights.join_timeout_s) if getattr(last, "engine_down", False) \
            else timeout

    def engines(self) -> tuple[int, int]:
        """(engine restarts over all generators so far, generators whose engine is up)."""
        reports = [self.last_report.get(g) for g in self.generators]
        return (sum(getattr(r, "engine_restarts", 0) for r in reports),
                sum(not getattr(r, "engine_down", False) for r in reports))

    def check(self, in_flight: dict[int, int], incomplete: Iterable = (),
              now: float | None = None) -> None:
        """Raise `GeneratorLostError` naming every generator not heard from within
        rollout.generator_timeout_s (before its first report: weights.join_timeout_s, the
        allowance for starting vLLM and joining the weight group), and every message
        (`incomplete`: (source, tag, age s) from the channel) arriving for longer than that."""
        now = time.monotonic() if now is None else now
        timeout, join = self.rollout.generator_timeout_s, self.weights.join_timeout_s
        lines = []
        for g in self.generators:
            host = self.hosts[g]
            heard = self.last_heard.get(g)
            if heard is None:
                if now - self.t_start > join:
                    lines.append(f"generator rank {g} (host {host}) has not reported in "
                                 f"{now - self.t_start:.0f} s since the job started "
                                 f"(weights.join_timeout_s = {join:g}); "
                                 f"is its vLLM engine stuck starting?")
            elif now - heard > (bound := self.bound(g)):
                last = self.last_report.get(g)
                version, running = (last.version, last.running) if last else ("?", "?")
                key = "weights.join_timeout_s: restarting its engine" if bound != timeout \
                    else "rollout.generator_timeout_s"
                lines.append(f"generator rank {g} (host {host}) silent for {now - heard:.1f} s "
                             f"({key} = {bound:g}) with "
                             f"{in_flight.get(g, 0)} prompt(s) in flight; last report: version "
                             f"{version}, {running} request(s) running; its vLLM engine or "
                             f"process is hung or gone")
        for src, tag, age in incomplete:
            if age > timeout:
                lines.append(f"a {tag.name} message from generator rank {src} (host "
                             f"{self.hosts[src]}) has been arriving for {age:.0f} s "
                             f"(rollout.generator_timeout_s = {timeout:g})")
        if lines:
            raise GeneratorLostError("; ".join(lines))


class ControllerWatch:
    """A generator's view of the controller's liveness (the controller sends a ControllerBeat
    at least every rollout.heartbeat_s).

    Args:
        rollout, weights: the run's config sections.
        rank: this generator's world rank; hosts: every world rank's host name.
        t_start: when this generator's loop started (monotonic).
    """

    def __init__(self, rollout, weights, rank: int, hosts: list[str],
                 t_start: float | None = None, beacon=None):
        self.rollout, self.weights, self.rank, self.hosts = rollout, weights, rank, hosts
        self.t_start = time.monotonic() if t_start is None else t_start
        self.last_heard: float | None = None
        self.beacon = beacon        # trainer rank 0's beacon (transport.beacon.RankWatch) or None

    @property
    def me(self) -> str:
        return f"generator rank {self.rank} (host {self.hosts[self.rank]})"

    def heard(self, now: float | None = None) -> None:
        self.last_heard = time.monotonic() if now is None else now

    def check(self, now: float | None = None, incomplete: Iterable = ()) -> None:
        """Raise `ControllerLostError` when the controller has sent nothing for
        rollout.generator_timeout_s; before its first message, when its beacon has fallen
        silent that long, or (no beat yet) after weights.join_timeout_s. `incomplete` (the
        channel's (source, tag, age s)): a message from it still arriving is named too (its
        later messages wait behind it)."""
        now = time.monotonic() if now is None else now
        # polled on every check, so that its beats never pile up in MPI's unexpected-message
        # queue, which every receive of this rank searches
        beat = self.beacon.poll(now) if self.beacon is not None else None
        if self.last_heard is None and beat is not None:
            # before its first message, trainer rank 0's beacon says it is alive (building the
            # model, loading a checkpoint, the initial evaluation's set-up): silence counts from it
            silent, bound, key = now - beat, self.rollout.generator_timeout_s, "rollout.generator_timeout_s"
        elif self.last_heard is None:
            silent, bound, key = now - self.t_start, self.weights.join_timeout_s, "weights.join_timeout_s"
        else:
            silent, bound, key = (now - self.last_heard, self.rollout.generator_timeout_s,
                                  "rollout.generator_timeout_s")
        if silent > bound:
            what = ("" if self.last_heard is not None else "since its beacon's last beat "
                    if beat is not None else "since this generator started ")
            stuck = [f"; a {tag.name} message from it has been arriving for {age:.0f} s"
                     for src, tag, age in incomplete if src == CONTROLLER_RANK]
            msg = (f"{self.me}: controller (rank {CONTROLLER_RANK}, host "
                   f"{self.hosts[CONTROLLER_RANK]}) silent for {silent:.0f} s {what}({key} = "
                   f"{bound:g}){''.join(stuck)}: the trainer is gone; exiting")
            log.error(msg)
            raise ControllerLostError(msg)

    def weights_failed(self, version: int, from_file: bool, waited_s: float,
                       exc: Exception) -> None:
        """Name a failed weight load in one line. A broadcast receive that timed out means the
        trainer stopped sending mid-update (it is gone or hung, as when the controller falls
        silent): `ControllerLostError`. Anything else is logged, and the caller re-raises it."""
        if not from_file and "timed out" in str(exc).lower():
            msg = (f"{self.me}: weights v{version} from the trainer (rank {CONTROLLER_RANK}, host "
                   f"{self.hosts[CONTROLLER_RANK]}) not received in {waited_s:.0f} s "
                   f"(weights.timeout_s = {self.weights.timeout_s:g}): the trainer is gone; "
                   f"exiting")
            log.error(msg)
            raise ControllerLostError(msg) from exc
        log.error("%s: loading weights v%d %s failed after %.1f s: %s", self.me, version,
                  "from disk" if from_file else "from the trainer", waited_s, exc)


class ServiceThread:
    """A loop on its own thread (the controller's MPI pump): started once, explicitly; stopped
    with a bounded join, and reported with where it is stuck if it does not end; an exception
    it raises is kept and surfaced to the caller by `check`."""

    def __init__(self, loop: Callable[[threading.Event], None], name: str,
                 on_error: Callable[[], None] | None = None):
        self._loop, self.name, self._on_error = loop, name, on_error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._loop(self._stop)
        except BaseException as exc:        # surfaced in the caller's thread by `check`
            self.error = exc
            if self._on_error is not None:
                self._on_error()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"{self.name} service thread failed") from self.error

    def stop(self, join_s: float) -> None:
        """Ask the loop to end and wait for it, at most `join_s`; RuntimeError with the stuck
        thread's stack if it does not end."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=join_s)
        if self._thread.is_alive():
            frame = sys._current_frames().get(self._thread.ident)
            where = "".join(traceback.format_stack(frame)[-6:]) if frame else "(no stack)\n"
            raise RuntimeError(f"the {self.name} service thread did not end within {join_s:g} s "
                               f"of being asked to stop; it is stuck at:\n{where}")
        self._thread = None
        self.check()
