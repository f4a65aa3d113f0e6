"""Every wait of a recipe beside the work it waits for (areal_hpc.plan.bounds): pure logic."""
from pathlib import Path

import pytest

from areal_hpc.config import ConfigError, load
from areal_hpc.config.schema import RolloutConfig
from areal_hpc.plan import bounds, budget

ROOT = Path(__file__).resolve().parents[2]
R32 = ROOT / "configs/qwen2_5_32b_math.yaml"
CLOCK = ["checkpoint.signal_lead_s=9000", "checkpoint.time_limit_s=86400"]   # areal_32b.sh's


def test_32b_first_batch_outlasts_the_old_fixed_bound_and_waits_on_rank_0s_liveness():
    """The failure this table exists for: the 32B trainer ranks' wait for the first batch (the
    initial evaluation, then a batch's generation) is longer than the collectives' default
    bound, so it must be, and is, bounded by rank 0's liveness; every wait with a fixed bound
    covers its work, and the preflight accepts the recipe."""
    est = budget.estimate_time(load(R32, CLOCK))
    rows = bounds.waits(est)
    first = next(x for x in rows if x.work.startswith("the first batch"))
    assert first.estimate_s > RolloutConfig.collective_timeout_s      # 1.1 h vs 30 min
    assert first.estimate_s == pytest.approx(bounds.eval_seconds(est) + est.gen_s)
    assert first.key is None and first.bound_s is None                # the beacon bounds it
    end = next(x for x in rows if x.work.startswith("end of job"))
    assert end.key is None and end.estimate_s > est.ckpt_s
    fixed = [x for x in rows if x.key is not None]
    assert {x.key for x in fixed} >= {"rollout.collective_timeout_s", "weights.timeout_s",
                                      "weights.join_timeout_s", "rollout.generator_timeout_s",
                                      "checkpoint.signal_lead_s", "rollout.engine_stall_s"}
    assert all(x.bound_s >= x.estimate_s for x in fixed), [(x.key, x.bound_s, x.estimate_s) for x in fixed]
    assert bounds.bound_problems(rows) is None
    assert budget.check_time(load(R32, CLOCK), env={}, warn=lambda line: None) is not None


@pytest.mark.parametrize("key,value", [("rollout.collective_timeout_s", 300),
                                       ("weights.join_timeout_s", 60),
                                       ("rollout.generator_timeout_s", 10.1),
                                       ("rollout.engine_stall_s", 1)])
def test_a_bound_shorter_than_its_work_is_refused_in_one_line_naming_the_key(key, value):
    # (below a weight receive's bound the config itself refuses generator_timeout_s while engines
    # restart: tests/config/test_config.py)
    extra = ["rollout.engine_restarts=0"] if key == "rollout.generator_timeout_s" else []
    cfg = load(R32, [*CLOCK, f"{key}={value}", *extra])
    with pytest.raises(ConfigError) as err:
        budget.check_time(cfg, env={}, warn=lambda line: None)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{key} = {value} s is shorter than what it bounds")
    assert "raise it to >= " in line


def test_engine_start_and_step_by_hand():
    """32B (32.8 B parameters in bf16): 65.5 GB read at 2 GB/s + 60 s + 120 s of CUDA graphs; a
    prefill of 8192 tokens on 8 H100s at MFU 0.35: 2 x 32.8e9 x 8192 / (8 x 989e12 x 0.35)."""
    cfg = load(R32, CLOCK)
    est = budget.estimate_time(cfg)
    from areal_hpc.plan.memory import read_arch
    p = float(read_arch(cfg).total_params)
    assert bounds.engine_start_seconds(cfg, p) == pytest.approx(2 * p / 2e9 + 180)
    assert bounds.engine_step_seconds(est, p) == pytest.approx(2 * p * 8192 / (8 * 989e12 * 0.35))
    eager = load(R32, [*CLOCK, "rollout.enforce_eager=true"])
    assert bounds.engine_start_seconds(eager, p) == pytest.approx(2 * p / 2e9 + 60)
