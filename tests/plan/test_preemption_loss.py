"""What a hard preemption loses, by checkpoint cadence (areal_hpc.plan.budget.hard_preemption):
pure arithmetic on the step-time estimate, checked by hand on the 32B recipe."""
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from areal_hpc.config import load
from areal_hpc.plan import budget

ROOT = Path(__file__).resolve().parents[2]
R32 = ROOT / "configs/qwen2_5_32b_math.yaml"


@pytest.fixture(scope="module")
def est():
    return budget.estimate_time(load(R32, []), "h100")


def test_synchronous_cadence(est):
    c = budget.cadence(est, 2, False)
    assert c.stall_s == c.complete_s == est.ckpt_s
    assert c.period_s == 2 * est.interval_s + est.ckpt_s
    # a kill at u in [0, period): u once the checkpoint is complete, else u + period
    assert c.loss_s == pytest.approx(c.period_s / 2 + est.ckpt_s)
    assert budget.cadence(est, 1, False).loss_s < c.loss_s


def test_asynchronous_cadence_completes_at_the_first_seal_point_after_the_write(est):
    stage = 2.0
    c = budget.cadence(est, 1, True, stage)
    fl, m = est.flops, est.cfg.train.ppo_minibatches
    prox = est.train_s * fl.prox / fl.total
    first_minibatch = prox + (est.train_s - prox) / m       # the trainer waits for no batch
    assert est.interval_s == est.step_s and est.ckpt_s < first_minibatch
    assert c.complete_s == pytest.approx(stage + first_minibatch)
    assert c.period_s == pytest.approx(stage + est.interval_s) and c.stall_s == stage
    assert c.loss_s == pytest.approx(c.period_s / 2 + c.complete_s)
    # without mid-step decision points: only at the next step boundary (the next save)
    no_mid = replace(est, cfg=load(R32, ["checkpoint.mid_step_stop=false"]))
    assert budget.cadence(no_mid, 1, True, stage).complete_s == pytest.approx(stage + est.interval_s)
    # a write longer than the step: the next save waits for it
    slow = replace(est, ckpt_s=1.5 * est.interval_s)
    c = budget.cadence(slow, 1, True, stage)
    assert c.complete_s == pytest.approx(stage + slow.ckpt_s)
    assert c.period_s == pytest.approx(stage + slow.ckpt_s)


def test_32b_recipe(est):
    hp = budget.hard_preemption(est)
    own, sync1 = hp.cadences
    assert (own.every, own.asynchronous, sync1.every, sync1.asynchronous) == (1, True, 1, False)
    # tp 2 x pp 8 x dp 2, distributed optimizer: 2 B of weight + 12 B / dp of optimizer a parameter
    assert hp.staged_bytes == pytest.approx(est.ckpt_bytes / 14 / 16 * (2 + 12 / 2))
    assert 15 * 2**30 < hp.staged_bytes < 16 * 2**30
    assert hp.grace_s == pytest.approx(est.ckpt_s + 60)
    assert hp.restart_s == pytest.approx(budget.RESTART_FIXED_S + 2 * est.ckpt_bytes / est.ckpt_bytes_s
                                         + est.gen_s)
    old = budget.hard_preemption(replace(est, cfg=load(R32, ["checkpoint.async_save=false",
                                                             "checkpoint.every_steps=2"])))
    assert [(c.every, c.asynchronous) for c in old.cadences] == [(2, False), (1, False), (1, True)]
    assert own.loss_s < old.cadences[0].loss_s and own.stall_s < sync1.stall_s / 50


def test_cli_prints_the_loss_and_the_grace_time():
    r = subprocess.run([sys.executable, "-m", "areal_hpc.plan", "time", str(R32), "--gpu", "h100"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "a hard preemption (SIGTERM, SIGKILL after GraceTime)" in r.stdout
    assert "async, every step (this config)" in r.stdout and "sync, every step" in r.stdout
    assert "GraceTime >= 244 s" in r.stdout


def test_the_stop_margin_is_the_mid_step_decisions():
    from areal_hpc.plan.budget import STOP_MARGIN_S
    from areal_hpc.preemption import MID_STEP_MARGIN_S
    assert STOP_MARGIN_S == MID_STEP_MARGIN_S
