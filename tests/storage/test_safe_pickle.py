"""A crafted checkpoint runs nothing when it is checked or loaded (storage/safe_pickle.py): DCP's
metadata pickle, its stored non-tensor items and every `.pt` file are checked before Megatron
unpickles them, with torch's weights-only unpickler invoked so that no environment variable turns
it off; `weights_only_loads` makes every torch.load inside it weights-only. The whole checkpoint
on real Megatron files: tests/storage/test_checkpoint_pickles.py."""
import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from areal_hpc.storage.safe_pickle import (COMMON, METADATA, REQUIRED, UnsafeCheckpoint,
                                           check_checkpoint, check_dcp, check_torch_pickle,
                                           weights_only_loads)

NO_WO = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


class Payload:
    """Unpickling it runs a shell command (what a crafted checkpoint would carry)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def stand_in_shards(folder: Path) -> Path:
    """The files a checkpoint's Megatron folder must hold to pass the check (safe_pickle.REQUIRED),
    for tests whose checkpoints are never loaded: DCP metadata of nothing, an empty common state
    (torch.save) and Megatron's backend description."""
    from torch.distributed.checkpoint.metadata import Metadata
    folder.mkdir(parents=True, exist_ok=True)
    (folder / METADATA).write_bytes(pickle.dumps(Metadata(state_dict_metadata={},
                                                          storage_data={})))
    torch.save({}, folder / COMMON)
    (folder / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}))
    return folder


def _save(folder, **extra):
    dcp.save({"w": torch.arange(6.0).reshape(2, 3), **extra}, checkpoint_id=str(folder),
             no_dist=True)
    return folder


def test_plain_checkpoints_pass(tmp_path):
    folder = _save(tmp_path / "ok", meta={"step": 3, "name": "x"}, note=None)
    assert check_dcp(folder) == 3      # meta.step, meta.name, note (DCP flattens dicts): read, passed
    with pytest.raises(UnsafeCheckpoint, match=r"no_such/\.metadata: missing"):
        check_dcp(tmp_path / "no_such")


def test_crafted_metadata_is_refused_unrun(tmp_path):
    folder = _save(tmp_path / "meta")
    marker = tmp_path / "ran"
    (folder / METADATA).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata: its pickle names posix\.system"):
        check_dcp(folder)
    (folder / METADATA).write_bytes(b"\x80\x05garbage")
    with pytest.raises(UnsafeCheckpoint, match="unreadable metadata"):
        check_dcp(folder)
    assert not marker.exists()


@pytest.mark.parametrize("env", [None, "1"])
def test_a_crafted_stored_item_is_refused_unrun(tmp_path, monkeypatch, env):
    if env:
        monkeypatch.setenv(NO_WO, env)
    marker = tmp_path / "ran"
    folder = _save(tmp_path / "item", evil=Payload(marker))
    assert not marker.exists()                  # saving pickled it, nothing ran
    with pytest.raises(UnsafeCheckpoint, match=r"stored item evil: its pickle names "
                                               r"posix\.system.*\(refused unread\)$"):
        check_dcp(folder)
    assert not marker.exists()


def test_the_payload_is_live_under_the_environment_variable(tmp_path, monkeypatch):
    """What the check is for: with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, a torch.load that passes
    no weights_only (as Megatron's load_common) runs the file's code."""
    marker = tmp_path / "ran"
    torch.save(Payload(marker), tmp_path / COMMON)
    monkeypatch.setenv(NO_WO, "1")
    with pytest.warns(UserWarning, match=NO_WO):
        torch.load(tmp_path / COMMON)
    assert marker.exists()


