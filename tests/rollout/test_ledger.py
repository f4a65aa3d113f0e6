"""The controller's ledger (rollout/ledger.py), pure: exactly once across checkpoints and
resumes, driven by random schedules of arrivals, steps, stale drops, preemptions with partial
groups, checkpoints and crashes back to the newest checkpoint (milliseconds each)."""
import numpy as np
from hypothesis import given, settings, strategies as st

from areal_hpc.rollout.ledger import Issue, Ledger

B, N, ETA = 2, 2, 1


def ledger(policy="reissue", max_reissues=1, max_concurrent=6, total_steps=None) -> Ledger:
    return Ledger(num_prompts=5, data_seed=0, generators=[1, 2], batch_prompts=B,
                  max_staleness=ETA, max_concurrent=max_concurrent, stale_policy=policy,
                  max_reissues=max_reissues, total_steps=total_steps)


def group(pid: int, oldest: int) -> list[dict]:
    return [{"prompt_id": pid, "sample_idx": i, "versions": np.array([oldest, oldest + 1]),
             "output_tokens": np.arange(2)} for i in range(N)]


class World:
    """The ledger's surroundings: a log (row → prompt), the generators (prompts out, the version
    each was issued at), the training steps, checkpoints and crashes. Mirrors what the
    controller does around the ledger."""

    def __init__(self, **kw):
        self.kw = kw
        self.led = ledger(**kw)
        self.log: list[int] = []                # row → prompt id
        self.out: dict[int, tuple[int, int]] = {}   # prompt → (generator rank, version issued)
        self.trained: dict[int, int] = {}       # prompt → step
        self.ckpt = None

    def issue(self):
        for it in self.led.issue():
            assert it.prompt_id not in self.out and it.prompt_id not in self.trained
            self.out[it.prompt_id] = (it.rank, self.led.version)

    def arrive(self, k: int):
        if self.out:
            pid = sorted(self.out)[k % len(self.out)]
            rank, v = self.out.pop(pid)
            rows = list(range(len(self.log), len(self.log) + N))
            self.log += [pid] * N
            self.led.arrived(rank, group(pid, v), rows)

    def preempt_partial(self, k: int):
        """A preemption's PARTIAL group for one prompt out (it stays out)."""
        if self.out:
            pid = sorted(self.out)[k % len(self.out)]
            self.led.partial_arrived(pid, len(self.log), N)
            self.log += [pid] * N

    def step(self):
        self.led.drop_stale()
        if len(self.led.buffer) >= B:
            step = self.led.version
            for g in self.led.take(B):
                pid = int(g.trajectories[0]["prompt_id"])
                assert pid not in self.trained, f"prompt {pid} trained twice"
                assert all(self.log[r] == pid for r in g.rows)
                assert step - g.oldest_version <= ETA or not self.led.stale_groups.drops
                self.trained[pid] = step
            self.led.trained(step + 1)

    def checkpoint(self):
        self.ckpt = (self.led.to_state(len(self.log)), dict(self.trained),
                     [(g.trajectories, g.rows) for g in self.led.buffer.groups()])

    def crash(self):
        """Back to the newest checkpoint: a fresh ledger restored from it; what was out is lost
        with the generators; steps after it are trained again."""
        if self.ckpt is None:
            return
        state, trained, buffered = self.ckpt
        self.led = ledger(**self.kw)
        self.led.restore(state, buffered)
        self.trained = dict(trained)
        self.out = {}
        self.log = self.log[:state.rollout_rows]     # later rows rolled back

    def accounted(self):
        """Every prompt issued is exactly one of: out, queued again, buffered, trained, given up."""
        led = self.led
        issued = set(range(led.cursor.consumed))
        queued = [p for p, _ in led.reissue]
        buffered = [int(g.trajectories[0]["prompt_id"]) for g in led.buffer.groups()]
        places = list(self.out) + queued + buffered + list(self.trained)
        assert len(places) == len(set(places)), "a prompt is in two places"
        missing = issued - set(places)
        assert len(missing) == led.stale_groups.lost, (missing, led.stale_groups.lost)
        assert set(led.prompts_in_flight) | set(queued) == set(self.out) | set(queued)
        assert set(led.partial) <= set(led.prompts_in_flight) | set(queued)


