"""A run's efficiency from its directory (areal_hpc/analysis/efficiency.py), on a hand-made run."""

import pytest

from areal_hpc.analysis.efficiency import run_efficiency
from areal_hpc.storage.rollout_log import RolloutWriter
from areal_hpc.storage.run_dir import RunDir
from areal_hpc.transport.messages import GeneratorStats

from .conftest import known_trajs


def _run(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    trajs, consumed = known_trajs()
    w = RolloutWriter(run.rollouts, config_yaml="name: r\nrollout:\n  group_size: 2\n")
    for g in range(0, len(trajs), 2):
        w.append(trajs[g:g + 2])
    for step in sorted(set(consumed)):
        w.mark_consumed([i for i, c in enumerate(consumed) if c == step], step)
    w.close()
    for k in range(3):      # 3 steps of 2 s training + 0.5 s update, 1 s waited each
        run.append_metrics({"step": k, "version": k + 1, "elapsed_s": 4.0 * (k + 1), "seconds": 2.0,
                            "weight_sync_s": 0.5, "wait_s": 1.0, "n_tokens": 100, "reward": 0.5,
                            "accuracy": 0.1 * (k + 1)})
    run.write_generators([GeneratorStats(rank=1, tokens=300, version=3, reward={}, engine_s=9.0,
                                         seconds={"busy": 6.0, "pause": 1.5, "eval": 2.0, "idle": 2.0,
                                                  "idle_scoring": 0.0, "other": 0.5})])
    run.write_evals([{"step": 0, "label": "initial", "accuracy": 0.05},
                     {"step": 3, "label": "final", "accuracy": 0.25}])
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
