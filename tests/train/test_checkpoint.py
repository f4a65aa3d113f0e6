"""Checkpoints on the real Megatron model + optimizer (gloo, one rank): exact resume, the run state,
the manifest's corruption checks, fallback to the previous checkpoint, pruning."""
import json
import multiprocessing

import numpy as np
import pytest
import torch

from areal_hpc.config import TrainConfig
from areal_hpc.storage import checkpoint as ck
from areal_hpc.storage.run_state import ControllerState
from areal_hpc.train import checkpoint as train_ck

pytestmark = pytest.mark.slow     # starts MPI / torch.distributed worlds or processes (tests/conftest.py)


@pytest.fixture(scope="module")
def actor_factory(tmp_path_factory):
    from areal_hpc.random_models import save_random_qwen2
    from areal_hpc.train.actor import Actor
    from areal_hpc.train.megatron_model import single_process

    single_process()
    path = tmp_path_factory.mktemp("qwen2")
    save_random_qwen2(path, vocab_size=64, hidden_size=32, intermediate_size=64,
                      max_position_embeddings=64)
    return lambda: Actor(TrainConfig(lr=1e-3, max_tokens_per_mb=64), str(path), group_size=2)


def _batch(seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(4):
        out = rng.integers(0, 64, 6).astype(np.int32)
        seqs.append({"prompt_tokens": rng.integers(0, 64, 4).astype(np.int32), "output_tokens": out,
                     "behav_logprobs": np.full(6, -4.0, np.float32), "reward": float(i % 2),
                     "versions": np.zeros(6, np.int32)})
    return seqs


def _weights(actor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in actor.hf_state_dict().items()}


CONTROLLER = ControllerState(
    version=1, cursor_consumed=12, accepted=6, rejected=1, dropped_stale=3, lost_stale=1,
    generated_tokens=960, rollout_rows=40, buffer_rows=np.arange(8, dtype=np.int64),
    buffer_group_ends=np.array([4, 8]), inflight_prompt_ids=np.array([10, 11]),
    inflight_dataset_index=np.array([3, 7]))


def test_resume_is_exact_and_state_round_trips(actor_factory, tmp_path):
    a = actor_factory()
    a.train_step(_batch(0))
    torch.manual_seed(123)
    children = set(multiprocessing.active_children())
    train_ck.save(tmp_path, 1, model=a.model, optimizer=a.optimizer, scheduler=a.lr_scheduler,
                  controller_state=CONTROLLER, config_yaml="name: t\n")
    # a synchronous save starts no process that outlives it (Megatron's results Manager: not)
    assert set(multiprocessing.active_children()) == children
    expected_rand = torch.rand(3)
    stats = a.train_step(_batch(1))
    after = _weights(a)

    b = actor_factory()                                 # fresh weights and optimizer
    found = ck.find_latest(tmp_path)
    assert found is not None and found[0] == ck.step_dir(tmp_path, 1)
    state = train_ck.load(found[0], model=b.model, optimizer=b.optimizer,
                          scheduler=b.lr_scheduler)
    assert torch.equal(torch.rand(3), expected_rand)    # RNG restored
    stats_b = b.train_step(_batch(1))
    assert stats_b["loss"] == stats["loss"]
    for k, v in _weights(b).items():
        assert torch.equal(v, after[k]), k              # bit-exact: Adam moments restored too

    assert state["step"] == 1 and state["config_yaml"] == "name: t\n"
    c = state["controller"]
    assert c.cursor_consumed == 12 and c.version == 1 and c.lost_stale == 1
    np.testing.assert_array_equal(c.inflight_dataset_index, [3, 7])
    np.testing.assert_array_equal(c.buffer_rows, np.arange(8))


def test_corrupt_newest_falls_back_with_message(actor_factory, tmp_path, caplog):
    a = actor_factory()
    for step in (2, 4, 6):
        train_ck.save(tmp_path, step, model=a.model, optimizer=a.optimizer, keep=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000006", "step_00000004"]
    newest = ck.step_dir(tmp_path, 6)
    shard = max((newest / ck.SHARDS).rglob("*.distcp"), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])            # truncated
    with caplog.at_level("WARNING"):
        path, manifest = ck.find_latest(tmp_path)
    assert path == ck.step_dir(tmp_path, 4) and manifest["step"] == 4
    assert "step_00000006" in caplog.text and "bytes, the manifest says" in caplog.text

    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    with pytest.raises(ck.CheckpointError, match="CRC-32"):
        ck.validate(newest)

    (ck.step_dir(tmp_path, 4) / ck.MANIFEST).unlink()     # an unfinished save
    with pytest.raises(ck.CheckpointError, match="did not finish"):
        ck.validate(ck.step_dir(tmp_path, 4))
    assert ck.find_latest(tmp_path) is None


def test_a_crafted_checkpoint_is_refused_and_runs_nothing(actor_factory, tmp_path, caplog):
    """A checkpoint whose Megatron metadata pickle runs a command, its manifest resealed (sizes
    and CRC-32s rewritten, as an attacker would): resume passes it over with the reason, a
    direct load refuses it, and the command never runs."""
    import json
    import os
    import pickle
    import zlib

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    a = actor_factory()
    for step in (1, 2):
        train_ck.save(tmp_path, step, model=a.model, optimizer=a.optimizer)
    newest = ck.step_dir(tmp_path, 2)
    meta = newest / ck.SHARDS / ".metadata"
    meta.write_bytes(pickle.dumps(Payload()))
    manifest = json.loads((newest / ck.MANIFEST).read_text())
    rel = str(meta.relative_to(newest))
    manifest["files"][rel] = {"size": meta.stat().st_size, "crc32": zlib.crc32(meta.read_bytes())}
    manifest["bytes"] = sum(f["size"] for f in manifest["files"].values())
    (newest / ck.MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level("WARNING"):
        path, _ = ck.find_latest(tmp_path)
    assert path == ck.step_dir(tmp_path, 1) and "its pickle names posix.system" in caplog.text
    with pytest.raises(ck.CheckpointError, match="its pickle names posix.system"):
        train_ck.load(newest, model=a.model, optimizer=a.optimizer)
    assert not (tmp_path / "ran").exists()


def test_manifest_lists_every_file(actor_factory, tmp_path):
    a = actor_factory()
    path = train_ck.save(tmp_path, 3, model=a.model, optimizer=a.optimizer)
    manifest = json.loads((path / ck.MANIFEST).read_text())
    on_disk = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()
                     and p.name != ck.MANIFEST)
    assert sorted(manifest["files"]) == on_disk and ck.STATE in on_disk
    assert manifest["bytes"] == sum(v["size"] for v in manifest["files"].values())


def test_export_hf_from_checkpoint_equals_trained_weights(actor_factory, tmp_path):
    """tools/export_hf.py (its own process) writes the checkpoint's policy as a HF directory."""
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from areal_hpc.config import load, to_yaml
    a = actor_factory()
    a.train_step(_batch(2))
    cfg = load(None, [f"model.path={a.model_dir}", "data.train_path=unused.jsonl",
                      "train.max_tokens_per_mb=64", "rollout.max_model_len=64", "rollout.max_new_tokens=32",
                      "rollout.group_size=2", "train.lr=1e-3"])
    train_ck.save(tmp_path / "run", 1, model=a.model, optimizer=a.optimizer,
                  config_yaml=to_yaml(cfg))
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "tools/export_hf.py", str(tmp_path / "run"), "--out",
                        str(tmp_path / "hf")], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    trained = a.hf_state_dict()
    assert sorted(exported) == sorted(trained)
    for k, v in trained.items():
        assert torch.equal(exported[k], v.cpu()), k
    assert (tmp_path / "hf" / "config.json").exists()

    # step 0, the initial policy, has no checkpoint: it comes from the run's config.yaml
    r = subprocess.run([sys.executable, "tools/export_hf.py", str(tmp_path / "run"), "--step", "0",
                        "--out", str(tmp_path / "hf0")], cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "no config.yaml" in r.stderr
    (tmp_path / "run" / "config.yaml").write_text(to_yaml(cfg))
    r = subprocess.run([sys.executable, "tools/export_hf.py", str(tmp_path / "run"), "--step", "0",
                        "--out", str(tmp_path / "hf0")], cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported step 0 of" in r.stdout
    initial = load_file(Path(a.model_dir) / "model.safetensors")
    exported0 = load_file(tmp_path / "hf0" / "model.safetensors")
    assert sorted(exported0) == sorted(trained)
    for k, v in exported0.items():
        assert torch.equal(v, initial[k].to(v.dtype)), k
    assert any(not torch.equal(v, exported[k]) for k, v in exported0.items())   # not the trained one
    r = subprocess.run([sys.executable, "tools/export_hf.py", str(tmp_path / "run"), "--step", "7",
                        "--out", str(tmp_path / "x")], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "step_00000007" in r.stderr and "did not finish" in r.stderr

    r = subprocess.run([sys.executable, "tools/export_hf.py", str(tmp_path / "nothing"), "--out",
                        str(tmp_path / "x")], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr
