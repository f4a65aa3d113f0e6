"""Staleness control (AReaL's η bound), pure logic, thread-safe.

Unit: one rollout = one prompt = one group of n samples; `consumer_batch_size` is the number of
groups a training step consumes (B). A prompt may be submitted only while

    capacity = min(max_concurrent_rollouts - running,
                   (max_staleness + version + 1) * consumer_batch_size - (accepted + running)) > 0

so, consumed in order, every accepted group is trained at most η versions after the version it
was submitted under; η = 0 is on-policy (synchronous semantics). With `total_batches` (the run's
training steps) the window `max_staleness + version + 1` is capped at it: no prompt is issued
for a step the run will never take, so the generators finish the last batch and stop (their
engines free for the final evaluation) instead of generating groups no step trains. Rejected
groups free their slot and do not count. A resumed run restores `accepted` and `rejected` from
its checkpoint (the buffered groups count as accepted; `Ledger.restore`) and starts with nothing
running: the prompts that were in flight count again when they are issued again.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import get_args

import numpy as np

from ..config.schema import StalePolicy


class StalenessManager:
    def __init__(self, max_concurrent_rollouts: int, consumer_batch_size: int, max_staleness: int,
                 total_batches: int | None = None):
        if max_concurrent_rollouts < 1 or consumer_batch_size < 1 or max_staleness < 0 \
                or (total_batches is not None and total_batches < 0):
            raise ValueError("need max_concurrent_rollouts >= 1, consumer_batch_size >= 1, "
                             "max_staleness >= 0, total_batches >= 0 or None; got "
                             f"{max_concurrent_rollouts}, {consumer_batch_size}, {max_staleness}, "
                             f"{total_batches}")
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.consumer_batch_size = consumer_batch_size
        self.max_staleness = max_staleness
        self.total_batches = total_batches
        self.running = 0        # submitted, not yet returned
        self.accepted = 0       # returned and kept for training (consumed ones included)
        self.rejected = 0       # returned and discarded (for the record; frees its slot)
        self._lock = threading.Lock()

    def get_capacity(self, current_version: int) -> int:
        """How many more rollouts may be submitted now (may be negative)."""
        with self._lock:
            concurrency = self.max_concurrent_rollouts - self.running
            window = self.max_staleness + current_version + 1
            if self.total_batches is not None:
                window = min(window, self.total_batches)
            staleness = window * self.consumer_batch_size - (self.accepted + self.running)
            return min(concurrency, staleness)

    def on_rollout_submitted(self) -> None:
        with self._lock:
            self.running += 1

    def on_rollout_accepted(self) -> None:
        with self._lock:
            self.running -= 1
            self.accepted += 1

    def on_rollout_rejected(self) -> None:
        with self._lock:
            self.running -= 1
            self.rejected += 1

    def on_rollout_dropped(self) -> None:
        """An accepted rollout was discarded before training (too stale): its slot is freed."""
        with self._lock:
            self.accepted -= 1
            self.rejected += 1


@dataclass
class ReadyGroup:
    oldest_version: int         # policy version of the group's oldest token
    trajectories: list          # the group's samples (docs/architecture.md#data-contract)
    rows: list                  # their rows in the rollout log


@dataclass
class Batch:
    """One training step's data as the controller hands it to the trainer (on trainer rank 0):
    the trajectories group after group, their rollout-log rows in the same order (marked with
    the step once it is trained), and the batch statistics that go to metrics.jsonl."""
    trajectories: list[dict]
    rows: list[int]
    stats: dict

    @classmethod
    def of(cls, groups: list[ReadyGroup], stats: dict) -> Batch:
        return cls([t for g in groups for t in g.trajectories], [r for g in groups for r in g.rows],
                   stats)


class ReadyBuffer:
    """Scored groups waiting for a training step, taken oldest policy version first.

    Submission control alone cannot bound staleness when generation lengths are long-tailed: a
    slow group can finish after η further versions. `drop_older_than` removes such groups before
    a batch is taken, so no trained token is more than η versions behind the training policy.
    """

    def __init__(self):
        self._groups: list[ReadyGroup] = []

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, trajectories: list, rows: list) -> None:
        # (a sample stopped before its first token has none; an episode's observation tokens,
        # version -1, were not sampled: `oldest_sampled`; a group with none at all is never
        # buffered: `any_sampled`, Ledger.arrived)
        oldest = min(o for t in trajectories if (o := oldest_sampled(t["versions"])) is not None)
        self._groups.append(ReadyGroup(oldest, trajectories, rows))

    def groups(self) -> list[ReadyGroup]:
        """The buffered groups, in arrival order (what a checkpoint saves)."""
        return list(self._groups)

    def drop_older_than(self, version: int) -> list[ReadyGroup]:
        """Remove and return the groups whose oldest token predates `version`."""
        stale = [g for g in self._groups if g.oldest_version < version]
        self._groups = [g for g in self._groups if g.oldest_version >= version]
        return stale

    def take(self, n: int) -> list[ReadyGroup]:
        """The n groups with the oldest tokens (arrival order among equals)."""
        self._groups.sort(key=lambda g: g.oldest_version)
        taken, self._groups = self._groups[:n], self._groups[n:]
        return taken


class StaleGroups:
    """What becomes of groups dropped as too stale (rollout.stale_policy), pure bookkeeping.

    `reissue`: each dropped prompt is issued again, at most `max_reissues` times, then given up
    (counted in `lost`); `drop`: given up at once; `keep`: nothing is dropped (the caller does
    not ask). Dropping biases training towards short, easy prompts (the long-tailed ones are
    the stale ones); reissuing keeps them in the training distribution."""

    def __init__(self, policy: str, max_reissues: int):
        if policy not in get_args(StalePolicy) or max_reissues < 0:
            raise ValueError(f"stale policy {policy!r}, max_reissues {max_reissues}")
        self.policy, self.max_reissues = policy, max_reissues
        self.times: dict[int, int] = {}     # prompt id → times issued again (until trained)
        self.lost = 0                       # prompts given up, over the run

    @property
    def drops(self) -> bool:
        return self.policy != "keep"

    def on_dropped(self, prompt_id: int) -> bool:
        """A group of `prompt_id` was dropped: True = issue the prompt again."""
        n = self.times.get(prompt_id, 0)
        if self.policy == "reissue" and n < self.max_reissues:
            self.times[prompt_id] = n + 1
            return True
        self.times.pop(prompt_id, None)
        self.lost += 1
        return False

    def on_trained(self, prompt_id: int) -> None:
        self.times.pop(prompt_id, None)


def oldest_sampled(token_versions) -> int | None:
    """The oldest version among a trajectory's sampled tokens (a multi-turn episode's
    observation tokens carry version -1 and count for nothing); None without any."""
    v = np.asarray(token_versions)
    v = v[v >= 0]
    return int(v.min()) if len(v) else None


def any_sampled(trajectories) -> bool:
    """Whether any trajectory of a group has a sampled token (every episode of a group can end
    before the model's first turn: a `reset` that raised or timed out)."""
    return any(oldest_sampled(t["versions"]) is not None for t in trajectories)


def staleness_of(consume_version: int, token_versions) -> int:
    """How many versions behind the consuming policy the oldest sampled token of a trajectory
    is (0 without one)."""
    oldest = oldest_sampled(token_versions)
    return int(consume_version - oldest) if oldest is not None else 0
