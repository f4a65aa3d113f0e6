"""A training step stopped between minibatches (checkpoint.mid_step_stop), on one process (gloo):
`train_share` restores the step's start state bit-exactly (model, optimizer main parameters and
Adam state, param groups, LR scheduler) and raises `StepAbandoned`; the same step trained again
afterwards gives, bit for bit, what an uninterrupted run gives. Plain and distributed optimizer,
fp32 and bf16 (fp32 main parameters)."""
import dataclasses

import numpy as np
import pytest
import torch

from areal_hpc.config import TrainConfig
from areal_hpc.train.shares import split_batch

GROUP = 2


def _seqs(seed: int, n: int = 8) -> list[dict]:
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n):
        out = rng.integers(0, 128, int(rng.integers(3, 9))).astype(np.int32)
        seqs.append({"prompt_tokens": rng.integers(0, 128, 4).astype(np.int32),
                     "output_tokens": out,
                     "behav_logprobs": rng.uniform(-6.0, -3.0, len(out)).astype(np.float32),
                     "reward": float(rng.integers(0, 2)), "versions": np.zeros(len(out), np.int32)})
    return seqs


def _state(actor) -> dict:
    """Everything a step changes, copied: the model, each optimizer's parameters, state and
    param-group values, the scheduler."""
    out = {f"model.{n}": p.detach().clone() for n, p in actor.model.named_parameters()}
    opt = actor.optimizer
    for j, o in enumerate(getattr(opt, "chained_optimizers", None) or [opt]):
        inner = o.optimizer
        for gi, group in enumerate(inner.param_groups):
            for k, v in group.items():
                if k != "params":
                    out[f"opt{j}.group{gi}.{k}"] = v
            for pi, p in enumerate(group["params"]):
                out[f"opt{j}.{gi}.{pi}.param"] = p.detach().clone()
                for k, v in inner.state.get(p, {}).items():
                    out[f"opt{j}.{gi}.{pi}.{k}"] = v.clone() if torch.is_tensor(v) else v
    for k, v in vars(actor.lr_scheduler).items():
        if isinstance(v, (int, float, str, bool)):
            out[f"sched.{k}"] = v
    return out


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for k, v in want.items():
        if torch.is_tensor(v):
            assert v.dtype == got[k].dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v or (v != v and got[k] != got[k]), (k, got[k], v)


@pytest.fixture(scope="module")
def make(megatron_ws1, model_dir):
    from areal_hpc.train.actor import Actor
    base = TrainConfig(lr=1e-3, max_tokens_per_mb=24, lr_warmup_steps=2, lr_decay_style="linear",
                       total_steps=6, weight_decay=0.01)

    def make(**cfg):
        dtype = cfg.pop("dtype", "float32")
        return Actor(dataclasses.replace(base, **cfg), model_dir, group_size=GROUP, dtype=dtype)
    return make


def _share(actor, seed: int):
    return split_batch(_seqs(seed), actor.cfg, GROUP, 1)[0]


CASES = [dict(ppo_minibatches=2), dict(ppo_minibatches=4, distributed_optimizer=True),
         dict(ppo_minibatches=2, distributed_optimizer=True, dtype="bfloat16")]


@pytest.mark.parametrize("cfg", CASES, ids=["plain-mb2", "distopt-mb4", "distopt-bf16-mb2"])
def test_abandoned_step_restores_and_retrains_bit_exactly(make, cfg):
    from areal_hpc.train.actor import StepAbandoned
    n_mb = cfg["ppo_minibatches"]
    straight, stopped = make(**cfg), make(**cfg)
    for a in (straight, stopped):   # Adam state and a scheduler past its first steps
        a.train_share(_share(a, 0), 0)

    calls = []

    def stop_after_first(done, total, minibatch_s):
        calls.append((done, total))
        assert minibatch_s >= 0.0
        return done == 1

    before = _state(stopped)
    with pytest.raises(StepAbandoned) as exc:
        stopped.train_share(_share(stopped, 1), 1, should_stop=stop_after_first)
    assert (exc.value.done, exc.value.total) == (1, n_mb)
    assert calls == [(0, n_mb), (1, n_mb)]      # before π_prox, after minibatch 1
    _assert_same(_state(stopped), before)

    # the same step again (with a should_stop that never stops), then one more: as if uninterrupted
    never = []
    got = stopped.train_share(_share(stopped, 1), 1,
                              should_stop=lambda d, t, s: never.append(d) or False)
    assert never == list(range(n_mb))
    want = straight.train_share(_share(straight, 1), 1)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert got["lr"] == want["lr"]
    for a in (straight, stopped):
        a.train_share(_share(a, 2), 2)
    _assert_same(_state(stopped), _state(straight))


