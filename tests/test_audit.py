"""The run audit (areal_hpc/audit/) on run directories written by the project's own writers:
the real RolloutWriter (its reopen marks rolled-back rows, as a resume does), the real
checkpoint.write_state and checkpoint.write_manifest of areal_hpc/storage (stand-in Megatron
shards: find_latest checks their pickles, nothing loads them), config.yaml as main.py writes
it. A clean run passes; each kind of damage is found by the check it belongs to."""
import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from areal_hpc import audit as au
from areal_hpc.config import load, to_yaml
from areal_hpc.storage import checkpoint as ck
from areal_hpc.storage.run_state import ControllerState
from areal_hpc.storage.rollout_log import (DROPPED_STALE, FAILED, NOT_CONSUMED, PARTIAL, ROLLED_BACK,
                                           RolloutReader, RolloutWriter)
from tests.storage.test_safe_pickle import stand_in_shards

ROOT = Path(__file__).resolve().parents[1]
B, N, ETA, STEPS = 2, 2, 1, 6


@functools.lru_cache(maxsize=None)
def config_yaml(policy: str = "reissue", max_reissues: int = 1) -> str:
    """A run's config.yaml as main.py writes it (to_yaml of the loaded config)."""
    return to_yaml(load(None, ["model.path=model", "data.train_path=train.jsonl",
                               f"train.batch_prompts={B}", f"rollout.group_size={N}",
                               f"rollout.max_staleness={ETA}", f"train.total_steps={STEPS}",
                               f"rollout.stale_policy={policy}",
                               f"rollout.max_reissues={max_reissues}"]))


def write_checkpoint(run_dir: Path, step: int, controller: ControllerState,
                     config_yaml: str) -> Path:
    """state.h5 by checkpoint.write_state and manifest.json by checkpoint.write_manifest, as a
    save writes them, beside stand-in shards that pass the pickle check (safe_pickle.py)."""
    d = ck.step_dir(run_dir, step)
    stand_in_shards(d / ck.SHARDS)
    ck.write_state(d / ck.STATE, step=step, config_yaml=config_yaml, scheduler=None, rng=[],
                   controller=controller)
    ck.write_manifest(d, step)
    return d


