"""A real Megatron checkpoint whose pickles were replaced, its manifest resealed (sizes and
CRC-32s rewritten, as an attacker would: only the pickle check can catch it), never runs code:
resume passes it over with one line naming the file and takes the previous checkpoint, a direct
load or export refuses it before anything is loaded, with and without
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 in the environment; and under that variable the previous
checkpoint still loads, weights-only (storage/safe_pickle.py)."""
import os
import pickle
import shutil

import pytest
import torch

from areal_hpc.storage import checkpoint as ck
from areal_hpc.storage import manifest as mf
from areal_hpc.train import checkpoint as train_ck
from tests.storage.test_safe_pickle import NO_WO, Payload
from tests.train.test_checkpoint import _batch, _weights, actor_factory  # noqa: F401

pytestmark = pytest.mark.slow     # starts Megatron in a torch.distributed world of one


def _common_saved(shards, marker):         # common.pt as torch.save writes it, carrying code
    torch.save({"optimizer": Payload(marker)}, shards / "common.pt")


def _common_bare(shards, marker):          # common.pt replaced by a bare pickle
    (shards / "common.pt").write_bytes(pickle.dumps(Payload(marker)))


def _sharded_object(shards, marker):       # a sharded object's file (Megatron's common strategy)
    (shards / "optimizer.extra").mkdir()
    torch.save(Payload(marker), shards / "optimizer.extra" / "shard_0_1.pt")


def _no_metadata(shards, marker):
    (shards / ".metadata").unlink()


def _no_common(shards, marker):
    (shards / "common.pt").unlink()


def _other_backend(shards, marker):         # a loader nothing here has checked
    (shards / "metadata.json").write_text('{"sharded_backend": "zarr"}')


SPOIL = {"common.pt by torch.save": (_common_saved, "common.pt: its pickle names posix.system"),
         "common.pt a bare pickle": (_common_bare, "common.pt: not a torch.save archive; its "
                                                   "pickle names posix.system"),
         "a sharded-object .pt": (_sharded_object, "optimizer.extra/shard_0_1.pt: its pickle "
                                                   "names posix.system"),
         ".metadata deleted": (_no_metadata, "megatron/.metadata: missing"),
         "common.pt deleted": (_no_common, "megatron/common.pt: missing"),
         "metadata.json of another backend": (_other_backend, "megatron/metadata.json: "
                                                              "{'sharded_backend': 'zarr'}")}


@pytest.fixture(scope="module")
def pristine(actor_factory, tmp_path_factory):  # noqa: F811
    """A run with the real checkpoints of steps 1 and 2 (model and Adam state), and the
    weights saved at step 1."""
    run = tmp_path_factory.mktemp("pickles") / "run"
    a = actor_factory()
    a.train_step(_batch(0))
    train_ck.save(run, 1, model=a.model, optimizer=a.optimizer, scheduler=a.lr_scheduler)
    at_1 = _weights(a)
    a.train_step(_batch(1))
    train_ck.save(run, 2, model=a.model, optimizer=a.optimizer, scheduler=a.lr_scheduler)
    return run, a, at_1


def _spoiled(pristine, tmp_path, kind):
    run = tmp_path / "run"
    shutil.copytree(pristine[0], run)
    newest = ck.step_dir(run, 2)
    marker = tmp_path / "ran"
    SPOIL[kind][0](newest / ck.SHARDS, marker)
    ck.write_manifest(newest, 2)                    # resealed: sizes and CRC-32s match
    manifest = mf.validate_listing(newest)
    assert mf.verify_crc(newest, [(r, m["crc32"]) for r, m in manifest["files"].items()])[
        "error"] is None
    return run, newest, marker


@pytest.mark.parametrize("env", [None, "1"])
@pytest.mark.parametrize("kind", sorted(SPOIL))
def test_a_checkpoint_with_code_in_a_pickle_is_refused_before_any_load(pristine, tmp_path,
                                                                       monkeypatch, caplog,
                                                                       kind, env):
    if env:
        monkeypatch.setenv(NO_WO, env)
    run, newest, marker = _spoiled(pristine, tmp_path, kind)
    reason = SPOIL[kind][1]
    with caplog.at_level("WARNING", logger="areal_hpc.storage.checkpoint"):
        found = train_ck.find_resume(run)                   # resume's choice
    assert found is not None and found[0] == ck.step_dir(run, 1)
    skips = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skips) == 1 and reason in skips[0] and str(newest) in skips[0], skips
    assert "\n" not in skips[0]
    assert ck.find_latest(run, check_crc=False)[0] == ck.step_dir(run, 1)
    a = pristine[1]
    before = _weights(a)
    with pytest.raises(ck.CheckpointError, match=reason):
        train_ck.load(newest, model=a.model, optimizer=a.optimizer)
    with pytest.raises(ck.CheckpointError, match=reason):
        train_ck.load_model(newest, a.model)                # tools/export_hf.py's load
    with pytest.raises(ck.CheckpointError, match=reason):
        ck.validate(newest)                                 # tools/inspect_checkpoint.py's
    after = _weights(a)
    assert all(torch.equal(before[k], after[k]) for k in before)    # nothing loaded
    assert not marker.exists()


def test_the_attack_is_live_without_the_check_and_the_load_is_weights_only(pristine, tmp_path,
                                                                          monkeypatch):
    """Under the variable, Megatron's own load_common runs the replaced common.pt (what resume
    did before the check); the trainer's load runs it weights-only, so even bytes that were
    replaced after the check (here: the check skipped) run nothing."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    run, newest, marker = _spoiled(pristine, tmp_path, "common.pt by torch.save")
    monkeypatch.setenv(NO_WO, "1")
    monkeypatch.setattr(ck, "check_plain_data", lambda ckpt: None)     # as if checked earlier
    a = pristine[1]
    with pytest.raises(pickle.UnpicklingError):
        train_ck.load(newest, model=a.model, optimizer=a.optimizer)
    with pytest.raises(pickle.UnpicklingError):
        train_ck.load_model(newest, a.model)
    assert not marker.exists() and os.environ[NO_WO] == "1"
    with pytest.warns(UserWarning, match=NO_WO):
        TorchCommonLoadStrategy().load_common(newest / ck.SHARDS)
    assert marker.exists()


def test_under_the_variable_the_previous_checkpoint_still_loads(pristine, actor_factory,  # noqa: F811
                                                                tmp_path, monkeypatch):
    run, newest, marker = _spoiled(pristine, tmp_path, "common.pt by torch.save")
    monkeypatch.setenv(NO_WO, "1")
    path, _ = train_ck.find_resume(run)
    fresh = actor_factory()
    state = train_ck.load(path, model=fresh.model, optimizer=fresh.optimizer,
                          scheduler=fresh.lr_scheduler)
    assert state["step"] == 1
    got, want = _weights(fresh), pristine[2]
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not marker.exists()
