"""The controller's bookkeeping, pure: which prompt goes out next, which are in flight, which
groups wait for a step, what a checkpoint saves of it. No MPI, no files, no threads.

One prompt is one group of n samples; its prompt id is its position in the data cursor (unique
across epochs), kept when it is issued again. Every issued prompt is, at any moment, exactly one
of: in flight (with a generator, or queued to be issued again first: preempted, or dropped as
stale and reissued), buffered (its group arrived and waits for a step), trained, or given up
(dropped as stale more than rollout.max_reissues times, or under stale_policy drop). `to_state`
and `restore` carry that across a checkpoint, so that every group is trained at most once and
no prompt is lost (tests/rollout/test_ledger.py).

The controller (rollout/controller.py) moves messages and writes the rollout log; it asks this
object what to do and tells it what arrived.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from ..storage.run_state import ControllerState
from .staleness import ReadyBuffer, ReadyGroup, StaleGroups, StalenessManager, any_sampled


class PromptCursor:
    """Endless, reproducibly shuffled pass over the training prompts (one epoch after another)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.consumed = 0               # prompts handed out so far (the resume position)
        self._epoch, self._order = -1, []

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._epoch:        # one shuffle per epoch, derived from (seed, epoch)
            self._order = list(range(self.n))
            random.Random(self.seed + epoch).shuffle(self._order)
            self._epoch = epoch
        return self._order

    def next(self) -> int:
        idx = self.index_of(self.consumed)
        self.consumed += 1
        return idx

    def index_of(self, position: int) -> int:
        """The dataset index handed out as prompt number `position` (a prompt id)."""
        epoch, pos = divmod(position, self.n)
        return self._order_of(epoch)[pos]


@dataclass(frozen=True)
class Issue:
    """One prompt to send: to generator `rank`, dataset row `index`, and where its samples
    stopped if a preemption interrupted them (`partial`: first row and rows in the log)."""

    rank: int
    prompt_id: int
    index: int
    partial: tuple[int, int] | None = None