class Sim:
    """The controller's bookkeeping (rollout/controller.py) in miniature, driven by hand: prompts
    issued from a cursor (prompt id = cursor position), reissues first; groups appended to the
    real rollout log and buffered; stale groups dropped by rollout.stale_policy before each step;
    the B oldest groups trained; checkpoints of Controller.state(); a crash and a resume from the
    newest checkpoint (rows after it rolled back, buffered rows pending again, metrics cut)."""

    def __init__(self, run_dir: Path, *, max_reissues=1, policy="reissue", drop=True):
        self.run_dir = run_dir
        self.yaml = config_yaml(policy, max_reissues)
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(self.yaml)
        self.log = run_dir / "rollouts.h5"
        self.writer = RolloutWriter(self.log, self.yaml)
        self.policy, self.max_reissues, self.drop = policy, max_reissues, drop
        self.version = self.cursor = self.accepted = self.dropped = self.lost = self.tokens = 0
        self.inflight: dict[int, None] = {}
        self.reissue: list[int] = []
        self.buffer: list[tuple[int, list[int], int]] = []     # (prompt, rows, oldest version)
        self.times: dict[int, int] = {}
        self.partial: dict[int, tuple[int, int]] = {}           # prompt → (first row, rows)

    def issue(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            if self.reissue:
                pid = self.reissue.pop(0)
            else:
                pid, self.cursor = self.cursor, self.cursor + 1
            self.inflight[pid] = None
            out.append(pid)
        return out

    @staticmethod
    def _trajs(pid: int, versions, finish="stop", first_token=0) -> list[dict]:
        return [{"prompt_id": pid, "sample_idx": i, "prompt_tokens": [1, 2, 3],
                 "output_tokens": list(range(first_token, first_token + len(versions))),
                 "behav_logprobs": [-0.5] * len(versions),
                 "versions": versions, "reward": 1.0, "finish_reason": finish,
                 "generator_rank": 1, "t_submit": 0.0, "t_first_token": 1.0, "t_end": 2.0}
                for i in range(N)]

    def preempt(self, prefixes: dict[int, list[int]]) -> None:
        """A stop at a preemption: in-flight prompts' samples as far as they got (`prefixes`:
        prompt → versions of the tokens so far) appended as PARTIAL rows; still in flight."""
        for pid, versions in prefixes.items():
            assert pid in self.inflight
            rows = self.writer.append(self._trajs(pid, versions, "abort"), consumed=PARTIAL)
            self.partial[pid] = (rows[0], len(rows))

    def arrive(self, pid: int, versions, first_token=0) -> None:
        del self.inflight[pid]
        self.partial.pop(pid, None)
        rows = self.writer.append(self._trajs(pid, versions, first_token=first_token))
        self.buffer.append((pid, rows, min(versions)))
        self.accepted += 1
        self.tokens += N * len(versions)

    def fail(self, pid: int) -> None:
        """A group with no sampled token (every episode ended before the model's first turn):
        logged, marked FAILED, never buffered, its prompt given up (Ledger.arrived)."""
        del self.inflight[pid]
        self.partial.pop(pid, None)
        rows = self.writer.append(self._trajs(pid, []))
        self.writer.mark_consumed(rows, FAILED)

    def step(self) -> None:
        self.drop_stale()
        self.train()

    def drop_stale(self) -> None:
        """What next_batch does first: groups older than version - η out, by stale_policy."""
        if self.drop:
            stale = [g for g in self.buffer if g[2] < self.version - ETA]
            self.buffer = [g for g in self.buffer if g not in stale]
            for pid, rows, _ in stale:
                self.writer.mark_consumed(rows, DROPPED_STALE)
                self.accepted -= 1
                self.dropped += 1
                n = self.times.get(pid, 0)
                if self.policy == "reissue" and n < self.max_reissues:
                    self.times[pid] = n + 1
                    self.reissue.append(pid)
                else:
                    self.times.pop(pid, None)
                    self.lost += 1

    def train(self) -> None:
        """The B oldest groups trained at step `version`, one metrics.jsonl line."""
        assert len(self.buffer) >= B, "the scenario must have B groups ready"
        self.buffer.sort(key=lambda g: g[2])
        taken, self.buffer = self.buffer[:B], self.buffer[B:]
        rows = [r for _, rs, _ in taken for r in rs]
        self.writer.mark_consumed(rows, self.version)
        with RolloutReader(self.log) as r:
            stale = max(self.version - min(r[i]["versions"]) for i in rows)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": self.version, "version": self.version + 1,
                                "staleness_max": int(stale)}) + "\n")
        self.version += 1

    def state(self) -> ControllerState:
        inflight = sorted(self.inflight) + self.reissue
        part = sorted((p, *self.partial[p]) for p in inflight if p in self.partial)
        return ControllerState(
            partial_prompt_ids=np.asarray([p for p, _, _ in part], np.int64),
            partial_first_row=np.asarray([r for _, r, _ in part], np.int64),
            partial_rows=np.asarray([n for _, _, n in part], np.int64),
            version=self.version, cursor_consumed=self.cursor,
            accepted=self.accepted, rejected=self.dropped, dropped_stale=self.dropped,
            lost_stale=self.lost, generated_tokens=self.tokens,
            rollout_rows=self.writer.n_rows,
            buffer_rows=np.asarray([r for _, rs, _ in self.buffer for r in rs], np.int64),
            buffer_group_ends=np.cumsum([len(rs) for _, rs, _ in self.buffer], dtype=np.int64),
            inflight_prompt_ids=np.asarray(inflight, np.int64),
            inflight_dataset_index=np.asarray(inflight, np.int64))

    def checkpoint(self, tamper=None) -> None:
        state = self.state()
        if tamper is not None:
            state = tamper(state)
        write_checkpoint(self.run_dir, self.version, state, self.yaml)

    def crash_and_resume(self) -> None:
        self.writer.close()
        path, _ = ck.find_latest(self.run_dir)
        st = ck.read_state(path / ck.STATE)["controller"]
        self.writer = RolloutWriter.reopen(self.log, st.rollout_rows)
        rows = st.buffer_rows.tolist()
        self.writer.mark_consumed(rows, NOT_CONSUMED)
        ends = [0, *st.buffer_group_ends.tolist()]
        with RolloutReader(self.log) as r:
            self.buffer = [(int(r[rows[a]]["prompt_id"]), rows[a:b],
                            int(min(min(r[i]["versions"]) for i in rows[a:b])))
                           for a, b in zip(ends[:-1], ends[1:])]
        self.version, self.cursor = st.version, st.cursor_consumed
        self.accepted, self.dropped = st.accepted, st.dropped_stale
        self.lost = st.lost_stale
        self.tokens = st.generated_tokens
        self.inflight, self.times = {}, {}
        self.reissue = st.inflight_prompt_ids.tolist()
        self.partial = {p: (r, n) for p, r, n in zip(*(getattr(st, k).tolist() for k in (
            "partial_prompt_ids", "partial_first_row", "partial_rows")))}
        metrics = self.run_dir / "metrics.jsonl"
        keep = [ln for ln in metrics.read_text().splitlines()
                if json.loads(ln)["step"] < self.version]
        metrics.write_text("".join(ln + "\n" for ln in keep))

    def close(self) -> None:
        self.writer.close()


