"""A discarded episode (its environment failed, or discarded it: env.on_error) in a step's batch:
what the trainer trains of it and of its group, and what the audit decides from the log (the
same function, `guard_decisions`)."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from areal_hpc.algo.ppo import compute_advantages, equal_reward_groups, grpo_advantages
from areal_hpc.config import TrainConfig
from areal_hpc.train.shares import guard_decisions, split_batch

sys.path.insert(0, str(Path(__file__).parent))
from shares_worker import GROUP_SIZE, make_batch  # noqa: E402

CFG = TrainConfig(ppo_minibatches=1, prox="loglinear")
# group 0: sample 3 scored 1 but its tool server failed; group 1: no discard
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
DISCARD = ["", "", "", "timeout", "", "", "", ""]


def _batch():
    seqs = make_batch(seed=3, groups=2)
    return [{**s, "reward": r, "discard": d} for s, r, d in zip(seqs, REWARDS, DISCARD)]


def _split(on_error):
    """(advantage of each trained sequence by its index in the batch, the batch's stats)."""
    seqs = _batch()
    shares = split_batch(seqs, CFG, GROUP_SIZE, 1, on_error=on_error)
    index = {id(s["output_tokens"]): i for i, s in enumerate(seqs)}     # (unique arrays)
    return ({index[id(s["output_tokens"])]: float(s["advantage"])
             for sh in shares for mb in sh.minibatches for s in mb}, shares[0].stats)


def test_drop_episode_trains_the_rest_of_its_group_against_their_own_baseline():
    adv, stats = _split("drop_episode")
    assert sorted(adv) == [0, 1, 2, 4, 5, 6, 7]         # the discarded one is not trained
    # group 0's baseline is over its three outcomes [1, 0, 0] only: mean 1/3, std sqrt(2)/3
    want = (np.array([1.0, 0.0, 0.0]) - 1 / 3) / (np.sqrt(2) / 3 + 1e-6)
    assert [adv[i] for i in (0, 1, 2)] == pytest.approx(want.tolist(), rel=1e-5)
    plain = grpo_advantages(torch.tensor(REWARDS[4:]), GROUP_SIZE)
    assert [adv[i] for i in (4, 5, 6, 7)] == pytest.approx(plain.tolist(), rel=1e-5)
    assert stats["filtered_seqs"] == 1


def test_drop_group_trains_none_of_it():
    adv, stats = _split("drop_group")
    assert sorted(adv) == [4, 5, 6, 7] and stats["filtered_seqs"] == 4


def test_score_zero_trains_it_as_a_failure():
    adv, stats = _split("score_zero")
    assert sorted(adv) == list(range(8)) and stats["filtered_seqs"] == 0
    zeroed = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), GROUP_SIZE)
    assert [adv[i] for i in range(4)] == pytest.approx(zeroed.tolist(), rel=1e-5)
    assert adv[3] < 0


def test_the_audit_decides_the_same_from_the_log():
    """`guard_decisions` on the log's columns (float32 rewards, the discard column as bools)."""
    for on_error, kept in (("drop_episode", 7), ("drop_group", 4), ("score_zero", 8)):
        keep, _, zero_var, valid = guard_decisions(
            np.float32(REWARDS), np.full(8, 5), np.zeros(8, bool), CFG, GROUP_SIZE, None,
            np.array([bool(d) for d in DISCARD]), on_error)
        assert int(keep.sum()) == kept and not zero_var.any(), on_error


def test_a_group_equal_over_its_outcomes_has_no_signal():
    """[1, 1, 1, 0 discarded]: the outcomes are all equal: no signal, advantages exactly 0 (and
    left out under filter_zero_variance); a group with no outcome at all is not "equal"."""
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    valid = np.array([True, True, True, False, False, False, False, False])
    assert equal_reward_groups(r, 4, valid).tolist() == [True, False]
    assert grpo_advantages(r, 4, valid=valid).tolist() == [0.0] * 8
    cfg = TrainConfig(ppo_minibatches=1, filter_zero_variance=True)
    keep, _, zero_var, _ = guard_decisions(r.numpy(), np.full(8, 5), np.zeros(8, bool), cfg, 4,
                                           None, ~valid, "drop_episode")
    assert zero_var.tolist() == [True, False] and not keep.any()


def test_without_discards_the_advantages_are_as_before():
    r = torch.tensor(REWARDS, dtype=torch.float64)
    n = torch.arange(1, 9)
    a = compute_advantages(r, n, GROUP_SIZE, adv_norm="batch")
    b = compute_advantages(r, n, GROUP_SIZE, adv_norm="batch", valid=np.ones(8, bool))
    assert torch.allclose(a, b, atol=1e-6)


def test_an_unknown_on_error_is_refused():
    with pytest.raises(ValueError, match="env.on_error"):
        split_batch(_batch(), CFG, GROUP_SIZE, 1, on_error="ignore")
