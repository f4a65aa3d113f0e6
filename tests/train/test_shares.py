"""Each trainer rank gets only its data-parallel share of a batch (`shares.split_batch` on rank
0, `transport.mpi.GroupScatter` by data-parallel rank), equal to the split the trainer used to
compute on every rank from the whole batch; training a sent share is bit for bit training the
whole batch."""
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from areal_hpc.config import TrainConfig
from areal_hpc.train.shares import split_batch

sys.path.insert(0, str(Path(__file__).parent))
from shares_worker import CFG, GROUP_SIZE, make_batch, old_share  # noqa: E402

pytestmark = pytest.mark.slow     # starts MPI / torch.distributed worlds or processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("shares_worker.py")


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_split_is_the_old_whole_batch_split(dp):
    seqs = make_batch(seed=dp, groups=5)
    shares = split_batch(seqs, CFG, GROUP_SIZE, dp)
    assert len(shares) == dp
    seen = []
    for rank, share in enumerate(shares):
        ids, adv = old_share(seqs, dp, rank)
        assert [[id(s["output_tokens"]) for s in mb] for mb in share.minibatches] == \
            [[id(seqs[i]["output_tokens"]) for i in mb] for mb in ids]
        assert [s["advantage"] for mb in share.minibatches for s in mb] == \
            [adv[i] for mb in ids for i in mb]
        seen += [i for mb in ids for i in mb]
    assert sorted(seen) == list(range(len(seqs)))       # every sequence in exactly one share


def test_a_batch_that_cannot_be_split_is_refused():
    seqs = make_batch(groups=1)
    with pytest.raises(ValueError, match="cannot fill 8 minibatches"):
        split_batch(seqs[:4], TrainConfig(ppo_minibatches=8), GROUP_SIZE, 2)
    seqs[2] = {**seqs[2], "versions": seqs[2]["versions"][:-1]}
    with pytest.raises(ValueError, match="sequence 2: versions"):
        split_batch(seqs, CFG, GROUP_SIZE, 2)


def test_a_sent_share_trains_bit_for_bit_like_the_whole_batch(megatron_ws1, model_dir):
    """dp = 1: `train_share` on a pickled share (what a rank receives) against `train_step` on
    the whole batch, each on a fresh Actor: the same statistics and weights, exactly."""
    from areal_hpc.train.actor import Actor

    cfg = TrainConfig(lr=1e-3, max_tokens_per_mb=64, ppo_minibatches=2, adv_norm="batch",
                      prox="loglinear")
    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(8):
        out = rng.integers(0, 128, rng.integers(1, 20)).astype(np.int32)
        seqs.append(dict(prompt_tokens=rng.integers(0, 128, rng.integers(1, 10)).astype(np.int32),
                         output_tokens=out, reward=float(rng.integers(0, 2)),
                         behav_logprobs=-rng.random(len(out)).astype(np.float32) - 3,
                         versions=np.zeros(len(out), np.int32)))
    results = []
    for sent in (False, True):
        actor = Actor(cfg, model_dir, group_size=4, temperature=0.7)
        if sent:
            share = pickle.loads(pickle.dumps(split_batch(seqs, cfg, 4, 1)[0]))
            stats = actor.train_share(share, version=1)
        else:
            stats = actor.train_step(seqs, version=1)
        results.append((stats, actor.hf_state_dict()))
    (a, wa), (b, wb) = results
    for key in a:
        if not key.endswith("seconds"):
            assert a[key] == b[key], key
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_each_trainer_rank_receives_only_its_data_parallel_share(tmp_path, run_distributed):
    """4 ranks, dp2 x tp2 and dp2 x pp2 (Megatron's groups, gloo), pieces of at most 64 KiB."""
    run_distributed(WORKER, 4, tmp_path, env={"AREAL_MPI_MAX_MESSAGE_BYTES": str(64 * 1024)})
    reports = {k: json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(4)}
    whole = reports[0]["whole_bytes"]
    for name in ("dp2xtp2", "dp2xpp2"):
        by_dp: dict[int, list] = {}
        sent = reports[0][name]["part_bytes"]
        # about half of the whole batch each (less: only the fields training reads travel)
        assert all(0.2 * whole < b < 0.6 * whole for b in sent), (sent, whole)
        for rank, rep in sorted(reports.items()):
            mine = rep[name]
            by_dp.setdefault(mine["dp_rank"], []).append(mine)
            # rank 0 keeps its share; every other rank received its own share, nothing more
            assert mine["received"] == (0 if rank == 0 else sent[mine["dp_rank"]]), (name, rank)
        # two data-parallel ranks, two ranks each (the TP or PP peers), with the same share
        assert sorted(by_dp) == [0, 1] and all(len(v) == 2 for v in by_dp.values())
        for peers in by_dp.values():
            assert peers[0]["seq_ids"] == peers[1]["seq_ids"]
        assert sorted(by_dp[0][0]["seq_ids"] + by_dp[1][0]["seq_ids"]) == list(range(64))
    # dp2 x pp2 interleaves the data-parallel ranks (rank 1 is dp 1), dp2 x tp2 does not
    assert [reports[r]["dp2xpp2"]["dp_rank"] for r in range(4)] == [0, 1, 0, 1]
    assert [reports[r]["dp2xtp2"]["dp_rank"] for r in range(4)] == [0, 0, 1, 1]


