"""The pickles inside a checkpoint, checked before anything unpickles them for real.

A Megatron checkpoint (torch_dist backend) holds three kinds of pickle, each read by a loader
that can run code on a crafted file:
- DCP's `.metadata` (`FileSystemReader.read_metadata`: `pickle.load`);
- every non-tensor item stored in the shard files (`DefaultLoadPlanner.load_bytes`:
  `torch.load(weights_only=False)`);
- Megatron's `common.pt` and any sharded-object `.pt` file (`TorchCommonLoadStrategy`:
  `torch.load` with torch's default, which `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1` in the
  environment turns into a plain unpickler).
Its manifest's CRC-32s catch damage, not tampering. So before a checkpoint is loaded (resume,
export, inspection, the audit: `storage.checkpoint.check_plain_data`) `check_checkpoint` reads
each of them without executing code: `.metadata` by an unpickler that resolves only the globals
DCP's metadata is made of; every stored item and every `.pt` file anywhere in the checkpoint
must be a torch.save archive whose pickle names only torch's own weights-only globals (not the
ones a library added at import: the verdict is the same in every process) and that torch's
weights-only unpickler reads, called with `weights_only=True` (an explicit argument, which the
environment variable does not override). A checkpoint without the files every Megatron load
reads (`REQUIRED`), or whose metadata.json names another backend (another loader), is refused
too. Any failure raises UnsafeCheckpoint: one line naming the file (and the global or item);
`find_latest` then passes the checkpoint over. The tensor items of the shards are not read here:
DCP reads them with `torch.load(weights_only=True)` itself (torch's allowlist and what a library
added to it).

`weights_only_loads` closes the gap between the check and the load: inside it, every torch.load
is weights-only whatever its caller passes or the environment says, so bytes swapped after the
check still run nothing (the trainer's Megatron loads run inside it). DCP's `.metadata` is read
by a plain `pickle.load` that nothing can restrict: only the check protects it.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import zipfile
from contextlib import contextmanager
from pathlib import Path

METADATA = ".metadata"
COMMON = "common.pt"
CONFIG = "metadata.json"
# What every Megatron dist-checkpointing load reads: DCP's metadata, the common state, and the
# backend description (metadata.json); a folder without one of them cannot be loaded.
REQUIRED = (METADATA, COMMON, CONFIG)
# metadata.json as Megatron writes it for the backends checked here (its CheckpointingConfig):
# another backend would be loaded by another strategy, which nothing here has checked.
_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}
_CONFIG_MAX_BYTES = 1 << 16
_DCP = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
        "torch.distributed.checkpoint.filesystem")
_ALLOWED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"), ("builtins", "set"), ("builtins", "frozenset"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),     # StorageMeta.checkpoint_id
}
# torch.load reads both at every call (torch/serialization.py): FORCE makes every load
# weights-only, even one that passes weights_only=False; FORCE_NO makes a load that passes
# nothing a plain unpickler.
_FORCE, _FORCE_NO = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


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


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def _foreign_globals(file) -> list[str]:
    """The globals a pickle (a file object at its start) names that are not among torch's own
    weights-only globals, sorted; UnpicklingError (or EOFError) for what torch's scanner cannot
    parse."""
    from torch import _weights_only_unpickler as wo
    return sorted(wo.get_globals_in_pkl(file) - set(wo._get_allowed_globals()))


def _first_global(file) -> str | None:
    """The first global a bare pickle names (for the message only: the file is refused anyway),
    read by pickletools, which executes nothing; None when there is none or it is not a pickle."""
    strings: list[str] = []
    try:
        for op, arg, _ in pickletools.genops(file):
            if op.name == "GLOBAL":
                return str(arg).replace(" ", ".")
            if op.name == "STACK_GLOBAL" and len(strings) >= 2:
                return f"{strings[-2]}.{strings[-1]}"
            if isinstance(arg, str):
                strings.append(arg)
    except Exception:       # noqa: BLE001 -- not a pickle (or a torn one): nothing to name
        pass
    return None


def check_torch_pickle(src: Path | bytes, what: str | Path) -> None:
    """UnsafeCheckpoint (one line starting with `what`) unless `src`, a file or the bytes of a
    stored item, is a torch.save archive whose pickles name only torch's own weights-only globals
    and that torch's weights-only unpickler reads (`weights_only=True` passed: the environment
    cannot turn it off). Nothing in it is executed either way."""
    import torch

    def refuse(why: str):
        return UnsafeCheckpoint(f"{what}: {why} (refused unread)")

    def stream():
        return open(src, "rb") if isinstance(src, Path) else io.BytesIO(src)

    with stream() as f:
        zipped = f.read(4) == b"PK\x03\x04" and zipfile.is_zipfile(f)   # torch's own test, first
        if not zipped:
            f.seek(0)
            named = _first_global(f)
            raise refuse("not a torch.save archive" + (f"; its pickle names {named}" if named
                                                       else ""))
        try:
            with zipfile.ZipFile(f) as z:
                for entry in z.infolist():      # every entry, a repeated name's too
                    if entry.filename.endswith(".pkl"):
                        with z.open(entry) as pkl:
                            foreign = _foreign_globals(pkl)
                        if foreign:
                            more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
                            raise refuse(f"its pickle names {', '.join(foreign[:3])}{more}, "
                                         "which torch's weights-only globals do not include")
        except UnsafeCheckpoint:
            raise
        except Exception as exc:    # noqa: BLE001 -- a damaged archive or pickle: one line
            raise refuse(f"unreadable ({type(exc).__name__}: {_first_line(exc)})") from None
    try:
        with weights_only_loads():      # also when both variables are set (torch refuses that)
            torch.load(src if isinstance(src, Path) else io.BytesIO(src), map_location="cpu",
                       weights_only=True)
    except Exception as exc:        # noqa: BLE001 -- UnpicklingError and anything else
        raise refuse("not plain data (torch's weights-only unpickler refused it: "
                     f"{_first_line(exc)})") from None


def check_dcp(folder: Path) -> int:
    """Check `folder`'s DCP metadata (required) and stored non-tensor items (see the module);
    returns how many items were checked. Raises UnsafeCheckpoint naming the file."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = folder / METADATA
    if not path.is_file():
        raise UnsafeCheckpoint(f"{path}: missing (every load reads it; refused)")
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
        check_torch_pickle(data, f"{shard}: stored item {index.fqn}")
        checked += 1
    return checked


