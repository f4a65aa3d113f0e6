"""The controller (rollout/controller.py) in one process, on a double of its channel: prompts out,
groups in and logged, the η bound holding or dropping groups (a dropped prompt issued again), the
batches released to the trainer, a stop requested while waiting, a checkpoint's partial groups
checked against the log on resume. The same controller on a real two-rank MPI world:
test_controller.py."""
from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from areal_hpc.config import RunConfig, load, to_yaml
from areal_hpc.random_models import qwen_byte_tokenizer
from areal_hpc.rollout.controller import SERVICE_JOIN_S, Controller
from areal_hpc.rollout.gen_clock import BUCKETS
from areal_hpc.storage.rollout_log import (DROPPED_STALE, FAILED, NOT_CONSUMED, PARTIAL, RolloutReader,
                                           RolloutWriter)
from areal_hpc.storage.run_dir import RunDir
from areal_hpc.storage.run_state import CheckpointError, ControllerState
from areal_hpc.topology import TRAINER, Topology
from areal_hpc.transport import messages as msgs
from areal_hpc.transport.mpi import Tag

STEPS, B, N, ETA = 4, 2, 2, 1
GEN = 1                             # the one generator's rank
WAIT_S = 60.0                       # the bound of a wait for the service thread (a failure past it)


class FakeChannel:
    """The channel's protocol as the controller uses it (transport.mpi.Channel's send, poll,
    incomplete, idle, flush), in one process: what the controller sends is kept; `deliver` puts
    messages from a generator in, all at once (one poll takes them together)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.sent: list[tuple[int, Tag, object]] = []
        self._inbox: list[tuple[int, Tag, object]] = []

    def send(self, obj: object, dest: int, tag: Tag) -> None:
        with self._cond:
            self.sent.append((dest, tag, obj))
            self._cond.notify_all()

    def poll(self, source: int | None = None, tag: Tag | None = None):
        assert source is None and tag is None      # the controller takes every message
        with self._cond:
            got, self._inbox = self._inbox, []
        yield from got

    def incomplete(self) -> list[tuple[int, Tag, float]]:
        return []

    def idle(self, source: int | None = None, timeout: float = 0.05) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._inbox), timeout=timeout)

    def flush(self, timeout: float | None = None) -> bool:
        return True

    # -- the test's side ---------------------------------------------------------------------
    def deliver(self, *messages: object, src: int = GEN) -> None:
        with self._cond:
            self._inbox += [(src, m.TAG, m) for m in messages]
            self._cond.notify_all()

    def of(self, kind: type) -> list:
        with self._cond:
            return [m for _, _, m in self.sent if isinstance(m, kind)]

    def prompts(self) -> list[msgs.Prompt]:
        """Every prompt sent so far, in order (a prompt issued again is there again)."""
        return [p for m in self.of(msgs.Prompts) for p in m.prompts]

    def wait_for(self, predicate) -> bool:
        """Until `predicate()` holds for what was sent (the service thread sends), at most WAIT_S."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout=WAIT_S)


def _trajectory(prompt: msgs.Prompt, k: int, version: int, reason: str = "stop") -> dict:
    out = 1 + (prompt.prompt_id + k) % 4
    return dict(prompt_id=prompt.prompt_id, sample_idx=k,
                prompt_tokens=np.asarray(prompt.prompt_tokens, np.int32),
                output_tokens=np.arange(out, dtype=np.int32),
                behav_logprobs=np.full(out, -0.5, np.float32),
                versions=np.full(out, version, np.int32), reward=float(k % 2),
                finish_reason=reason, generator_rank=GEN, t_submit=1.0, t_first_token=1.5,
                t_end=2.0, reward_error="", reward_extra={})


def _group(prompt: msgs.Prompt, version: int) -> msgs.Group:
    """The prompt's scored group, every token of policy `version`."""
    return msgs.Group([_trajectory(prompt, k, version) for k in range(prompt.n)])


def _config(tmp_path: Path) -> RunConfig:
    root = Path(__file__).resolve().parents[2]
    return load(root / "configs/tiny_cpu.yaml",
                [f"output_dir={tmp_path}", "name=ctrl1", f"train.total_steps={STEPS}",
                 f"train.batch_prompts={B}", f"rollout.group_size={N}",
                 f"rollout.max_staleness={ETA}", "rollout.max_concurrent_prompts=4",
                 "rollout.stale_policy=reissue"])


