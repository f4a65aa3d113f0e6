"""load_run on a log of multi-turn episodes: per trajectory its sampled tokens, model turns and
tool calls; the oldest version and the staleness count sampled tokens only."""
import numpy as np

from areal_hpc.analysis.load import load_run
from areal_hpc.storage.rollout_log import RolloutWriter
from tests.storage.test_rollout_episodes import episode_traj, single_traj


def test_episode_columns_and_staleness_of_sampled_tokens(tmp_path):
    path = tmp_path / "rollouts.h5"
    w = RolloutWriter(path)
    w.append([single_traj(0, 0), episode_traj(0, 1), single_traj(1, 0, n_out=0)])
    w.mark_consumed([0, 1], step=6)
    w.close()
    t = load_run(path, progress=False)
    traj = t.traj
    assert traj["output_len"].tolist() == [4, 7, 0]
    assert traj["sampled_len"].tolist() == [4, 5, 0]
    assert traj["turns"].tolist() == [1, 2, 0]
    assert traj["tool_calls"].tolist() == [0, 2, 0] and traj["tool_errors"].tolist() == [0, 1, 0]
    np.testing.assert_allclose(traj["tool_seconds"], [0.0, 1.75, 0.0])
    assert traj["staleness"].tolist()[:2] == [6 - 2, 6 - 3]     # the episode's oldest: 3
    # per-token staleness: the single-turn sample's 4 tokens at 4, the episode's 5 sampled ones
    assert t.token_staleness == {1: 1, 2: 2, 3: 2, 4: 4}
