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
