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


def test_reward_error_roundtrip_and_cut(tmp_path):
    path = tmp_path / "r.h5"
    w = RolloutWriter(path)
    trajs = [_traj(0, i, 2, 3, 0) for i in range(3)]
    trajs[1]["reward_error"] = "timeout after 10 s"
    trajs[2]["reward_error"] = "é" * 60                     # 120 bytes of UTF-8
    w.append(trajs)                                         # trajs[0] has no reward_error key
    w.close()
    with RolloutReader(path) as r:
        assert [r[i]["reward_error"] for i in range(3)] == ["", "timeout after 10 s", "é" * 48]
        assert r.column("reward_error").tolist() == [b"", b"timeout after 10 s", ("é" * 48).encode()]
        np.testing.assert_array_equal(r.tokens("versions"), np.zeros(9))
        np.testing.assert_array_equal(r.tokens("prompt"), np.concatenate([t["prompt_tokens"] for t in trajs]))


def test_schema_1_logs_still_read(tmp_path):
    """A log written before reward_error existed: no such dataset, no format attribute."""
    import h5py
    path = tmp_path / "old.h5"
    w = RolloutWriter(path)
    w.append([_traj(0, 0, 2, 3, 0)])
    w.close()
    with h5py.File(path, "r+") as f:
        del f["traj/reward_error"]
        del f.attrs["format"]
        f.attrs["schema_version"] = 1
    with RolloutReader(path) as r:
        assert r[0]["reward_error"] == "" and r.column("reward_error").tolist() == [b""]
        assert r[0]["sample_idx"] == 0


def test_files_that_are_not_rollout_logs(tmp_path):
    import h5py
    from areal_hpc.storage.rollout_log import RolloutLogError
    good = tmp_path / "good.h5"
    w = RolloutWriter(good)
    w.append([_traj(i, 0, 5, 50, 0) for i in range(20)])
    w.close()
    (tmp_path / "text.h5").write_text("hello\n")
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f["x"] = np.arange(3)
    with h5py.File(tmp_path / "newer.h5", "w") as f:
        f.attrs["schema_version"] = 99
    data = good.read_bytes()
    (tmp_path / "cut.h5").write_bytes(data[: len(data) - 100])
    for name, msg in [("text.h5", "not an HDF5 file"), ("foreign.h5", "no schema_version"),
                      ("newer.h5", "schema_version 99"), ("cut.h5", "truncated HDF5 file")]:
        with pytest.raises(RolloutLogError, match=msg) as e:
            RolloutReader(tmp_path / name)
        assert str(tmp_path / name) in str(e.value)
    with pytest.raises(FileNotFoundError):
        RolloutReader(tmp_path / "missing.h5")


def test_a_reward_float32_cannot_hold_is_that_samples_failure(tmp_path):
    """A reward of 1e300 (a config typo before weights were range-checked, or a reward function)
    used to be stored as float32 inf, after which every reader refused the whole log. It is
    refused at write time for that sample: stored as 0 with the reason, the dict set to match."""
    from areal_hpc.analysis.load import load_run
    path = tmp_path / "rollouts.h5"
    w = RolloutWriter(path)
    trajs = [_traj(0, i, 2, 3, 0) for i in range(6)]
    for t, reward in zip(trajs, [1e300, float("inf"), float("nan"), -1e39, "1.0", 0.5]):
        t["reward"] = reward
    assert w.append(trajs) == list(range(6))
    w.append([_traj(1, 0, 2, 3, 0)])
    w.close()
    why = "is not a finite float32 (stored as 0)"
    assert [t["reward"] for t in trajs] == [0.0] * 5 + [0.5]
    assert trajs[0]["reward_error"] == f"reward 1e+300 {why}" and trajs[5].get("reward_error") is None
    with RolloutReader(path) as r:
        assert r.column("reward").tolist() == [0.0] * 5 + [0.5, 0.0]
        errors = [r[i]["reward_error"] for i in range(7)]
        assert errors == [f"reward {x} {why}" for x in ("1e+300", "inf", "nan", "-1e+39", "1.0")] + ["", ""]
        assert r.bad == {}
    run = load_run(path, progress=False)
    assert len(run.traj) == 7 and run.skipped == {} and run.traj["reward_error"][0].startswith("reward 1e+300")


@pytest.mark.parametrize("field, value, why", [
    ("behav_logprobs", [-0.1, float("nan"), -0.2], "behav_logprobs is not a log-probability: nan"),
    ("behav_logprobs", [-0.1, -0.1, 5.0], "behav_logprobs is not a log-probability: 5.0"),
    ("versions", [0, -1, 0], "versions is negative: -1"),
    ("t_end", float("inf"), "t_end is not a finite number: inf"),
    ("finish_reason", "eos", "finish_reason 'eos' is not one of"),
    ("seed", -7, "seed is not a seed: -7"),
])
def test_what_a_reader_would_refuse_is_not_written(tmp_path, field, value, why):
    """Any other value the reader would refuse: a ValueError naming the trajectory and the
    field, before anything of the batch is written; the log goes on as if it was never tried."""
    path = tmp_path / "r.h5"
    w = RolloutWriter(path)
    w.append([_traj(0, 0, 2, 3, 0)])
    bad = _traj(7, 1, 4, 3, 0)
    bad[field] = np.asarray(value) if isinstance(value, list) else value
    with pytest.raises(ValueError, match=f"trajectory 7/1: {why}"):
        w.append([_traj(5, 0, 2, 3, 0), bad])
    good = _traj(2, 0, 3, 2, 1)
    assert w.append([good]) == [1]
    w.close()
    with RolloutReader(path) as r:
        assert len(r) == 2 and r[1]["prompt_id"] == 2
        np.testing.assert_array_equal(r[1]["prompt_tokens"], good["prompt_tokens"])
        np.testing.assert_array_equal(r.tokens("versions"), [0, 0, 0, 1, 1])
