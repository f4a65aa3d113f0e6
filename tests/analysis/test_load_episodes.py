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
    from areal_hpc.analysis.summary import overview
    got = overview(t)
    assert (got["turns_mean"], got["tool_calls"], got["tool_errors"]) == (1.0, 2, 1)   # (1+2+0)/3
    assert got["tool_seconds"] == 1.75


def test_show_prints_an_episode_turn_by_turn(tmp_path, capsys):
    """The viewer (`--show`): an episode's turns in order, each model turn with its versions and
    trained tokens, each observation with its masked tokens, then its tool calls; a single-turn
    sample as one answer."""
    from areal_hpc.analysis.cli import main
    path = tmp_path / "rollouts.h5"
    w = RolloutWriter(path)
    w.append([episode_traj(0, 0), single_traj(1, 0)])
    w.close()
    assert main([str(path), "--no-plots", "--show", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())        # the console wraps at its width
    assert "versions 3→5 (interrupted)" in out          # sampled tokens only (observations: -1)
    assert "turn 1, model (3 tokens, versions 3→4, 3 trained) 11 12 13" in out
    assert "turn 2, observation (2 tokens, 2 masked) 40 41" in out
    assert "turn 3, model (2 tokens, versions 4→5, 2 trained) 14 15" in out
    assert "tool calculator(2*21): 2 B in 0.25 s, ran" in out
    assert "tool python(print(1/0)): 0 B in 1.50 s, error: ZeroDivisionError" in out
    assert "answer 20 21 22 23" in out and out.index("turn 3") < out.index("answer 20")


def test_episodes_plot_only_for_a_run_with_episodes(tmp_path):
    from areal_hpc.analysis.plots import write_plots
    path = tmp_path / "rollouts.h5"
    w = RolloutWriter(path)
    w.append([episode_traj(0, 0), episode_traj(0, 1), single_traj(1, 0)])
    w.mark_consumed([0, 1, 2], step=0)
    w.close()
    made = write_plots([load_run(path, progress=False)], tmp_path / "plots")
    assert [p.name for p in made][-1] == "episodes.png" and made[-1].stat().st_size > 0
    single = tmp_path / "single.h5"
    w = RolloutWriter(single)
    w.append([single_traj(0, 0)])
    w.close()
    made = write_plots([load_run(single, progress=False)], tmp_path / "plots1")
    assert "episodes.png" not in [p.name for p in made]