def _topology(cfg: RunConfig) -> Topology:
    """Trainer rank 0 of a two-rank world (one trainer, one generator), without MPI."""
    return Topology(cfg=cfg.topology, world=None, role_comm=None, rank=0, role=TRAINER,
                    role_rank=0, controller_addr="127.0.0.1", trainer_port=0, weight_port=0,
                    local_rank=0, hosts=["node-a", "node-b"])


class Setup:
    """A config, topology, prompts and tokenizer; `controller` makes one on a fresh channel."""

    def __init__(self, tmp_path: Path):
        self.cfg = _config(tmp_path)
        assert self.cfg.topology.n_trainers == 1 and self.cfg.topology.n_generators == 1
        self.topo = _topology(self.cfg)
        self.rows = [{"question": f"{i} + {i}", "reward_kind": "math", "reference": str(2 * i)}
                     for i in range(10)]
        self.tok = qwen_byte_tokenizer(tmp_path / "tokenizer", eos=256, max_len=256)
        self.log = RunDir(self.cfg.run_dir).rollouts
        self.made: list[Controller] = []

    def controller(self, resume: ControllerState | None = None) -> tuple[Controller, FakeChannel]:
        chan = FakeChannel()
        writer = RolloutWriter(self.log, to_yaml(self.cfg)) if resume is None \
            else RolloutWriter.reopen(self.log, resume.rollout_rows)
        try:
            ctrl = Controller(self.cfg, self.topo, self.rows, self.tok, chan=chan, writer=writer,
                              resume=resume)
        except BaseException:
            writer.close()
            raise
        self.made.append(ctrl)
        return ctrl, chan


@pytest.fixture
def setup(tmp_path):
    s = Setup(tmp_path)
    yield s
    for ctrl in s.made:         # a failed test leaves no service thread running
        ctrl.service.stop(SERVICE_JOIN_S)
        ctrl.close()


def test_groups_in_batches_out_within_eta(setup):
    ctrl, chan = setup.controller()
    by_id = {}

    def answer(*plan: tuple[int, int]) -> None:
        """Deliver the groups of (prompt id, version) at once."""
        chan.deliver(*(_group(by_id[p], v) for p, v in plan))

    def sent(*ids: int) -> bool:
        by_id.update((p.prompt_id, p) for p in chan.prompts())
        return set(ids) <= set(by_id)

    # Version 0: the η window (η + 1 batches of B) and the concurrency bound allow 4 prompts.
    assert ctrl.submit() == 4
    assert [p.prompt_id for p in chan.prompts()] == [0, 1, 2, 3] and sent(0, 1, 2, 3)
    assert {d for d, t, _ in chan.sent if t == Tag.PROMPTS} == {GEN}
    assert all(p.n == N for p in chan.prompts())
    answer((0, 0), (1, 0))
    assert ctrl.receive() == 2 and len(ctrl.buffer) == 2 and ctrl.in_flight == {GEN: 2}
    with RolloutReader(setup.log) as r:
        assert len(r) == 2 * N and (r.column("consumed_step") == NOT_CONSUMED).all()

    # Step 0: the buffered groups are the batch.
    b0 = ctrl.next_batch()
    assert sorted({t["prompt_id"] for t in b0.trajectories}) == [0, 1] and len(b0.rows) == B * N
    assert b0.stats["staleness_max"] == 0 and b0.stats["dropped_stale"] == 0
    assert b0.stats["reward"] == 0.5                        # rewards 0, 1 in every group
    ctrl.on_trained(b0.rows, 0, 1)
    # Nothing buffered and a stop requested: no batch, nothing taken.
    assert ctrl.next_batch(should_stop=lambda: True) is None and len(ctrl.buffer) == 0

    # Step 1: a group of version 0 is one version behind: held and trained (η = 1).
    assert chan.wait_for(lambda: sent(4, 5))                # the service thread refills
    answer((2, 0), (3, 1))
    b1 = ctrl.next_batch()
    assert sorted({t["prompt_id"] for t in b1.trajectories}) == [2, 3]
    assert b1.stats["staleness_max"] == ETA and b1.stats["dropped_stale"] == 0
    ctrl.on_trained(b1.rows, 1, 2)

    # Step 2: a group of version 0 is now two behind: dropped as it arrives, its rows marked,
    # its prompt issued again; the one-behind and current groups are the batch.
    assert chan.wait_for(lambda: sent(6, 7))
    answer((4, 0), (5, 1), (6, 2))
    b2 = ctrl.next_batch()
    assert sorted({t["prompt_id"] for t in b2.trajectories}) == [5, 6]
    assert b2.stats["dropped_stale"] == 1 and b2.stats["staleness_max"] == ETA
    assert chan.wait_for(lambda: [p.prompt_id for p in chan.prompts()].count(4) == 2)
    ctrl.on_trained(b2.rows, 2, 3)

    # Step 3, the last: the prompt issued again arrives at the current version.
    answer((7, 2), (4, 3))
    b3 = ctrl.next_batch()
    assert sorted({t["prompt_id"] for t in b3.trajectories}) == [4, 7]
    assert len(chan.of(msgs.StepsDone)) == 1                # the run's last batch was taken
    ctrl.on_trained(b3.rows, 3, 4)

    seconds = dict.fromkeys(BUCKETS, 0.0) | {"busy": 1.0}
    chan.deliver(msgs.GeneratorStats(GEN, 0, seconds, 4, {"calls": 0, "errors": 0, "timeouts": 0}))
    ctrl.stop()
    assert [m.preempted for m in chan.of(msgs.Stop)] == [False] and sorted(ctrl.gen_stats) == [GEN]
    state = ctrl.state()
    state.check("the final state")
    assert state.version == STEPS and state.dropped_stale == 1
    ctrl.close()
    with RolloutReader(setup.log) as r:
        consumed, pids = r.column("consumed_step"), r.column("prompt_id")
    assert state.rollout_rows == len(consumed)
    for step, b in enumerate((b0, b1, b2, b3)):             # each trained row marked with its step
        assert (consumed[b.rows] == step).all()
    dropped = np.flatnonzero(consumed == DROPPED_STALE)
    assert len(dropped) == N and (pids[dropped] == 4).all()
    trained = [int(t["prompt_id"]) for b in (b0, b1, b2, b3) for t in b.trajectories[::N]]
    assert sorted(trained) == list(range(8))                # every prompt once, none lost