def test_the_trainers_batch_is_a_share_none_at_a_preemption_and_a_bad_batch_raises(tmp_path):
    """`Trainer._batch` on a single trainer rank (MPI.COMM_SELF, no copy of the share)."""
    from areal_hpc.config import load
    from areal_hpc.rollout.staleness import Batch
    from areal_hpc.train.lead import Follower
    from tests.train.one_rank import StandInActor, TrainerOfParts, one_rank_topology

    seqs = make_batch(groups=3)
    first = Batch(seqs, [1], {"reward": 0.5})
    batches = iter([first, None, Batch(seqs[:1], [2], {})])

    class LeadOfBatches(Follower):      # rank 0's lead as _batch sees it: batches, None at a preemption
        def batch(self):
            return next(batches)

    cfg = load(None, [f"model.path={tmp_path / 'model'}", "data.train_path=x.jsonl", f"output_dir={tmp_path}",
                      "name=r", "train.ppo_minibatches=2", "train.adv_norm=batch", "train.prox=loglinear",
                      f"rollout.group_size={GROUP_SIZE}", "rollout.collective_timeout_s=10",
                      "rollout.max_new_tokens=64"])
    assert cfg.train == CFG
    topo = one_rank_topology(cfg)
    assert topo.is_controller and topo.controller_alive is None
    t = TrainerOfParts(cfg, topo, StandInActor(), LeadOfBatches())
    share, batch = t._batch()
    want = split_batch(seqs, CFG, GROUP_SIZE, 1)[0]
    assert batch is first and share.n_seqs == len(seqs) == want.n_seqs
    assert [[id(s["output_tokens"]) for s in mb] for mb in share.minibatches] == \
        [[id(s["output_tokens"]) for s in mb] for mb in want.minibatches]
    assert t._batch() == (None, None)
    with pytest.raises(ValueError, match="cannot fill 2 minibatches"):
        t._batch()


# ------------------------------------------------------------------ collapse guards (train.*)


def _rewarded(seqs, rewards, cut=()):
    """`seqs` with these rewards, and finish_reason "length" at the indices `cut`."""
    return [{**s, "reward": float(r), "finish_reason": "length" if i in cut else "stop"}
            for i, (s, r) in enumerate(zip(seqs, rewards))]


def _kept(shares):
    return sorted(id(s["output_tokens"]) for sh in shares for mb in sh.minibatches for s in mb)


def test_zero_variance_groups_are_left_out_and_counted():
    seqs = make_batch(groups=3)
    # group 0 all 1 (no signal), group 1 mixed, group 2 all 0 (no signal)
    seqs = _rewarded(seqs, [1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0])
    cfg = TrainConfig(ppo_minibatches=2, prox="loglinear", filter_zero_variance=True)
    shares = split_batch(seqs, cfg, GROUP_SIZE, 2)
    assert _kept(shares) == sorted(id(s["output_tokens"]) for s in seqs[4:8])
    assert shares[0].stats["zero_var_groups"] == 2 and shares[0].stats["filtered_seqs"] == 8
    assert shares[0].n_seqs == 12 and not shares[0].no_signal
    # without the guard they train (advantage 0) and are still counted
    plain = split_batch(seqs, TrainConfig(ppo_minibatches=2, prox="loglinear"), GROUP_SIZE, 2)
    assert len(_kept(plain)) == 12
    assert plain[0].stats["zero_var_groups"] == 2 and plain[0].stats["filtered_seqs"] == 0


