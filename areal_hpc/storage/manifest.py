"""What a checkpoint folder is and whether one is complete: its names, its manifest (every file
with its size and CRC-32), the checks of a folder against its manifest, the CRC-32s a writer
records, and the atomic write. One process, no communicator: storage/checkpoint.py saves and
finds checkpoints (collectively over the trainer ranks) on top of this.

Layout, one folder per training step, under `<run_dir>/checkpoints/`:

  step_00000012/
    megatron/       model + optimizer shards, written and read by areal_hpc/train/checkpoint.py
                    (Megatron dist-checkpointing); storage/ only makes the folder and lists,
                    sizes and checksums its files.
    state.h5        the run state (run_state.py): step, the optimizer layout, the LR
                    scheduler, every trainer rank's RNG states, the config, and the
                    controller's state (`ControllerState`)
    manifest.json   written last, atomically (write, fsync, rename): every file with its size and
                    CRC-32. A folder without a valid manifest is not a checkpoint.
"""
from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path, PurePosixPath

from .run_dir import CHECKPOINTS
from .run_state import FORMAT, CheckpointError, is_int, no_constant, read_state
from .safe_pickle import UnsafeCheckpoint, check_checkpoint

MANIFEST = "manifest.json"
STATE = "state.h5"
SHARDS = "megatron"
STEP_PREFIX = "step_"
# A save of a step that already has a complete checkpoint is written into `step_N.next` and
# swapped in when sealed (the old one renamed `step_N.old`, then deleted); neither name is listed.
STAGED, REPLACED = ".next", ".old"
# The CRC-32s of the shard files a rank's writer wrote, read back by the writer itself (an
# asynchronous save's writer process), for the manifest: `<folder>/.sums.<rank>.tmp` (a .tmp file
# is never part of a checkpoint), taken at the seal.
SUMS = ".sums.{rank}.tmp"


def step_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"{STEP_PREFIX}{step:08d}"


def step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(STEP_PREFIX) or not name[len(STEP_PREFIX):].isdigit():
        return None
    return int(name[len(STEP_PREFIX):])


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint folders (valid or not), newest step first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := step_of(p)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


# ---------------------------------------------------------------------------- checksums

def crc32_file(path: Path, chunk: int = 1 << 24) -> int:
    return crc32_counted(path, chunk)[0]


def write_sums(folder: Path, rank: int, files: list[Path], seconds: float) -> None:
    """Record the size and CRC-32 of `files` (written by this rank, inside `folder`) and the
    seconds the write took, for `take_sums`. A file that cannot be read is left out: the seal
    reads it (and a failed write fails the save before that)."""
    sums = {}
    for path in files:
        try:
            crc, n = crc32_counted(Path(path))
        except OSError:
            continue
        sums[str(Path(path).relative_to(folder))] = {"size": n, "crc32": crc}
    (folder / SUMS.format(rank=rank)).write_text(json.dumps({"files": sums,
                                                               "seconds": seconds}))


def take_sums(folder: Path, rank: int) -> tuple[dict, float | None]:
    """({relative path: {size, crc32}}, the write's seconds) that `write_sums` recorded for
    `rank`, the record deleted; ({}, None) when there is none (nothing written by this rank)."""
    path = folder / SUMS.format(rank=rank)
    try:
        record = json.loads(path.read_text())
        path.unlink()
    except (OSError, ValueError):
        return {}, None
    return record["files"], record["seconds"]


def crc32_counted(path: Path, chunk: int = 1 << 24) -> tuple[int, int]:
    """The CRC-32 of the file at `path` and how many bytes were read for it."""
    crc, n = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
            n += len(block)
    return crc, n


def listed_files(ckpt: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))


def _check_manifest(ckpt: Path, manifest) -> None:
    """CheckpointError unless `manifest` has the schema `write_manifest` writes: format, step (the
    folder's), created, files {relative path inside the folder: {size, crc32}}, bytes."""
    bad = lambda why: CheckpointError(f"{ckpt}: malformed {MANIFEST} ({why})")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt}: {MANIFEST} is not an areal_hpc checkpoint manifest")
    step = manifest.get("step")
    if not is_int(step) or step < 0 or step != step_of(ckpt):
        raise bad(f"step {step!r}, the folder is step {step_of(ckpt)}")
    created = manifest.get("created")
    if not isinstance(created, (int, float)) or isinstance(created, bool) \
            or not math.isfinite(created):
        raise bad(f"created {created!r} is not a time")
    files = manifest.get("files")
    if not isinstance(files, dict) or STATE not in files:
        raise bad(f"files is not a table of files with {STATE} in it")
    root = ckpt.resolve()
    for rel, meta in files.items():
        pure = PurePosixPath(rel) if isinstance(rel, str) else None
        if pure is None or not rel or "\0" in rel or "\\" in rel or pure.is_absolute() \
                or str(pure) != rel or any(part in ("..", ".") for part in pure.parts) \
                or rel == MANIFEST:
            raise bad(f"file name {rel!r} is not a path inside the checkpoint folder")
        if not (ckpt / rel).resolve().is_relative_to(root):
            raise bad(f"{rel} leads out of the checkpoint folder")
        if not isinstance(meta, dict) or set(meta) != {"size", "crc32"} \
                or not is_int(meta["size"]) or meta["size"] < 0 \
                or not is_int(meta["crc32"]) or not 0 <= meta["crc32"] < 1 << 32:
            raise bad(f"{rel}: {meta!r} is not {{size, crc32}} as non-negative ints")
    total = manifest.get("bytes")
    if not is_int(total) or total != sum(m["size"] for m in files.values()):
        raise bad(f"bytes {total!r} is not the sum of the file sizes")