def test_a_group_without_a_sampled_token_is_recorded_never_trained_and_ends_nothing(setup):
    """Every episode of a group ended before the model's first turn (its environment's `reset`
    raised or timed out): no sampled token, no policy version. Its rows are marked FAILED as it
    arrives, its prompt given up (never issued again: a resume does not see it in flight
    either), its slot in the η budget freed, the step's metrics count it; the controller
    serves on (such a group once took `min()` of nothing in the buffer, killed the
    controller's thread and so the job, again after every requeue)."""
    ctrl, chan = setup.controller()
    assert ctrl.submit() == 4
    p = {q.prompt_id: q for q in chan.prompts()}
    failed = [dict(_trajectory(p[0], k, 0, reason="stop"), reward=0.0,
                   output_tokens=np.zeros(0, np.int32), behav_logprobs=np.zeros(0, np.float32),
                   versions=np.zeros(0, np.int32), reward_error="reset: ConnectionError")
              for k in range(N)]
    chan.deliver(msgs.Group(failed), _group(p[1], 0), _group(p[2], 0))
    b0 = ctrl.next_batch()
    assert [t["prompt_id"] for t in b0.trajectories[::N]] == [1, 2]
    assert b0.stats["failed_groups"] == 1 and b0.stats["dropped_stale"] == 0
    ctrl.on_trained(b0.rows, 0, 1)
    # the service thread refills, the failed group's slot freed: 4 + 1 slots of η, 2 trained
    assert chan.wait_for(lambda: len(chan.prompts()) >= 7) and ctrl.service.running
    state = ctrl.state()
    assert 0 not in state.inflight_prompt_ids.tolist() and state.accepted == 2
    ctrl.close()
    with RolloutReader(setup.log) as r:
        consumed, pids = r.column("consumed_step"), r.column("prompt_id")
    assert (consumed[pids == 0] == FAILED).all() and (pids == 0).sum() == N
    assert (consumed[b0.rows] == 0).all()
    assert [q.prompt_id for q in chan.prompts()].count(0) == 1     # never issued again