def test_stop_before_prox_on_the_first_step(make):
    """Before the first optimizer step Adam has no state: the restore leaves none."""
    from areal_hpc.train.actor import StepAbandoned
    a, b = make(ppo_minibatches=2), make(ppo_minibatches=2)
    before = _state(a)
    with pytest.raises(StepAbandoned) as exc:
        a.train_share(_share(a, 0), 0, should_stop=lambda d, t, s: True)
    assert exc.value.done == 0
    _assert_same(_state(a), before)
    with pytest.raises(StepAbandoned):
        a.train_share(_share(a, 0), 0, should_stop=lambda d, t, s: d == 1)
    _assert_same(_state(a), before)
    a.train_share(_share(a, 0), 0)
    b.train_share(_share(b, 0), 0)
    _assert_same(_state(a), _state(b))


# ------------------------------------------------------------- the decision, pure

def test_verdict():
    from areal_hpc.preemption import mid_step_verdict as v
    now = 1000.0
    # no signal pending, the end or the rest unknown: finish the step
    assert v(pending=False, now=now, job_end=now + 10, rest_s=500, checkpoint_s=0) == (False, None)
    assert v(pending=True, now=now, job_end=None, rest_s=500, checkpoint_s=0) == (False, None)
    assert v(pending=True, now=now, job_end=now + 10, rest_s=None, checkpoint_s=0) == (False, None)
    # 3600 s to the end, 300 s checkpoint, 60 s margin: 3240 s for the rest of the step
    assert v(pending=True, now=now, job_end=now + 3600, rest_s=3000, checkpoint_s=300,
             margin_s=60) == (False, 3240)
    assert v(pending=True, now=now, job_end=now + 3600, rest_s=3300, checkpoint_s=300,
             margin_s=60) == (True, 3240)
    # the end already past
    assert v(pending=True, now=now, job_end=now - 5, rest_s=1, checkpoint_s=0, margin_s=0) \
        == (True, -5)


def test_job_end(monkeypatch):
    from areal_hpc import preemption, slurm_job
    from areal_hpc.config import RunConfig
    cfg = RunConfig()
    assert preemption.job_end(cfg, None, {}) == (None, "")
    assert preemption.job_end(cfg, 500.0, {}) == (None, "")     # a signal, no lead known
    assert preemption.job_end(cfg, None, {"SLURM_JOB_END_TIME": "9000"}) == (9000.0,
                                                                          "SLURM_JOB_END_TIME")
    cfg.checkpoint.signal_lead_s = 1200
    assert preemption.job_end(cfg, 500.0, {}) == (1700.0, "the signal + checkpoint.signal_lead_s")
    # the earliest of those known
    assert preemption.job_end(cfg, 500.0, {"SLURM_JOB_END_TIME": "1600"})[0] == 1600.0
    cfg.checkpoint.time_limit_s = 100
    assert preemption.job_end(cfg, 500.0, {"SLURM_JOB_START_TIME": "1000"}) == (
        1100.0, "checkpoint.time_limit_s")
    # in a Slurm job without the key: the batch script's --signal
    cfg = RunConfig()
    monkeypatch.setattr(slurm_job, "job_clock", lambda c, env: (None, "", 900.0, "the script"))
    assert preemption.job_end(cfg, 500.0, {"SLURM_JOB_ID": "7"}) == (1400.0,
                                                                     "the signal + the script")


def test_signal_time_recorded():
    from areal_hpc import preemption
    preemption.reset()
    try:
        assert preemption.requested_at() is None
        preemption.request(at=123.0)
        assert preemption.requested() and preemption.requested_at() == 123.0
        preemption.request()                    # a later one keeps the first time
        assert preemption.requested_at() == 123.0
    finally:
        preemption.reset()


def test_ledger_put_back_keeps_the_batch_first():
    """A batch put back is buffered again (checkpoint rows included), taken first among its
    version, and the current version's batch is no longer taken (no stale drop on its account)."""
    from areal_hpc.rollout.ledger import Ledger

    def group(pid, oldest):
        return [{"prompt_id": pid, "sample_idx": i, "versions": np.array([oldest]),
                 "output_tokens": np.arange(1)} for i in range(2)]
    led = Ledger(num_prompts=8, data_seed=0, generators=[1], batch_prompts=2, max_staleness=1,
                 max_concurrent=8, stale_policy="reissue", max_reissues=1)
    issued = led.issue()
    for k, it in enumerate(issued[:4]):
        led.arrived(1, group(it.prompt_id, 0), [2 * k, 2 * k + 1])
    before = led.to_state(8)
    taken = led.take(2)
    assert led.next_train_version == 1
    led.put_back(taken)
    assert led.next_train_version == 0
    after = led.to_state(8)
    assert sorted(after.buffer_rows.tolist()) == sorted(before.buffer_rows.tolist())
    a, b = after.as_lists(), before.as_lists()
    assert a.keys() == b.keys()
    for k in b:                         # the counters, the cursor, what is in flight: as before
        if k != "buffer_rows":
            assert a[k] == b[k], k
    assert [g.rows for g in led.take(2)] == [g.rows for g in taken]
