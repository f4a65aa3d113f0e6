"""The generator rank's loop: generate groups without ever waiting for training.

    loop:
        handle controller messages:
            PROMPTS → submit each prompt's n samples to vLLM as one request
            WEIGHTS → acknowledge "started"; interrupt in-flight requests, receive the new
                      weights over the weight group (or load them from disk), drop the KV
                      cache, resume (later tokens carry the new version); acknowledge "loaded"
            EVAL    → run the held-out prompts to completion at the current version
            STEPS_DONE → the run's last batch is taken: the time accounting ends
            STOP    → finish; at a preemption, first abort the engine's requests and send back
                      every training group still in flight as far as it got (PARTIAL): the
                      resumed job continues each sample from its prefix
            CONTROLLER_HEARTBEAT → (liveness only)
        nothing from the controller for rollout.generator_timeout_s (before its first message:
            weights.join_timeout_s), or a weight broadcast that stops arriving for
            weights.timeout_s → the trainer is gone: `ControllerLostError`, the rank ends and
            its reaper kills the vLLM engine and reward workers
        step vLLM; hand every finished sample to the reward pool (processes beside the
        engine, so scoring overlaps generation); send each group once all its samples are scored
        the engine died or stalled (engine_guard.EngineWatch) → kill it, start a new one with
            the current weights (from disk, or sent again over the re-formed weight group:
            recovery.py), continue its in-flight samples from their tokens (at most
            rollout.engine_restarts per rollout.engine_restart_window_s, else the job ends)

Sampling seeds (rollout.per_request_seeds): every sample is generated under its own seed
(`seeds.sample_seed`: from train.seed, the prompt's id and the sample's index; held-out
prompts apart), recorded with it in the rollout log, so which tokens it draws does not depend
on the batch around it. In rollout.mode sync the scored groups also go to the controller in
the order their prompts came (a group waits for the ones before it; the trainer waits for the
whole batch anyway), so that the batch, and the rollout log's rows, come in the same order in
every run.
"""
from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import preemption, stuck
from ..config import RunConfig
from ..determinism import seeded
from ..data.prompts import read_chat_template
from ..env.runner import EnvRunner
from ..env.tool_calls import ToolCalling
from ..reward import custom
from ..reward.pool import RewardPool
from ..topology import CONTROLLER_RANK, Topology
from ..transport import messages as msgs
from ..transport.mpi import Channel
from .engine_guard import EngineWatch, RestartBudget
from .episodes import EpisodeLoop
from .gen_clock import GenClock
from .liveness import ControllerWatch, Pacer
from .recovery import EngineRecovery, request_id
from .seeds import group_seed
from .vllm_engine import FinishedSample, VLLMEngine, engine_options

log = logging.getLogger(__name__)
# At the end (STOP: a preemption's, or the run's), how long the environments of the episodes still
# running have for their close(), in all (a preemption's signal window holds it)
ENV_ENDING_S = 10.0


@dataclass
class _Group:
    prompt: msgs.Prompt
    samples: dict = field(default_factory=dict)   # sample_idx → finished sample
    rewards: dict = field(default_factory=dict)   # sample_idx → reward
    errors: dict = field(default_factory=dict)    # sample_idx → reward-service error, if any
    discards: dict = field(default_factory=dict)  # sample_idx → why its episode is not trained
    extras: dict = field(default_factory=dict)    # sample_idx → a reward function's logged fields
    episodes: dict = field(default_factory=dict)  # sample_idx → its env.episode.Episode (env.fn)

    @property
    def generated(self) -> bool:
        return len(self.samples) == self.prompt.n

    @property
    def scored(self) -> bool:
        return len(self.rewards) == self.prompt.n


def _parse_request_id(rid: str) -> tuple[str, int, int]:
    kind, pid, idx = rid.split(":")
    return kind, int(pid), int(idx)


