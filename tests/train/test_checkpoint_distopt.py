"""Checkpoints with Megatron's distributed optimizer (DP = 2 gloo processes, fp32 on CPU), and the
plain optimizer's checkpoints written before its first step or by older versions (one process).

One world (tests/train/distopt_worker.py) runs, each on a fresh Actor: an uninterrupted run of
five training steps (two optimizer steps each) that checkpoints before its first step and after
its second; a resume from the step-2 checkpoint for the last three (six optimizer steps); a resume
from the step-0 checkpoint (written before Adam had any state) for all five. Both resumes must
give the uninterrupted run's losses, grad norms, lrs, Adam state and weights bit for bit.
"""

import dataclasses
import pickle
from pathlib import Path

import h5py
import pytest
import torch

from areal_hpc.config import TrainConfig
from areal_hpc.storage import checkpoint as ck
from areal_hpc.train import checkpoint as train_ck
from tests.train.test_checkpoint import _batch

pytestmark = pytest.mark.slow     # starts MPI / torch.distributed worlds or processes (tests/conftest.py)

WORKER = Path(__file__).with_name("distopt_worker.py")
WORLD = 2
SAVE_AT, STEPS = 2, 5
# Warm-up then linear decay (lr > 0 to the end): the resumed lr comes from the restored
# scheduler. Weight decay: the dummy Adam step Megatron takes before loading moves the weights.
CFG = TrainConfig(lr=1e-3, max_tokens_per_mb=64, distributed_optimizer=True, ppo_minibatches=2,
                  lr_warmup_steps=1, lr_decay_style="linear", total_steps=STEPS + 1,
                  weight_decay=0.01)
ACTOR = dict(group_size=2)


def _model_dir(path: Path) -> str:
    from areal_hpc.random_models import save_random_qwen2

    return save_random_qwen2(path, vocab_size=64, hidden_size=32, intermediate_size=64,
                             max_position_embeddings=64)


