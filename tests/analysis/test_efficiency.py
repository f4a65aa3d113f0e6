"""A run's efficiency from its directory (areal_hpc/analysis/efficiency.py), on a hand-made run;
the collapse rule; means over steps that skip null / NaN diagnostics."""

import math

import pytest

from areal_hpc.analysis.efficiency import collapse_point, mean_skipping, moving_mean, run_efficiency
from areal_hpc.storage.rollout_log import RolloutWriter
from areal_hpc.storage.run_dir import RunDir
from areal_hpc.transport.messages import GeneratorStats

from .conftest import known_trajs

EVALS3 = [{"step": 0, "label": "initial", "accuracy": 0.05}, {"step": 3, "label": "final", "accuracy": 0.25}]


def _run(tmp_path, rewards=(0.5, 0.5, 0.5), extra=None, evals=EVALS3):
    """A hand-made run of len(rewards) steps (2 s training + 0.5 s update, 1 s waited each);
    `extra`: fields added to each step's metrics record (one dict per step)."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    trajs, consumed = known_trajs()
    w = RolloutWriter(run.rollouts, config_yaml="name: r\nrollout:\n  group_size: 2\n")
    for g in range(0, len(trajs), 2):
        w.append(trajs[g:g + 2])
    for step in sorted(set(consumed)):
        w.mark_consumed([i for i, c in enumerate(consumed) if c == step], step)
    w.close()
    for k, reward in enumerate(rewards):
        run.append_metrics({"step": k, "version": k + 1, "elapsed_s": 4.0 * (k + 1), "seconds": 2.0,
                            "weight_sync_s": 0.5, "wait_s": 1.0, "n_tokens": 100, "reward": reward,
                            "accuracy": 0.1 * (k + 1), **(extra[k] if extra else {})})
    run.write_generators([GeneratorStats(rank=1, tokens=100 * len(rewards), version=len(rewards), reward={},
                                         engine_s=9.0,
                                         seconds={"busy": 6.0, "pause": 1.5, "eval": 2.0, "idle": 2.0,
                                                  "idle_scoring": 0.0, "other": 0.5})])
    run.write_evals(evals)
    return run.path


def test_efficiency_of_a_hand_made_run(tmp_path):
    r = run_efficiency(_run(tmp_path), "async", target=0.2)
    assert r["steps"] == 3 and r["wall_s"] == 12.0 and r["steps_per_h"] == 900.0
    assert r["gen_busy"] == pytest.approx(6.0 / 10.0) and r["engine_busy"] == pytest.approx(0.9)
    assert r["trainer_idle"] == pytest.approx(3.0 / 12.0) and r["gen_tok_s_busy"] == 50.0
    # 3 steps, generation 100 tok / 50 tok/s + a 0.5 s load, training 2.5 s: pipelined bound
    assert r["ideal_s"] == pytest.approx(3 * 2.5 + 3 * 2.5 / 3)       # max + min / S of the totals
    assert r["dropped_groups"] == 1 and r["stale_mean"] >= 0
    assert (r["initial_acc"], r["final_acc"]) == (0.05, 0.25)
    assert r["t_target_heldout"] == 12.0 and r["collapsed"] is False
    assert r["collapsed_at"] is None and r["collapsed_by"] is None
    # no diagnostics logged (an older run): the ideal values, nothing skipped
    assert (r["clip_frac"], r["imp_weight_mean"], r["behav_dropped_frac"]) == (0.0, 1.0, 0.0)
    assert math.isnan(r["ess_last10"]) and r["diag_skipped_last10"]["ess"] == 0
    assert r["reward_last10"] == 0.5 and set(r["diag_skipped"].values()) == {0}


# --- the collapse rule ---------------------------------------------------------------------------

EVALS = [{"step": 0, "label": "initial", "accuracy": 0.12}, {"step": 10, "accuracy": 0.15},
         {"step": 20, "accuracy": 0.16}, {"step": 30, "accuracy": 0.18},
         {"step": 40, "label": "final", "accuracy": 0.2}]


def test_a_healthy_run_did_not_collapse():
    # low and noisy, two zero-reward steps in a row, a slow start: no 5-step mean below 0.02,
    # every evaluation above half the initial one
    rewards = [0.0, 0.0, 0.0, 0.0, 0.15] + [0.1, 0.0, 0.0, 0.2, 0.05] * 7
    assert collapse_point(rewards, EVALS) == (None, None)


def test_a_late_collapse_is_found_where_it_began():
    # zero reward from step 26 on: the first 5-step window of zeros ends at step 30
    assert collapse_point([0.2] * 25 + [0.0] * 15, EVALS) == (30, "reward")


def test_a_mid_run_collapse_that_recovers_still_counts():
    # the old rule (last 10 steps' mean < 0.02) misses it: the run ends at 0.2
    rewards = [0.2] * 15 + [0.01] * 6 + [0.2] * 19
    assert collapse_point(rewards, EVALS) == (20, "reward")
    # null (a step without a batch reward) is skipped within the window
    rewards[17] = None
    assert collapse_point(rewards, EVALS) == (20, "reward")


def test_a_mid_run_dip_of_the_heldout_below_half_the_initial():
    evals = [dict(e) for e in EVALS]
    evals[2]["accuracy"] = 0.059        # step 20: below 0.06 = half of 0.12, back up later
    assert collapse_point([0.2] * 40, evals) == (20, "held-out")
    evals[2]["accuracy"] = 0.06         # at half: not below it
    assert collapse_point([0.2] * 40, evals) == (None, None)
    # whichever shows it first
    assert collapse_point([0.2] * 5 + [0.0] * 35, [dict(e, accuracy=0.01) if e["step"] == 20 else e
                                                   for e in EVALS]) == (10, "reward")


def test_collapse_steps_are_the_runs_own():
    # a resumed run's metrics start at version 11: the window ending at its 5th step is step 15
    assert collapse_point([0.0] * 5, [], steps=list(range(11, 16))) == (15, "reward")


def test_run_efficiency_records_where_it_collapsed(tmp_path):
    evals = [{"step": 0, "label": "initial", "accuracy": 0.2}, {"step": 6, "accuracy": 0.05},
             {"step": 12, "label": "final", "accuracy": 0.2}]
    r = run_efficiency(_run(tmp_path, rewards=[0.3] * 12, evals=evals), "async", target=0.5)
    assert (r["collapsed"], r["collapsed_at"], r["collapsed_by"]) == (True, 6, "held-out")


# --- null / NaN diagnostics --------------------------------------------------------------------

def test_means_skip_null_and_nan():
    assert mean_skipping([1.0, None, 3.0, float("nan")]) == (2.0, 2)
    m, k = mean_skipping([None, float("nan")])
    assert math.isnan(m) and k == 2
    assert moving_mean([1.0, None, 3.0, 5.0], 2) == [1.0, 3.0, 4.0]


def test_run_efficiency_skips_steps_without_a_measurement(tmp_path):
    # 12 steps; the trainer writes null (or NaN) where a step had no learning signal
    nan = float("nan")
    extra = [{"ess": 0.8, "kl_behav": 0.02, "clip_frac": 0.01, "imp_weight_mean": 0.99, "dropped_frac": 0.0,
              "seq_ess": 0.7, "truncated_frac": 0.0, "response_len": 10.0}
             for _ in range(12)]
    for k in (0, 5, 11):                # one step before the last 10, two within them
        extra[k].update(ess=None, kl_behav=nan, clip_frac=None, imp_weight_mean=nan, dropped_frac=None,
                        seq_ess=None)
    extra[3]["zero_var_groups"] = None
    rewards = [0.3] * 11 + [None]
    r = run_efficiency(_run(tmp_path, rewards=rewards, extra=extra), "async", target=0.5)
    assert r["ess_last10"] == pytest.approx(0.8) and r["kl_behav_last10"] == pytest.approx(0.02)
    assert r["diag_skipped_last10"] == {"reward": 1, "ess": 2, "seq_ess": 2, "kl_behav": 2,
                                        "truncated_frac": 0, "response_len": 0}
    assert r["clip_frac"] == pytest.approx(0.01) and r["imp_weight_mean"] == pytest.approx(0.99)
    assert r["behav_dropped_frac"] == 0.0
    assert r["diag_skipped"] == {"clip_frac": 3, "imp_weight_mean": 3, "behav_dropped_frac": 3}
    assert r["reward_last10"] == pytest.approx(0.3) and r["zero_var_groups"] == 0
    assert r["collapsed"] is False
