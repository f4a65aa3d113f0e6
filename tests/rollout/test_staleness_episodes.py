"""η counts a multi-turn episode by its oldest sampled token: its observation tokens carry
version -1 and were never sampled (areal_hpc/rollout/staleness.py)."""
import numpy as np

from areal_hpc.env.episode import Episode
from areal_hpc.rollout.staleness import ReadyBuffer, oldest_sampled, staleness_of


def _episode_versions() -> np.ndarray:
    ep = Episode([1, 2], max_tokens=32, max_turns=3)
    ep.add_sample([5, 6], [-0.1, -0.2], [4, 4])
    ep.add_observation([9, 9, 9])
    ep.add_sample([7], [-0.3], [6])
    assert ep.oldest_version == 4
    return ep.arrays()["versions"]


def test_staleness_counts_the_oldest_sampled_token():
    v = _episode_versions()
    assert v.min() == -1
    assert oldest_sampled(v) == 4 and staleness_of(7, v) == 3
    assert oldest_sampled([-1, -1]) is None and staleness_of(7, [-1, -1]) == 0
    assert staleness_of(7, [5, 3, 6]) == 4 and staleness_of(7, []) == 0     # single-turn: as before


def test_a_ready_group_of_episodes_is_as_old_as_its_oldest_sampled_token():
    buf = ReadyBuffer()
    buf.add([{"versions": _episode_versions()}, {"versions": np.asarray([5, 5], np.int32)},
              {"versions": np.zeros(0, np.int32)}], rows=[0, 1, 2])
    assert buf.groups()[0].oldest_version == 4
    assert buf.drop_older_than(4) == [] and len(buf.drop_older_than(5)) == 1