def build_run(run_dir: Path, *, final_tamper=None, future_version=False, max_reissues=1,
              drop=True, crash_at_end=False, before_final=None, policy="reissue") -> Path:
    """Six steps of B = 2 groups of n = 2 with η = 1: checkpoints at steps 2, 4 and the end, a
    crash after step 2's checkpoint (one step and two groups rolled back, their prompts issued
    again), a group dropped as stale (issued again, or given up with max_reissues = 0), and at
    the end one group pending and one prompt in flight."""
    s = Sim(run_dir, max_reissues=max_reissues, drop=drop, policy=policy)
    s.issue(6)                                      # prompts 0-5, version 0
    s.arrive(0, [0, 0]), s.arrive(1, [0]), s.arrive(2, [0])
    s.step()                                        # step 0: prompts 0, 1
    s.arrive(3, [0, 1]), s.arrive(4, [1])
    s.step()                                        # step 1: prompts 2, 3
    s.checkpoint()                                  # step 2: 4 buffered, 5 in flight
    s.arrive(5, [1])
    s.issue(2)                                      # 6, 7
    s.arrive(6, [2])
    s.step()                                        # step 2, lost with the crash
    s.crash_and_resume()                            # rows of 5 and 6 rolled back
    assert s.issue(3) == [5, 6, 7]
    s.arrive(5, [2]), s.arrive(6, [2])
    s.step()                                        # step 2 again: prompts 4, 5
    s.issue(3)                                      # 8, 9, 10 at version 3
    s.arrive(7, [2, 3])
    s.step()                                        # step 3: prompts 6, 7
    s.checkpoint()                                  # step 4: 8, 9, 10 in flight
    s.arrive(8, [3]), s.arrive(9, [4, 5] if future_version else [4])
    s.step()                                        # step 4: prompts 8, 9
    s.arrive(10, [3])                               # finished late: stale at step 5
    s.issue(1)                                      # 11
    s.arrive(11, [5])
    s.drop_stale()                                  # step 5 begins: 10 dropped
    for pid in s.issue(1):                          # 10 again (12 if given up, or not dropped)
        s.arrive(pid, [5])
    s.train()                                       # step 5
    pending, flying = s.issue(2)
    s.arrive(pending, [6])
    if crash_at_end:
        s.close()
        return run_dir
    if before_final is not None:
        before_final(s)
    s.checkpoint(final_tamper)                      # step 6: one group buffered, one in flight
    s.close()
    return run_dir


def checks(report) -> dict[str, au.Check]:
    return {c.name: c for c in report.checks}


def failing(report) -> set[int]:
    return {k for k, c in enumerate(report.checks, 1) if c.ok is False}


