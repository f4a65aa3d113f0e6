"""A generator rank's weight loads and its engine's recovery: the part of `Generator`
(rollout/generator.py, which mixes this class in) that keeps generating through a weight update
and through a vLLM engine's fault.

An engine fault (rollout/engine_guard.py finds it) is recovered in the rank: the engine's
processes are killed, a new engine is started on the same devices, and the in-flight samples
continue from their tokens. Where the new engine gets its weights depends on weights.mode:

- disk: the trainer's last published files, loaded at once;
- broadcast: the weight group is re-formed. The new engine holds no weights it may generate
  with, so the rank stops stepping it and reports `WeightsAck(version, "awaiting")`; the trainer
  forms the group's next generation (`WeightsNotice.generation`), every member joins it (the
  members that were up leave the old one), and the current version is sent again. Members that
  already run it take it off the wire without loading it (`VLLMEngine.drain_weights`); the new
  engine loads it and its samples go on. A broadcast that fails on a live engine (a member died
  mid-broadcast: the rest time out after weights.timeout_s) leaves that engine's model half
  loaded: it too waits for the version to be sent again, its samples kept.

While a rank waits for weights it generates nothing, not even for a held-out evaluation: an
evaluation met then answers for the prompts it had finished and drops the rest (logged).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import replace

from .. import preemption, stuck
from ..config.rules import receive_bound_s
from ..topology import CONTROLLER_RANK
from ..transport import messages as msgs
from .engine_guard import (EngineRestartsError, EngineWatch, engine_procs, is_engine_dead,
                           kill_engine)
from .gpu_memory import EngineMemoryError, read_devices, wait_for_memory

log = logging.getLogger(__name__)

# Test hook: the engine's processes are killed as the update to this version begins, so that a
# member of the weight group dies inside a broadcast at a moment chosen, not hoped for
# (tests/e2e/test_engine_restart.py). Once per rank.
KILL_AT_UPDATE_ENV = "AREAL_TEST_KILL_ENGINE_AT_UPDATE"


def _test_kill(engine, version: int, restarts: int) -> None:
    """The hook: "<version>" kills every process of the engine, "stop:<version>" stops its
    EngineCore (SIGSTOP: a stall, as tools/chaos.py's stop_engine)."""
    how, _, at = os.environ.get(KILL_AT_UPDATE_ENV, "").rpartition(":")
    if at != str(version) or restarts != 0:
        return
    log.warning("test hook %s: %s the engine at the update to v%d", KILL_AT_UPDATE_ENV,
                "stopping" if how == "stop" else "killing", version)
    procs = engine_procs(engine)
    for p in procs[:1] if how == "stop" else procs:
        with contextlib.suppress(Exception):
            p.send_signal(signal.SIGSTOP) if how == "stop" else p.kill()


def request_id(kind: str, prompt_id: int, sample_idx: int) -> str:
    return f"{kind}:{prompt_id}:{sample_idx}"


class EngineRecovery:
    """Weight loads and engine recovery, mixed into `Generator` (its attributes: cfg, topo,
    engine, engine_factory, guard, restarts, groups, chan, watch, clock, me)."""

    awaiting: int | None = None     # the weights version this rank's engine waits for (broadcast)
    read_gpu_memory = staticmethod(read_devices)    # the engine's GPUs' memory (gpu_memory.py)

    def _update_weights(self, msg: msgs.WeightsNotice) -> None:
        """Load the announced version and acknowledge it: "started" first, so that a load that
        never finishes is told apart from a notice never taken up; "loaded" only once the
        engine runs the new weights (a failed load raises, or under broadcast waits for the
        version again: no generation on a half-loaded model). A notice with a `generation`
        joins the re-formed weight group first; a version this engine already runs (sent again
        for a member that rejoined) is taken off the wire without loading. The trainer fails
        the job if an acknowledgement does not arrive in time."""
        version = msg.version
        if self.awaiting is not None and msg.path is None and msg.generation is None:
            # Sent before this rank waited (its engine is in no group, or its group failed):
            # the version comes again with the group's next generation.
            log.info("%s: weights v%d notice from before the weight group was re-formed: "
                     "skipped", self.me, version)
            return
        drain = msg.path is None and self.awaiting is None and version == self.engine.version
        msgs.post(self.chan, msgs.WeightsAck(version, "started"), CONTROLLER_RANK)
        t0 = time.monotonic()
        held = list(getattr(self.engine, "_requests", {}).values())  # the update takes them out
        try:
            # A load with no result for rollout.engine_stall_s is a stall; a receive over the
            # weight group waits on its peers too, and its collective's timeout (weights.timeout_s)
            # bounds it first: a peer that died mid-broadcast is not this engine's stall.
            bound = None if msg.path is not None else receive_bound_s(self.cfg) \
                + (self.cfg.weights.join_timeout_s if msg.generation is not None else 0.0)  # the join too
            with self._busy(bound):
                _test_kill(self.engine, version, self.restarts.total)
                if msg.generation is not None:
                    self._join_group(msg.generation)
                if drain:
                    self.engine.drain_weights(msg.plan)
                    paused_s = 0.0
                elif msg.path is not None:
                    paused_s = self.engine.update_weights_from_file(version, msg.path)
                else:
                    paused_s = self.engine.update_weights(version, msg.plan)
            self._weights_path = msg.path
        except Exception as exc:
            cause = None if preemption.requested() else self._fault(exc)
            if cause is not None:       # a dead engine: a new one loads this version
                self._recover(f"{cause} (during the update to weights v{version})",
                              held=held, version=version, path=msg.path)
                if self.awaiting is not None:
                    return              # the version comes again over the re-formed group
                paused_s = time.monotonic() - t0
            elif preemption.requested():    # TERM reached the engine too: wait for the stop
                log.warning("generator rank %d: weights v%d not loaded, its vLLM engine went with "
                            "the preemption (%s); waiting for stop", self.topo.rank, version, exc)
                self._engine_lost = True
                return
            elif msg.path is None and self.engine_factory is not None:
                # The broadcast failed on a live engine (a member of the group died mid-way):
                # its model may be half loaded unless it was only draining; it waits for the
                # version to be sent again over a re-formed group.
                self._await(version if not drain else None,
                            f"the broadcast of weights v{version} failed ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})")
                return
            else:
                self.watch.weights_failed(version, msg.path is not None, time.monotonic() - t0, exc)
                raise
        if self.awaiting is not None:
            log.warning("%s: weights v%d loaded; generating again", self.me, version)
        self.awaiting = None
        self.clock.count("pause", paused_s)
        msgs.post(self.chan, msgs.WeightsAck(self.engine.version, "loaded", paused_s),
                  CONTROLLER_RANK)

    def _join_group(self, generation: int) -> None:
        """Join the weight group's `generation` (every worker of the engine; the old group, if
        any, torn down)."""
        address = replace(self.topo.weight_group_address(self.cfg.weights), generation=generation)
        t0 = time.monotonic()
        log.info("%s: joining the weight group's generation %d", self.me, generation)
        self.engine.init_weight_group(address, self.topo.weight_group_rank)
        log.info("%s: joined the weight group's generation %d in %.1f s", self.me, generation,
                 time.monotonic() - t0)

    def _await(self, version: int | None, why: str) -> None:
        """After a failed broadcast: wait for `version` to be sent again over a re-formed group
        (told to the controller). None: this engine was only taking a version it runs off the
        wire, its model is intact; it joins the next generation with the others."""
        if version is None:
            log.warning("%s: %s; its model is intact (it runs that version already); it joins the "
                        "re-formed weight group", self.me, why)
            return
        self.awaiting = version
        log.warning("%s: %s; not generating until the weight group is re-formed and weights v%d "
                    "sent again", self.me, why, version)
        msgs.post(self.chan, msgs.WeightsAck(version, "awaiting"), CONTROLLER_RANK)

    @contextlib.contextmanager
    def _busy(self, stall_s: float | None = None):
        """Around a call that waits on the engine: the watch's stall bound (or `stall_s`) runs
        meanwhile, and the rank's progress watch gives the call that long."""
        bound = self.cfg.rollout.engine_stall_s if stall_s is None else stall_s
        with stuck.expect(bound, "a call into the vLLM engine"), \
                (self.guard.busy(stall_s) if self.guard is not None else nullcontext()):
            yield

    def _guarded(self, fn, *args):
        """`fn(*args)`; an engine fault in it (not a preemption's) is recovered (`_recover`):
        then None. Anything else is raised."""
        try:
            return fn(*args)
        except Exception as exc:
            cause = None if preemption.requested() else self._fault(exc)
            if cause is None:
                raise
            self._recover(cause)
            return None

    def _recover_idle_fault(self) -> None:
        """An engine fault the watch found while nothing waited on the engine: recovered as
        one met in a call (`_guarded`), unless the engine went with a preemption."""
        if self.guard is not None and self.guard.cause is not None and not self._engine_lost \
                and not preemption.requested():
            self._guarded(self._raise_fault)

    def _raise_fault(self) -> None:
        raise RuntimeError(self.guard.cause)

    def _fault(self, exc: BaseException) -> str | None:
        """Why the engine failed, if it is an engine fault this rank can restart it from (its
        watch fired, a process of it is gone, or vLLM says it is dead); None otherwise."""
        if self.engine_factory is None or self.guard is None:
            return None
        cause = self.guard.cause or self.guard.check()
        if cause is None and is_engine_dead(exc):
            cause = f"vLLM engine error ({type(exc).__name__}: {exc})"
        return cause

    def _recover(self, cause: str, held=(), version: int | None = None,
                 path: str | None = None) -> None:
        """Replace a faulted engine: count it (past rollout.engine_restarts the job ends), kill
        every process of it, start a new one on the same devices, and continue its in-flight
        samples from their tokens (`held`: samples a weight update had taken out of the
        engine). Its weights: `version` (else the ones loaded last) from `path` (disk), or,
        under broadcast, sent again over the re-formed weight group (module doc)."""
        t0 = time.monotonic()
        log.warning("%s: vLLM engine fault: %s", self.me, cause)
        self.guard.fire(cause)          # kills it, if the watch has not already
        self.guard.close()
        try:
            self.restarts.record(cause)
        except EngineRestartsError as exc:
            log.error("%s", exc)
            raise
        old, self.last_fault = self.engine, cause
        version = (self.awaiting if self.awaiting is not None else old.version) \
            if version is None else version
        path = path if path is not None else self._weights_path
        broadcast = self.cfg.weights.mode == "broadcast"
        if not broadcast and version > 0 and path is None:
            msg = (f"{self.me}: its vLLM engine failed ({cause}) and cannot be restarted: no "
                   f"published copy of weights v{version} to load; the job ends")
            log.error(msg)
            raise EngineRestartsError(msg)
        now = time.time()
        samples = {s.request_id: s for s in (old._finish(r, "abort", now) for r in held)}
        samples.update((s.request_id, s) for s in old.abort_all())
        kill_engine(old, self.guard.segments if self.guard is not None else ())
        self._heartbeat(force=True, down=True)
        r = self.cfg.rollout
        with stuck.expect(r.engine_memory_wait_s + self.cfg.weights.join_timeout_s,
                          "restarting the vLLM engine"):
            try:
                wait_for_memory(lambda: self.read_gpu_memory(r.engine_tp),
                                r.gpu_memory_utilization, r.engine_memory_wait_s, self.me)
            except EngineMemoryError as exc:
                log.error("%s", exc)
                raise
            with preemption.shield_children():
                self.engine = self.engine_factory(version=version)
        if broadcast:
            self.awaiting = version     # not stepped until the group sends it (`run`)
            self.engine.hold()          # and its samples not generated before (no weights yet)
        elif version > 0:
            self.engine.update_weights_from_file(version, path)
            self._weights_path = path
        self.guard = EngineWatch(self.engine, self.cfg.rollout.engine_stall_s)
        kept, fresh = self._continue(samples)
        if self.watch is not None:
            self.watch.heard()          # this rank's own work, not the controller's silence
        self._heartbeat(force=True)
        log.warning("%s: vLLM engine restarted in %.1f s at weights v%d%s (restart %d; cause: %s); "
                    "%d sample(s) continued with %d token(s) kept, %d started again", self.me,
                    time.monotonic() - t0, version,
                    ", to come over the re-formed weight group" if broadcast else "",
                    self.restarts.total, cause, len(kept), sum(kept), fresh)
        if broadcast:
            msgs.post(self.chan, msgs.WeightsAck(version, "awaiting"), CONTROLLER_RANK)

    def _continue(self, samples: dict) -> tuple[list[int], int]:
        """Every unfinished sample of every group here, on the new engine: continued from its
        tokens, returned at once if it had finished, or started again if the old engine had no
        record of it. Returns (tokens kept per continued sample, samples started again)."""
        if self.envs is not None:
            return self._continue_episodes(samples)
        r, kept, fresh = self.cfg.rollout, [], 0
        for (kind, pid), group in list(self.groups.items()):
            seeds = self._seeds(kind, pid, group.prompt.n)
            again = []
            for idx in range(group.prompt.n):
                smp = samples.get(request_id(kind, pid, idx))
                if idx in group.samples:
                    continue
                if smp is None:
                    again.append(idx)
                elif smp.finish_reason != "abort":
                    self._finished(kind, pid, idx, smp)
                else:
                    self.engine.continue_sample(smp, r.max_new_tokens, **self._sampling(kind))
                    kept.append(len(smp.output_tokens))
            if again:
                fresh += len(again)
                self.engine.submit_group([request_id(kind, pid, i) for i in again],
                                         group.prompt.prompt_tokens, max_new_tokens=r.max_new_tokens,
                                         seeds=seeds and [seeds[i] for i in again],
                                         **self._sampling(kind))
        return kept, fresh

    def _abandon_eval(self, pending: set) -> int:
        """An evaluation met while this rank waits for weights: its unfinished samples are
        stopped and their prompts dropped from it (generated on no policy's weights they would
        count for nothing true); returns how many prompts were dropped."""
        dropped = 0
        for pid in sorted(pending):
            group = self.groups.get(("eval", pid))
            if group is None or group.generated:
                continue
            self.engine.abort([request_id("eval", pid, i) for i in range(group.prompt.n)])
            del self.groups[("eval", pid)]
            pending.discard(pid)
            dropped += 1
        if dropped:
            log.warning("%s: %d held-out prompt(s) left out of this evaluation: the engine waits "
                        "for weights v%d", self.me, dropped, self.awaiting)
        return dropped
