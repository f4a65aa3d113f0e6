"""The audit of runs with multi-turn episodes (areal_hpc/audit/, check 8): every trained token
was sampled, every observation token masked; staleness counts an episode by its oldest sampled
token. The runs are tests/test_audit.py's, written by the real RolloutWriter, with each sample
made an episode (a sampled turn, an observation, the rest) and then, for the failures, the
rollout log's mask or versions corrupted on disk."""
import h5py
import numpy as np
import pytest

from areal_hpc import audit as au
from areal_hpc.env.episode import NO_VERSION
from areal_hpc.storage.rollout_log import RolloutReader
from tests import test_audit as ta

OBS = [90, 91]          # each sample's observation tokens, after its first sampled token
MASK_CHECK = 8
PLAIN = ta.Sim


class EpisodeSim(ta.Sim):
    """tests/test_audit.py's run, each sample an episode: its first sampled token, an
    observation (mask 0, version -1, log-probability 0), then its other sampled tokens."""

    @staticmethod
    def _trajs(pid, versions, finish="stop", first_token=0):
        out = PLAIN._trajs(pid, versions, finish, first_token)
        for t in out:
            n = len(t["versions"])
            if n == 0:
                continue
            t["output_tokens"] = t["output_tokens"][:1] + OBS + t["output_tokens"][1:]
            t["behav_logprobs"] = t["behav_logprobs"][:1] + [0.0] * len(OBS) + t["behav_logprobs"][1:]
            t["versions"] = list(t["versions"][:1]) + [NO_VERSION] * len(OBS) + list(t["versions"][1:])
            t["loss_mask"] = np.asarray([1] + [0] * len(OBS) + [1] * (n - 1), np.uint8)
            ends = [1, 1 + len(OBS)] + ([len(OBS) + n] if n > 1 else [])
            t["turn_ends"], t["turn_is_sample"] = np.asarray(ends), np.asarray([1, 0, 1][:len(ends)])
            t["tool_calls"] = [{"name": "calculator", "args": "1+1", "output_bytes": 1,
                                "seconds": 0.01, "error": None}]
        return out

    def arrive(self, pid, versions, first_token=0):
        super().arrive(pid, versions, first_token)
        self.tokens += ta.N * len(OBS) * bool(len(versions))   # the ledger counts every token


class SampledReader(RolloutReader):
    """The simulated controller's view of a row: its sampled tokens' versions (the controller's
    buffer and metrics count an episode by its oldest sampled token, rollout/staleness.py)."""

    def __getitem__(self, i):
        row = super().__getitem__(i)
        row["versions"] = row["versions"][row["loss_mask"] == 1]
        return row


@pytest.fixture
def episodes(tmp_path, monkeypatch):
    monkeypatch.setattr(ta, "Sim", EpisodeSim)
    monkeypatch.setattr(ta, "RolloutReader", SampledReader)
    return ta.build_run(tmp_path / "episodes")


def _edit(run_dir, name, row_of_token):
    """Change one output token of the log on disk: `row_of_token(reader) -> (row, offset)`."""
    log = run_dir / "rollouts.h5"
    with RolloutReader(log) as r:
        row, k = row_of_token(r)
        at = (int(r.column("output_end")[row - 1]) if row else 0) + k
        pid, sidx = int(r.column("prompt_id")[row]), int(r.column("sample_idx")[row])
    with h5py.File(log, "r+") as f:
        ds = f["tokens"][name]
        ds[at] = 1 - ds[at] if name == "loss_mask" else NO_VERSION
    return row, pid, sidx


def _trained_row(r):
    return int(np.flatnonzero(r.column("consumed_step") >= 0)[0])


def test_a_run_of_episodes_passes_and_staleness_counts_sampled_tokens(episodes, tmp_path,
                                                                      monkeypatch):
    report = au.audit(episodes)
    assert [c.ok for c in report.checks] == [True] * 8, report.text()
    with RolloutReader(episodes / "rollouts.h5") as r:
        assert (r.tokens("versions") == NO_VERSION).sum() == (r.tokens("loss_mask") == 0).sum() > 0
    monkeypatch.undo()
    plain = au.audit(ta.build_run(tmp_path / "plain"))
    assert report.checks[4].detail[0] == plain.checks[4].detail[0]     # the same staleness
    assert "mask 1 with version -1 in 0, mask 0 with a version in 0" in report.checks[7].detail[0]


def test_a_trained_observation_token_is_named(episodes):
    row, pid, sidx = _edit(episodes, "loss_mask", lambda r: (_trained_row(r), 1))
    report = au.audit(episodes)
    assert ta.failing(report) == {MASK_CHECK}, report.text()
    text = "\n".join(report.checks[7].detail)
    assert (f"1 row(s) train a token that was not sampled (loss mask 1, version -1): row {row} "
            f"(prompt {pid} sample {sidx}) output token 1, 1 such") in text
    assert report.exit_code == au.EXIT_VIOLATED


def test_a_sampled_token_masked_out_is_named(episodes):
    row, pid, sidx = _edit(episodes, "loss_mask", lambda r: (_trained_row(r), 0))
    report = au.audit(episodes)
    assert ta.failing(report) == {MASK_CHECK}, report.text()
    assert (f"1 row(s) mask a sampled token out of the loss (loss mask 0, version >= 0): row {row} "
            f"(prompt {pid} sample {sidx})") in "\n".join(report.checks[7].detail)


def test_a_log_from_before_episodes_is_checked_as_all_trained(tmp_path):
    """No mask in the log: every token was trained, so a version -1 is a token trained unsampled."""
    run = ta.build_run(tmp_path / "old")
    with h5py.File(run / "rollouts.h5", "r+") as f:
        for name in ("tokens/loss_mask", "turns", "tools", "traj/turns_end", "traj/tools_end"):
            del f[name]
    assert au.audit(run).ok
    row, pid, sidx = _edit(run, "versions", lambda r: (_trained_row(r), 0))
    report = au.audit(run)
    assert MASK_CHECK in ta.failing(report), report.text()
    assert f"row {row} (prompt {pid} sample {sidx}) output token 0" in report.checks[7].detail[1]