def validate(ckpt: Path, check_crc: bool = True) -> dict:
    """The manifest of a complete checkpoint; CheckpointError naming what is wrong otherwise
    (no manifest, a manifest that is not JSON or not of the schema `write_manifest` writes, a file
    name that leads out of the folder, a file missing, of another size or CRC-32, a file on
    disk that the manifest does not list). One process reads every file for the CRC-32s;
    `find_latest` with a communicator splits them over the ranks."""
    manifest = validate_listing(ckpt)
    if check_crc:
        bad = verify_crc(ckpt, [(rel, meta["crc32"]) for rel, meta in manifest["files"].items()])
        if bad["error"] is not None:
            raise CheckpointError(bad["error"])
    check_plain_data(ckpt)
    return manifest


def validate_listing(ckpt: Path) -> dict:
    """`validate` without the CRC-32s: the manifest, and every file it lists there with its size,
    nothing else (metadata only, no file is read but the manifest)."""
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST} (the save did not finish)")
    try:
        manifest = json.loads(mpath.read_text(), parse_constant=no_constant)
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{ckpt}: unreadable {MANIFEST} ({exc})") from None
    _check_manifest(ckpt, manifest)
    try:
        for rel, meta in manifest["files"].items():
            p = ckpt / rel
            if not p.is_file():
                raise CheckpointError(f"{ckpt}: {rel} is missing")
            size = p.stat().st_size
            if size != meta["size"]:
                raise CheckpointError(f"{ckpt}: {rel} has {size} bytes, the manifest says "
                                      f"{meta['size']}")
        extra = sorted(set(listed_files(ckpt)) - set(manifest["files"]))
    except OSError as exc:
        raise CheckpointError(f"{ckpt}: unreadable ({exc})") from None
    if extra:
        raise CheckpointError(f"{ckpt}: {extra[0]} is not in the {MANIFEST} "
                              f"({len(extra)} unlisted file(s))")
    return manifest


def verify_crc(ckpt: Path, files: list[tuple[str, int]]) -> dict:
    """Check the CRC-32 of `files` ([(relative path, expected CRC-32)], in the manifest's order),
    stopping at the first that fails. Returns {"error": the message naming it or None, "file": its
    path or None, "bytes": how many bytes were read, "files": how many files were checked}."""
    read = checked = 0
    for rel, want in files:
        try:
            crc, n = crc32_counted(ckpt / rel)
        except OSError as exc:
            return {"error": f"{ckpt}: unreadable ({exc})", "file": rel, "bytes": read,
                    "files": checked}
        read, checked = read + n, checked + 1
        if crc != want:
            return {"error": f"{ckpt}: {rel} fails its CRC-32 check (corrupted)", "file": rel,
                    "bytes": read, "files": checked}
    return {"error": None, "file": None, "bytes": read, "files": checked}



def check_plain_data(ckpt: Path) -> None:
    """CheckpointError unless every pickle of `ckpt` holds plain data only and the files every
    load reads are there (safe_pickle.py): before anything of it is unpickled, by every loader."""
    try:
        check_checkpoint(ckpt, SHARDS)
    except UnsafeCheckpoint as exc:
        raise CheckpointError(str(exc)) from None



def check_state(ckpt: Path, manifest: dict) -> None:
    """The run state matches the manifest, and the shards' pickles are plain data
    (storage/safe_pickle.py: nothing in a crafted checkpoint runs when it is loaded)."""
    state = read_state(ckpt / STATE)
    if state["step"] != manifest["step"]:
        raise CheckpointError(f"{ckpt}: {STATE} is of step {state['step']}, the "
                              f"{MANIFEST} of step {manifest['step']}")
    check_plain_data(ckpt)



def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a synced temporary file and a rename: a reader finds the
    old file or the whole new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make the renames in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

