"""One episode's token sequence, built token in and token out (pure: no engine, no process).

The sequence is the prompt's ids, then, turn after turn, the ids the model sampled (with their
log-probabilities and policy versions, as the engine gave them) and the ids of the environment's
observation, appended as they come. Nothing already in it is decoded or tokenised again: a
sampled turn whose text would tokenise otherwise (a tokenizer's merges make ``decode`` then
``encode`` differ from the sampled ids) keeps its sampled ids, which are the ones trained. An
observation's text is tokenised once, when it is appended (``encode``: the tokenizer's, without
special tokens), after ``template`` wraps it; an observation given as ids is appended as it is,
between the template's two parts, each tokenised once.

Per output token (everything after the prompt): ``loss_mask`` 1 for a sampled token, 0 for an
observation token; ``logprobs`` the behaviour log-probability (0.0 for an observation token, so
that a sum over masked tokens stays finite); ``versions`` the policy version that sampled it (-1
for an observation token). ``turns`` holds each turn's [start, end) in the output and its kind;
``tool_calls`` the environment's tool records, in order. The episode's staleness is its oldest
sampled token's version (``oldest_version``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from .base import MAX_TOKEN_ID, Step, ToolCall

SAMPLE, OBSERVATION = "sample", "observation"
NO_VERSION = -1
# why an episode ended before its environment said done
CUT_TURNS, CUT_TOKENS = "max_turns", "max_episode_tokens"
# A text observation is cut to this many characters per token the episode has left before it is
# tokenised (a token covers fewer on any text a tokenizer meets): an observation of megabytes
# costs the generator's loop a bounded tokenisation, and the episode ends cut, as it would have.
MAX_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class Turn:
    kind: str       # SAMPLE or OBSERVATION
    start: int      # offsets into the output (the tokens after the prompt)
    end: int


def _ids(ids, what: str, vocab_size: int | None = None) -> list[int]:
    out = [int(i) for i in ids]
    top = MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
    bad = next((i for i in out if not 0 <= i <= top), None)
    if bad is not None:
        raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {top}]")
    return out


class Episode:
    """Append turns with ``add_sample`` and ``add_observation``; read the arrays at any time."""

    def __init__(self, prompt_ids: Sequence[int], *, max_tokens: int, max_turns: int,
                 encode: Optional[Callable[[str], list[int]]] = None,
                 template: str = "{observation}", vocab_size: Optional[int] = None):
        # vocab_size: the engine's (an id at or past it is refused here, not by the engine)
        self.vocab_size = vocab_size
        self.prompt_ids = _ids(prompt_ids, "prompt", vocab_size)
        if len(self.prompt_ids) >= max_tokens:
            raise ValueError(f"the prompt's {len(self.prompt_ids)} tokens leave none of the "
                             f"episode's {max_tokens}")
        self.max_tokens, self.max_turns = max_tokens, max_turns
        self.encode = encode
        self.template = template
        self._wrap: tuple[list[int], list[int]] | None = None   # the template's parts, as ids
        self.output: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turns: list[Turn] = []
        self.tool_calls: list[ToolCall] = []
        self.rewards: list[float] = []
        self.done = False
        self.cut: Optional[str] = None      # CUT_TURNS, CUT_TOKENS, or None
        self.error: Optional[str] = None
        self.discard = ""       # why it is not trained (storage/episode_log.py DISCARD_CAUSES)

    # ---- reading ----

    @property
    def ids(self) -> list[int]:
        """The whole sequence: what the engine continues from, and what is trained."""
        return self.prompt_ids + self.output

    @property
    def n_turns(self) -> int:
        """Model turns so far."""
        return sum(t.kind == SAMPLE for t in self.turns)

    @property
    def budget_left(self) -> int:
        """Tokens the episode may still take (the next turn's max_tokens)."""
        return self.max_tokens - len(self.prompt_ids) - len(self.output)

    @property
    def oldest_version(self) -> Optional[int]:
        """The oldest policy version among the sampled tokens (None before any)."""
        sampled = [v for v in self.versions if v != NO_VERSION]
        return min(sampled) if sampled else None

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-token arrays and turn boundaries, as the rollout log stores token arrays."""
        return {"prompt": np.asarray(self.prompt_ids, np.int32),
                "output": np.asarray(self.output, np.int32),
                "loss_mask": np.asarray(self.loss_mask, np.uint8),
                "behav_logprobs": np.asarray(self.logprobs, np.float32),
                "versions": np.asarray(self.versions, np.int32),
                "turn_ends": np.asarray([t.end for t in self.turns], np.int64),
                "turn_is_sample": np.asarray([t.kind == SAMPLE for t in self.turns], np.uint8)}

    def sampled_turns(self) -> list[list[int]]:
        """The ids of each model turn, in order (a turn continued after an update is one)."""
        return [self.output[t.start:t.end] for t in self.turns if t.kind == SAMPLE]

    def state(self) -> dict:
        """The episode as plain data (JSON-able): what a preempted job saves of it."""
        return {"prompt_ids": self.prompt_ids, "max_tokens": self.max_tokens,
                "max_turns": self.max_turns, "template": self.template, "output": self.output,
                "loss_mask": self.loss_mask, "logprobs": self.logprobs, "versions": self.versions,
                "turns": [[t.kind, t.start, t.end] for t in self.turns],
                "tool_calls": [asdict(c) for c in self.tool_calls], "rewards": self.rewards,
                "done": self.done, "cut": self.cut, "error": self.error, "discard": self.discard}

    @classmethod
    def from_state(cls, state: dict, encode: Optional[Callable[[str], list[int]]] = None,
                   vocab_size: Optional[int] = None) -> Episode:
        """The episode `state` saved, token for token, ready to go on."""
        ep = cls(state["prompt_ids"], max_tokens=state["max_tokens"], max_turns=state["max_turns"],
                 encode=encode, template=state["template"], vocab_size=vocab_size)
        for name in ("output", "loss_mask", "logprobs", "versions", "rewards", "done", "cut", "error"):
            setattr(ep, name, state[name])
        ep.discard = state.get("discard", "")
        ep.turns = [Turn(*t) for t in state["turns"]]
        ep.tool_calls = [ToolCall(**c) for c in state["tool_calls"]]
        return ep

    # ---- building ----

    def add_sample(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                   *, continues: bool = False) -> None:
        """Append the model's tokens as sampled. ``continues``: they continue the last turn (cut
        by a weight update and resumed from its prefix), which stays one turn. Raises ValueError
        on a caller's mistake (lengths differ, past the budget, after the end)."""
        if self.done:
            raise ValueError("the episode has ended")
        ids = _ids(ids, "sampled turn", self.vocab_size)
        logprobs, versions = [float(x) for x in logprobs], [int(v) for v in versions]
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"sampled turn: {len(ids)} ids, {len(logprobs)} logprobs, "
                             f"{len(versions)} versions")
        if any(v < 0 for v in versions) or any(math.isnan(x) for x in logprobs):
            raise ValueError("sampled turn: a version below 0 or a NaN log-probability")
        if len(ids) > self.budget_left:
            raise ValueError(f"sampled turn: {len(ids)} tokens, {self.budget_left} left")
        if continues:
            if not self.turns or self.turns[-1].kind != SAMPLE:
                raise ValueError("continues=True without a model turn to continue")
            last = self.turns.pop()
            start = last.start
        else:
            if self.n_turns >= self.max_turns:
                raise ValueError(f"a turn past max_turns ({self.max_turns})")
            start = len(self.output)
        self._append(ids, 1, logprobs, versions)
        self.turns.append(Turn(SAMPLE, start, len(self.output)))

    def add_observation(self, observation, tool: Optional[ToolCall] = None) -> int:
        """Append an observation (text: wrapped by the template, tokenised once; ids: between
        the template's parts; None: nothing) and the tool call behind it. Cut to the budget left:
        the episode then ends, cut at max_episode_tokens. Returns the tokens appended."""
        if self.done:
            raise ValueError("the episode has ended")
        if tool is not None:
            self.tool_calls.append(tool)
        if observation is None:
            return 0
        over = False
        if isinstance(observation, str):
            room = max(0, self.budget_left) * MAX_CHARS_PER_TOKEN
            over = len(observation) > room
            ids = self._encode(self.template.format(observation=observation[:room]))
        else:
            head, tail = self._parts()
            ids = head + _ids(observation, "observation", self.vocab_size) + tail
        if over or len(ids) >= self.budget_left:    # no room left for a model turn after it
            ids = ids[:self.budget_left]
            self.finish(CUT_TOKENS)
        start = len(self.output)
        self._append(ids, 0, [0.0] * len(ids), [NO_VERSION] * len(ids))
        if ids:
            self.turns.append(Turn(OBSERVATION, start, len(self.output)))
        return len(ids)

    def apply(self, step: Step) -> None:
        """Take the environment's answer to the last turn: its reward, then its observation and
        tool call, or the end (done; a failed or discarding environment ends the episode with
        its error and cause, and an observation that comes with done is not appended: nothing
        follows it)."""
        self.add_reward(step.reward)
        if step.error is not None or step.done:
            if step.tool is not None:
                self.tool_calls.append(step.tool)
            self.finish(error=step.error, cause=step.cause)
            return
        self.add_observation(step.observation, step.tool)
        self.after_turn()

    def add_reward(self, reward: Optional[float]) -> None:
        """A turn's reward (the final one, or one of the per-turn rewards); None: none."""
        if reward is not None:
            self.rewards.append(float(reward))

    def after_turn(self) -> None:
        """Called after the environment answered a turn that was not the last: cuts the episode
        at max_turns (or when no token is left for another turn)."""
        if not self.done and self.n_turns >= self.max_turns:
            self.finish(CUT_TURNS)
        elif not self.done and self.budget_left <= 0:
            self.finish(CUT_TOKENS)

    def finish(self, cut: Optional[str] = None, error: Optional[str] = None,
               cause: Optional[str] = None) -> None:
        """End the episode: the environment said done (cut None), a bound cut it, or it failed
        (`error`: the episode is discarded for `cause`, "raised" if none is given)."""
        self.done = True
        self.cut = self.cut or cut
        self.error = self.error or error
        if error is not None:
            self.discard = self.discard or cause or "raised"

    # ---- internals ----

    def _append(self, ids: list[int], mask: int, logprobs: list[float], versions: list[int]):
        self.output += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    def _encode(self, text: str) -> list[int]:
        if self.encode is None:
            raise ValueError("a text observation needs the episode's encode (a tokenizer)")
        return _ids(self.encode(text), "observation", self.vocab_size) if text else []

    def _parts(self) -> tuple[list[int], list[int]]:
        if self._wrap is None:
            head, _, tail = self.template.format(observation="\0").partition("\0")
            self._wrap = (self._encode(head) if head else [], self._encode(tail) if tail else [])
        return self._wrap
