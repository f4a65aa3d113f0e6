"""The rollout log's per-sample seed column (issue 30): written, read back, and absent from logs
written before it, which read (and, continued after a resume, are filled) as NO_SEED."""
import h5py
import numpy as np
import pytest

from areal_hpc.storage.rollout_log import NO_SEED, RolloutLogError, RolloutReader, RolloutWriter

from .test_rollout_log import _traj


def _seeded(pid, idx, seed):
    t = _traj(pid, idx, 4, 5, 0)
    if seed is not None:
        t["seed"] = seed
    return t


def test_seeds_round_trip(tmp_path):
    path = tmp_path / "r.h5"
    with_seed = [_seeded(0, 0, 2**61 + 3), _seeded(0, 1, 2**61 + 4), _seeded(1, 0, None)]
    w = RolloutWriter(path)
    w.append(with_seed)
    assert w.read(1)["seed"] == 2**61 + 4
    w.close()
    with RolloutReader(path) as r:
        assert r.column("seed").tolist() == [2**61 + 3, 2**61 + 4, NO_SEED]
        assert [r[i]["seed"] for i in range(3)] == [2**61 + 3, 2**61 + 4, NO_SEED]


def _without_seed_column(path):
    """As a log written before the seed column: the same file with /traj/seed removed."""
    with h5py.File(path, "a") as f:
        del f["traj/seed"]


def test_a_log_from_before_the_seed_column(tmp_path):
    path = tmp_path / "old.h5"
    w = RolloutWriter(path)
    w.append([_seeded(0, 0, None), _seeded(0, 1, None)])
    w.close()
    _without_seed_column(path)
    with RolloutReader(path) as r:
        assert "seed" not in r.f["traj"]
        assert r.column("seed").tolist() == [NO_SEED, NO_SEED]
        assert r[1]["seed"] == NO_SEED and r[1]["sample_idx"] == 1
    # a resumed job continues it: the old rows read as before, the new ones have their seeds
    w = RolloutWriter.reopen(path, keep_rows=2)
    w.append([_seeded(1, 0, 7), _seeded(1, 1, 8)])
    w.close()
    with RolloutReader(path) as r:
        assert r.column("seed").tolist() == [NO_SEED, NO_SEED, 7, 8]
        np.testing.assert_array_equal(r[3]["output_tokens"], _traj(1, 1, 4, 5, 0)["output_tokens"])


def test_a_seed_below_no_seed_is_damage(tmp_path):
    path = tmp_path / "r.h5"
    w = RolloutWriter(path)
    w.append([_seeded(0, 0, 5)])
    w.close()
    with h5py.File(path, "a") as f:
        f["traj/seed"][0] = -7
    with RolloutReader(path) as r, pytest.raises(RolloutLogError, match="seed is not a seed"):
        r[0]