@pytest.fixture
def clean(tmp_path):
    return build_run(tmp_path / "clean")


def test_clean_run_passes(clean, capsys):
    report = au.audit(clean)
    assert report.ok and failing(report) == set(), report.text()
    assert [c.ok for c in report.checks] == [True] * 8, report.text()
    text = report.text()
    assert "rolled back and issued again: 2" in text      # prompts 5 and 6
    assert "dropped as stale and issued again: 1" in text  # prompt 10
    assert "in flight at the checkpoint (issued again by a resume): 1" in text
    assert "lost: 0" in text and report.figure("lost") == 0        # printed, and typed for tools
    assert report.figure("kept_tokens") == 0 and report.figure("absent", -1) == -1
    assert "steps 0-5 consumed, each 4 trajectories in 2 whole groups of 2" in text
    with RolloutReader(clean / "rollouts.h5") as r:    # the resume really rolled rows back
        assert (r.column("consumed_step") == ROLLED_BACK).sum() == 4
    assert au.main([str(clean), "--no-crc"]) == 0
    assert "result: every guarantee checked holds" in capsys.readouterr().out


def test_given_up_prompt_is_accounted(tmp_path):
    report = au.audit(build_run(tmp_path / "r", max_reissues=0))
    assert report.ok, report.text()
    assert "dropped and given up: 1" in report.text()


def test_a_failed_prompt_is_accounted(tmp_path):
    """A group without a sampled token, marked FAILED, its prompt given up: the audit passes and
    counts it apart; the same prompt trained later would be one issued again."""
    def fail_one(s):
        (pid,) = s.issue(1)
        s.fail(pid)

    report = au.audit(build_run(tmp_path / "r", before_final=fail_one))
    assert report.ok, report.text()
    assert "never trained, given up: 1" in report.text()


def test_trajectory_trained_twice(clean):
    with RolloutReader(clean / "rollouts.h5") as r:
        consumed = r.column("consumed_step")
    dropped = np.flatnonzero(consumed == DROPPED_STALE).tolist()
    w = RolloutWriter.reopen(clean / "rollouts.h5", keep_rows=len(consumed))
    w.mark_consumed(dropped, 5)                     # the stale group trained as well
    w.close()
    report = au.audit(clean)
    assert 1 in failing(report), report.text()
    assert "prompt 10 sample 0" in checks(report)["no trajectory trained twice"].detail[1]
    assert au.main([str(clean)]) == 1


def test_step_missing_from_metrics(clean):
    path = clean / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("".join(ln + "\n" for ln in lines if json.loads(ln)["step"] != 3))
    report = au.audit(clean)
    assert failing(report) == {2}, report.text()
    assert "once each: missing: 3" in "\n".join(report.checks[1].detail)


def test_step_missing_from_log(clean):
    with RolloutReader(clean / "rollouts.h5") as r:
        consumed = r.column("consumed_step")
    w = RolloutWriter.reopen(clean / "rollouts.h5", keep_rows=len(consumed))
    w.mark_consumed(np.flatnonzero(consumed == 3).tolist(), 4)     # step 3 gone, 4 twice
    w.close()
    report = au.audit(clean)
    assert 2 in failing(report), report.text()
    detail = "\n".join(report.checks[1].detail)
    assert "consumed nothing" in detail and "step 4: 8" in detail


def test_lost_prompt(tmp_path):
    def forget_inflight(state):
        return state.replace(inflight_prompt_ids=state.inflight_prompt_ids[:0],
                             inflight_dataset_index=state.inflight_dataset_index[:0])
    report = au.audit(build_run(tmp_path / "r", final_tamper=forget_inflight))
    assert failing(report) == {3}, report.text()
    assert "1 prompt(s) lost" in "\n".join(report.checks[2].detail)
    assert report.figure("lost") == 1


