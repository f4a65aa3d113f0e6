"""Asynchronous checkpoints (checkpoint.async_save: Megatron's asynchronous dist-checkpoint save
behind `Checkpointer`) on the real Megatron model + optimizer (gloo, one rank): what they write
loads bit for bit as a synchronous save of the same moment, though the next step trains while
they are written; a checkpoint is chosen by resume only once sealed (a writer killed with its
trainer, or a seal that never came, leaves the previous one); pruning keeps the complete one
while a newer one is in flight; a save of a step again keeps the complete one until the new one
is sealed; the host-memory bound turns a save synchronous."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from areal_hpc.storage import checkpoint as ck
from areal_hpc.train import checkpoint as train_ck
from tests.storage.test_safe_pickle import stand_in_shards
from tests.train.test_checkpoint import CONTROLLER, _batch, _weights, actor_factory  # noqa: F401

pytestmark = pytest.mark.slow     # starts MPI / torch.distributed worlds or processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def _save(saver, a, step, **kw):
    return saver.save(step, model=a.model, optimizer=a.optimizer, scheduler=a.lr_scheduler, **kw)


def _optimizer_state(actor) -> dict[str, torch.Tensor]:
    inner = actor.optimizer.optimizer
    return {f"{i}.{k}": v.clone() for i, st in enumerate(inner.state.values())
            for k, v in st.items() if torch.is_tensor(v)}


def _wait_for_file(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_async_save_loads_bit_for_bit_as_a_sync_one(actor_factory, tmp_path):  # noqa: F811
    a = actor_factory()
    a.train_step(_batch(0))
    weights, adam = _weights(a), _optimizer_state(a)
    torch.manual_seed(7)
    train_ck.save(tmp_path / "sync", 1, model=a.model, optimizer=a.optimizer,
                  scheduler=a.lr_scheduler, controller_state=CONTROLLER)
    saver = train_ck.Checkpointer(tmp_path / "async", async_save=True)
    torch.manual_seed(7)
    assert _save(saver, a, 1, controller_state=CONTROLLER, wait=False) is None
    expected_rand = torch.rand(3)       # the run state is of the save's moment, not the seal's
    assert saver.pending == 1 and saver.staged_bytes > 0
    assert ck.find_latest(tmp_path / "async") is None          # not sealed: not a checkpoint
    a.train_step(_batch(1))             # the next step changes the weights while they are written
    assert saver.wait() == ck.step_dir(tmp_path / "async", 1) and saver.pending is None
    assert ck.find_latest(tmp_path / "async")[1]["step"] == 1

    loaded = []
    for run in ("sync", "async"):
        b = actor_factory()
        path, _ = ck.find_latest(tmp_path / run)
        state = train_ck.load(path, model=b.model, optimizer=b.optimizer,
                              scheduler=b.lr_scheduler)
        assert torch.equal(torch.rand(3), expected_rand), run          # RNG of the save
        assert state["controller"].cursor_consumed == CONTROLLER.cursor_consumed
        loaded.append(b)
    for b in loaded:
        for k, v in _weights(b).items():
            assert torch.equal(v, weights[k]), k        # the weights when saved, bit for bit
        got = _optimizer_state(b)
        assert sorted(got) == sorted(adam)
        for k, v in adam.items():
            assert torch.equal(got[k], v), k
    stats = [b.train_step(_batch(2)) for b in loaded]
    assert stats[0]["loss"] == stats[1]["loss"]
    after = [_weights(b) for b in loaded]
    for k, v in after[0].items():
        assert torch.equal(v, after[1][k]), k
    # the shards themselves are the same bytes (Megatron's .metadata differs: its own ids)
    for f in (ck.step_dir(tmp_path / "sync", 1) / ck.SHARDS).glob("*.distcp"):
        other = ck.step_dir(tmp_path / "async", 1) / ck.SHARDS / f.name
        assert f.read_bytes() == other.read_bytes(), f.name


def test_an_async_save_never_sealed_is_passed_over(actor_factory, tmp_path, caplog):  # noqa: F811
    """The trainer dies after its writer wrote every shard but before the seal: no manifest, so
    resume takes the previous checkpoint; the next save of that step replaces the folder."""
    a = actor_factory()
    saver = train_ck.Checkpointer(tmp_path, async_save=True, keep=1)
    assert _save(saver, a, 1) == ck.step_dir(tmp_path, 1)                 # complete
    a.train_step(_batch(0))
    assert _save(saver, a, 2, wait=False) is None
    # while step 2 is in flight, keep=1 still keeps step 1: the only complete checkpoint
    assert ck.step_dir(tmp_path, 1).is_dir()
    _wait_for_file(ck.step_dir(tmp_path, 2) / ".sums.0.tmp")      # the write has ended
    saver.abandon()                                               # ...and no seal comes
    assert sorted((ck.step_dir(tmp_path, 2) / ck.SHARDS).glob("*.distcp"))
    with caplog.at_level("WARNING"):
        path, manifest = ck.find_latest(tmp_path)
    assert manifest["step"] == 1 and "step_00000002: no manifest.json" in caplog.text

    saver = train_ck.Checkpointer(tmp_path, async_save=True, keep=1)       # the rerun
    assert _save(saver, a, 2, wait=False) is None
    assert saver.wait() == ck.step_dir(tmp_path, 2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000002"]   # keep=1
    ck.validate(ck.step_dir(tmp_path, 2))


KILLED = """
import os, signal, sys
from pathlib import Path
from areal_hpc.config import TrainConfig
from areal_hpc.train import checkpoint as train_ck
from areal_hpc.train.actor import Actor
from areal_hpc.train.megatron_model import single_process
from tests.train.test_checkpoint import _batch