def _preempted(setup: Setup) -> ControllerState:
    """A controller stopped at a preemption: prompts 0 and 1 sent back partial (their samples as
    far as they got), prompt 2's group buffered, prompt 3 in flight. Returns its state."""
    ctrl, chan = setup.controller()
    assert ctrl.submit() == 4
    p = {q.prompt_id: q for q in chan.prompts()}
    partial = [[_trajectory(p[i], k, 0, reason="abort") for k in range(N)] for i in (0, 1)]
    chan.deliver(msgs.Partial(partial), _group(p[2], 0))
    assert ctrl.receive() == 1
    state = ctrl.state()
    ctrl.close()
    return state


def test_a_resume_continues_the_partial_groups(setup):
    state = _preempted(setup)
    assert state.partial_prompt_ids.tolist() == [0, 1]
    assert state.partial_first_row.tolist() == [0, N] and state.partial_rows.tolist() == [N, N]
    assert sorted(state.inflight_prompt_ids.tolist()) == [0, 1, 3]
    with RolloutReader(setup.log) as r:                     # the log's reader checks them too
        tokens = state.check_partial(setup.log, r)
    assert tokens == sum(1 + (i + k) % 4 for i in (0, 1) for k in range(N))

    ctrl, chan = setup.controller(resume=state)
    assert len(ctrl.buffer) == 1 and ctrl.version == 0
    assert ctrl.submit() == 3                               # the prompts in flight, first
    again = {q.prompt_id: q for q in chan.prompts()}
    assert sorted(again) == [0, 1, 3]
    for i in (0, 1):                                        # continued from their PARTIAL rows
        cont = again[i].continued
        assert [c.sample_idx for c in cont] == list(range(N))
        assert all(c.finish_reason == "abort" for c in cont)
        assert [len(c.output_tokens) for c in cont] == [1 + (i + k) % 4 for k in range(N)]
    assert again[3].continued == ()
    with RolloutReader(setup.log) as r:                     # the buffered group pending again
        status = r.column("consumed_step")
    assert (status[:2 * N] == PARTIAL).all() and (status[2 * N:] == NOT_CONSUMED).all()
    # the continued samples come back with the one model turn the log gave them; a run without
    # an environment still has no episode figures (a resumed run's metrics equal an unbroken one's)
    assert all(c.turn_is_sample is not None for c in again[0].continued)
    done = [_trajectory(again[0], k, 0) for k in range(N)]
    chan.deliver(msgs.Group([dict(t, turn_ends=np.asarray([len(t["output_tokens"])]),
                                  turn_is_sample=np.ones(1, np.uint8)) for t in done]))
    b = ctrl.next_batch()
    assert sorted({t["prompt_id"] for t in b.trajectories}) == [0, 2]
    assert not [k for k in b.stats if k.startswith("episode/")], b.stats


def test_a_partial_group_that_is_not_its_prompts_rows_is_refused(setup):
    state = _preempted(setup)
    swapped = state.replace(partial_first_row=state.partial_first_row[::-1].copy())
    with pytest.raises(CheckpointError, match=r"partial group of prompt 0 \(rows 2-3\) is not "
                                              r"that prompt's PARTIAL rows in the log"):
        setup.controller(resume=swapped)
    not_in_flight = state.replace(inflight_prompt_ids=np.array([1, 3]),
                                  inflight_dataset_index=state.inflight_dataset_index[1:].copy())
    with pytest.raises(CheckpointError, match="partial group of prompt 0"):
        setup.controller(resume=not_in_flight)
    assert setup.controller(resume=state)[0].ledger.partial == {0: (0, N), 1: (N, N)}