def check_checkpoint(ckpt: Path, shards: str) -> int:
    """Every pickle of the checkpoint folder `ckpt` checked (see the module): its Megatron folder
    `ckpt/shards` holds every file of `REQUIRED`, its DCP metadata and stored items pass
    `check_dcp`, and every `.pt` file anywhere in `ckpt` passes `check_torch_pickle`. Returns how
    many pickles were checked; UnsafeCheckpoint naming the file otherwise."""
    folder = ckpt / shards
    for name in REQUIRED:
        if not (folder / name).is_file():
            raise UnsafeCheckpoint(f"{folder / name}: missing (every Megatron load reads it; "
                                   "a checkpoint without it is refused)")
    _check_config(folder / CONFIG)
    checked = check_dcp(folder)
    for path in sorted(ckpt.rglob("*.pt")):
        if path.is_file():
            check_torch_pickle(path, path)
            checked += 1
    return checked


def _check_config(path: Path) -> None:
    """UnsafeCheckpoint unless `path` (metadata.json) names the backends Megatron writes and
    this module checks (`_CONFIG`; a missing version is Megatron's default, 1): a small JSON
    object, no other key, no other value."""
    try:
        with open(path, "rb") as f:
            text = f.read(_CONFIG_MAX_BYTES + 1)
        if len(text) > _CONFIG_MAX_BYTES:
            raise ValueError(f"over {_CONFIG_MAX_BYTES} bytes")
        config = json.loads(text)
    except (OSError, ValueError, RecursionError) as exc:
        raise UnsafeCheckpoint(f"{path}: unreadable ({_first_line(exc)})") from None
    ok = isinstance(config, dict) and "sharded_backend" in config and set(config) <= set(
        _CONFIG) and all(type(config.get(k, v)) is type(v) and config.get(k, v) == v
                         for k, v in _CONFIG.items())
    if not ok:
        raise UnsafeCheckpoint(f"{path}: {_first_line(Exception(repr(config)))[:120]} is not "
                               f"{json.dumps(_CONFIG)} (another loader, not checked: refused)")


@contextmanager
def weights_only_loads():
    """Every torch.load inside is weights-only, whatever its caller passes and whatever the
    environment said (TORCH_FORCE_WEIGHTS_ONLY_LOAD=1, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD unset;
    both as they were afterwards). For a load of a checkpoint that `check_checkpoint` passed:
    bytes replaced since then still run nothing. The environment is the process's: a torch.load
    on another thread meanwhile is weights-only too."""
    saved = {k: os.environ.get(k) for k in (_FORCE, _FORCE_NO)}
    os.environ[_FORCE] = "1"
    os.environ.pop(_FORCE_NO, None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