if __name__ == "__main__":
    single_process()
    a = Actor(TrainConfig(lr=1e-3, max_tokens_per_mb=64), sys.argv[1], group_size=2)
    saver = train_ck.Checkpointer(sys.argv[2], async_save=True)
    saver.save(1, model=a.model, optimizer=a.optimizer)
    a.train_step(_batch(0))
    saver.save(2, model=a.model, optimizer=a.optimizer, wait=False)
    print("scheduled", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)        # the trainer dies while its writer writes
"""


def test_a_trainer_killed_during_an_async_write_resumes_from_the_previous(actor_factory,  # noqa: F811
                                                                           tmp_path):
    """kill -9 of the trainer right after it scheduled an asynchronous save: its writer may
    still finish the shards, but no seal comes: resume takes the previous checkpoint."""
    a = actor_factory()
    script, out = tmp_path / "killed.py", tmp_path / "killed.out"
    script.write_text(textwrap.dedent(KILLED))
    # its own session: the processes it leaves (the writer, Megatron's results Manager, the
    # resource tracker: orphans holding its output open) are killed with the group afterwards
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, str(script), str(a.model_dir),
                                 str(tmp_path / "run")], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        assert proc.wait(timeout=600) == -signal.SIGKILL, out.read_text()[-3000:]
        assert "scheduled" in out.read_text()
        # the orphaned writer finishes on its own: let it, not to race the checks below
        _wait_for_file(ck.step_dir(tmp_path / "run", 2) / ".sums.0.tmp")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    path, manifest = ck.find_latest(tmp_path / "run")
    assert manifest["step"] == 1 and path == ck.step_dir(tmp_path / "run", 1)
    assert not (ck.step_dir(tmp_path / "run", 2) / ck.MANIFEST).exists()


def test_prune_keeps_the_complete_checkpoint_while_a_newer_one_is_in_flight(tmp_path):
    def complete(step):
        d = ck.begin_save(tmp_path, step)
        stand_in_shards(d / ck.SHARDS)      # what the pickle check requires (safe_pickle.py)
        (d / ck.SHARDS / "x.distcp").write_bytes(bytes([step]) * 100)
        ck.finish_save(tmp_path, step, scheduler=None, controller_state=None, config_yaml="",
                       optimizer_format=ck.PLAIN, optimizer_state=False, keep=5, started=0.0)

    complete(2)
    complete(4)
    in_flight = ck.begin_save(tmp_path, 6)
    (in_flight / ck.SHARDS / "x.distcp").write_bytes(b"half")
    ck._prune(tmp_path, keep=1, newest=4)          # the seal of step 4 with keep=1
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000006", "step_00000004"]
    assert ck.find_latest(tmp_path)[1]["step"] == 4


def test_a_second_save_of_a_step_keeps_the_complete_one_until_sealed(actor_factory,  # noqa: F811
                                                                     tmp_path, caplog):
    """A preemption's save right after a periodic one of the same step: the shards are linked,
    not written, the new run state replaces the old only once sealed; killed before its seal,
    the complete one stays (and the leftover goes with the next save)."""
    from dataclasses import replace

    a = actor_factory()
    a.train_step(_batch(0))
    saver = train_ck.Checkpointer(tmp_path)
    path = _save(saver, a, 1, controller_state=CONTROLLER)
    shards = {f.name: f.read_bytes() for f in (path / ck.SHARDS).iterdir()}
    inodes = {f.name: f.stat().st_ino for f in (path / ck.SHARDS).iterdir()}
    later = replace(CONTROLLER, cursor_consumed=20)

    # a save of step 1 again, killed before its seal: the staging folder is never listed
    staged = ck.begin_save(tmp_path, 1)
    assert staged.name == "step_00000001.next" and staged.parent == path.parent
    (staged / ck.STATE).write_bytes(b"half")
    assert ck.find_latest(tmp_path)[0] == path
    assert ck.read_state(path / ck.STATE)["controller"].cursor_consumed == 12

    with caplog.at_level("INFO"):
        assert _save(saver, a, 1, controller_state=later) == path
    assert "not linked" not in caplog.text
    assert not staged.exists() and not path.with_name(path.name + ".old").exists()
    got, manifest = ck.find_latest(tmp_path)
    assert got == path and manifest["step"] == 1
    ck.validate(path)
    assert ck.read_state(path / ck.STATE)["controller"].cursor_consumed == 20
    for f in (path / ck.SHARDS).iterdir():          # the same files: linked, nothing written
        assert f.read_bytes() == shards[f.name] and f.stat().st_ino == inodes[f.name], f.name
    b = actor_factory()
    train_ck.load(path, model=b.model, optimizer=b.optimizer, scheduler=b.lr_scheduler)
    for k, v in _weights(b).items():
        assert torch.equal(v, _weights(a)[k]), k


def test_over_the_host_bound_the_save_is_synchronous(actor_factory, tmp_path, caplog):  # noqa: F811
    a = actor_factory()
    saver = train_ck.Checkpointer(tmp_path, async_save=True, max_host_bytes=1024)
    with caplog.at_level("WARNING"):
        assert _save(saver, a, 1, wait=False) == ck.step_dir(tmp_path, 1)   # complete on return
    assert saver.pending is None and saver.staged_bytes > 1024
    assert "over checkpoint.async_max_host_gb" in caplog.text
    ck.validate(ck.step_dir(tmp_path, 1))
    # the staged bytes: the model's weights (no optimizer state before its first step), and
    # their small byte items; the shard files hold them with their framing
    weights = sum(p.numel() * p.element_size() for p in a.model.parameters())
    shards = sum(f.stat().st_size for f in (ck.step_dir(tmp_path, 1) / ck.SHARDS).glob("*.distcp"))
    assert weights <= saver.staged_bytes <= shards
    assert np.isfinite(saver.seconds) and saver.seconds > 0


def test_two_ranks_async_save_loads_bit_for_bit(run_distributed, tmp_path):
    """DP = 2 with the distributed optimizer (each rank its own optimizer shard): the writers
    of both ranks write while the next step trains, the seal is collective, and both
    checkpoints, the synchronous and the asynchronous one, load the state of the save's moment
    bit for bit on each rank."""
    import dataclasses
    import pickle

    from areal_hpc.config import TrainConfig
    from tests.train.test_checkpoint_distopt import _max_diff, _model_dir, _same_opt_state

    spec = {"model_dir": str(_model_dir(tmp_path / "qwen2")),
            "cfg": dataclasses.replace(TrainConfig(lr=1e-3, max_tokens_per_mb=64,
                                                   ppo_minibatches=2, weight_decay=0.01),
                                       distributed_optimizer=True),
            "actor": {"group_size": 2}, "batches": [_batch(0), _batch(1)]}
    (tmp_path / "in.pkl").write_bytes(pickle.dumps(spec))
    run_distributed(ROOT / "tests/train/async_ckpt_worker.py", 2, tmp_path, mpi=False,
                    timeout=600)
    for rank in range(2):
        out = pickle.loads((tmp_path / f"out.{rank}.pkl").read_bytes())
        assert out["returned"] is None and out["found_in_flight"] is None, rank
        assert out["sealed"] == out["found"] == str(ck.step_dir(tmp_path / "async", 1))
        assert out["own_shards"], rank          # its writer's files, their CRC-32s checked
        for run in ("sync", "async"):      # fp32 main weights and Adam moments, `step` too
            _same_opt_state(out[run]["opt"], out["at_save"]["opt"])
        # the model weights (right after a distributed optimizer's load they are not yet the
        # main weights: tests/train/test_checkpoint_distopt.py trains on for that)
        assert _max_diff(out["async"]["weights"], out["sync"]["weights"]) == 0.0, rank
