"""The throughput planner (areal_hpc.plan.throughput): simulation invariants, calibration, CLI."""
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from areal_hpc.plan import main
from areal_hpc.plan.calibration import calibrate
from areal_hpc.plan.throughput import Lengths, Rates, Setup, predict, simulate, sync_variant
from areal_hpc.config import load

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/tiny_cpu.yaml"


def _setup(**kw):
    base = dict(n_generators=2, batch_prompts=8, group_size=4, max_staleness=1,
                max_concurrent_prompts=16, seq_limit=32, max_new_tokens=4096)
    base.update(kw)
    return Setup(**base)


def _rates(**kw):
    base = dict(gen_tok_s=1000.0, train_tok_s=4000.0, update_s=0.5, c_half=0.0,
                lengths=Lengths.constant(100))
    base.update(kw)
    return Rates(**base)


LONG = Lengths(median=100, p99=1000, source="long tail")


@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize("policy", ["reissue", "drop"])
def test_staleness_bounded_unless_keep(eta, policy):
    res = simulate(_setup(max_staleness=eta, stale_policy=policy), _rates(lengths=LONG), 15, seed=1)
    assert res.staleness_max <= eta
    keep = simulate(_setup(max_staleness=1, stale_policy="keep"), _rates(lengths=LONG), 15, seed=1)
    assert keep.dropped_share == 0


def test_stopping_doomed_groups_saves_generation_on_a_long_tail():
    """abort_stale: a group in flight that is already too old for the next batch stops where it
    is (as the generators do on StaleBefore), so the engine moves on to prompts that can still be
    trained: the same steps sooner, the staleness still bounded. (Its prompt is reissued sooner
    too, and a long one is often doomed again: more drops, not fewer.)"""
    setup = _setup(max_staleness=1)
    rates = _rates(lengths=LONG, train_tok_s=20000.0, update_s=0.05)
    for seed in range(3):
        on = simulate(replace(setup, abort_stale=True), rates, 30, seed=seed)
        off = simulate(setup, rates, 30, seed=seed)
        assert on.staleness_max <= 1 and off.staleness_max <= 1
        assert off.dropped_share > 0 and on.dropped_share >= off.dropped_share
        assert on.wall_s < off.wall_s


def test_eta0_is_on_policy_like_sync():
    res = simulate(_setup(max_staleness=0), _rates(lengths=LONG), 10)
    assert res.staleness_max == 0 and res.dropped_share == 0
    s, r = sync_variant(_setup(), _rates(lengths=LONG), 1.0, 1.0)
    sync = simulate(s, r, 10)
    assert sync.staleness_max == 0
    # η = 0 on disjoint devices with the same rates: the same alternation, training hidden by nothing
    assert sync.wall_s == pytest.approx(res.wall_s, rel=0.02)


def test_generation_bound_matches_analytic_rate():
    setup = _setup(max_staleness=4, max_concurrent_prompts=64)
    rates = _rates(gen_tok_s=1000.0, train_tok_s=1e7, update_s=0.01)
    res = simulate(setup, rates, 30)
    per_step = 8 * 4 * 100 / (2 * 1000.0) + 0.01       # B n L / (G T(C)) + update
    assert res.steps_per_hour == pytest.approx(3600 / per_step, rel=0.04)
    assert res.gen_busy_frac > 0.95
    assert res.trained_tokens == 30 * 8 * 4 * 100           # exactly the S steps' batches


def test_training_bound():
    rates = _rates(gen_tok_s=1e6, train_tok_s=1000.0, update_s=0.5, train_overhead_s=0.2)
    res = simulate(_setup(max_staleness=2), rates, 20)
    step = 0.2 + 8 * 4 * 100 / 1000.0 + 0.5
    assert res.steps_per_hour == pytest.approx(3600 / step, rel=0.03)


@pytest.mark.parametrize("lengths", [Lengths.constant(100), LONG])
def test_async_at_least_sync_and_ideal_never_beaten(lengths):
    rates = _rates(lengths=lengths)
    for eta in (0, 1, 2, 4, 8):
        setup = _setup(max_staleness=eta)
        res = simulate(setup, rates, 12, seed=3)
        assert res.wall_s >= res.ideal_wall_s * (1 - 1e-9)
        s, r = sync_variant(setup, rates, 1.0, 1.0)
        sync = simulate(s, r, 12, seed=3)
        assert sync.wall_s >= sync.ideal_wall_s * (1 - 1e-9)
        if eta >= 1:
            assert res.steps_per_hour >= sync.steps_per_hour * 0.999