OPS = st.lists(st.tuples(st.sampled_from(["issue", "arrive", "step", "checkpoint", "crash",
                                          "partial"]), st.integers(0, 7)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(OPS, st.sampled_from(["reissue", "drop", "keep"]))
def test_exactly_once_across_checkpoints_and_crashes(ops, policy):
    w = World(policy=policy)
    for op, k in ops:
        {"issue": w.issue, "step": w.step, "checkpoint": w.checkpoint, "crash": w.crash}.get(
            op, lambda: None)() if op not in ("arrive", "partial") else \
            (w.arrive(k) if op == "arrive" else w.preempt_partial(k))
        w.accounted()


def test_state_round_trips():
    w = World()
    w.issue()
    w.arrive(0), w.arrive(0), w.arrive(0)
    w.step()
    w.issue()
    w.preempt_partial(0)
    state = w.led.to_state(len(w.log))
    again = ledger()
    again.restore(state, [(g.trajectories, g.rows) for g in w.led.buffer.groups()])
    assert again.to_state(len(w.log)).as_lists() == state.as_lists()
    # after the resume nothing runs; the prompts that were out go first, the partial one with
    # its rows
    assert again.staleness.running == 0
    first = again.issue()
    assert [(i.prompt_id, i.partial is not None) for i in first[:len(state.inflight_prompt_ids)]] \
        == [(int(p), int(p) in w.led.partial) for p in state.inflight_prompt_ids]


def test_issue_respects_eta_and_balances_generators():
    led = ledger(max_concurrent=100)
    first = led.issue()
    assert len(first) == (ETA + 1) * B                 # versions 0..η of batches, at version 0
    assert sorted(i.rank for i in first) == [1, 1, 2, 2]
    assert led.issue() == []                            # the bound is spent
    for it in first[:B]:
        led.arrived(it.rank, group(it.prompt_id, 0), [])
    led.take(B)
    led.trained(1)
    more = led.issue()
    assert [i.prompt_id for i in more] == [4, 5] and all(isinstance(i, Issue) for i in more)


def test_group_too_old_for_the_next_batch_is_dropped_while_a_step_trains():
    """Against the earliest version a group can still be trained at: the current one until its
    batch is taken, the next one while that batch trains. A group that is already too old for
    the next batch frees its slot at once, so its prompt is issued again during the step."""
    led = ledger(max_concurrent=100)
    a, b, c, d = led.issue()                            # at version 0
    for it in (a, b):
        led.arrived(it.rank, group(it.prompt_id, 0), [])
    led.take(B)
    led.trained(1)
    e, f = led.issue()                                  # at version 1
    for it in (c, e):
        led.arrived(it.rank, group(it.prompt_id, 0 if it is c else 1), [])
    assert led.next_train_version == 1 and led.drop_stale() == []   # c fits version 1's batch
    led.take(B)                                         # version 1's batch: c and e, training
    led.arrived(d.rank, group(d.prompt_id, 0), [])      # d: version 0, can go in 2's at best
    assert led.next_train_version == 2
    assert led.issue() == []                            # the η budget is spent, by d
    assert [int(g.trajectories[0]["prompt_id"]) for g in led.drop_stale()] == [d.prompt_id]
    assert [i.prompt_id for i in led.issue()] == [d.prompt_id]      # again, during the step
    led.arrived(f.rank, group(f.prompt_id, 1), [])
    assert led.drop_stale() == []                       # version 1 fits version 2's batch
    led.trained(2)
    assert led.next_train_version == 2


def test_no_prompt_is_issued_for_a_step_the_run_never_takes():
    """With the run's total_steps, the last batch is the last thing issued: a group of it
    dropped as too stale is issued again, and nothing else."""
    led = ledger(max_concurrent=100, total_steps=2)
    first = led.issue()
    assert len(first) == 2 * B
    for it in first[:B]:
        led.arrived(it.rank, group(it.prompt_id, 0), [])
    led.take(B)
    led.trained(1)
    assert led.issue() == []                            # the window 1 + η + 1 is capped at 2
    late = first[B]
    led.arrived(late.rank, group(late.prompt_id, 0), [])
    led.trained(2)                                      # (as if trained without it): now stale
    assert [int(g.trajectories[0]["prompt_id"]) for g in led.drop_stale()] == [late.prompt_id]
    assert [i.prompt_id for i in led.issue()] == [late.prompt_id]
    assert led.issue() == []


def test_stale_group_is_reissued_then_given_up():
    led = ledger(max_reissues=1)
    (a, *_) = led.issue()
    led.arrived(a.rank, group(a.prompt_id, 0), [0, 1])
    led.trained(3)                                      # 3 versions later: stale at η = 1
    assert [int(g.trajectories[0]["prompt_id"]) for g in led.drop_stale()] == [a.prompt_id]
    assert led.reissue[0] == (a.prompt_id, a.index) and led.dropped_stale == 1
    again = led.issue()[0]
    assert again.prompt_id == a.prompt_id
    led.arrived(again.rank, group(a.prompt_id, 0), [2, 3])
    led.drop_stale()
    assert led.stale_groups.lost == 1 and all(p != a.prompt_id for p, _ in led.reissue)