def test_zero_variance_is_decided_on_the_rewards_as_the_log_stores_them():
    """0.1 + 0.2 and 0.3 are two float64 rewards but one float32 (the rollout log's dtype): the
    group has no signal, as the audit reading the log decides (`guard_decisions`, shared)."""
    from areal_hpc.train.shares import guard_decisions
    seqs = _rewarded(make_batch(groups=2), [0.1 + 0.2, 0.3, 0.3, 0.3, 1, 0, 0, 1])
    cfg = TrainConfig(ppo_minibatches=2, prox="loglinear", filter_zero_variance=True)
    shares = split_batch(seqs, cfg, GROUP_SIZE, 1)
    assert shares[0].stats["zero_var_groups"] == 1 and shares[0].stats["filtered_seqs"] == 4
    stored = np.array([s["reward"] for s in seqs], dtype=np.float32)
    n_out = np.array([len(s["output_tokens"]) for s in seqs])
    keep, _, zero_var, _ = guard_decisions(stored, n_out, np.zeros(8, bool), cfg, GROUP_SIZE, None)
    assert zero_var.tolist() == [True, False] and keep.tolist() == [False] * 4 + [True] * 4


def test_a_batch_without_signal_trains_nothing():
    seqs = _rewarded(make_batch(groups=2), [1, 1, 1, 1, 0, 0, 0, 0])
    for cfg in (TrainConfig(ppo_minibatches=2, prox="loglinear"),
                TrainConfig(ppo_minibatches=2, prox="loglinear", filter_zero_variance=True)):
        shares = split_batch(seqs, cfg, GROUP_SIZE, 2)
        assert all(sh.no_signal and sh.stats["no_signal_steps"] == 1 for sh in shares)
        assert _kept(shares) == []


def test_overlong_filter_and_shape():
    seqs = make_batch(groups=2)
    n = [len(s["output_tokens"]) for s in seqs]
    rewards = [1, 0, 1, 0, 1, 1, 0, 0]
    cut = {1, 4}
    filt = split_batch(_rewarded(seqs, rewards, cut), TrainConfig(ppo_minibatches=2, prox="loglinear",
                                                                  overlong="filter"), GROUP_SIZE, 1)
    assert _kept(filt) == sorted(id(s["output_tokens"]) for i, s in enumerate(seqs) if i not in cut)
    assert filt[0].stats["truncated_frac"] == 0.25 and filt[0].stats["filtered_seqs"] == 2
    # shape: max_new_tokens 400, buffer 100: penalty (300 - n) / 100 clipped to [-1, 0]
    cfg = TrainConfig(ppo_minibatches=1, prox="loglinear", overlong="shape", overlong_buffer=100,
                      reward_norm="none")
    shaped = split_batch(_rewarded(seqs, rewards, cut), cfg, GROUP_SIZE, 1, max_new_tokens=400)
    adv = {id(s["output_tokens"]): s["advantage"] for mb in shaped[0].minibatches for s in mb}
    for i, s in enumerate(seqs):
        want = rewards[i] + min(0.0, max(-1.0, (300 - n[i]) / 100))
        assert adv[id(s["output_tokens"])] == pytest.approx(want, abs=1e-6), i
    with pytest.raises(ValueError, match="max_new_tokens"):
        split_batch(_rewarded(seqs, rewards), cfg, GROUP_SIZE, 1)


def test_guards_off_is_the_old_split():
    """With the guards off, a batch with finish reasons splits exactly as before (the split of
    `test_split_is_the_old_whole_batch_split`), and its statistics are reported."""
    seqs = _rewarded(make_batch(seed=3, groups=5), [float(i % 3) for i in range(20)], cut={0, 5})
    shares = split_batch(seqs, CFG, GROUP_SIZE, 2)
    for rank, share in enumerate(shares):
        ids, adv = old_share(seqs, 2, rank)
        assert [s["advantage"] for mb in share.minibatches for s in mb] == \
            [adv[i] for mb in ids for i in mb]
    assert shares[0].stats["truncated_frac"] == 0.1
    want = -sum(float(np.sum(s["behav_logprobs"], dtype=np.float64)) for s in seqs) \
        / sum(len(s["output_tokens"]) for s in seqs)
    assert shares[0].stats["entropy"] == pytest.approx(want)
