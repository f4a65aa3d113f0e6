"""Multi-turn episodes on a generator rank (env.fn set; docs/environments.md), mixed into
`Generator`.

Each sample of a group is an episode (env/episode.py): its environment (env/runner.py, a child
process of its own) gives the first prompt; the model's turn is one engine request on the
episode's whole sequence so far, ending at a turn stop (env.turn_stop), EOS or its length; the
environment's answer to it (a future, so a slow tool holds its own episode only: the engine goes
on decoding every other request) is appended as observation tokens, and the next turn is
submitted, until the environment says done or a bound cuts it. Nothing is tokenised twice: a
turn's request is the episode's ids, and its sampled ids are appended as they came.

Weight updates interrupt a turn as they do a single-turn sample (the engine resubmits it from
its prefix; its later tokens carry the new version); an engine restart continues it the same
way. At a preemption each episode in flight goes back as far as it got, its finish_reason
saying where it stood: "abort" (in the middle of a model turn, which the resumed job continues),
"abort_env" (the model's last turn was answered, or its answer was in flight). The resumed job
brings a fresh environment to that point by stepping it through the saved model turns (their
answers not appended again: the saved tokens are the ones trained; their rewards and tool
records taken again), then goes on. An episode that had no token yet starts afresh.

Native tool calling (env.tool_parser, env/tool_calls.py): the first prompt declares the tools
through the chat template; each model turn is parsed by vLLM's tool parser, its calls go to the
environment's `call` one after another (phase "calls"), and the results are appended as the
chat template's tool messages; a turn without a call is the answer, stepped as any turn.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Optional

import numpy as np

from ..data.prompts import prompt_ids
from ..env.base import Step, ToolCall, turn_stops
from ..env.episode import MAX_CHARS_PER_TOKEN, OBSERVATION, SAMPLE, Episode
from ..env.tool_calls import ParsedTurn
from ..transport import messages as msgs
from .recovery import request_id
from .seeds import continuation_seed
from .staleness import oldest_sampled
from .vllm_engine import FinishedSample

log = logging.getLogger(__name__)

# finish_reason of an episode in flight at a preemption (storage/rollout_log.py FINISH_REASONS)
MID_TURN, AT_ENV = "abort", "abort_env"


@dataclass
class _Ep:
    """One episode in flight: its sample's key, row and seed, its sequence once the environment
    gave the first prompt, and what it waits for (`future`: the environment's answer; else its
    model turn is in the engine)."""
    kind: str
    pid: int
    idx: int
    row: dict
    seed: Optional[int]
    t_submit: float
    episode: Optional[Episode] = None
    future: object = None
    phase: str = ""             # "queued" (env.max_episodes run), "reset", "restore", "step"
    #                             (a future), "turn" (its model turn in the engine)
    continues: bool = False     # the turn in the engine continues the last model turn
    resume: str = ""            # a restored episode: its saved finish_reason
    t_first: Optional[float] = None
    interrupts: int = 0
    parsed: Optional[ParsedTurn] = None     # native tool calling: the turn whose calls run


def env_row(prompt: msgs.Prompt) -> dict:
    """The data row an environment's reset gets: the dataset's own, whole, as the controller
    sent it (with "question" and "answer" as the run reads them), else the prompt's answer as
    "answer"."""
    return dict(prompt.row) if prompt.row else {"answer": prompt.reference}


class EpisodeLoop:
    """The episode side of `Generator` (its attributes: cfg, engine, groups, tokenizer, envs:
    an env.runner.EnvRunner or None, episodes)."""

    # -- starting -------------------------------------------------------------------------------
    def _start_episodes(self, kind: str, prompt: msgs.Prompt, seeds: list[int] | None) -> None:
        """A prompt's n episodes: each from its environment's reset, or, continued from a
        preempted job, its saved tokens once a fresh environment has been brought there."""
        earlier = {int(c.sample_idx): c for c in prompt.continued}
        row = env_row(prompt)
        for idx in range(prompt.n):
            ep = _Ep(kind, prompt.prompt_id, idx, row, seeds and seeds[idx], time.time(),
                     phase="queued")
            key = (kind, prompt.prompt_id, idx)
            self.episodes[key] = ep
            c = earlier.get(idx)
            if c is not None and len(c.output_tokens) and c.prompt_tokens is not None:
                ep.episode, ep.resume = self._restored(c), c.finish_reason
                ep.t_submit, ep.t_first = c.t_submit, c.t_first_token
                self._kept[key] = int(np.sum(ep.episode.loss_mask))
            self._queued.append(key)
        self._start_queued()

    def _start_queued(self) -> None:
        """Start waiting episodes while fewer than env.max_episodes run (each holds a process)."""
        while self._queued and len(self.episodes) - len(self._queued) < self.cfg.env.max_episodes:
            key = self._queued.pop(0)
            ep = self.episodes.get(key)
            if ep is None:
                continue
            if (ep.kind, ep.pid) not in self.groups:    # an evaluation's prompt left out
                del self.episodes[key]
                continue
            if ep.episode is None:
                ep.future, ep.phase = self.envs.reset(key, ep.row), "reset"
                continue
            turns = ep.episode.sampled_turns()[:self._replayed_turns(ep)]
            ep.future, ep.phase = self.envs.restore(key, ep.row, [
                (self._text(ids), ids, self._replayed_calls(ids)) for ids in turns]), "restore"

    def _restored(self, c: msgs.Continuation) -> Episode:
        """The episode a PARTIAL row saved, token for token (its rewards and tool records come
        again from the environment's replay)."""
        e, kinds = self.cfg.env, []
        start = 0
        for end, sampled in zip(np.asarray(c.turn_ends).tolist(),
                                np.asarray(c.turn_is_sample).tolist()):
            kinds.append([SAMPLE if sampled else OBSERVATION, start, int(end)])
            start = int(end)
        mask = c.loss_mask if c.loss_mask is not None else np.ones(len(c.output_tokens))
        return Episode.from_state({
            "prompt_ids": [int(t) for t in c.prompt_tokens], "max_tokens": self._episode_tokens(),
            "max_turns": e.max_turns, "template": e.observation_template,
            "output": np.asarray(c.output_tokens).tolist(), "loss_mask": np.asarray(mask).tolist(),
            "logprobs": np.asarray(c.behav_logprobs, np.float64).tolist(),
            "versions": np.asarray(c.versions).tolist(), "turns": kinds, "tool_calls": [],
            "rewards": [], "done": False, "cut": None, "error": None}, encode=self._encode,
            vocab_size=self._vocab_size)

    @staticmethod
    def _replayed_turns(ep: _Ep) -> int:
        """How many of a restored episode's model turns its environment had answered: all but
        the last when the model was writing it (MID_TURN), or when its answer was in flight
        (AT_ENV, the last turn a model turn: stepped again, for real, after the replay)."""
        ep_, n = ep.episode, ep.episode.n_turns
        last_sampled = bool(ep_.turns) and ep_.turns[-1].kind == SAMPLE
        return n - 1 if (ep.resume == MID_TURN or last_sampled) and n else n

    # -- the loop's side ------------------------------------------------------------------------
    def _episode_tokens(self) -> int:
        """env.max_episode_tokens, or the engine's bound (rollout.max_model_len) when unset."""
        return self.cfg.env.max_episode_tokens or self.cfg.rollout.max_model_len

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @cached_property
    def _vocab_size(self) -> int:
        """The ids the engine takes: below the larger of the tokenizer's size and the model's
        vocab_size (config.json), as vLLM checks a request's ids (an environment's id past it
        ends its episode, not the generator)."""
        try:
            model = json.loads((Path(self.cfg.model.path) / "config.json").read_text())["vocab_size"]
        except (OSError, ValueError, KeyError, TypeError):
            model = 0
        return max(len(self.tokenizer), int(model))

    def _text(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _env_waiting(self) -> bool:
        return any(ep.future is not None for ep in self.episodes.values())

    def _submit_turn(self, ep: _Ep, continued: FinishedSample | None = None) -> None:
        """The episode's next model turn (or its cut one, `continued`, on a new engine) to the
        engine: the whole sequence so far, the turn stops, at most rollout.max_new_tokens and
        what the episode has left."""
        r, eps = self.cfg.rollout, ep.episode
        strings, ids = turn_stops(self.cfg.env)
        sampling = dict(self._sampling(ep.kind), stop=strings, stop_token_ids=ids)
        ep.future, ep.phase = None, "turn"
        # a continued turn's tokens before this request are in the episode already
        before = eps.turns[-1].end - eps.turns[-1].start if ep.continues else 0
        limit = min(r.max_new_tokens - before, eps.budget_left)
        if ep.continues and limit <= 0 and (continued is None or not len(continued.output_tokens)):
            # a cut turn that already has all its tokens (its end was still in flight): it ends
            self._turn_done(ep.kind, ep.pid, ep.idx, self._empty_turn(ep))
            return
        # (a request with tokens from an old engine and none left ends at once: the engine's
        # resubmission finishes it as "length")
        limit = max(1, limit)
        if continued is None and ep.continues:
            continued = self._empty_turn(ep)
        if continued is not None:       # `limit` counts its tokens from the old engine too
            # (the turn's tokens in the episode end its prompt: a stop string may begin there)
            self.engine.continue_sample(continued, limit, **sampling, stop_context=before)
        else:
            self.engine.submit(request_id(ep.kind, ep.pid, ep.idx), eps.ids, limit,
                               seed=self._turn_seed(ep), **sampling)

    def _turn_done(self, kind: str, pid: int, idx: int, smp: FinishedSample) -> None:
        """A model turn ended (a turn stop, EOS, its length): appended as sampled, and its text
        and ids to the environment."""
        ep = self.episodes[(kind, pid, idx)]
        if len(smp.output_tokens) and ep.t_first is None:
            ep.t_first = smp.t_first_token
        ep.interrupts += smp.num_interrupts
        ep.episode.add_sample(smp.output_tokens, smp.behav_logprobs, smp.versions,
                              continues=ep.continues)
        ep.continues = False
        self._ask(ep, ep.episode.sampled_turns()[-1])

    def _ask(self, ep: _Ep, turn: list[int]) -> None:
        """The environment's answer to the model's last turn, as a future: its step, or, with
        native tool calling, the turn's tool calls (a turn without one is the answer: a step)."""
        key = (ep.kind, ep.pid, ep.idx)
        parsed = self._parse(turn)
        if parsed is None or parsed.is_answer:
            ep.future, ep.phase = self.envs.step(key, self._text(turn), turn), "step"
        else:
            ep.parsed = parsed
            ep.future, ep.phase = self.envs.call(key, parsed.calls), "calls"

    def _parse(self, turn: list[int]) -> ParsedTurn | None:
        if self.tool_calling is None:
            return None
        # special tokens kept: some models' call tags are special tokens (vLLM's server too)
        return self.tool_calling.parse(self.tokenizer.decode(list(turn), skip_special_tokens=False))

    def _replayed_calls(self, turn: list[int]) -> list | None:
        """What a resumed episode's environment is asked for a saved model turn: its tool calls
        (native tool calling), else None (its step)."""
        parsed = self._parse(turn)
        return None if parsed is None or parsed.is_answer else parsed.calls

    def _after_calls(self, ep: _Ep, steps: list[Step]) -> None:
        """A turn's tool calls answered: their results (and the calls that could not be made,
        answered with their error, in the turn's order) appended as the chat template's tool
        messages, then the next turn; a call that ends the episode (the environment failed,
        or discarded it) ends it there."""
        eps, parsed, ep.parsed = ep.episode, ep.parsed, None
        if steps and (steps[-1].error is not None or steps[-1].done):
            eps.tool_calls += [s.tool for s in steps[:-1] if s.tool is not None]
            eps.apply(steps[-1])
            return
        made = iter(steps)
        results, records = [], []
        for item in parsed.order:
            if isinstance(item, ToolCall):          # could not be made: its error answers it
                results.append(f"error: {item.error}")
                records.append(item)
                continue
            s = next(made)
            eps.add_reward(s.reward)
            results.append(s.observation)
            records.append(s.tool)
        room = max(0, eps.budget_left) * MAX_CHARS_PER_TOKEN     # bounded before tokenising
        ids = self.tool_calling.observation([r[:room] for r in results],
                                            last_token=eps.sampled_turns()[-1][-1])
        eps.tool_calls += [r for r in records if r is not None]
        try:
            eps.add_observation(ids)
        except ValueError as exc:   # an id past the vocabulary: this episode ends
            eps.finish(error=f"calls: {exc}", cause="refused")
            return
        eps.after_turn()
        if not eps.done:
            self._submit_turn(ep)

    def _poll_episodes(self) -> list[tuple[str, object]]:
        """Take the environments' answers that came; returns the groups now complete."""
        complete = []
        for key, ep in list(self.episodes.items()):
            gone = (ep.kind, ep.pid) not in self.groups     # an evaluation's prompt left out
            if gone and ep.phase == "turn":
                self._end_episode(key)
            if ep.future is None or not ep.future.done():
                continue
            result, ep.future = ep.future.result(), None
            if gone:
                self._end_episode(key)
                continue
            getattr(self, f"_after_{ep.phase}")(ep, result)
            if ep.episode is not None and ep.episode.done:
                group = self._episode_over(key, ep)
                if group.generated:
                    complete.append((ep.kind, self.groups.pop((ep.kind, ep.pid))))
        return complete

    def _after_reset(self, ep: _Ep, step: Step) -> None:
        prompt = self.groups[(ep.kind, ep.pid)].prompt
        if step.error is None and step.observation is None:
            step = Step(done=True, error="reset gave no prompt", cause="refused")
        if step.error is not None:
            ep.episode = Episode(prompt.prompt_tokens, max_tokens=self._episode_tokens(),
                                 max_turns=self.cfg.env.max_turns)
            ep.episode.finish(error=step.error, cause=step.cause)
            return
        first = step.observation
        tools = self.tool_calling.tools if self.tool_calling is not None else None
        ids = (prompt_ids(self.tokenizer, self.cfg.data, first, tools) if isinstance(first, str)
               else [int(t) for t in first])
        e = self.cfg.env
        try:
            ep.episode = Episode(ids, max_tokens=self._episode_tokens(), max_turns=e.max_turns,
                                 encode=self._encode, template=e.observation_template,
                                 vocab_size=self._vocab_size)
        except ValueError as exc:   # a prompt longer than the episode's bound, an id past the vocabulary
            ep.episode = Episode(prompt.prompt_tokens, max_tokens=1 << 30, max_turns=1)
            ep.episode.finish(error=f"reset: {exc}", cause="refused")
            return
        self._submit_turn(ep)

    def _after_step(self, ep: _Ep, step: Step) -> None:
        try:
            ep.episode.apply(step)
        except ValueError as exc:   # an observation's id past the vocabulary: this episode ends
            ep.episode.finish(error=f"step: {exc}", cause="refused")
        if not ep.episode.done:
            self._submit_turn(ep)

    def _after_restore(self, ep: _Ep, steps: list[Step]) -> None:
        """The fresh environment replayed the saved model turns: their rewards and tool records
        taken again (their observations are in the saved tokens); then the episode goes on."""
        eps = ep.episode
        failed = next((s for s in steps if s.error is not None), None)
        if failed is not None:
            eps.finish(error=f"replaying the episode: {failed.error}", cause=failed.cause)
            return
        for s in steps[1:]:
            eps.add_reward(s.reward)
            if s.tool is not None:
                eps.tool_calls.append(s.tool)
            if s.done:      # a replay that ends where the episode went on: not deterministic
                eps.finish(error="replaying the episode: the environment ended it early",
                           cause="refused")
                return
        last_sampled = bool(eps.turns) and eps.turns[-1].kind == SAMPLE
        if ep.resume == MID_TURN and last_sampled:
            ep.continues = True         # the model goes on with the turn it was writing
            self._submit_turn(ep)
        elif last_sampled:              # its answer was in flight: asked again
            self._ask(ep, eps.sampled_turns()[-1])
        else:
            eps.after_turn()
            if not eps.done:
                self._submit_turn(ep)

    @staticmethod
    def _turn_seed(ep: _Ep) -> Optional[int]:
        """The seed of a request for the episode's next tokens: its sample's seed continued at
        the tokens it has (`continuation_seed`), so that no two of its requests share one."""
        return None if ep.seed is None else continuation_seed(ep.seed, len(ep.episode.output))

    def _end_episode(self, key) -> None:
        ep = self.episodes.pop(key, None)
        if ep is not None and ep.phase != "queued":
            self.envs.finish(key)
        self._start_queued()

    def _episode_over(self, key, ep: _Ep):
        """An episode ended: its sample and reward into its group, its environment freed."""
        self._end_episode(key)
        group = self.groups[(ep.kind, ep.pid)]
        group.samples[ep.idx] = self._episode_sample(ep, self._end_reason(ep.episode))
        group.episodes[ep.idx] = ep.episode
        group.rewards[ep.idx] = ep.episode.reward
        if ep.episode.error:
            group.errors[ep.idx] = ep.episode.error
            group.discards[ep.idx] = ep.episode.discard
            log.warning("episode of prompt %d sample %d discarded (%s): %s (reward %.3g)", ep.pid,
                        ep.idx, ep.episode.discard, ep.episode.error, ep.episode.reward)
        self.tokens_generated += int(np.sum(ep.episode.loss_mask)) - self._kept.pop(key, 0)
        return group

    @staticmethod
    def _end_reason(episode: Episode) -> str:
        """The finish reason of an ended episode: its cut (env.episode's CUT_TURNS or
        CUT_TOKENS), else "stop"."""
        return episode.cut or "stop"

    def _episode_sample(self, ep: _Ep, reason: str) -> FinishedSample:
        a, now = ep.episode.arrays(), time.time()
        return FinishedSample(request_id(ep.kind, ep.pid, ep.idx), a["prompt"], a["output"],
                              a["behav_logprobs"], a["versions"], reason, ep.t_submit,
                              ep.t_first or now, now, ep.interrupts, ep.seed)

    # -- a preemption, an engine restart ---------------------------------------------------------
    def _abort_stale_episodes(self, version: int) -> None:
        """StaleBefore: stop every training group whose episodes hold a sampled token older than
        `version` (the controller drops it on arrival) and send it as far as it got, as
        `Generator._abort_stale` does single-turn groups: its turns in the engine aborted, its
        environments ended (one answering a call, once it has answered), the episodes not ended
        yet with reward 0 and where they stood."""
        for (kind, pid), group in list(self.groups.items()):
            keys = [k for k in self.episodes if k[:2] == (kind, pid)]
            if kind != "train" or not keys:
                continue
            oldest = [self.engine.oldest_version(request_id(*k)) for k in keys]
            oldest += [self.episodes[k].episode.oldest_version for k in keys
                       if self.episodes[k].episode is not None]
            oldest += [oldest_sampled(s.versions) for s in group.samples.values()]
            oldest = [v for v in oldest if v is not None]
            if not oldest or min(oldest) >= version:
                continue
            self._queued = [q for q in self._queued if q not in keys]
            turns = {s.request_id: s for s in self.engine.abort(
                [request_id(*k) for k in keys if self.episodes[k].phase == "turn"])}
            self._partial_episodes(turns, set(keys))
            for k in keys:
                self._end_episode(k)
                group.rewards.setdefault(k[2], 0.0)
                self.tokens_generated += int(np.sum(group.samples[k[2]].versions >= 0)) \
                    - self._kept.pop(k, 0)
            self.stale_aborted += 1
            self._send(self.groups.pop((kind, pid)))

    def _partial_episodes(self, aborted: dict, keys: set | None = None) -> None:
        """At a preemption: every training episode in flight (of `keys`: those) into its group
        as far as it got (`aborted`: the engine's turns, by request id), with where it stood
        (module doc)."""
        for key, ep in list(self.episodes.items()):
            group = self.groups.get((ep.kind, ep.pid))
            if ep.kind != "train" or group is None or (keys is not None and key not in keys):
                continue
            eps, reason = ep.episode, AT_ENV
            if ep.phase in ("restore", "queued") and eps is not None:
                reason = ep.resume
            elif ep.phase == "turn":
                smp = aborted.get(request_id(*key))
                if smp is not None and len(smp.output_tokens):
                    eps.add_sample(smp.output_tokens, smp.behav_logprobs, smp.versions,
                                   continues=ep.continues)
                    reason = MID_TURN
                elif ep.continues or not eps.output:
                    reason = MID_TURN
            if eps is None:     # no prompt from its environment yet: started afresh on resume
                group.samples[ep.idx] = FinishedSample(
                    request_id(*key), np.asarray(group.prompt.prompt_tokens, np.int32),
                    np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32),
                    MID_TURN, ep.t_submit, ep.t_submit, time.time(), seed=ep.seed)
                continue
            group.samples[ep.idx] = self._episode_sample(ep, reason)
            group.episodes[ep.idx] = eps

    def _continue_episodes(self, samples: dict) -> tuple[list[int], int]:
        """After an engine restart: each episode's model turn that was in the old engine goes on
        from its tokens on the new one (one it had finished is taken as finished); one the old
        engine had no record of is submitted again. Returns (tokens kept per turn, turns
        started again)."""
        kept, fresh = [], 0
        for key, ep in list(self.episodes.items()):
            if ep.phase != "turn" or (ep.kind, ep.pid) not in self.groups:
                continue
            smp = samples.get(request_id(*key))
            if smp is None:
                fresh += 1
                self._submit_turn(ep)
            elif smp.finish_reason != "abort":
                self._turn_done(*key, smp)
            else:
                self._submit_turn(ep, smp)
                kept.append(len(smp.output_tokens))
        return kept, fresh

    def _empty_turn(self, ep: _Ep) -> FinishedSample:
        return FinishedSample(request_id(ep.kind, ep.pid, ep.idx),
                              np.asarray(ep.episode.ids, np.int32), np.zeros(0, np.int32),
                              np.zeros(0, np.float32), np.zeros(0, np.int32), "abort",
                              ep.t_submit, ep.t_first or ep.t_submit, time.time(),
                              seed=self._turn_seed(ep))
