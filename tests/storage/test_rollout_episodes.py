"""Multi-turn episodes in the rollout log: the loss mask, turns and tool calls
(areal_hpc/storage/episode_log.py), beside single-turn samples and logs written before them."""
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from areal_hpc.env.base import ToolCall
from areal_hpc.env.episode import NO_VERSION, Episode
from areal_hpc.storage.rollout_log import RolloutLogError, RolloutReader, RolloutWriter


def episode_traj(pid: int, idx: int, args: str = "2*21") -> dict:
    """A trajectory of a real Episode: sampled turn, observation, sampled turn."""
    ep = Episode([5, 6, 7], max_tokens=64, max_turns=3)
    ep.add_sample([11, 12, 13], [-0.5, -0.25, -1.0], [3, 3, 4])
    ep.add_observation([40, 41], ToolCall("calculator", args, 2, 0.25))
    ep.add_sample([14, 15], [-0.125, -2.0], [4, 5])
    ep.finish()
    ep.tool_calls.append(ToolCall("python", "print(1/0)", 0, 1.5, "ZeroDivisionError"))
    a = ep.arrays()
    return {"prompt_id": pid, "sample_idx": idx, "prompt_tokens": a["prompt"],
            "output_tokens": a["output"], "behav_logprobs": a["behav_logprobs"],
            "versions": a["versions"], "loss_mask": a["loss_mask"], "turn_ends": a["turn_ends"],
            "turn_is_sample": a["turn_is_sample"], "tool_calls": list(ep.tool_calls),
            "reward": 1.0, "finish_reason": "stop", "generator_rank": 0, "t_submit": 1.0,
            "t_first_token": 1.5, "t_end": 2.0}


def single_traj(pid: int, idx: int, n_out: int = 4, version: int = 2) -> dict:
    return {"prompt_id": pid, "sample_idx": idx, "prompt_tokens": np.arange(1, 4, dtype=np.int32),
            "output_tokens": np.arange(20, 20 + n_out, dtype=np.int32),
            "behav_logprobs": np.full(n_out, -0.5, np.float32),
            "versions": np.full(n_out, version, np.int32), "reward": 0.0, "finish_reason": "stop",
            "generator_rank": 0, "t_submit": 1.0, "t_first_token": 1.5, "t_end": 2.0}


def _check_episode(row: dict, want: dict) -> None:
    for key in ("output_tokens", "behav_logprobs", "versions", "loss_mask", "turn_ends",
                "turn_is_sample"):
        np.testing.assert_array_equal(row[key], want[key], err_msg=key)
    assert row["tool_calls"] == [
        {"name": "calculator", "args": "2*21", "output_bytes": 2, "seconds": 0.25, "error": None},
        {"name": "python", "args": "print(1/0)", "output_bytes": 0, "seconds": 1.5,
         "error": "ZeroDivisionError"}]


def _check_single(row: dict, n_out: int) -> None:
    assert row["loss_mask"].tolist() == [1] * n_out
    assert row["turn_ends"].tolist() == [n_out] and row["turn_is_sample"].tolist() == [1]
    assert row["tool_calls"] == []


def test_an_episode_and_single_turn_samples_round_trip(tmp_path):
    path = tmp_path / "r.h5"
    ep = episode_traj(0, 0)
    assert ep["loss_mask"].tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert ep["versions"].tolist() == [3, 3, 4, NO_VERSION, NO_VERSION, 4, 5]
    w = RolloutWriter(path)
    assert w.append([single_traj(0, 0), ep]) == [0, 1]
    assert w.append([single_traj(1, 0, n_out=0)]) == [2]
    _check_episode(w.read(1), ep)
    w.close()
    with RolloutReader(path) as r:
        _check_single(r[0], 4)
        _check_episode(r[1], ep)
        assert r[2]["loss_mask"].tolist() == [] and r[2]["turn_ends"].tolist() == []
        assert r.tokens("loss_mask").tolist() == [1] * 4 + [1, 1, 1, 0, 0, 1, 1]
        assert r.column("turns_end").tolist() == [0, 3, 3]
        assert r.column("tools_end").tolist() == [0, 2, 2]


def test_tool_text_is_capped_at_a_character_boundary(tmp_path):
    w = RolloutWriter(tmp_path / "r.h5")
    w.append([episode_traj(0, 0, args="é" * 300)])
    args = w.read(0)["tool_calls"][0]["args"]
    w.close()
    assert args == "é" * 128                # 256 bytes, whole characters


@pytest.mark.parametrize("change, why", [
    (lambda x: x["versions"].__setitem__(1, NO_VERSION),
     "versions is negative: -1 at output token 1, where loss_mask is 1"),
    (lambda x: x["versions"].__setitem__(3, 4), "versions is 4 at output token 3, where loss_mask is 0"),
    (lambda x: x["loss_mask"].__setitem__(0, 2), "loss_mask must hold one 0 or 1"),
    (lambda x: x.__setitem__("loss_mask", x["loss_mask"][:-1]), "loss_mask must hold one 0 or 1"),
    (lambda x: x["behav_logprobs"].__setitem__(4, -0.5), "behav_logprobs of an observation token"),
    (lambda x: x["turn_ends"].__setitem__(-1, 6), "turn_ends must rise to the 7 output tokens"),
    (lambda x: x["turn_is_sample"].__setitem__(1, 1), "turn_is_sample disagrees with loss_mask"),
    (lambda x: x["tool_calls"].__setitem__(0, ToolCall("calculator", "1", -1)),
     "tool_calls: seconds 0.0 and output_bytes -1"),
])
def test_a_mask_that_disagrees_is_refused_before_any_of_the_batch_is_written(tmp_path, change, why):
    path = tmp_path / "r.h5"
    w = RolloutWriter(path)
    w.append([episode_traj(0, 0)])
    bad = episode_traj(7, 1)
    change(bad)
    with pytest.raises(ValueError, match=f"^trajectory 7/1: {why}"):
        w.append([single_traj(5, 0), bad])
    assert w.append([episode_traj(2, 0)]) == [1]
    w.close()
    with RolloutReader(path) as r:
        assert len(r) == 2 and r[1]["prompt_id"] == 2
        assert r.tokens("loss_mask").tolist() == [1, 1, 1, 0, 0, 1, 1] * 2
        assert r.column("turns_end").tolist() == [3, 6] and r.column("tools_end").tolist() == [2, 4]
        _check_episode(r[1], episode_traj(2, 0))


