"""A preempted job's partial episode goes back to a generator whole: the controller's
Continuation of a PARTIAL row carries the episode's loss mask, turns and tool calls as the
rollout log stores them, beside its tokens, log-probabilities and versions."""
import numpy as np

from areal_hpc.rollout.controller import Controller
from areal_hpc.storage.rollout_log import PARTIAL, RolloutWriter
from tests.storage.test_rollout_episodes import episode_traj, single_traj


class LogOnly:
    """What Controller._continuation reads of its controller: the rollout log's writer."""

    def __init__(self, writer: RolloutWriter):
        self.writer = writer


def test_a_partial_episode_is_continued_with_its_mask_turns_and_tools(tmp_path):
    w = RolloutWriter(tmp_path / "r.h5")
    ep = {**episode_traj(3, 1), "finish_reason": "abort"}
    w.append([{**single_traj(3, 0), "finish_reason": "abort"}, ep], consumed=PARTIAL)
    one, episode = (Controller._continuation(LogOnly(w), row) for row in (0, 1))
    w.close()
    for key in ("output_tokens", "behav_logprobs", "versions", "loss_mask", "turn_ends",
                "turn_is_sample"):
        np.testing.assert_array_equal(getattr(episode, key), ep[key], err_msg=key)
    assert [c["name"] for c in episode.tool_calls] == ["calculator", "python"]
    assert episode.sample_idx == 1 and episode.finish_reason == "abort"
    assert one.loss_mask.tolist() == [1] * 4 and one.turn_ends.tolist() == [4]
    assert one.tool_calls == ()