class Generator(EngineRecovery, EpisodeLoop):
    """A generator rank's loop around its children: the vLLM engine, the reward pool, the
    environments of multi-turn episodes (env.fn; episodes.py) and the channel to the controller.
    `start` makes the children on a rank; a test passes its own."""

    def __init__(self, cfg: RunConfig, topo: Topology, *, engine=None, rewards=None, chan=None,
                 tokenizer=None, clock: GenClock | None = None, engine_factory=None, envs=None,
                 tool_calling=None):
        self.cfg, self.topo = cfg, topo
        # `engine_factory(version=...)` starts an engine like the first: a faulted one is
        # replaced by it (None: a fault ends the rank, as for a test's own engine)
        self.engine_factory, self.guard = engine_factory, None
        r = cfg.rollout
        hosts = getattr(topo, "hosts", None)
        self.me = f"generator rank {topo.rank}" + (f" (host {hosts[topo.rank]})" if hosts else "")
        self.restarts = RestartBudget(r.engine_restarts, r.engine_restart_window_s, self.me)
        self.last_fault, self._weights_path = "", None      # the newest loaded weights' files
        self.engine, self.rewards, self.chan, self.tokenizer = engine, rewards, chan, tokenizer
        self.per_request_seeds = seeded(cfg)     # rollout.per_request_seeds or deterministic
        self.groups: dict[tuple[str, int], _Group] = {}
        self._kept: dict[tuple[str, int, int], int] = {}   # a continued sample's earlier tokens
        # env.fn: the episodes' environments (env.runner.EnvRunner), the episodes in flight
        # (episodes.py) and those waiting for one of env.max_episodes places
        self.envs, self.episodes, self._queued = envs, {}, []
        self.tool_calling = tool_calling    # env.tool_parser: env/tool_calls.py ToolCalling
        # rollout.mode sync: training groups are sent in the order their prompts came
        # (`_send`): the prompt ids still to send, and the scored groups waiting for earlier ones
        self._in_order = cfg.rollout.mode == "sync"
        self._send_order: list[int] = []
        self._held: dict[int, _Group] = {}
        self.tokens_generated = 0
        self.regenerated = 0        # partial samples of a preempted job generated again (_submit)
        self.stale_aborted = 0      # training groups stopped as too stale (StaleBefore)
        self.clock = clock or GenClock()    # where the time went (generators.json; gen_clock.py)
        self._heartbeats = Pacer(cfg.rollout.heartbeat_s)
        self.preempted = False
        self._engine_lost = False
        self.awaiting: int | None = None    # weights version a new engine waits for (recovery.py)
        self.watch: ControllerWatch | None = None   # the controller's liveness, from the loop's start
        self._hold, self._holding = preemption.hold_hook(), False     # a test's (HOLD_HOOK_ENV)

    @classmethod
    def start(cls, cfg: RunConfig, topo: Topology) -> "Generator":
        """On a generator rank, once its node passed its start-up check (areal_hpc.main runs
        preflight.generator_node): the channel, the tokenizer, then the engine (joining the weight
        group) and the reward pool, kept out of a USR1's reach."""
        from transformers import AutoTokenizer

        chan = Channel(topo.world)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        tool_calling = (ToolCalling(tokenizer, cfg.env, read_chat_template(cfg.data.chat_template))
                        if cfg.env.tool_parser else None)
        with preemption.shield_children():     # engine processes must outlive a USR1
            r = cfg.rollout
            factory = functools.partial(
                VLLMEngine, cfg.model.path, dtype=cfg.model.dtype, seed=cfg.train.seed + topo.rank,
                tensor_parallel_size=topo.engine_tp, per_request_seeds=seeded(cfg),
                **engine_options(r))
            engine = factory()
            if cfg.weights.mode == "broadcast":
                engine.init_weight_group(topo.weight_group_address(cfg.weights),
                                         topo.weight_group_rank)
            rw = cfg.reward
            rewards = RewardPool(rw.workers, math_timeout_s=rw.math_timeout_s,
                                 unsafe_no_sandbox=rw.unsafe_no_sandbox, extractor=rw.extractor,
                                 functions=custom.specs_of(cfg), fn_timeout_s=rw.fn_timeout_s)
            envs = EnvRunner(cfg.env, cfg.env.max_episodes) if cfg.env.fn else None
        return cls(cfg, topo, engine=engine, rewards=rewards, chan=chan, tokenizer=tokenizer,
                   engine_factory=factory, envs=envs, tool_calling=tool_calling)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        self.watch = ControllerWatch(self.cfg.rollout, self.cfg.weights, self.topo.rank,
                                     self.topo.hosts, beacon=self.topo.controller_alive)
        if self.engine_factory is not None:
            self.guard = EngineWatch(self.engine, self.cfg.rollout.engine_stall_s)
        stuck.arm()                     # a rank alive but stuck is named (areal_hpc/stuck.py)
        running = True
        while running:
            stuck.progress()
            self._recover_idle_fault()
            self._tick()
            self._heartbeat()
            self.watch.check(incomplete=self.chan.incomplete())
            for _, tag, msg in self.chan.poll(source=CONTROLLER_RANK):
                self.watch.heard()
                running = self._handle(msgs.check(tag, msg))
                self._tick()
                # This rank's own work on the message (a weight load, an eval) is not silence.
                self.watch.heard()
                if not running:
                    break
            if not running:
                break
            with self.clock.timed("send"):
                for _, group in self._collect_rewards():     # eval groups never reach this loop
                    self._send(group)
            if self.engine.has_unfinished() and not self._engine_lost and self.awaiting is None \
                    and not self._held_by_test():
                with self.clock.timed("busy"):
                    self._generate()
                self._held_by_test()    # before a weight notice can move the version on
            else:       # nothing to generate: waiting on scores of finished samples, or on prompts
                scoring = bool(self.rewards.unfinished) or self._env_waiting()
                with self.clock.timed("idle_scoring" if scoring else "idle"):
                    self.chan.idle(source=CONTROLLER_RANK, timeout=0.005 if scoring else 0.05)
        self._finish()

    def _held_by_test(self) -> bool:
        """preemption.HOLD_HOOK_ENV: once the engine has the hook's weights version (or a later
        one, where no sample had tokens in between) and a sample has its tokens, the mark is
        written and the engine steps no more; the loop still answers the controller (its STOP
        ends the hold). Checked before and after each engine step."""
        if self._hold is None or self._holding:
            return self._holding
        version, tokens, path = self._hold
        if self.engine.version >= version and self.engine.longest_unfinished() >= tokens:
            self._holding = True
            Path(path).write_text(f"{self.me}: held at {self.engine.longest_unfinished()} tokens\n")
        return self._holding

    def _handle(self, msg) -> bool:
        """Act on one message from the controller; False once it says stop."""
        match msg:
            case msgs.Prompts() if self._engine_lost:
                # TERM took the engine with it (a preemption): these prompts stay in flight in
                # the controller's books, and the checkpoint issues them again on resume.
                log.info("generator rank %d: %d prompt(s) not started, the engine is gone",
                         self.topo.rank, len(msg.prompts))
            case msgs.Prompts(prompts=prompts):
                self.clock.start()
                with self.clock.timed("submit"):
                    for p in prompts:
                        self._guarded(self._submit, "train", p)
            case msgs.WeightsNotice() if not self._engine_lost:
                with self._engine_paused():
                    self._update_weights(msg)
            case msgs.StaleBefore(version=version) if not self._engine_lost:
                with self.clock.timed("send"):
                    self._guarded(self._abort_stale, version)
            case msgs.StepsDone():
                self.clock.end()
            case msgs.EvalRequest():
                with self.clock.timed("eval"), self._engine_paused():
                    self._evaluate(msg)
            case msgs.Stop(preempted=preempted):
                self.preempted = preempted
                if preempted:   # in-flight work goes back, to be continued on resume
                    self._send_partial()
                return False
        return True             # a ControllerBeat only says the controller is alive

    def _generate(self) -> None:
        """One engine step. SIGTERM at a preemption reaches the engine processes too: then the
        engine is written off and the loop waits for the controller's STOP, instead of failing
        the job before its checkpoint."""
        try:
            self._step()
        except Exception:
            if not preemption.requested():
                log.error("generator rank %d (host %s): its vLLM engine failed",
                          self.topo.rank, self.topo.hosts[self.topo.rank])
                raise
            log.warning("vLLM engine lost during preemption; waiting for stop")
            self._engine_lost = True

    def _finish(self) -> None:
        """After STOP: the totals to the controller, then the reward pool and the engine end."""
        self.clock.end()
        msgs.post(self.chan, msgs.GeneratorStats(
            self.topo.rank, self.tokens_generated, dict(self.clock.seconds), self.engine.version,
            self.rewards.stats(), self.stale_aborted, self.clock.engine_s, self.restarts.total),
            CONTROLLER_RANK)
        self.chan.flush(timeout=60)
        self.rewards.close()
        if self.envs is not None:   # the episodes still running get their close(), briefly
            self.envs.close(ending_s=min(self.cfg.env.call_timeout_s, ENV_ENDING_S))
        if self.guard is not None:
            self.guard.close()
        try:
            self.engine.shutdown()
        except Exception as exc:    # noqa: BLE001 - an engine lost to the preemption's signal
            if not self._engine_lost:
                raise
            log.warning("generator rank %d: shutting down the lost vLLM engine: %s",
                        self.topo.rank, exc)

    def _heartbeat(self, force: bool = False, down: bool = False) -> None:
        """Tell the controller this loop still turns (at most every rollout.heartbeat_s): a
        generator that falls silent (hung engine, stopped or lost process) is named by the
        trainer after rollout.generator_timeout_s instead of being waited on forever. `down`:
        its engine is being replaced (the controller allows the time to start one)."""
        if self._heartbeats.due() or force:
            msgs.post(self.chan, msgs.Heartbeat(
                self.engine.version, 0 if down else self.engine.num_running(),
                self.tokens_generated, self.restarts.total, down, self.last_fault),
                CONTROLLER_RANK)

    def _tick(self, count: bool = True) -> None:
        """The engine's occupancy clock (GenClock.tick): a lost engine has no work."""
        self.clock.tick(not self._engine_lost and self.engine.has_unfinished(), count)

    @contextmanager
    def _engine_paused(self):
        """A weight load or an evaluation: not the engine's training work (`engine_s`)."""
        self._tick()
        yield
        self._tick(count=False)

    def _sampling(self, kind: str) -> dict:
        r = self.cfg.rollout
        return dict(temperature=r.temperature, top_p=r.top_p,
                    ignore_eos=r.ignore_eos and kind == "train")

    def _seeds(self, kind: str, pid: int, n: int) -> list[int] | None:
        """The group's per-sample seeds (sample i: group_seed + i), None without them."""
        seed0 = group_seed(self.cfg.train.seed, kind, pid)
        return None if not self.per_request_seeds else [seed0 + i for i in range(n)]

    def _submit(self, kind: str, prompt: msgs.Prompt) -> None:
        r = self.cfg.rollout
        self.groups[(kind, prompt.prompt_id)] = _Group(prompt)
        pid, sampling = prompt.prompt_id, self._sampling(kind)
        if kind == "train" and self._in_order:
            self._send_order.append(pid)
        seeds = self._seeds(kind, pid, prompt.n)
        if self.envs is not None:
            self._start_episodes(kind, prompt, seeds)
            return
        # A preempted job's partial outputs: each goes on from its prefix (a finished one is
        # scored again); the samples that had no token yet start afresh below, and so, with
        # per-request seeds, does an unfinished one whose tokens all came from the weights this
        # engine holds: generated again from its own seed it draws what the uninterrupted run
        # drew (its prefix too), where a continuation would draw from a continuation seed.
        earlier = {int(c.sample_idx): c for c in prompt.continued
                   if len(c.output_tokens) or c.finish_reason != "abort"}
        if seeds:
            again = [i for i, c in earlier.items() if c.finish_reason == "abort"
                     and (np.asarray(c.versions) == self.engine.version).all()]
            for i in again:
                del earlier[i]
            if again:
                self.regenerated += len(again)
                log.info("prompt %d: %d partial sample(s) generated again from their seeds (their "
                         "tokens came from the weights held now, version %d)", pid, len(again),
                         self.engine.version)
        for idx, c in sorted(earlier.items()):
            self.engine.continue_sample(FinishedSample(
                request_id(kind, pid, idx), np.asarray(prompt.prompt_tokens, dtype=np.int32),
                np.asarray(c.output_tokens), np.asarray(c.behav_logprobs), np.asarray(c.versions),
                c.finish_reason, c.t_submit, c.t_first_token, c.t_end,
                seed=seeds and seeds[idx]),
                r.max_new_tokens, **sampling)
            self._kept[(kind, pid, idx)] = len(c.output_tokens)   # not generated here
        fresh = [i for i in range(prompt.n) if i not in earlier]
        if fresh:
            self.engine.submit_group([request_id(kind, pid, i) for i in fresh],
                                     prompt.prompt_tokens, max_new_tokens=r.max_new_tokens,
                                     seeds=seeds and [seeds[i] for i in fresh], **sampling)

    def _step(self) -> None:
        """One engine step; every finished sample goes to the reward pool at once. An engine
        fault (not a preemption's) is recovered here (`_recover`)."""
        def step():
            with self._busy():
                return self.engine.step()
        for smp in self._guarded(step) or ():
            kind, pid, idx = _parse_request_id(smp.request_id)
            if (kind, pid, idx) in self.episodes:
                self._turn_done(kind, pid, idx, smp)
            else:
                self._finished(kind, pid, idx, smp)

    def _record(self, kind: str, pid: int, idx: int, smp: FinishedSample) -> _Group:
        """A sample ends (finished or stopped): into its group, the tokens generated here counted."""
        group = self.groups[(kind, pid)]
        group.samples[idx] = smp
        self.tokens_generated += len(smp.output_tokens) - self._kept.pop((kind, pid, idx), 0)
        return group

    def _finished(self, kind: str, pid: int, idx: int, smp: FinishedSample) -> None:
        """A sample is done: recorded, and to the reward pool."""
        group = self._record(kind, pid, idx, smp)
        text = self.tokenizer.decode(smp.output_tokens, skip_special_tokens=True)
        self.rewards.submit((kind, pid, idx), group.prompt.reward_kind, text,
                            group.prompt.reference, group.prompt.row)

    def _collect_rewards(self, timeout: float = 0.0) -> list[tuple[str, _Group]]:
        """Scores that arrived (and episodes that ended); returns the groups now fully generated
        and scored."""
        complete = self._poll_episodes() if self.envs is not None else []
        for res in self.rewards.done(timeout):
            kind, pid, idx = res.key
            group = self.groups.get((kind, pid))
            if group is None:       # an evaluation's prompt left out (`_abandon_eval`)
                continue
            group.rewards[idx] = res.reward
            if res.extras:
                group.extras[idx] = res.extras
            if res.error:
                group.errors[idx] = res.error
                log.warning("reward for prompt %d sample %d: %s (scored 0)", pid, idx, res.error)
            if group.generated and group.scored:
                complete.append((kind, self.groups.pop((kind, pid))))
        return complete

    def _trajectories(self, group: _Group) -> list[msgs.Trajectory]:
        """One trajectory dict per sample (docs/architecture.md#data-contract); a sample not
        scored yet (a partial group) has reward 0."""
        p = group.prompt
        return [{
            "prompt_id": p.prompt_id, "sample_idx": idx,
            "prompt_tokens": np.asarray(p.prompt_tokens, dtype=np.int32),
            "output_tokens": s.output_tokens, "behav_logprobs": s.behav_logprobs,
            "versions": s.versions, "reward": group.rewards.get(idx, 0.0),
            "finish_reason": s.finish_reason, "generator_rank": self.topo.rank,
            "t_submit": s.t_submit, "t_first_token": s.t_first_token, "t_end": s.t_end,
            "reward_error": group.errors.get(idx, ""), "reward_extra": group.extras.get(idx, {}),
            "seed": -1 if s.seed is None else int(s.seed), "discard": group.discards.get(idx, ""),
            **self._episode_fields(group.episodes.get(idx)),
        } for idx, s in sorted(group.samples.items())]

    @staticmethod
    def _episode_fields(episode) -> dict:
        """A multi-turn episode's own prompt (its environment's), mask, turns and tool calls
        (nothing for a single-turn sample)."""
        if episode is None:
            return {}
        a = episode.arrays()
        return {"prompt_tokens": a["prompt"], "loss_mask": a["loss_mask"], "turn_ends": a["turn_ends"],
                "turn_is_sample": a["turn_is_sample"], "tool_calls": list(episode.tool_calls)}

    def _send(self, group: _Group) -> None:
        """A scored training group to the controller; in sync mode once every group whose
        prompt came before it here has been sent (`_in_order`)."""
        if not self._in_order:
            msgs.post(self.chan, msgs.Group(self._trajectories(group)), CONTROLLER_RANK)
            return
        self._held[group.prompt.prompt_id] = group
        self._send_held()

    def _send_held(self, every: bool = False) -> None:
        """The held groups that are next in prompt order (`every`: all of them, in order)."""
        while self._send_order and (every or self._send_order[0] in self._held):
            group = self._held.pop(self._send_order.pop(0), None)
            if group is not None:
                msgs.post(self.chan, msgs.Group(self._trajectories(group)), CONTROLLER_RANK)

    def _abort_stale(self, version: int) -> None:
        """Stop generating every training group with a token older than `version` (the
        controller would drop it on arrival) and send it as far as it got: its unfinished
        samples end with finish_reason "abort" and reward 0, unscored; its finished ones keep
        their scores (a group still being scored is sent when they arrive)."""
        if self.envs is not None:
            self._abort_stale_episodes(version)
            return
        for (kind, pid), group in list(self.groups.items()):
            if kind != "train" or group.generated:
                continue
            running = [request_id(kind, pid, i) for i in range(group.prompt.n)
                       if i not in group.samples]
            firsts = [v for v in (self.engine.oldest_version(r) for r in running) if v is not None]
            firsts += [int(s.versions[0]) for s in group.samples.values() if len(s.versions)]
            if not firsts or min(firsts) >= version:
                continue
            for smp in self.engine.abort(running):
                idx = _parse_request_id(smp.request_id)[2]
                if smp.finish_reason != "abort":    # finished before the abort: scored as any
                    self._finished(kind, pid, idx, smp)
                else:
                    self._record(kind, pid, idx, smp).rewards[idx] = 0.0
            self.stale_aborted += 1
            if group.scored:
                self._send(self.groups.pop((kind, pid)))

    def _send_partial(self) -> None:
        """At a preemption: abort every sample and send each training group still here (being
        generated, or generated and being scored) with all its samples as far as they got. The
        engine's outputs so far live in this process, so this takes milliseconds, inside any
        signal window, also when the engine's processes were already killed. Eval groups are
        dropped (an evaluation is rerun whole)."""
        self._send_held(every=True)     # scored groups held for order: complete, sent as such
        turns = {}
        for smp in self.engine.abort_all():
            kind, pid, idx = _parse_request_id(smp.request_id)
            if (kind, pid, idx) in self.episodes:
                turns[smp.request_id] = smp
            elif (kind, pid) in self.groups:
                self.groups[(kind, pid)].samples[idx] = smp
        if self.envs is not None:
            self._partial_episodes(turns)
        train = [g for (kind, _), g in sorted(self.groups.items()) if kind == "train"]
        partial = [self._trajectories(g) for g in train if g.generated]
        if len(partial) < len(train):   # every submitted sample is in the engine's outputs
            log.warning("generator rank %d: %d in-flight group(s) without all their samples "
                        "not kept", self.topo.rank, len(train) - len(partial))
        tokens = sum(len(t["output_tokens"]) for g in partial for t in g)
        log.info("generator rank %d: preempted with %d group(s) in flight, %d tokens kept",
                 self.topo.rank, len(partial), tokens)
        msgs.post(self.chan, msgs.Partial(partial), CONTROLLER_RANK)

    def _evaluate(self, msg: msgs.EvalRequest) -> None:
        """Held-out accuracy at the current version: run the eval prompts to completion here,
        without taking weight updates, so every eval token comes from one policy version."""
        t0 = time.monotonic()
        pending = set()
        for p in msg.prompts:
            self._guarded(self._submit, "eval", p)
            pending.add(p.prompt_id)
        results = []
        while pending:
            self._heartbeat()
            if self.awaiting is not None:       # the engine failed: no weights to generate with
                self._abandon_eval(pending)
            elif self.engine.has_unfinished():
                self._step()
            for kind, group in self._collect_rewards(0.0 if self.engine.has_unfinished() else 0.05):
                if kind == "train":
                    self._send(group)
                    continue
                pending.discard(group.prompt.prompt_id)
                results.append({"prompt_id": group.prompt.prompt_id,
                                "rewards": [group.rewards[i] for i in range(group.prompt.n)]})
        results.sort(key=lambda x: x["prompt_id"])     # not in the order the scores came
        msgs.post(self.chan, msgs.EvalResult(self.engine.version, results, time.monotonic() - t0),
                  CONTROLLER_RANK)


def run_generator(cfg: RunConfig, topo: Topology) -> int:
    """Returns the exit code: 0, or EXIT_PREEMPTED when the controller stopped for a preemption."""
    gen = Generator.start(cfg, topo)
    gen.run()
    return preemption.EXIT_PREEMPTED if gen.preempted else 0
