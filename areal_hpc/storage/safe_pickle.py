"""The pickles inside a Megatron checkpoint, checked before anything unpickles them for real.

Megatron's dist-checkpointing saves through torch.distributed.checkpoint (DCP), which reads two
things with a plain unpickler: the folder's `.metadata` (`FileSystemReader.read_metadata`,
`pickle.load`) and every non-tensor item stored in the shard files (`DefaultLoadPlanner.
load_bytes`, `torch.load(weights_only=False)`). A crafted checkpoint can run code through either.
Its manifest's CRC-32s catch damage, not tampering. So before a checkpoint is loaded
(`storage.checkpoint`: resume, export, inspection) its `.metadata` is unpickled here by an
unpickler that resolves only the globals DCP's metadata is made of, and each stored non-tensor
item is read by torch's `weights_only` unpickler; either failing refuses the checkpoint with one
line naming the file and the global or item. Once both pass, the same bytes unpickled by DCP can
only rebuild those allowed objects.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

METADATA = ".metadata"
_DCP = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
        "torch.distributed.checkpoint.filesystem")
_ALLOWED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"), ("builtins", "set"), ("builtins", "frozenset"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),     # StorageMeta.checkpoint_id
}


class UnsafeCheckpoint(ValueError):
    """A pickle in a checkpoint names something the checker does not allow."""


def _allowed(module: str, name: str) -> bool:
    import torch

    if (module, name) in _ALLOWED:
        return True
    if module == "torch":                               # dtypes, layouts, memory formats
        return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                       torch.memory_format))
    if module in _DCP:                                  # DCP's metadata classes and enums
        obj = getattr(__import__(module, fromlist=[name]), name, None)
        return isinstance(obj, type) or name == "_MEM_FORMAT_ENCODING"
    return False


class _Restricted(pickle.Unpickler):
    def __init__(self, file, where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module, name):
        if not _allowed(module, name):
            raise UnsafeCheckpoint(f"{self.where}: its pickle names {module}.{name}, which a "
                                   "checkpoint's metadata never holds (refused unread)")
        return super().find_class(module, name)


def check_dcp(folder: Path) -> int:
    """Check `folder`'s DCP metadata and stored non-tensor items (see the module); returns how
    many items were checked. Raises UnsafeCheckpoint naming the file."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = folder / METADATA
    if not path.is_file():
        return 0
    try:
        with open(path, "rb") as f:
            meta = _Restricted(f, path).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:        # noqa: BLE001 -- truncated or not a pickle: one line
        raise UnsafeCheckpoint(f"{path}: unreadable metadata ({type(exc).__name__}: {exc})") from None
    items = getattr(meta, "state_dict_metadata", None)
    storage = getattr(meta, "storage_data", None)
    if not isinstance(items, dict) or not isinstance(storage, dict):
        raise UnsafeCheckpoint(f"{path}: not DCP metadata (no state_dict_metadata / storage_data)")
    checked = 0
    for index, info in storage.items():
        if not isinstance(items.get(getattr(index, "fqn", None)), BytesStorageMetadata):
            continue
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpoint(f"{path}: item {index.fqn} is stored transformed "
                                   f"({info.transform_descriptors}); not checked, refused")
        shard = (folder / str(info.relative_path)).resolve()
        if shard.parent != folder.resolve():
            raise UnsafeCheckpoint(f"{path}: item {index.fqn} points outside the folder")
        with open(shard, "rb") as f:
            f.seek(int(info.offset))
            data = f.read(int(info.length))
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:    # noqa: BLE001 -- UnpicklingError and anything else
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise UnsafeCheckpoint(f"{shard}: stored item {index.fqn} is not plain data "
                                   f"(torch's weights-only unpickler refused it: {first})") from None
        checked += 1
    return checked
