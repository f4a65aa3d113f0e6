"""The typed controller/generator messages: one class per tag, posted under its tag, checked on
arrival, and unchanged through pickle protocol 5 (what mpi4py's pkl5 channel uses)."""
import pickle

import numpy as np
import pytest

from areal_hpc.transport import messages as msgs
from areal_hpc.transport.mpi import Tag


class _Chan:
    def __init__(self):
        self.sent = []

    def send(self, obj, dest, tag):
        self.sent.append((dest, tag, obj))


def _trajectory(idx: int) -> msgs.Trajectory:
    return {"prompt_id": 7, "sample_idx": idx, "prompt_tokens": np.arange(4, dtype=np.int32),
            "output_tokens": np.arange(3, dtype=np.int32),
            "behav_logprobs": np.full(3, -0.5, np.float32), "versions": np.array([1, 1, 2], np.int32),
            "reward": 1.0, "finish_reason": "stop", "generator_rank": 1, "t_submit": 1.0,
            "t_first_token": 1.5, "t_end": 2.0, "reward_error": "", "reward_extra": {}}


EXAMPLES = [
    msgs.Prompts([msgs.Prompt(7, [1, 2, 3], 2, "math", "14", continued=(msgs.Continuation(
        0, np.arange(3, dtype=np.int32), np.zeros(3, np.float32), np.ones(3, np.int32),
        "abort", 1.0, 1.5, 2.0),))]),
    msgs.WeightsNotice(3, plan=[(0, [("w", (2, 2), "float32")])]),
    msgs.WeightsNotice(3, path="/run/weights/v00000003"),
    msgs.EvalRequest([msgs.Prompt(0, [5], 4, "custom", None, row={"question": "q"})]),
    msgs.Stop(preempted=True),
    msgs.ControllerBeat(3),
    msgs.StaleBefore(2),
    msgs.StepsDone(),
    msgs.Group([_trajectory(0), _trajectory(1)]),
    msgs.Partial([[_trajectory(0), _trajectory(1)]]),
    msgs.EvalResult(3, [{"prompt_id": 0, "rewards": [1.0, 0.0]}], 0.25),
    msgs.GeneratorStats(1, 100, {"busy": 1.0}, 3, {"calls": 2, "errors": 0, "timeouts": 0}, 4, 0.9),
    msgs.WeightsAck(3, "loaded", paused_s=0.1),
    msgs.Heartbeat(3, running=5, tokens=100),
]


def test_every_tag_has_exactly_one_message_class():
    assert sorted(m.TAG for m in msgs.MESSAGES) == sorted(Tag)
    assert {type(m) for m in EXAMPLES} == set(msgs.MESSAGES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_posted_under_its_tag_and_unchanged_through_pickle(msg):
    chan = _Chan()
    msgs.post(chan, msg, 2)
    (dest, tag, obj), = chan.sent
    assert dest == 2 and tag == msg.TAG and obj is msg
    got = msgs.check(tag, pickle.loads(pickle.dumps(obj, protocol=5)))
    assert type(got) is type(msg)
    assert pickle.dumps(got, protocol=5) == pickle.dumps(msg, protocol=5)


def test_a_message_under_another_tag_is_named():
    with pytest.raises(TypeError, match="tag STOP is a WeightsAck, expected Stop"):
        msgs.check(Tag.STOP, msgs.WeightsAck(1, "started"))
    with pytest.raises(TypeError, match="tag TRAJECTORIES is a list, expected Group"):
        msgs.check(Tag.TRAJECTORIES, [_trajectory(0)])      # an untyped payload


def test_only_messages_are_posted():
    with pytest.raises(TypeError, match="not a controller/generator message: dict"):
        msgs.post(_Chan(), {"version": 1}, 1)


def test_messages_are_immutable():
    with pytest.raises(AttributeError):
        msgs.Stop().preempted = True


def test_generator_stats_as_json_for_generators_json():
    import dataclasses
    import json
    st = next(m for m in EXAMPLES if isinstance(m, msgs.GeneratorStats))
    assert json.loads(json.dumps(dataclasses.asdict(st))) == {
        "rank": 1, "tokens": 100, "seconds": {"busy": 1.0}, "version": 3,
        "reward": {"calls": 2, "errors": 0, "timeouts": 0}, "stale_aborted": 4,
        "engine_s": 0.9, "engine_restarts": 0}