def launch(run_distributed, work: Path) -> list[dict]:
    """Run the worker's world in `work`; the output of each rank."""
    model_dir = _model_dir(work / "qwen2")
    spec = {"model_dir": str(model_dir), "cfg": CFG, "actor": ACTOR, "save_at": SAVE_AT,
            "batches": [_batch(s) for s in range(STEPS)]}
    (work / "in.pkl").write_bytes(pickle.dumps(spec))
    run_distributed(WORKER, WORLD, work, mpi=False, timeout=600)
    return [pickle.loads((work / f"out.{r}.pkl").read_bytes()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_distributed):
    return launch(run_distributed, tmp_path_factory.mktemp("distopt"))


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _same_opt_state(got: dict, want: dict) -> None:
    assert got["state"].keys() == want["state"].keys()
    for key, st in want["state"].items():
        g = got["state"][key]
        assert sorted(g) == sorted(st), key
        for name, v in st.items():
            if torch.is_tensor(v):
                assert g[name].dtype == v.dtype and torch.equal(g[name], v), (key, name, g[name], v)
            else:
                assert g[name] == v, (key, name)
    assert not got["step_tensor_shared"], "one `step` tensor shared by several params"


def _same_stats(got: list[dict], want: list[dict], rank: int) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        for key in ("loss", "grad_norm", "lr"):
            assert g[key] == w[key], (rank, step, key, g[key], w[key])


def test_distributed_optimizer_resume_is_bit_exact(runs):
    for rank, out in enumerate(runs):
        ref, res = out["ref"], out["resumed"]
        _same_opt_state(out["resumed_after_load"], out["ref_at_save"])   # step included
        _same_stats(res["stats"], ref["stats"][SAVE_AT:], rank)
        assert _max_diff(res["weights"], ref["weights"]) == 0.0, rank
        _same_opt_state(res["opt"], ref["opt"])
        steps = {float(st["step"]) for st in res["opt"]["state"].values()}
        assert steps == {STEPS * CFG.ppo_minibatches}, steps


def test_distributed_optimizer_checkpoint_before_first_step(runs):
    for rank, out in enumerate(runs):
        assert "from_zero_error" not in out, out.get("from_zero_error")
        ref, z = out["ref"], out["from_zero"]
        _same_stats(z["stats"], ref["stats"], rank)
        assert _max_diff(z["weights"], ref["weights"]) == 0.0, rank
        _same_opt_state(z["opt"], ref["opt"])


def test_optimizer_layout_mismatch_is_refused(runs):
    for out in runs:
        err = out["mismatch_error"]
        assert err is not None and err.startswith("CheckpointError"), err
        assert "distributed_optimizer" in err


# ------------------------------------------------------------- plain optimizer, one process

@pytest.fixture(scope="module")
def plain_factory(tmp_path_factory):
    from areal_hpc.train.actor import Actor
    from areal_hpc.train.megatron_model import single_process

    single_process()
    path = _model_dir(tmp_path_factory.mktemp("plain") / "qwen2")
    cfg = TrainConfig(lr=1e-3, max_tokens_per_mb=64, weight_decay=0.01)
    return lambda distributed=False: Actor(
        dataclasses.replace(cfg, distributed_optimizer=distributed), path, group_size=2)


def _save_old_format(run_dir: Path, step: int, actor) -> Path:
    """A checkpoint as the previous `checkpoint.save` wrote it: the model and
    `optimizer.sharded_state_dict` whatever its state, state.h5 without the optimizer attributes
    (no manifest: `load` does not read it)."""
    from megatron.core import dist_checkpointing

    from areal_hpc.train.cpu_compat import CudaToCpuMode
    path = ck.step_dir(run_dir, step)
    (path / ck.SHARDS).mkdir(parents=True)
    msd = actor.model.module.sharded_state_dict()
    with CudaToCpuMode():
        dist_checkpointing.save(
            {"model": msd, "optimizer": actor.optimizer.sharded_state_dict(msd)},
            str(path / ck.SHARDS))
    ck.write_state(path / ck.STATE, step=step, config_yaml="", rng=[ck.rng_state()],
                   scheduler=actor.lr_scheduler.state_dict(), controller=None)
    with h5py.File(path / ck.STATE, "a") as f:
        del f.attrs["optimizer_format"], f.attrs["optimizer_state"]
    return path


def _train(actor, first: int, n: int) -> tuple[list[float], dict]:
    losses = [actor.train_step(_batch(first + i), first + i)["loss"] for i in range(n)]
    return losses, {k: v.clone() for k, v in actor.hf_state_dict().items()}


@pytest.mark.parametrize("writer", ["current", "old"])
def test_plain_checkpoint_before_first_step(plain_factory, tmp_path, writer):
    """Before this fix the plain optimizer wrote param groups without Adam moments, a checkpoint
    that validated and then failed every load (KeyError '...exp_avg...'). Both such old
    checkpoints and the current ones (model only) resume exactly."""
    a = plain_factory()
    if writer == "current":
        path = train_ck.save(tmp_path, 0, model=a.model, optimizer=a.optimizer,
                             scheduler=a.lr_scheduler)
        assert ck.read_state(path / ck.STATE)["optimizer_state"] is False
    else:
        path = _save_old_format(tmp_path, 0, a)
    want_losses, want = _train(a, 0, 3)
    b = plain_factory()
    train_ck.load(path, model=b.model, optimizer=b.optimizer, scheduler=b.lr_scheduler)
    losses, got = _train(b, 0, 3)
    assert losses == want_losses
    assert _max_diff(got, want) == 0.0


def test_plain_old_format_checkpoint_with_state_loads_exactly(plain_factory, tmp_path):
    a = plain_factory()
    a.train_step(_batch(0), 0)
    path = _save_old_format(tmp_path, 1, a)
    assert ck.read_state(path / ck.STATE)["optimizer_format"] is None
    want_losses, want = _train(a, 1, 3)
    b = plain_factory()
    train_ck.load(path, model=b.model, optimizer=b.optimizer, scheduler=b.lr_scheduler)
    losses, got = _train(b, 1, 3)
    assert losses == want_losses
    assert _max_diff(got, want) == 0.0


def test_plain_checkpoint_into_distributed_optimizer_is_refused(plain_factory, tmp_path):
    a = plain_factory()
    a.train_step(_batch(0), 0)
    path = train_ck.save(tmp_path, 1, model=a.model, optimizer=a.optimizer)
    d = plain_factory(distributed=True)
    with pytest.raises(ck.CheckpointError, match="written by the plain optimizer"):
        train_ck.load(path, model=d.model, optimizer=d.optimizer)
