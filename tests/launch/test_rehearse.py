"""The dress rehearsal of a GPU recipe (areal_hpc/launch/rehearse.py): the layout it scales to,
and, on the namespaced 4-node local cluster, the 32B recipe's real training path through its own
batch script and slurm/site_gpu.sh: preempted, requeued, resumed, finished, exported, audited."""
import re
from pathlib import Path

import pytest

from areal_hpc.config import load
from areal_hpc.launch import rehearse
from tests.launch.test_slurm_netns import netns_cluster  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name,tp,pp,dp,etp,per_node", [
    ("areal_32b.sh", 2, 2, 2, 2, (4, 1)), ("areal_7b.sh", 1, 2, 2, 1, (2, 2)),
    ("areal_1_5b.sh", 1, 2, 2, 1, (2, 2))])
def test_each_recipe_keeps_its_structure_at_two_nodes_a_component(name, tp, pp, dp, etp, per_node, tmp_path):
    """Every parallel dimension the recipe has, at 2; each component on 2 nodes; only the
    #SBATCH node and task counts of the batch script change; the overrides load as a valid
    config of that layout that keeps the recipe's optimizer and recompute settings."""
    text = (ROOT / "slurm" / name).read_text()
    lay = rehearse.layout(text)
    assert (lay.tp, lay.pp, lay.dp, lay.engine_tp) == (tp, pp, dp, etp)
    assert (lay.trainers_per_node, lay.generators_per_node) == per_node
    scaled = rehearse.scaled_script(text, lay)
    changed = [(a, b) for a, b in zip(text.splitlines(), scaled.splitlines()) if a != b]
    assert len(changed) == 2 and len(scaled.splitlines()) == len(text.splitlines())
    for (a, b), per in zip(changed, per_node):
        assert a.startswith("#SBATCH --nodes=") and b == re.sub(
            r"--ntasks-per-node=\d+", f"--ntasks-per-node={per}", re.sub(r"--nodes=\d+", "--nodes=2", a))
    recipe = load(ROOT / lay.config, ["model.path=x", "data.train_path=x"])
    cfg = load(ROOT / lay.config, rehearse.overrides(lay, Path("/m"), tmp_path, "r", 4))
    t = cfg.topology
    assert (t.n_trainers, t.tp, t.pp, t.n_generators) == (tp * pp * dp, tp, pp, 2 * per_node[1])
    assert t.n_trainers == 2 * per_node[0] and cfg.rollout.engine_tp == etp
    for key in ("distributed_optimizer", "sequence_parallel", "recompute_granularity", "off_policy",
                "ppo_minibatches", "prox"):
        assert getattr(cfg.train, key) == getattr(recipe.train, key), key
    assert cfg.rollout.max_staleness == recipe.rollout.max_staleness
    assert cfg.checkpoint.every_steps == 1 and cfg.reward.fn.endswith("by_length.py:by_length")


def test_full_scale_preflight_of_each_recipe_passes():
    for name in ("areal_32b.sh", "areal_7b.sh", "areal_1_5b.sh"):
        lines = rehearse.full_scale_preflight((ROOT / "slurm" / name).read_text())
        assert lines[0].startswith("memory: the busiest trainer GPU") and "every fixed wait covers" in lines[1]


@pytest.mark.e2e
@pytest.mark.slow
def test_32b_recipe_rehearsal_on_four_namespaced_nodes(netns_cluster, jobs, tiny_model, tmp_path):  # noqa: F811
    """sbatch slurm/areal_32b.sh (its node counts scaled) on 4 hosts of their own: 8 trainer ranks
    (TP 2 x PP 2 x DP 2, distributed optimizer) on 2 nodes, 2 generator ranks with a vLLM engine
    of 2 workers on 2 nodes, one MPI world from the shipped site file. USR1 after the first step
    → checkpoint, exit 3, requeue → the second attempt resumes and finishes every step, exports
    policy/, and the audit of the run's files passes."""
    env = {k: v for k, v in netns_cluster["env"].items() if not re.match(r"(MPIR_CVAR|FI|UCX)_", k)}
    res = rehearse.rehearse(ROOT / "slurm/areal_32b.sh", Path(tiny_model), tmp_path, steps=4, timeout=600,
                            env=jobs.env(env), say=lambda line: None)
    run = Path(res["run"])
    assert res["audit"] == 0, res["audit_out"]
    assert res["steps"] == [0, 1, 2, 3] and 1 <= res["stopped_at"] < 4, res
    log = Path(res["batch_out"]).read_text(errors="replace")
    assert "requeueing job" in log and f"job {res['job']} attempt 1" in log, log[-3000:]
    assert "trainers on node[1-2] (8 tasks), generators on node[3-4] (2 tasks)" in log, log[-3000:]
    second = (run / f"logs/job-{res['job']}/attempt-1/ranks.log").read_text(errors="replace")
    assert re.search(r"resuming from \S+step_0+[1-3]: [1-3] of 4 steps done", second), second[-3000:]
    from areal_hpc.storage.run_dir import RunDir
    metrics = RunDir(run).read_metrics()
    # every step trained (a gradient through TP, PP and DP, the distributed optimizer stepped)
    assert all(m["grad_norm"] > 0 and m["no_signal_steps"] == 0 for m in metrics), metrics
    assert (run / "policy/config.json").exists()
    assert not jobs.leftovers(), "processes of the job are still running"