def test_before_the_first_batch_the_waiting_thread_receives(setup):
    """The initial evaluation and a weight update before any batch: no service thread yet, so
    the waiting thread receives (and sends the heartbeats); no training prompt goes out."""
    ctrl, chan = setup.controller()
    ctrl.request_eval(setup.rows[:3], 2)
    [request] = chan.of(msgs.EvalRequest)
    assert [p.n for p in request.prompts] == [2, 2, 2]
    chan.deliver(msgs.EvalResult(0, [{"prompt_id": p.prompt_id, "rewards": [1.0, 0.0]}
                                     for p in request.prompts], 0.5))
    assert ctrl.eval_result() == {"version": 0, "accuracy": 0.5, "samples": 6, "seconds": 0.5}
    # an evaluation whose every prompt was left out (the engines restarting) has no accuracy
    ctrl.request_eval(setup.rows[:3], 2)
    chan.deliver(msgs.EvalResult(0, [], 0.1))
    assert ctrl.eval_result() == {"version": 0, "accuracy": None, "samples": 0, "seconds": 0.1}
    assert not ctrl.service.running and [b.version for b in chan.of(msgs.ControllerBeat)] == [0]
    ctrl.send_weights_notice(1, path="weights/v00000001")
    assert [n.version for n in chan.of(msgs.WeightsNotice)] == [1]
    chan.deliver(msgs.WeightsAck(1, "started"), msgs.WeightsAck(1, "loaded", paused_s=0.0))
    ctrl.wait_weights_acks(1, timeout_s=WAIT_S)     # returns once both arrived (raises if not)
    assert chan.of(msgs.Prompts) == [] and not ctrl.service.running


def test_start_makes_the_channel_and_opens_or_reopens_the_log(setup):
    """`Controller.start`, as trainer rank 0 makes it (this process's MPI, COMM_SELF): a new log;
    a resume's log checked by its reader, reopened and its partial groups checked; a resume
    without its log refused before anything is written."""
    from mpi4py import MPI

    from areal_hpc.transport.mpi import Channel
    topo = dataclasses.replace(setup.topo, world=MPI.COMM_SELF, role_comm=MPI.COMM_SELF)
    state = _preempted(setup)
    setup.log.unlink()
    with pytest.raises(FileNotFoundError, match="no rollout log at"):
        Controller.start(setup.cfg, topo, setup.rows, setup.tok, resume=state)
    assert not setup.log.exists()
    fresh = Controller.start(setup.cfg, topo, setup.rows, setup.tok)
    setup.made.append(fresh)
    assert isinstance(fresh.chan, Channel) and fresh.writer.n_rows == 0
    fresh.close()
    setup.log.unlink()
    state = _preempted(setup)
    again = Controller.start(setup.cfg, topo, setup.rows, setup.tok, resume=state)
    setup.made.append(again)
    assert len(again.buffer) == 1 and again.ledger.partial == {0: (0, N), 1: (N, N)}
    assert again.writer.n_rows == state.rollout_rows


def test_a_steps_episode_figures():
    """Per-step figures of multi-turn episodes in the batch's stats; none for single-turn ones."""
    from areal_hpc.rollout.controller import episode_stats
    from tests.storage.test_rollout_episodes import episode_traj, single_traj
    assert episode_stats([single_traj(0, 0), single_traj(0, 1)]) == {}
    cut = dict(episode_traj(1, 0), finish_reason="max_turns", discard="timeout")
    got = episode_stats([episode_traj(0, 0), cut, single_traj(2, 0)])
    assert got == {"episode/turns_mean": (2 + 2 + 1) / 3, "episode/tool_calls": 4,
                   "episode/tool_errors": 2, "episode/tool_seconds": 3.5,
                   "episode/cut_max_turns": 1 / 3, "episode/discarded_timeout": 1,
                   **{f"episode/discarded_{c}": 0 for c in ("died", "raised", "refused", "env")}}


def test_an_environment_gets_the_whole_dataset_row(setup, tmp_path):
    """With env.fn, a math row's own fields reach the environment's reset, with "question" and
    "answer" as the run reads them (here from other keys, the answer cut to its final answer);
    without one, nothing extra is sent."""
    from areal_hpc.data.prompts import load_prompts_of
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"problem": "6*7?", "solution": "so #### 42", "tools": ["calc"],
                                "meta": {"level": 3}}) + "\n")
    setup.cfg.data.question_key, setup.cfg.data.answer_key = "problem", "solution"
    setup.cfg.env.fn = "calculator"
    setup.rows = load_prompts_of(setup.cfg, str(data))
    ctrl, _ = setup.controller()
    row = ctrl.encode(0, setup.rows[0], 2).row
    assert row == {"problem": "6*7?", "solution": "so #### 42", "tools": ["calc"],
                   "meta": {"level": 3}, "question": "6*7?", "answer": "42"}
    setup.cfg.env.fn = None
    assert "row" not in load_prompts_of(setup.cfg, str(data))[0]
