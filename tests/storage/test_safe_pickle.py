"""A crafted checkpoint runs nothing when it is loaded (storage/safe_pickle.py): DCP's metadata
pickle and its stored non-tensor items are checked before Megatron unpickles them."""
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from areal_hpc.storage.safe_pickle import METADATA, UnsafeCheckpoint, check_dcp


class Payload:
    """Unpickling it runs a shell command (what a crafted checkpoint would carry)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _save(folder, **extra):
    dcp.save({"w": torch.arange(6.0).reshape(2, 3), **extra}, checkpoint_id=str(folder),
             no_dist=True)
    return folder


def test_plain_checkpoints_pass(tmp_path):
    folder = _save(tmp_path / "ok", meta={"step": 3, "name": "x"}, note=None)
    assert check_dcp(folder) == 3      # meta.step, meta.name, note (DCP flattens dicts): read, passed
    assert check_dcp(tmp_path / "no_such") == 0


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


def test_a_crafted_stored_item_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    folder = _save(tmp_path / "item", evil=Payload(marker))
    assert not marker.exists()                  # saving pickled it, nothing ran
    with pytest.raises(UnsafeCheckpoint, match="stored item evil is not plain data"):
        check_dcp(folder)
    assert not marker.exists()