def test_a_discarded_episode_keeps_its_cause_and_an_older_log_has_none(tmp_path):
    """/traj/discard: the cause of each row's discard ("" none), refused when unknown; a log
    from before it (schema 4) reads as none discarded, and a writer that continues it adds
    the column."""
    path = tmp_path / "r.h5"
    w = RolloutWriter(path)
    w.append([dict(episode_traj(0, 0), discard="timeout"), single_traj(0, 1)])
    with pytest.raises(ValueError, match="^trajectory 1/0: discard 'tired' is not one of"):
        w.append([dict(episode_traj(1, 0), discard="tired")])
    w.close()
    with RolloutReader(path) as r:
        assert [r[0]["discard"], r[1]["discard"]] == ["timeout", ""]
        assert r.column("discard").tolist() == [1, 0]
    with h5py.File(path, "a") as f:
        del f["traj/discard"]
        f.attrs["schema_version"] = 4
    with RolloutReader(path) as r:
        assert r[0]["discard"] == "" and r.column("discard").tolist() == [0, 0]
    w = RolloutWriter.reopen(path, keep_rows=2)
    w.append([dict(episode_traj(2, 0), discard="env")])
    w.close()
    with RolloutReader(path) as r:
        assert r.column("discard").tolist() == [0, 0, 5] and r[2]["discard"] == "env"
    with h5py.File(path, "a") as f:
        f["traj/discard"][1] = 9
    with RolloutReader(path) as r, pytest.raises(RolloutLogError, match="unknown discard cause"):
        r.column("discard")


def _strip_episode_datasets(path) -> None:
    """Make `path` a log as written before episodes: no mask, turns, tools nor their ends."""
    with h5py.File(path, "a") as f:
        for name in ("tokens/loss_mask", "turns", "tools", "traj/turns_end", "traj/tools_end"):
            del f[name]


def test_an_older_log_reads_as_single_turn_and_a_writer_continues_it(tmp_path):
    path = tmp_path / "r.h5"
    w = RolloutWriter(path)
    w.append([single_traj(0, 0), single_traj(0, 1, n_out=2)])
    w.close()
    _strip_episode_datasets(path)
    with RolloutReader(path) as r:
        _check_single(r[0], 4)
        _check_single(r[1], 2)
        assert r.tokens("loss_mask").tolist() == [1] * 6
        assert r.column("turns_end").tolist() == [0, 0]
    w = RolloutWriter.reopen(path, keep_rows=2)
    ep = episode_traj(1, 0)
    assert w.append([ep]) == [2]
    w.close()
    with RolloutReader(path) as r:
        _check_single(r[1], 2)
        _check_episode(r[2], ep)
        assert r.tokens("loss_mask").tolist() == [1] * 6 + [1, 1, 1, 0, 0, 1, 1]


def test_a_torn_append_of_turns_and_tools_is_cut_back_on_reopen(tmp_path):
    """A writer killed after it appended an episode's turns and tools but before the commit
    marker: the resumed writer cuts them back, and the next rows read as written."""
    path = tmp_path / "r.h5"
    w = RolloutWriter(path)
    w.append([episode_traj(0, 0)])
    for grp, name, value in (("turns", "end", 99), ("tools", "name", b"torn"),
                             ("tools", "args", b""), ("tools", "output_bytes", 1)):
        ds = w.f[grp][name]
        ds.resize((ds.shape[0] + 1,))
        ds[-1] = value
    w.close()
    w = RolloutWriter.reopen(path, keep_rows=1)
    assert w.f["turns/end"].shape[0] == 3 and w.f["tools/name"].shape[0] == 2
    assert w.f["tools/seconds"].shape[0] == 2
    ep = episode_traj(1, 0)
    w.append([ep])
    w.close()
    with RolloutReader(path) as r:
        _check_episode(r[0], episode_traj(0, 0))
        _check_episode(r[1], ep)


KILLED_WRITER = """
import os, sys
sys.path.insert(0, sys.argv[2])
from test_rollout_episodes import episode_traj, single_traj
from areal_hpc.storage.rollout_log import RolloutWriter
w = RolloutWriter(sys.argv[1])
w.append([episode_traj(0, 0), single_traj(0, 1)])
w.append([episode_traj(1, 0)])
os._exit(0)     # killed: never closed, its SWMR-write flag stays set
"""


def test_a_killed_writers_episodes_are_recovered_whole(tmp_path):
    """The rows of a writer that died are copied into a fresh file (h5_read.rewrite_committed),
    the episode datasets cut to the committed rows with them."""
    path = tmp_path / "r.h5"
    subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path), str(Path(__file__).parent)],
                   check=True, timeout=120)
    w = RolloutWriter.reopen(path, keep_rows=3)
    w.append([episode_traj(2, 0)])
    w.close()
    with RolloutReader(path) as r:
        assert len(r) == 4
        for i in (0, 2, 3):
            _check_episode(r[i], episode_traj(r[i]["prompt_id"], 0))
        _check_single(r[1], 4)
