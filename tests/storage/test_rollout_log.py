import subprocess
import sys

import numpy as np
import pytest

from areal_hpc.storage.rollout_log import RolloutReader, RolloutWriter


def _traj(pid, idx, n_prompt, n_out, version):
    rng = np.random.default_rng(pid * 10 + idx)
    return {
        "prompt_id": pid, "sample_idx": idx,
        "prompt_tokens": rng.integers(0, 500, n_prompt, dtype=np.int32),
        "output_tokens": rng.integers(0, 500, n_out, dtype=np.int32),
        "behav_logprobs": -rng.random(n_out, dtype=np.float32),
        "versions": np.full(n_out, version, dtype=np.int32),
        "reward": float(idx % 2), "finish_reason": "stop" if idx else "length",
        "generator_rank": 1, "t_submit": 1.0, "t_first_token": 1.5, "t_end": 2.0 + idx,
    }


def test_roundtrip(tmp_path):
    path = tmp_path / "r.h5"
    w = RolloutWriter(path, config_yaml="name: x\n")
    batch1 = [_traj(0, 0, 5, 7, 0), _traj(0, 1, 5, 3, 0)]
    batch2 = [_traj(1, 0, 4, 11, 1), _traj(1, 1, 4, 1, 2)]
    assert w.append(batch1) == [0, 1]
    assert w.append(batch2) == [2, 3]
    w.mark_consumed([1, 3], step=5)
    w.close()
    with RolloutReader(path) as r:
        assert len(r) == 4 and r.config_yaml == "name: x\n"
        for i, t in enumerate(batch1 + batch2):
            row = r[i]
            for key in ("prompt_tokens", "output_tokens", "behav_logprobs", "versions"):
                np.testing.assert_array_equal(row[key], t[key])
            for key in ("prompt_id", "sample_idx", "finish_reason", "generator_rank", "t_end"):
                assert row[key] == t[key]
            assert row["reward"] == pytest.approx(t["reward"])
        assert r.column("consumed_step").tolist() == [-1, 5, -1, 5]
        with pytest.raises(IndexError):
            r[4]


def test_refuses_to_overwrite_and_checks_lengths(tmp_path):
    path = tmp_path / "r.h5"
    w = RolloutWriter(path)
    bad = _traj(0, 0, 3, 4, 0)
    bad["versions"] = bad["versions"][:2]
    with pytest.raises(ValueError, match="one entry per output token"):
        w.append([bad])
    w.close()
    with pytest.raises(FileExistsError):
        RolloutWriter(path)


READER = """
import sys, time
from areal_hpc.storage.rollout_log import RolloutReader
r = RolloutReader(sys.argv[1])
seen = 0
deadline = time.time() + 60
while seen < 20 and time.time() < deadline:
    n = len(r)
    for i in range(seen, n):
        row = r[i]
        assert len(row["output_tokens"]) == len(row["versions"]) == i + 1, (i, row)
    seen = n
    time.sleep(0.01)
print(seen)
"""


def test_swmr_reader_follows_a_live_writer(tmp_path):
    path = tmp_path / "live.h5"
    w = RolloutWriter(path)
    w.append([_traj(0, 0, 2, 1, 0)])
    reader = subprocess.Popen([sys.executable, "-c", READER, str(path)], stdout=subprocess.PIPE, text=True)
    for i in range(1, 20):
        w.append([_traj(i, 0, 2, i + 1, i)])
    out, _ = reader.communicate(timeout=90)
    w.close()
    assert reader.returncode == 0 and out.strip() == "20"