def test_deterministic_for_a_seed():
    a = simulate(_setup(), _rates(lengths=LONG), 10, seed=7)
    b = simulate(_setup(), _rates(lengths=LONG), 10, seed=7)
    c = simulate(_setup(), _rates(lengths=LONG), 10, seed=8)
    assert a == b and a.step_s != c.step_s


def test_long_tail_raises_staleness_and_drops():
    short = simulate(_setup(max_staleness=1), _rates(lengths=Lengths(median=100, p99=150)), 20)
    long = simulate(_setup(max_staleness=1), _rates(lengths=Lengths(median=100, p99=1000)), 20)
    assert long.dropped_share > short.dropped_share
    # kept instead of dropped, the late groups show up as staleness beyond η
    keep = dict(max_staleness=1, stale_policy="keep")
    short = simulate(_setup(**keep), _rates(lengths=Lengths(median=100, p99=150)), 20)
    long = simulate(_setup(**keep), _rates(lengths=Lengths(median=100, p99=1000)), 20)
    assert long.staleness_max > short.staleness_max > 1
    assert long.staleness_p95 > short.staleness_p95


def _fake_run(d: Path, with_log: bool) -> Path:
    d.mkdir()
    steps = [{"step": i, "seconds": 2.0, "weight_sync_s": 0.5, "wait_s": 0.1, "n_tokens": 4000,
              "response_len": 40.0 + i, "staleness_mean": 0.5} for i in range(3)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (d / "generators.json").write_text(json.dumps([
        {"rank": r, "version": 2, "reward": {}, "tokens": 10000,
         "seconds": {"busy": 10.0, "pause": 1, "idle": 1, "eval": 0, "idle_scoring": 0}} for r in (1, 2)]))
    (d / "config.yaml").write_text(TINY.read_text())
    if with_log:
        from areal_hpc.storage.rollout_log import RolloutWriter
        w = RolloutWriter(d / "rollouts.h5", "")
        trajs = [{"prompt_id": 0, "sample_idx": k, "prompt_tokens": np.arange(5, dtype=np.int32),
                  "output_tokens": np.arange(n, dtype=np.int32),
                  "behav_logprobs": np.zeros(n, dtype=np.float32),
                  "versions": np.zeros(n, dtype=np.int32), "reward": 0.0, "finish_reason": "stop",
                  "generator_rank": 1, "t_submit": 0.0, "t_first_token": 0.0, "t_end": 1.0}
                 for k, n in enumerate([10, 20, 30, 40])]
        w.append(trajs)
        w.close()
    return d


def test_calibration(tmp_path):
    r = calibrate(_fake_run(tmp_path / "a", with_log=False))
    assert r.gen_tok_s == pytest.approx(1000.0) and r.train_tok_s == pytest.approx(2000.0)
    assert r.update_s == pytest.approx(0.5)
    assert sorted(r.lengths.values) == [40.0, 41.0, 42.0]
    r = calibrate(_fake_run(tmp_path / "b", with_log=True))
    assert sorted(r.lengths.values) == [10, 20, 30, 40] and r.lengths.prompt_len == 5
    assert r.gen_tok_s == pytest.approx(100 / 20)       # log tokens / busy seconds of all engines
    pred = predict(load(TINY), replace(r, gen_tok_s=500.0), steps=3)
    assert pred.speedup > 0 and pred.async_.steps == 3


def test_cli(tmp_path, capsys):
    run = _fake_run(tmp_path / "run", with_log=False)
    assert main(["throughput", str(TINY), "--from-run", str(run), "--steps", "4", "--search"]) == 0
    out = capsys.readouterr().out
    assert "steps/h" in out and "speedup" in out and "search" in out
    assert main(["throughput", str(TINY), "--gen-tok-s", "500", "--train-tok-s", "900",
                 "--update-s", "0.1", "--median-len", "30", "--p99-len", "90", "--steps", "3",
                 "train.batch_prompts=4"]) == 0
    assert main(["throughput", str(TINY), "--from-run", str(run), "--gen-tok-s", "-1"]) == 2
    assert "error: --gen-tok-s" in capsys.readouterr().err
    assert main(["throughput", str(TINY), "--from-run", str(tmp_path / "none")]) == 2
    assert "error: --from-run" in capsys.readouterr().err
    bad = tmp_path / "bad.h5"
    bad.write_text("not hdf5")
    assert main(["throughput", str(TINY), "--from-run", str(run), "--lengths", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and str(bad) in err and "Traceback" not in err


def test_assumed_rates_follow_the_stated_roofline():
    """Without measured rates: the H100 roofline of the docstring, from the recipe's model."""
    from areal_hpc.plan import throughput as T
    from areal_hpc.plan.calibration import assumed_rates
    from areal_hpc.plan.memory import read_arch
    cfg = load(str(ROOT / "configs/qwen2_5_1_5b_math.yaml"))
    lengths = Lengths(median=6000, p99=27648)
    gen, train, update, c_half = assumed_rates(cfg, lengths)
    arch = read_arch(cfg)
    p = arch.total_params
    per_token = (6 + 2 * (cfg.train.recompute_granularity == "full") + 2 * 3 / 4) * p
    assert cfg.train.prox == "recompute" and cfg.train.ppo_minibatches == 4    # π_prox over 3 of 4
    assert train == pytest.approx(cfg.topology.n_trainers * T.GPU_BF16_FLOPS * T.TRAIN_MFU / per_token)
    assert update == pytest.approx(2 * p / T.WEIGHT_BCAST_BYTES_S + T.UPDATE_FIXED_S)
    kv = 2 * arch.layers * arch.kv_heads * arch.head_dim * 2
    ctx = lengths.prompt_len + lengths.mean(cfg.rollout.max_new_tokens) / 2
    assert c_half == pytest.approx(2 * p / (kv * ctx))
    # the saturating decode model at c_half reproduces the roofline's step time at any c
    c = 7
    step = (2 * p + c * kv * ctx) / (T.GPU_HBM_BYTES_S * T.DECODE_BW_EFFICIENCY * cfg.rollout.engine_tp)
    peak = T.GPU_HBM_BYTES_S * T.DECODE_BW_EFFICIENCY * cfg.rollout.engine_tp / (kv * ctx)
    assert c / step == pytest.approx(peak * c / (c + c_half))
    assert 0 < gen < peak


def test_the_simulation_and_the_controller_follow_one_ledger(monkeypatch):
    """The planner drives the controller's Ledger: the sequence of issues, arrivals, steps it
    made on a long tail (drops and reissues among them), replayed on a fresh Ledger as the
    controller would make them, gives the same prompts out, the same groups dropped and taken."""
    from areal_hpc.plan import throughput
    from areal_hpc.rollout import controller
    from areal_hpc.rollout.ledger import Ledger
    assert throughput.Ledger is controller.Ledger is Ledger

    def summary(out):
        if not isinstance(out, list):
            return out
        return [(x.rank, x.prompt_id) if hasattr(x, "prompt_id") else x.trajectories[0]["prompt_id"]
                for x in out]

    script, made = [], []

    class Recorded(Ledger):
        def __init__(self, **kw):
            super().__init__(**kw)
            made.append(kw)

    for name in ("issue", "arrived", "drop_stale", "take", "trained"):
        def method(self, *args, _name=name):
            out = getattr(Ledger, _name)(self, *args)
            script.append((_name, args, summary(out)))
            return out
        setattr(Recorded, name, method)
    monkeypatch.setattr(throughput, "Ledger", Recorded)
    res = simulate(_setup(max_staleness=1), _rates(lengths=LONG, train_tok_s=20000.0, update_s=0.05),
                   30, seed=0)
    drops = [s for s in script if s[0] == "drop_stale" and s[2]]
    assert res.dropped_share > 0 and drops                        # the sequence holds drops
    replay = Ledger(**made[0])
    for name, args, out in script:
        assert summary(getattr(replay, name)(*args)) == out, (name, args)
    first = drops[0][2][0]                                        # a dropped prompt is issued again,
    later = [s for s in script[script.index(drops[0]):] if s[0] == "issue" and s[2]]
    assert later[0][2][0][1] == first                             # first