class Ledger:
    def __init__(self, *, num_prompts: int, data_seed: int, generators: list[int],
                 batch_prompts: int, max_staleness: int, max_concurrent: int,
                 stale_policy: str, max_reissues: int, total_steps: int | None = None):
        self.cursor = PromptCursor(num_prompts, data_seed)
        self.max_staleness = max_staleness
        self.staleness = StalenessManager(max_concurrent_rollouts=max_concurrent,
                                          consumer_batch_size=batch_prompts,
                                          max_staleness=max_staleness,
                                          total_batches=total_steps)
        self.version = 0                # policy version the generators have (training steps done)
        self._taken_for = -1            # the version whose batch was taken last (see next_train_version)
        self.in_flight = {g: 0 for g in generators}     # prompts out per generator rank
        self.prompts_in_flight: dict[int, int] = {}     # prompt_id → dataset index
        # (prompt_id, dataset index) to issue first: in flight at a resume, or dropped as stale
        self.reissue: list[tuple[int, int]] = []
        self.buffer = ReadyBuffer()
        # prompt_id → (first row, rows) of its group's PARTIAL rows in the log: sent back at a
        # preemption, continued from when the prompt is issued again
        self.partial: dict[int, tuple[int, int]] = {}
        self.dropped_stale = 0          # groups dropped for exceeding η, over the run
        self.failed_groups = 0          # groups without a sampled token, in this attempt
        self.stale_groups = StaleGroups(stale_policy, max_reissues)   # dropped: again or lost
        self.generated_tokens = 0

    # -- out ------------------------------------------------------------------------------------
    def issue(self) -> list[Issue]:
        """As many prompts as the staleness bound allows, each to the least-loaded generator:
        the ones to issue again first, then the cursor's next."""
        out = []
        for _ in range(max(0, self.staleness.get_capacity(self.version))):
            g = min(self.in_flight, key=self.in_flight.get)
            if self.reissue:
                pid, idx = self.reissue.pop(0)
            else:
                idx = self.cursor.next()
                pid = self.cursor.consumed - 1      # unique per submission, also across epochs
            self.prompts_in_flight[pid] = idx
            self.in_flight[g] += 1
            self.staleness.on_rollout_submitted()
            out.append(Issue(g, pid, idx, self.partial.get(pid)))
        return out

    # -- in -------------------------------------------------------------------------------------
    def arrived(self, rank: int, trajectories: list[dict], rows: list[int]) -> bool:
        """Generator `rank` sent a scored group (logged as `rows`): it waits for a step. Returns
        False for a group with no sampled token (every episode of it ended before the model's
        first turn): it is not buffered and never trained, its prompt given up (issued again it
        would most likely fail again, also after a requeue); the caller marks its rows FAILED."""
        pid = int(trajectories[0]["prompt_id"])
        self.in_flight[rank] -= 1
        self.prompts_in_flight.pop(pid, None)
        self.partial.pop(pid, None)
        self.generated_tokens += sum(len(t["output_tokens"]) for t in trajectories)
        if not any_sampled(trajectories):
            self.staleness.on_rollout_rejected()       # its slot in the η budget is freed
            self.failed_groups += 1
            return False
        self.staleness.on_rollout_accepted()
        self.buffer.add(trajectories, rows)
        return True

    def partial_arrived(self, prompt_id: int, first_row: int, num_rows: int) -> None:
        """At a preemption: the prompt's samples as far as they got (PARTIAL rows); it stays in
        flight, and is continued from them when issued again."""
        self.partial[int(prompt_id)] = (first_row, num_rows)

    # -- to a step ------------------------------------------------------------------------------
    @property
    def next_train_version(self) -> int:
        """The earliest policy version a buffered group can still be trained at: the current one
        until its batch is taken, the next one while that batch trains."""
        return self.version + (self._taken_for == self.version)

    @property
    def stale_before(self) -> int:
        """A group with a token older than this can no longer be trained within η."""
        return self.next_train_version - self.max_staleness

    def drop_stale(self) -> list[ReadyGroup]:
        """Remove the buffered groups whose oldest token is more than η versions behind the
        version they can earliest be trained at, by stale_policy (none under keep); their prompts
        are queued to be issued again or given up. Returns them (the caller marks their rows in
        the log). Called as groups arrive, not only when a batch is taken: a group that is already
        too old for the next batch frees its slot in the η budget at once, so the generators
        regenerate it while the trainer trains instead of idling with the budget spent."""
        if not self.stale_groups.drops:
            return []
        stale = self.buffer.drop_older_than(self.stale_before)
        for g in stale:
            self.staleness.on_rollout_dropped()
            pid = int(g.trajectories[0]["prompt_id"])
            if self.stale_groups.on_dropped(pid):   # the same prompt id: its log rows tell
                self.reissue.append((pid, self.cursor.index_of(pid)))   # the story
        self.dropped_stale += len(stale)
        return stale

    def take(self, n: int) -> list[ReadyGroup]:
        """The n groups with the oldest tokens, for a step."""
        groups = self.buffer.take(n)
        self._taken_for = self.version
        for g in groups:
            self.stale_groups.on_trained(int(g.trajectories[0]["prompt_id"]))
        return groups

    def put_back(self, groups: list[ReadyGroup]) -> None:
        """The batch `take` gave was not trained (its step was stopped midway): its groups wait
        again, ahead of the others of their version, and the current version's batch counts as
        not taken. Their log rows were never marked, the η counters never moved."""
        rest = self.buffer.take(len(self.buffer))
        for g in [*groups, *rest]:
            self.buffer.add(g.trajectories, g.rows)
        self._taken_for = -1

    def trained(self, new_version: int) -> None:
        self.version = new_version

    # -- checkpoint -----------------------------------------------------------------------------
    def to_state(self, rollout_rows: int) -> ControllerState:
        """What a resumed ledger needs (the controller's part of a checkpoint's state.h5)."""
        groups = self.buffer.groups()
        inflight = sorted(self.prompts_in_flight.items()) + list(self.reissue)
        partial = sorted((p, *self.partial[p]) for p, _ in inflight if p in self.partial)
        ints = lambda v: np.asarray(v, dtype=np.int64)
        return ControllerState(
            version=self.version, cursor_consumed=self.cursor.consumed,
            accepted=self.staleness.accepted, rejected=self.staleness.rejected,
            dropped_stale=self.dropped_stale, lost_stale=self.stale_groups.lost,
            generated_tokens=self.generated_tokens, rollout_rows=rollout_rows,
            buffer_rows=ints([r for g in groups for r in g.rows]),
            buffer_group_ends=np.cumsum([len(g.rows) for g in groups], dtype=np.int64),
            inflight_prompt_ids=ints([p for p, _ in inflight]),
            inflight_dataset_index=ints([i for _, i in inflight]),
            partial_prompt_ids=ints([p for p, _, _ in partial]),
            partial_first_row=ints([r for _, r, _ in partial]),
            partial_rows=ints([n for _, _, n in partial]))

    def restore(self, state: ControllerState, buffered: list[tuple[list[dict], list[int]]]) -> None:
        """Continue from `to_state`: `buffered` are its buffered groups (trajectories, rows),
        read back from the log. Prompts in flight are issued again first (with their partial
        rows); the η budget continues from the saved counters."""
        for trajs, rows in buffered:
            self.buffer.add(trajs, rows)
        self.version = state.version
        self.cursor.consumed = state.cursor_consumed
        # The saved counters (the buffered groups count as accepted); nothing runs yet: the
        # prompts that were in flight count again when they are issued again.
        st = self.staleness
        st.accepted, st.rejected, st.running = state.accepted, state.rejected, 0
        self.dropped_stale = state.dropped_stale
        self.stale_groups.lost = state.lost_stale or 0      # None before stale_policy
        self.generated_tokens = state.generated_tokens
        self.reissue = list(zip(state.inflight_prompt_ids.tolist(),
                                state.inflight_dataset_index.tolist()))
        self.partial = {p: (r, n) for p, r, n in zip(state.partial_prompt_ids.tolist(),
                                                     state.partial_first_row.tolist(),
                                                     state.partial_rows.tolist())}
