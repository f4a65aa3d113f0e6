import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from areal_hpc.storage.rollout_log import RolloutWriter
from tests.conftest import built_once

ROOT = Path(__file__).resolve().parents[2]
T0 = 1.8e9      # a realistic time.time(); every number below is relative to it

# (prompt_id, sample_idx, rank, prompt_len, versions, reward, finish, submit, first, end,
#  consumed_step, reward_error): ten trajectories in five groups, hand-checked in test_summary.
KNOWN = [
    (0, 0, 1, 3, [0, 0, 0, 0], 1.0, "stop", 0, 1, 3, 0, ""),
    (0, 1, 1, 3, [0, 0], 1.0, "stop", 0, 1, 2, 0, ""),
    (1, 0, 2, 5, [0, 0, 1, 1, 1, 1], 1.0, "length", 0, 2, 5, 1, ""),       # interrupted once
    (1, 1, 2, 5, [1, 1, 1], 0.0, "stop", 1, 2, 4, 1, "timeout after 10 s"),
    (2, 0, 1, 4, [0, 1, 2], 0.0, "stop", 2, 3, 6, 2, "reward worker process died"),  # twice
    (2, 1, 1, 4, [1, 1], 1.0, "stop", 2, 4, 6, 2, ""),
    (3, 0, 2, 2, [0], 0.5, "stop", 3, 4, 4, -2, ""),                       # dropped as stale
    (3, 1, 2, 2, [0, 0, 0, 0, 0], 0.0, "length", 3, 4, 8, -2, ""),
    (4, 0, 1, 3, [2, 2, 2, 2], 1.0, "stop", 6, 7, 9, -1, ""),              # pending
    (4, 1, 1, 3, [2, 2], 0.0, "stop", 6, 7, 8, -1, ""),
]


def known_trajs():
    """The KNOWN rows as the controller's trajectory dicts, and their consumed steps."""
    trajs, consumed = [], []
    for pid, idx, rank, plen, versions, reward, finish, ts, tf, te, step, err in KNOWN:
        n = len(versions)
        trajs.append({
            "prompt_id": pid, "sample_idx": idx, "generator_rank": rank,
            "prompt_tokens": np.arange(3, 3 + plen, dtype=np.int32),
            "output_tokens": np.arange(10, 10 + n, dtype=np.int32),
            "behav_logprobs": np.full(n, -0.5, dtype=np.float32),
            "versions": np.asarray(versions, dtype=np.int32),
            "reward": reward, "finish_reason": finish,
            "t_submit": T0 + ts, "t_first_token": T0 + tf, "t_end": T0 + te, "reward_error": err,
        })
        consumed.append(step)
    return trajs, consumed


def write_known_log(path: Path, name: str = "known") -> Path:
    """A rollout log holding KNOWN, appended group by group, with its consumed steps marked."""
    trajs, consumed = known_trajs()
    w = RolloutWriter(path, config_yaml=f"name: {name}\nmodel:\n  path: {path.parent}/nomodel\n")
    for g in range(0, len(trajs), 2):
        w.append(trajs[g:g + 2])
    for step in sorted(set(consumed)):
        w.mark_consumed([i for i, c in enumerate(consumed) if c == step], step)
    w.close()
    return path


@pytest.fixture
def known_log(tmp_path):
    return write_known_log(tmp_path / "known" / "rollouts.h5")


@pytest.fixture
def write_log():
    """`write_known_log(path, name)`, for tests that need several logs."""
    return write_known_log


@pytest.fixture
def known():
    """KNOWN as trajectory dicts, and their consumed steps."""
    return known_trajs()


@pytest.fixture(scope="session")
def trained_tiny_model(tmp_path_factory):
    """A tiny model that answers some problems, so the evaluations compare non-zero accuracies:
    the project's (models/tiny, built by tools/run_local.sh), or the same recipe pre-trained
    shorter (250 steps, at most 90 s: a minute and a half of a suite near its budget), built into
    a temp dir when it is absent. (`tiny_model`, tests/conftest.py, is pre-trained 30 steps.)"""
    built = ROOT / "models" / "tiny"
    if (built / "config.json").is_file() and (built / "heldout.jsonl").is_file():
        return built

    def build(folder: Path) -> str:
        out = folder / "tiny"
        r = subprocess.run([sys.executable, "tools/make_tiny_model.py", "--out", str(out), "--steps", "250",
                            "--minutes", "1.5"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, r.stderr[-3000:]
        return str(out)
    return Path(built_once(tmp_path_factory, "trained_tiny_model", build))
