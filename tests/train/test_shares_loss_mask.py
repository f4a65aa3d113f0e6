"""A step's batch with multi-turn episodes: the advantages' token weights, the entropy estimate
and the shares count an episode's sampled tokens only (areal_hpc/train/shares.py)."""
import numpy as np
import pytest

from areal_hpc.config import TrainConfig
from areal_hpc.train.shares import split_batch, trained_tokens


def _batch(with_observations: bool) -> list[dict]:
    rng = np.random.default_rng(3)
    seqs = []
    for i in range(8):
        n = 3 + i
        s = {"prompt_tokens": np.arange(1, 4), "output_tokens": rng.integers(0, 100, n),
             "behav_logprobs": -rng.random(n).astype(np.float32), "reward": float(i % 3 == 0)}
        if with_observations and i % 2 == 0:       # 4 observation tokens inserted after token 1
            s["output_tokens"] = np.insert(s["output_tokens"], 1, [7, 7, 7, 7])
            s["behav_logprobs"] = np.insert(s["behav_logprobs"], 1, [0.0] * 4).astype(np.float32)
            s["loss_mask"] = np.insert(np.ones(n, np.uint8), 1, [0] * 4)
        seqs.append(s)
    return seqs


@pytest.mark.parametrize("adv_norm", ["batch", "none"])
def test_observation_tokens_weigh_nothing_in_advantages_and_entropy(adv_norm):
    cfg = TrainConfig(ppo_minibatches=1, adv_norm=adv_norm, filter_zero_variance=False)
    plain, episodes = _batch(False), _batch(True)
    assert [trained_tokens(s) for s in plain] == [trained_tokens(s) for s in episodes]
    assert sum(len(s["output_tokens"]) for s in episodes) == sum(
        len(s["output_tokens"]) for s in plain) + 16
    a, = split_batch(plain, cfg, group_size=4, dp=1)
    b, = split_batch(episodes, cfg, group_size=4, dp=1)
    adv = lambda share: sorted(float(s["advantage"]) for mb in share.minibatches for s in mb)
    assert adv(a) == adv(b) and a.adv_abs_mean == b.adv_abs_mean
    assert a.stats["entropy"] == pytest.approx(b.stats["entropy"], rel=1e-12)
    masks = [s.get("loss_mask") for mb in b.minibatches for s in mb]
    assert sum(m is not None for m in masks) == 4     # the mask travels with the sequence


def test_a_mask_of_another_length_is_named():
    seqs = _batch(True)
    seqs[2]["loss_mask"] = seqs[2]["loss_mask"][:-1]
    with pytest.raises(ValueError, match="sequence 2: loss_mask and output_tokens differ in length"):
        split_batch(seqs, TrainConfig(ppo_minibatches=1), group_size=4, dp=1)
