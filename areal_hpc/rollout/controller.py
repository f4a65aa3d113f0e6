"""The controller, hosted on trainer rank 0: the messages to and from the generators, the rollout
log, batches. What is in flight, buffered and trained is its `Ledger` (rollout/ledger.py, pure).

It hands prompts to the least-loaded generator while the η bound allows, receives scored groups
(never blocking a generator), appends every trajectory to the rollout HDF5 log and keeps the
groups until a training step takes them, oldest policy version first.

Groups more than η versions older than the batch they can earliest go into are dropped as soon
as that is known, on arrival or when a step ends (marked `DROPPED_STALE` in the log, their slots
freed at once; `Ledger.drop_stale`) and, by rollout.stale_policy, their prompts issued again
(`staleness.StaleGroups`).

From the first batch on, a service thread does the receiving, logging and prompt dispatch, so the
generators are refilled while the trainer computes (the training step never stalls them, and HDF5
writes stay off the training critical path). Every MPI call and every state change happens under
one lock; the trainer's thread only waits on the condition for its batch or eval result. Receives
never block under the lock: a message is completed in the background (`Channel.poll`), so a large
one still arriving does not stall the trainer's thread.

Liveness both ways: generators report (HEARTBEAT) and the controller names one silent for
rollout.generator_timeout_s; the controller sends CONTROLLER_HEARTBEAT to every generator at least
every rollout.heartbeat_s (service thread, or whichever thread waits), and a generator that hears
nothing for that long ends itself (the trainer is gone).
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np

from .. import stuck
from ..config import RunConfig, to_yaml
from ..config.rules import LOADING_MARGIN_S
from ..data.prompts import prompt_ids, reset_row
from ..env.episode import CUT_TURNS
from ..storage.rollout_log import (DROPPED_STALE, FAILED, NOT_CONSUMED, PARTIAL, RolloutReader,
                                   RolloutWriter)
from ..storage.episode_log import DISCARD_CAUSES
from ..storage.run_dir import RunDir
from ..storage.run_state import ControllerState
from ..topology import Topology
from ..transport import messages as msgs
from ..transport.mpi import Channel
from ..transport.weights import AckTracker
from .ledger import Ledger
from .liveness import GeneratorWatch, Pacer, ServiceThread
from .staleness import Batch, staleness_of

log = logging.getLogger(__name__)


def reward_extras(trajs: list[dict]) -> dict[str, float]:
    """Per-step means of the fields user reward functions logged ("reward/<name>"), each over
    the samples that carry it."""
    values: dict[str, list[float]] = {}
    for t in trajs:
        for k, v in (t.get("reward_extra") or {}).items():
            values.setdefault(k, []).append(v)
    return {f"reward/{k}": float(np.mean(v)) for k, v in sorted(values.items())}


def episode_stats(trajs: list[dict]) -> dict[str, float]:
    """Per-step figures of multi-turn episodes (none for single-turn samples): model turns per
    episode, tool calls, failed ones, their seconds, the share cut at env.max_turns, and the
    episodes discarded (env.on_error), by cause."""
    if not any(t.get("turn_is_sample") is not None for t in trajs):
        return {}
    calls = [c if isinstance(c, dict) else vars(c)
             for t in trajs for c in t.get("tool_calls") or ()]
    turns = [int(np.sum(t["turn_is_sample"])) if t.get("turn_is_sample") is not None else 1
             for t in trajs]
    return {"episode/turns_mean": float(np.mean(turns)), "episode/tool_calls": len(calls),
            "episode/tool_errors": sum(1 for c in calls if c.get("error")),
            "episode/tool_seconds": float(sum(c.get("seconds", 0.0) for c in calls)),
            "episode/cut_max_turns": float(np.mean([t.get("finish_reason") == CUT_TURNS
                                                    for t in trajs])),
            **{f"episode/discarded_{c}": sum(1 for t in trajs if t.get("discard") == c)
               for c in DISCARD_CAUSES[1:]}}


# How long `stop` waits for the service thread to end: one of its iterations is a non-blocking
# poll, an HDF5 append and a few non-blocking sends (well under a second); a thread still running
# after this is stuck (reported with its stack) rather than slow.
SERVICE_JOIN_S = 60.0


class Controller:
    """Trainer rank 0's side of the generators, around its children: the channel to the
    generators and the rollout log's writer. `start` makes them on the rank; a test passes its
    own (a double of the channel's send, poll, incomplete, idle and flush). A resumed
    controller's writer is its checkpoint's log reopened (`RolloutWriter.reopen`)."""

    def __init__(self, cfg: RunConfig, topo: Topology, train_rows: list[dict], tokenizer, *,
                 chan, writer: RolloutWriter, resume: ControllerState | None = None):
        self.cfg, self.topo = cfg, topo
        self.chan, self.writer = chan, writer
        self.rows = train_rows
        self.tokenizer = tokenizer
        r = cfg.rollout
        # What is in flight, buffered, trained, to issue again: pure bookkeeping (ledger.py).
        self.ledger = Ledger(num_prompts=len(train_rows), data_seed=cfg.data.seed,
                             generators=list(topo.generator_ranks),
                             batch_prompts=cfg.train.batch_prompts,
                             max_staleness=0 if r.mode == "sync" else r.max_staleness,
                             max_concurrent=r.max_concurrent_prompts,
                             stale_policy=r.stale_policy, max_reissues=r.max_reissues,
                             total_steps=cfg.train.total_steps)
        self.gen_stats: dict[int, msgs.GeneratorStats] = {}
        self._eval_results: list[msgs.EvalResult] = []
        self._dropped_since_batch = 0       # groups dropped as stale since the last batch was taken
        self._failed_since_batch = 0        # groups without a sampled token since then
        self._stale_sent = 0                # the last StaleBefore version sent to the generators
        self._taken = None                  # the groups of the batch in training
        self._cond = threading.Condition(threading.RLock())
        # The MPI pump runs on its own thread from the first batch on, so that groups are
        # received, logged and their prompts' successors issued while the trainer thread computes
        # (MPI needs at least THREAD_SERIALIZED, which `start` checks: every MPI call here
        # holds `_cond`).
        self.service = ServiceThread(self._serve, "controller", on_error=self._wake)
        self.weight_acks = AckTracker({g: topo.hosts[g] for g in topo.generator_ranks})
        self.weight_generation = 0      # the weight group's generation (re-formed: `regroup`)
        self.watch = GeneratorWatch(r, cfg.weights, topo.generator_ranks, topo.hosts)
        self._beats = Pacer(r.heartbeat_s)              # ControllerBeat to every generator
        if resume is not None:
            self._restore(resume)

    @classmethod
    def start(cls, cfg: RunConfig, topo: Topology, train_rows: list[dict], tokenizer,
              resume: ControllerState | None = None) -> "Controller":
        """On trainer rank 0: the channel over the world and the rollout log, a new one, or the
        checkpoint's reopened (`resume`: rows it did not see are rolled back)."""
        from mpi4py import MPI
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise RuntimeError("the controller needs MPI initialised with at least "
                               "MPI_THREAD_SERIALIZED (mpi4py's default is MULTIPLE; check "
                               "mpi4py.rc.thread_level)")
        path = RunDir(cfg.run_dir).rollouts
        if resume is None:
            writer = RolloutWriter(path, to_yaml(cfg))
        else:
            with RolloutReader(path):       # there, and a rollout log, before it is written to
                pass
            writer = RolloutWriter.reopen(path, resume.rollout_rows)
        return cls(cfg, topo, train_rows, tokenizer, chan=Channel(topo.world), writer=writer,
                   resume=resume)

    # The ledger's figures the trainer and the liveness checks read.
    version = property(lambda self: self.ledger.version)
    in_flight = property(lambda self: self.ledger.in_flight)
    generated_tokens = property(lambda self: self.ledger.generated_tokens)
    buffer = property(lambda self: self.ledger.buffer)

    # -- the service thread ---------------------------------------------------------------------
    def _serve(self, stop: threading.Event) -> None:
        """Receive groups and refill the generators until stopped; wakes waiters on arrivals."""
        while not stop.is_set():
            with self._cond:
                self._beat()
                got = self.receive()
                if got:
                    self._drop_stale()
                self.submit()
                if got:
                    self._cond.notify_all()
            if not got:
                time.sleep(0.002)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _beat(self, now: float | None = None) -> None:
        """CONTROLLER_HEARTBEAT to every generator, at most every rollout.heartbeat_s (call with
        the lock held): generators end themselves when the controller falls silent."""
        if self._beats.due(now):
            for g in self.topo.generator_ranks:
                msgs.post(self.chan, msgs.ControllerBeat(self.version), g)

    def _wait(self, ready, on_wait=None, watch: bool = True) -> None:
        """Block (holding the lock on return) until the predicate `ready()` holds, pausing
        between checks in one of two ways: once the service thread runs (from the first batch),
        until it wakes this thread (`_await_service`); before that, by receiving in this thread
        (`_receive_here`). With `watch`, a generator silent for too long raises
        `GeneratorLostError` (`GeneratorWatch.check`)."""
        pause = self._await_service if self.service.running else self._receive_here
        while not ready():
            stuck.progress()            # waiting on the generators: not this rank's hang
            self.service.check()
            if watch:
                self.watch.check(self.in_flight, self.chan.incomplete())
            pause()
            if on_wait:
                on_wait(len(self.buffer))

    def _await_service(self) -> None:
        self._cond.wait(timeout=0.1)

    def _receive_here(self) -> None:
        """The service thread's work but issuing prompts: heartbeats out, messages in."""
        self._beat()
        self._receive_or_idle()

    def _receive_or_idle(self) -> None:
        """Take what has arrived, or sleep until a message waits (at most 50 ms)."""
        if not self.receive():
            self.chan.idle(timeout=0.05)

    # -- prompts out, groups in ----------------------------------------------------------------
    def encode(self, prompt_id: int, row: dict, n: int,
               continued: tuple[msgs.Continuation, ...] = ()) -> msgs.Prompt:
        ids = prompt_ids(self.tokenizer, self.cfg.data, row["question"])
        # reward functions of the user's own see the whole row as read; an environment its
        # reset's row (`reset_row`)
        whole = reset_row(row) if self.cfg.env.fn else row.get("row")
        return msgs.Prompt(prompt_id, ids, n, row["reward_kind"], row["reference"],
                           row=whole, continued=continued)

    def submit(self) -> int:
        """Hand out as many prompts as the staleness bound allows; returns how many."""
        issued = self.ledger.issue()
        batches: dict[int, list[msgs.Prompt]] = {}
        for it in issued:
            continued = ()
            if it.partial is not None:              # its samples go on from where they stopped
                first, count = it.partial
                continued = tuple(self._continuation(r) for r in range(first, first + count))
            batches.setdefault(it.rank, []).append(
                self.encode(it.prompt_id, self.rows[it.index], self.cfg.rollout.group_size, continued))
        for g, prompts in batches.items():
            msgs.post(self.chan, msgs.Prompts(prompts), g)
        return len(issued)

    def receive(self) -> int:
        """Take every group that has arrived; returns how many."""
        got = 0
        for src, tag, msg in self.chan.poll():
            self.watch.heard(src)
            match msgs.check(tag, msg):
                case msgs.Heartbeat():
                    self._engine_report(src, msg)
                    self.watch.report(src, msg)
                case msgs.Group(trajectories=group):
                    rows = self.writer.append(group)
                    if not self.ledger.arrived(src, group, rows):
                        self._failed(src, group, rows)
                    got += 1
                case msgs.Partial(groups=groups):   # preempted: the prompts stay in flight
                    for group in groups:
                        rows = self.writer.append(group, consumed=PARTIAL)
                        self.ledger.partial_arrived(group[0]["prompt_id"], rows[0], len(rows))
                case msgs.EvalResult():
                    self._eval_results.append(msg)
                case msgs.GeneratorStats():
                    self.gen_stats[src] = msg
                case msgs.WeightsAck():
                    self.weight_acks.record(src, msg)
        return got

    def _failed(self, src: int, group: list[dict], rows: list[int]) -> None:
        """A group without a sampled token (Ledger.arrived): its rows marked FAILED, one line
        with the first episode's error; the step it would have joined waits for another."""
        self.writer.mark_consumed(rows, FAILED)
        self._failed_since_batch += 1
        why = next((t["reward_error"] for t in group if t.get("reward_error")), "no error given")
        log.warning("generator rank %d: every sample of prompt %d ended before a sampled token "
                    "(%s): the group is not trained, the prompt given up (%d such group(s) so "
                    "far)", src, int(group[0]["prompt_id"]), why, self.ledger.failed_groups)

    def _engine_report(self, src: int, beat: msgs.Heartbeat) -> None:
        """One line per engine restart a generator reports (rollout/engine_guard.py)."""
        was_down = getattr(self.watch.last_report.get(src), "engine_down", False)
        if was_down and not beat.engine_down:
            log.warning("generator rank %d (host %s): vLLM engine restarted (%d so far), its "
                        "in-flight samples continued; cause: %s", src, self.topo.hosts[src],
                        beat.engine_restarts, beat.engine_fault)
        elif beat.engine_down and not was_down:
            log.warning("generator rank %d (host %s): vLLM engine down, restarting; cause: %s",
                        src, self.topo.hosts[src], beat.engine_fault)

    def _continuation(self, row: int) -> msgs.Continuation:
        """A PARTIAL row as a generator continues it (a prompt's `continued` samples)."""
        t = self.writer.read(row)
        t["tool_calls"] = tuple(t["tool_calls"])        # an episode's, as the log read them
        return msgs.Continuation(**{k: t[k] for k in (
            "sample_idx", "output_tokens", "behav_logprobs", "versions", "finish_reason",
            "t_submit", "t_first_token", "t_end", "loss_mask", "turn_ends", "turn_is_sample",
            "tool_calls", "prompt_tokens")})

    def _drop_stale(self) -> int:
        """Groups whose oldest token is more than η versions behind the policy, by
        rollout.stale_policy: `reissue` drops them (marked DROPPED_STALE in the log) and issues
        their prompts again, first; `drop` drops them for good; `keep` trains them anyway."""
        stale = self.ledger.drop_stale()
        if stale:
            self.writer.mark_consumed([r for g in stale for r in g.rows], DROPPED_STALE)
            self._dropped_since_batch += len(stale)
        return len(stale)

    def _send_stale_before(self) -> None:
        """Tell every generator the oldest version a group may still hold to be trained
        (rollout.abort_stale, under stale_policy reissue or drop): it stops generating the groups
        that are already too old, which would only be dropped here (call with the lock held)."""
        r = self.cfg.rollout
        if not (r.abort_stale and r.mode == "async" and self.ledger.stale_groups.drops):
            return
        version = self.ledger.stale_before
        if version > self._stale_sent:
            self._stale_sent = version
            for g in self.topo.generator_ranks:
                msgs.post(self.chan, msgs.StaleBefore(version), g)

    def next_batch(self, on_wait=None, should_stop=None) -> Batch | str | None:
        """Block until B groups are ready; returns them as one `Batch` (trajectories group after
        group, their log rows, the batch statistics). `on_wait(n_ready)` is called while waiting
        (progress display); when `should_stop()` turns true first (preemption), returns None
        and takes nothing; when a generator's new engine waits for weights first (broadcast),
        returns `msgs.RESEND_WEIGHTS` and takes nothing."""
        B = self.cfg.train.batch_prompts
        t0 = time.monotonic()
        self.service.start()
        with self._cond:
            # The step that ended made the buffer's oldest groups older; later arrivals are
            # dropped by the service thread as they come.
            self._drop_stale()
            self._wait(lambda: len(self.buffer) >= B or bool(should_stop and should_stop())
                       or bool(self.weight_acks.awaiting), on_wait)
            if should_stop and should_stop():
                return None
            if len(self.buffer) < B:
                log.warning("generator(s) %s wait for weights v%d (a new engine): sending them "
                            "again over a re-formed weight group before the next batch",
                            sorted(self.weight_acks.awaiting), self.version)
                return msgs.RESEND_WEIGHTS
            groups = self.ledger.take(B)                  # oldest first
            self._taken = groups                          # until trained (or put back)
            dropped, self._dropped_since_batch = self._dropped_since_batch, 0
            failed, self._failed_since_batch = self._failed_since_batch, 0
            self._send_stale_before()
            if self.version + 1 >= self.cfg.train.total_steps:
                # the run's last batch: nothing more to generate for training (the η window
                # is capped at total_steps); the generators' time accounting ends here
                for g in self.topo.generator_ranks:
                    msgs.post(self.chan, msgs.StepsDone(), g)
        trajs = [t for g in groups for t in g.trajectories]
        stale = [staleness_of(self.version, t["versions"]) for t in trajs]
        rewards = np.array([t["reward"] for t in trajs], dtype=np.float64)
        stats = {"wait_s": time.monotonic() - t0, "reward": float(rewards.mean()),
                 "accuracy": float((rewards > 0.5).mean()),
                 "staleness_max": max(stale), "staleness_mean": float(np.mean(stale)),
                 "dropped_stale": dropped, "lost_stale": self.ledger.stale_groups.lost,
                 "failed_groups": failed,
                 "reward_errors": sum(1 for t in trajs if t.get("reward_error")),
                 "response_len": float(np.mean([len(t["output_tokens"]) for t in trajs])),
                 **dict(zip(("engine_restarts", "generators_live"), self.watch.engines())),
                 **reward_extras(trajs),
                 # a run without an environment has single-turn samples only, though those continued
                 # from the log carry one model turn each (storage/episode_log.py's row_episode)
                 **(episode_stats(trajs) if self.cfg.env.fn else {})}
        return Batch.of(groups, stats)

    def on_trained(self, rows: list[int], step: int, new_version: int) -> None:
        with self._cond:
            self.writer.mark_consumed(rows, step)
            self.ledger.trained(new_version)
            self._taken = None

    def put_back(self) -> list[int]:
        """The batch in training was not trained (its step stopped midway): its groups go back
        to the buffer, first among their version, so that a checkpoint keeps them and a resume
        trains them first. Returns their prompt ids."""
        with self._cond:
            groups, self._taken = self._taken or [], None
            self.ledger.put_back(groups)
        return [int(g.trajectories[0]["prompt_id"]) for g in groups]

    collects_acks = True        # the trainer's weight notifier (train/weight_publisher.py)

    def regroup(self, force: bool = False) -> int | None:
        """The weight group's next generation, to be formed before the update that follows,
        when a generator waits for weights (its engine was replaced, or a broadcast failed on
        it), when one reports its engine down (its workers are gone from the group: a broadcast
        over it would wait on them until weights.timeout_s; the new engine joins the next
        generation once it is up, within weights.join_timeout_s), or `force` (the last
        broadcast failed); None: the group stands."""
        with self._cond:
            down = sorted(g for g in self.topo.generator_ranks
                          if getattr(self.watch.last_report.get(g), "engine_down", False))
            if not (force or self.weight_acks.awaiting or down):
                return None
            self.weight_generation += 1
            log.warning("weight group: forming generation %d (generators waiting for weights: %s; "
                        "engines down: %s)", self.weight_generation,
                        sorted(self.weight_acks.awaiting) or "none", down or "none")
            return self.weight_generation

    def send_weights_notice(self, version: int, *, plan=None, path: str | None = None,
                            generation: int | None = None) -> None:
        """Tell every generator that `version` is coming: over the weight group (`plan`, sent
        while the stage senders broadcast; joining its `generation` first when it was
        re-formed) or in the safetensors directory `path` (complete)."""
        msg = msgs.WeightsNotice(version, plan=plan, generation=generation) if path is None \
            else msgs.WeightsNotice(version, path=path)
        with self._cond:
            self.weight_acks.sent()
            for g in self.topo.generator_ranks:
                msgs.post(self.chan, msg, g)

    def wait_weights_acks(self, version: int, timeout_s: float,
                          cause: BaseException | None = None) -> bool:
        """Block until every generator acknowledges running `version`, at most `timeout_s`;
        raise `WeightSyncError` naming each generator (rank, host) that did not. With `cause`
        (the trainer's side of the update failed, e.g. a collective timed out) only a short
        grace is given for late acknowledgements: the update has failed either way, unless a
        generator's engine failed in it. Then the wait is extended by the time a new engine
        takes to start (weights.join_timeout_s), and returns True once every generator either
        runs `version` or waits for it: the update is to be sent again over a re-formed group."""
        t0 = time.monotonic()
        deadline = [t0 + (min(timeout_s, 5.0) if cause is not None else timeout_s)]
        # A generator's receive is bounded by weights.timeout_s + rollout.engine_stall_s on its
        # side (config/rules.py receive_bound_s): one that started loading and stalls is found
        # by its watch within that, and says so (its engine killed, a heartbeat) within
        # LOADING_MARGIN_S more; `timeout_s` (0 at a preemption) stands for weights.timeout_s
        # here. Never past rollout.generator_timeout_s (config/rules.py keeps it above that sum
        # where engines restart): a config whose generators are lost sooner ends the job there.
        loading_s = min(timeout_s + self.cfg.rollout.engine_stall_s + LOADING_MARGIN_S,
                        max(timeout_s, self.cfg.rollout.generator_timeout_s))
        restart_s = self.cfg.weights.join_timeout_s + timeout_s

        def ready() -> bool:
            acks, now = self.weight_acks, time.monotonic()
            if acks.complete(version) or acks.settled(version):
                return True
            if self.cfg.weights.mode == "broadcast" and any(
                    acks.started.get(g, -1) >= version and acks.loaded.get(g, -1) < version
                    and g not in acks.awaiting for g in acks.expected):
                deadline[0] = max(deadline[0], t0 + loading_s)    # may yet stall and restart
            if acks.awaiting or any(getattr(self.watch.last_report.get(g), "engine_down", False)
                                    for g in acks.expected):
                deadline[0] = max(deadline[0], t0 + restart_s)     # a new engine is starting
            return now > deadline[0]

        with self._cond:
            # Not watched: a generator is silent while it loads; `timeout_s` bounds this wait.
            self._wait(ready, watch=False)
            if not self.weight_acks.complete(version) and self.weight_acks.settled(version):
                return True
            self.weight_acks.check(version, time.monotonic() - t0, cause)
        return False

    # -- held-out evaluation --------------------------------------------------------------------
    def request_eval(self, rows: list[dict], samples: int) -> None:
        """Split the held-out prompts over the generators; results are collected by `eval_result`."""
        gens = self.topo.generator_ranks
        prompts = [self.encode(i, r, samples) for i, r in enumerate(rows)]
        with self._cond:
            for k, g in enumerate(gens):
                msgs.post(self.chan, msgs.EvalRequest(prompts[k::len(gens)]), g)

    def eval_result(self) -> dict:
        """Block until every generator answered the last eval request; accuracy over all samples."""
        with self._cond:
            self._wait(lambda: len(self._eval_results) >= len(self.topo.generator_ranks))
            parts, self._eval_results = self._eval_results, []
        rewards = np.array([r for p in parts for res in p.results for r in res["rewards"]])
        # no samples: every generator's engine was restarting (its prompts were left out)
        return {"version": parts[0].version,
                "accuracy": float((rewards > 0.5).mean()) if rewards.size else None,
                "samples": int(rewards.size), "seconds": max(p.seconds for p in parts)}

    # -- the end ----------------------------------------------------------------------------------
    def stop(self, preempted: bool = False) -> None:
        """Tell generators to finish, take every group they still send into the buffer, and
        collect their statistics. At a preemption they first send their in-flight groups as far
        as they got (PARTIAL rows in the log; the prompts stay in flight, and a resume continues
        them); otherwise in-flight work is dropped. The log stays open until `close`."""
        self.service.stop(SERVICE_JOIN_S)
        for g in self.topo.generator_ranks:
            msgs.post(self.chan, msgs.Stop(preempted), g)
        deadline = time.monotonic() + self.cfg.rollout.generator_timeout_s
        while len(self.gen_stats) < len(self.topo.generator_ranks):
            if time.monotonic() > deadline:
                missing = [g for g in self.topo.generator_ranks if g not in self.gen_stats]
                log.warning("no final statistics from generator rank(s) %s within "
                            "rollout.generator_timeout_s; ending without them", missing)
                break
            self._receive_or_idle()
        self.chan.flush(timeout=60)
        for rank, st in sorted(self.gen_stats.items()):
            sec = st.seconds
            log.info("generator rank %d: %d tokens, engine busy %.1f%% of its time; loop in the "
                     "engine's step %.1f%% (generating %.1fs, "
                     "weight-update pauses %.1fs, idle %.1fs of which %.1fs waiting on scores, "
                     "loop work %.1fs (submitting %.1fs, sending %.1fs, other %.1fs); eval %.1fs "
                     "apart); reward calls %d, errors %d, timeouts %d",
                     rank, st.tokens, 100 * st.engine_share(),
                     100 * st.busy_share(), sec["busy"], sec["pause"],
                     st.idle_s(), sec["idle_scoring"], st.loop_work(),
                     sec.get("submit", 0.0), sec.get("send", 0.0), sec.get("other", 0.0),
                     sec["eval"], st.reward["calls"], st.reward["errors"], st.reward["timeouts"])
        RunDir(self.cfg.run_dir).write_generators([self.gen_stats[r] for r in sorted(self.gen_stats)])

    def close(self) -> None:
        self.writer.close()

    # -- checkpoint and resume ------------------------------------------------------------------
    def state(self) -> ControllerState:
        """What a resumed controller needs (saved in the checkpoint's state.h5): the ledger's
        state (version, data cursor, staleness counters, the log rows of buffered groups, the
        prompts in flight with the PARTIAL rows to continue them from) and the number of log
        rows (rows appended later are rolled back on resume)."""
        with self._cond:
            return self.ledger.to_state(self.writer.n_rows)

    def _restore(self, state: ControllerState) -> None:
        """Continue from `state()` of a checkpoint, on its reopened rollout log (rows after the
        checkpoint marked ROLLED_BACK): the buffered rows pending again and the buffer refilled
        from them, the prompts that were in flight queued to be issued first, their partial
        groups checked against the log (`ControllerState.check_partial`)."""
        rows = state.buffer_rows.tolist()
        groups = [g.tolist() for g in state.groups()]
        trajs = [self.writer.read(r) for r in rows]
        for t in trajs:
            t["output_tokens"] = np.asarray(t["output_tokens"])
        self.writer.mark_consumed(rows, NOT_CONSUMED)
        by_row = dict(zip(rows, trajs))
        self.ledger.restore(state, [([by_row[r] for r in g], g) for g in groups])
        led = self.ledger
        kept = state.check_partial(self.writer.path, self.writer)
        log.info("resumed at version %d: %d buffered groups, %d prompts to reissue (%d of them "
                 "continued from %d partial tokens), cursor at %d", led.version, len(groups),
                 len(led.reissue), len(led.partial), kept, led.cursor.consumed)