@pytest.mark.parametrize("env", [None, "1"])
def test_pt_files_with_code_are_refused_unrun_whatever_the_environment(tmp_path, monkeypatch,
                                                                        env):
    if env:
        monkeypatch.setenv(NO_WO, env)
    marker = tmp_path / "ran"
    good = tmp_path / "good.pt"
    torch.save({"step": torch.tensor(3.0), "groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}],
                "name": "x", "size": torch.Size([2]), "dtype": torch.bfloat16}, good)
    check_torch_pickle(good, good)
    check_torch_pickle(good.read_bytes(), "an item")
    zipped, raw = tmp_path / "zipped.pt", tmp_path / "raw.pt"
    torch.save({"optimizer": Payload(marker)}, zipped)      # a torch.save archive carrying it
    raw.write_bytes(pickle.dumps(Payload(marker)))          # a bare pickle named .pt
    for path in (zipped, raw):
        with pytest.raises(UnsafeCheckpoint) as info:
            check_torch_pickle(path, path)
        line = str(info.value)
        assert line.startswith(f"{path}: ") and "posix.system" in line and "\n" not in line
    polyglot = tmp_path / "polyglot.pt"     # a bare pickle first, a good archive after it
    polyglot.write_bytes(pickle.dumps(Payload(marker)) + good.read_bytes())
    with pytest.raises(UnsafeCheckpoint, match="polyglot.pt: not a torch.save archive; its "
                                               "pickle names posix.system"):
        check_torch_pickle(polyglot, polyglot)
    twice = tmp_path / "twice.pt"           # one name twice: each reader may take another
    bad, ok = io.BytesIO(), io.BytesIO()
    torch.save(Payload(marker), bad)
    torch.save({"w": torch.ones(1)}, ok)
    with zipfile.ZipFile(bad) as zb, zipfile.ZipFile(ok) as zo, \
            zipfile.ZipFile(twice, "w") as out, pytest.warns(UserWarning, match="Duplicate"):
        for entry in zo.infolist():
            out.writestr(entry, zo.read(entry))
            if entry.filename.endswith("data.pkl"):
                out.writestr(entry.filename, zb.read(entry.filename))
    with pytest.raises(UnsafeCheckpoint, match="twice.pt: its pickle names posix.system"):
        check_torch_pickle(twice, twice)
    (tmp_path / "junk.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(UnsafeCheckpoint, match="junk.pt: not a torch.save archive"):
        check_torch_pickle(tmp_path / "junk.pt", tmp_path / "junk.pt")
    torn = tmp_path / "torn.pt"
    torn.write_bytes(good.read_bytes()[:-200])
    with pytest.raises(UnsafeCheckpoint, match=r"torn.pt: "):
        check_torch_pickle(torn, torn)
    assert not marker.exists()


def test_only_torchs_own_globals_pass_whatever_a_library_registered(tmp_path):
    """megatron.core registers globals with torch's weights-only unpickler at import
    (argparse.Namespace among them); the check allows torch's own only, in every process."""
    import argparse

    import megatron.core  # noqa: F401 -- registers its safe globals

    path = tmp_path / "ns.pt"
    torch.save({"args": argparse.Namespace(lr=1.0)}, path)
    torch.load(path, weights_only=True)        # torch alone would take it after the import
    with pytest.raises(UnsafeCheckpoint, match=r"its pickle names argparse\.Namespace"):
        check_torch_pickle(path, path)


def test_a_checkpoint_needs_every_file_a_load_reads_and_every_pt_is_checked(tmp_path):
    marker = tmp_path / "ran"
    ckpt = tmp_path / "step"
    stand_in_shards(ckpt / "megatron")
    assert check_checkpoint(ckpt, "megatron") == 1                     # common.pt
    for name in REQUIRED:
        data = (ckpt / "megatron" / name).read_bytes()
        (ckpt / "megatron" / name).unlink()
        with pytest.raises(UnsafeCheckpoint, match=f"megatron/{name}: missing"):
            check_checkpoint(ckpt, "megatron")
        (ckpt / "megatron" / name).write_bytes(data)
    config = ckpt / "megatron" / "metadata.json"
    good = config.read_text()
    for bad, why in (('{"sharded_backend": "zarr"}', "another loader"),
                     ('{"sharded_backend": "torch_dist", "x": 1}', "another loader"),
                     ('{"sharded_backend": "torch_dist", "common_backend_version": "1"}',
                      "another loader"),
                     ("[1]", "another loader"), ("{", "unreadable"),
                     (" " * 70_000 + "{}", "unreadable")):
        config.write_text(bad)
        with pytest.raises(UnsafeCheckpoint, match=f"metadata.json: .*{why}"):
            check_checkpoint(ckpt, "megatron")
    config.write_text('{"sharded_backend": "torch_dist"}')        # versions: Megatron's default
    check_checkpoint(ckpt, "megatron")
    config.write_text(good)
    obj = ckpt / "megatron" / "optimizer.extra" / "shard_0_1.pt"      # a sharded object's file
    obj.parent.mkdir()
    torch.save({"k": 1}, obj)
    assert check_checkpoint(ckpt, "megatron") == 2
    torch.save(Payload(marker), obj)
    with pytest.raises(UnsafeCheckpoint, match=f"^{obj}: its pickle names posix.system"):
        check_checkpoint(ckpt, "megatron")
    obj.unlink()
    torch.save(Payload(marker), ckpt / "elsewhere.pt")                 # outside megatron/ too
    with pytest.raises(UnsafeCheckpoint, match="elsewhere.pt: its pickle names posix.system"):
        check_checkpoint(ckpt, "megatron")
    assert not marker.exists()


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_weights_only_loads_overrides_every_caller_and_restores_the_environment(
        tmp_path, monkeypatch, env):
    if env is None:
        monkeypatch.delenv(NO_WO, raising=False)
    else:
        monkeypatch.setenv(NO_WO, env)
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save(Payload(marker), path)
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    with weights_only_loads():
        for kwargs in ({}, {"weights_only": False}):    # Megatron's and DCP's load_bytes' calls
            with pytest.raises(pickle.UnpicklingError):
                torch.load(path, **kwargs)
        buf.seek(0)
        assert torch.equal(torch.load(buf, weights_only=False)["w"], torch.ones(2))
    assert os.environ.get(NO_WO) == env and "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2)}, good)
    if env == "1":                      # both variables set: torch refuses every load
        with pytest.raises(RuntimeError, match="Only one of"):
            torch.load(good, weights_only=True)
    check_torch_pickle(good, good)      # the check still reads it
    assert not marker.exists()