def test_pending_rows_not_buffered(tmp_path):
    def forget_buffer(state):
        return state.replace(buffer_rows=state.buffer_rows[:0],
                             buffer_group_ends=state.buffer_group_ends[:0],
                             accepted=state.accepted - 1)
    report = au.audit(build_run(tmp_path / "r", final_tamper=forget_buffer))
    assert failing(report) == {4}, report.text()
    assert "2 pending row(s) the checkpoint did not buffer" in "\n".join(report.checks[3].detail)


def test_token_version_beyond_its_step(tmp_path):
    report = au.audit(build_run(tmp_path / "r", future_version=True))
    assert 5 in failing(report), report.text()
    assert "at step 4 has version 5" in "\n".join(report.checks[4].detail)


def test_staleness_beyond_eta(tmp_path):
    report = au.audit(build_run(tmp_path / "r", drop=False))   # the stale group trained
    assert failing(report) == {5}, report.text()
    assert "more than η = 1 versions stale" in "\n".join(report.checks[4].detail)


def test_stale_training_under_keep_is_no_guarantee(tmp_path):
    report = au.audit(build_run(tmp_path / "r", drop=False, policy="keep"))
    assert report.exit_code == 0 and report.checks[4].ok is None, report.text()
    assert "not a guarantee of this run" in report.text()


def test_run_past_its_checkpoint_is_audited_as_a_resume_sees_it(tmp_path):
    run = build_run(tmp_path / "r", crash_at_end=True)     # killed after step 5, newest: step 4
    report = au.audit(run)
    assert report.ok, report.text()
    assert "went on past its newest checkpoint (step 4" in report.text()
    assert "steps 4-5 were trained after the newest checkpoint" in report.text()


def test_corrupt_newest_checkpoint_is_passed_over(clean):
    (ck.step_dir(clean, 6) / ck.STATE).write_bytes(b"not hdf5")
    report = au.audit(clean)
    assert report.ok, report.text()
    assert any("step_00000006" in n for n in report.notes), report.notes
    assert "checkpoint: checkpoints/step_00000004" in report.text()


def test_without_checkpoint_the_buffer_is_not_checkable(clean):
    for d in ck.list_checkpoints(clean):
        shutil.rmtree(d)
    report = au.audit(clean)
    assert report.exit_code == 0, report.text()
    assert report.checks[3].ok is None and "not checkable" in report.checks[3].detail[0]
    assert report.checks[2].ok is None


def test_earlier_attempts_are_named(clean):
    (clean / "metrics.attempt-1.jsonl").write_text("")
    assert any("metrics.attempt-1.jsonl" in n for n in au.audit(clean).notes)


@pytest.mark.parametrize("name, content, where", [
    ("rollouts.h5", b"this is not HDF5", "rollouts.h5"),
    ("metrics.jsonl", b'{"step": 0}\n{"step": 1, "los', "metrics.jsonl:2"),
    ("config.yaml", b"train: [unclosed\n", "config.yaml"),
])
def test_unreadable_input_is_one_line(clean, capsys, name, content, where):
    (clean / name).write_bytes(content)
    assert au.main([str(clean)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and where in lines[0], out.err


@pytest.mark.parametrize("entry", [["tools/audit_run.py"], ["-m", "areal_hpc.audit"]])
def test_command_line(clean, entry):
    r = subprocess.run([sys.executable, *entry, str(clean)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[ok] 6." in r.stdout


def test_empty_run_without_checkpoint(tmp_path):
    """A job stopped before its first group arrived: nothing violated, the rest not checkable."""
    run = tmp_path / "empty"
    run.mkdir()
    (run / "config.yaml").write_text(config_yaml())
    RolloutWriter(run / "rollouts.h5", config_yaml()).close()
    report = au.audit(run)
    assert report.exit_code == 0, report.text()
    assert [c.ok for c in report.checks] == [True, True, None, None, True, True, True, True], report.text()


def test_issued_again_after_training(tmp_path):
    """A trained prompt issued once more, its new group buffered at the final checkpoint."""
    def reissue_trained(sim):
        sim.inflight[0] = None                      # prompt 0 was trained at step 0
        sim.arrive(0, [6])
    report = au.audit(build_run(tmp_path / "r", before_final=reissue_trained))
    assert failing(report) == {3}, report.text()
    assert "prompt 0 trained at step 0 was issued again (rows 32-33: pending)" in report.text()


def preempted_run(run_dir: Path, *, continue_from=0, resume=True, tamper=None) -> Path:
    """A preemption with prompt 2 mid-generation: its samples kept as PARTIAL rows (one token,
    version 0) and referenced by the checkpoint at the stop; the resume continues them (the
    continuation's tokens start at `continue_from`: 0 is the partial row's own first token)
    and trains them at step 1. Without `resume`, the run ends preempted."""
    s = Sim(run_dir)
    s.issue(3)                                      # prompts 0-2
    s.arrive(0, [0]), s.arrive(1, [0])
    s.step()                                        # step 0: prompts 0, 1
    s.preempt({2: [0]})
    s.checkpoint(tamper)                            # step 1: prompt 2 in flight, partial
    if resume:
        s.crash_and_resume()
        assert s.issue(2) == [2, 3]
        s.arrive(2, [0, 1], first_token=continue_from), s.arrive(3, [1])
        s.step()                                    # step 1: prompts 2, 3
        s.checkpoint()
    s.close()
    return run_dir


def test_partial_rows_continued_from_their_prefix(tmp_path):
    report = au.audit(preempted_run(tmp_path / "r"))
    assert report.ok, report.text()
    text = report.text()
    assert "2 partial row(s); 2 continued by a later row that starts with them (2 tokens kept" \
        in text and report.figure("kept_tokens") == 2
    assert "preempted mid-generation and continued from their partial rows: 1" in text
    waiting = au.audit(preempted_run(tmp_path / "w", resume=False))
    assert waiting.ok, waiting.text()
    assert "2 waiting in the checkpoint's partial groups" in waiting.text()


def test_continuation_that_does_not_start_with_its_partial_row(tmp_path):
    report = au.audit(preempted_run(tmp_path / "r", continue_from=1))
    assert failing(report) == {7}, report.text()
    assert "does not start with partial row" in report.text()


def test_partial_rows_the_checkpoint_forgot(tmp_path):
    def forget(state):
        return state.replace(**{k: np.zeros(0, np.int64) for k in (
            "partial_prompt_ids", "partial_first_row", "partial_rows")})
    report = au.audit(preempted_run(tmp_path / "r", resume=False, tamper=forget))
    assert failing(report) == {7}, report.text()
    assert "not among the checkpoint's partial groups" in report.text()


def test_groups_without_signal_are_counted_against_the_log(clean):
    """metrics.jsonl's zero_var_groups (groups of equal rewards, which the guards may leave out
    of the loss) and filtered_seqs (left out) must be the log's at every step, decided by the
    trainer's own function on the stored rewards: each such group is consumed by its step like
    any other. Every reward of this run is 1.0: every trained group has no signal; the guards
    are off (the defaults), so none is left out."""
    path = clean / "metrics.jsonl"
    recs = [json.loads(ln) for ln in path.read_text().splitlines()]

    def write(counts, filtered=None):
        filtered = filtered or [0] * len(counts)
        path.write_text("".join(json.dumps({**r, "zero_var_groups": c, "filtered_seqs": f}) + "\n"
                                for r, c, f in zip(recs, counts, filtered)))

    write([B] * len(recs))
    report = au.audit(clean)
    assert report.ok, report.text()
    assert f"{B * len(recs)} group(s) without learning signal over {len(recs)} steps, each consumed " \
           f"by its step; 0 trajectories left out of the loss" in report.text()
    write([B] * 3 + [B - 1] + [B] * (len(recs) - 4))
    report = au.audit(clean)
    assert failing(report) == {2}, report.text()
    assert f"step 3: {B - 1} counted, {B} in the log" in report.text()
    write([B] * len(recs), [0, 0, N] + [0] * (len(recs) - 3))
    report = au.audit(clean)
    assert failing(report) == {2}, report.text()
    assert f"filtered_seqs disagrees with the guards on the log: step 2: {N} left out, 0 by the " \
           "log" in report.text()
