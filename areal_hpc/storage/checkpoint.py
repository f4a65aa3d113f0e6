"""The files of the checkpoints a preempted or killed job resumes from: folders, manifests with
CRC-32 checksums, the run state (state.h5), validation, finding the newest, pruning.

Layout, one folder per training step, under `<run_dir>/checkpoints/`:

  step_00000012/
    megatron/       model + optimizer shards, written and read by areal_hpc/train/checkpoint.py
                    (Megatron dist-checkpointing); this module only makes the folder and lists,
                    sizes and checksums its files.
    state.h5        the run state (run_state.py): step, the optimizer layout, the LR
                    scheduler, every trainer rank's RNG states, the config, and the
                    controller's state (`ControllerState`)
    manifest.json   written last, atomically (write, fsync, rename): every file with its size and
                    CRC-32. A folder without a valid manifest is not a checkpoint.

The rollout log is flushed before the checkpoint is written (`RolloutWriter` flushes per batch),
so every row the state refers to is on disk. Only the newest `keep` checkpoints are kept.

A save is `begin_save` (the empty folder), the shards, then `finish_save` (state.h5, manifest,
pruning), both collective over the trainer ranks (the MPI trainer communicator); a load reads
`read_state` and restores each rank's RNG states with `restore_rng`. `find_latest` runs on one
process, or collectively over the trainer ranks, which then split the CRC-32 checks of each
candidate's files by bytes (`split_files`). Nothing here knows a model or an optimizer.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import zlib
from pathlib import Path, PurePosixPath
from typing import Any, Callable


from ..transport import mpi as coll
from .run_dir import CHECKPOINTS
from .run_state import (DISTRIBUTED, FORMAT, PLAIN, CheckpointError, ControllerState,  # noqa: F401
                        _is_int, _no_constant, read_state, rng_state, set_rng_state, write_state)
from .safe_pickle import UnsafeCheckpoint, check_dcp

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE = "state.h5"
SHARDS = "megatron"
_PREFIX = "step_"


def step_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"{_PREFIX}{step:08d}"


def step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(_PREFIX) or not name[len(_PREFIX):].isdigit():
        return None
    return int(name[len(_PREFIX):])


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint folders (valid or not), newest step first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := step_of(p)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


# ---------------------------------------------------------------------------- checksums

def crc32_file(path: Path, chunk: int = 1 << 24) -> int:
    return _crc32_counted(path, chunk)[0]


def _crc32_counted(path: Path, chunk: int = 1 << 24) -> tuple[int, int]:
    """The CRC-32 of the file at `path` and how many bytes were read for it."""
    crc, n = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
            n += len(block)
    return crc, n


def _files(ckpt: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))


def _check_manifest(ckpt: Path, manifest) -> None:
    """CheckpointError unless `manifest` has the schema `write_manifest` writes: format, step (the
    folder's), created, files {relative path inside the folder: {size, crc32}}, bytes."""
    bad = lambda why: CheckpointError(f"{ckpt}: malformed {MANIFEST} ({why})")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt}: {MANIFEST} is not an areal_hpc checkpoint manifest")
    step = manifest.get("step")
    if not _is_int(step) or step < 0 or step != step_of(ckpt):
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
                or not _is_int(meta["size"]) or meta["size"] < 0 \
                or not _is_int(meta["crc32"]) or not 0 <= meta["crc32"] < 1 << 32:
            raise bad(f"{rel}: {meta!r} is not {{size, crc32}} as non-negative ints")
    total = manifest.get("bytes")
    if not _is_int(total) or total != sum(m["size"] for m in files.values()):
        raise bad(f"bytes {total!r} is not the sum of the file sizes")


def validate(ckpt: Path, check_crc: bool = True) -> dict:
    """The manifest of a complete checkpoint; CheckpointError naming what is wrong otherwise
    (no manifest, a manifest that is not JSON or not of the schema `write_manifest` writes, a file
    name that leads out of the folder, a file missing, of another size or CRC-32, a file on
    disk that the manifest does not list). One process reads every file for the CRC-32s;
    `find_latest` with a communicator splits them over the ranks."""
    manifest = _validate_listing(ckpt)
    if check_crc:
        bad = _verify_crc(ckpt, [(rel, meta["crc32"]) for rel, meta in manifest["files"].items()])
        if bad["error"] is not None:
            raise CheckpointError(bad["error"])
    check_plain_data(ckpt)
    return manifest


def _validate_listing(ckpt: Path) -> dict:
    """`validate` without the CRC-32s: the manifest, and every file it lists there with its size,
    nothing else (metadata only, no file is read but the manifest)."""
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST} (the save did not finish)")
    try:
        manifest = json.loads(mpath.read_text(), parse_constant=_no_constant)
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
        extra = sorted(set(_files(ckpt)) - set(manifest["files"]))
    except OSError as exc:
        raise CheckpointError(f"{ckpt}: unreadable ({exc})") from None
    if extra:
        raise CheckpointError(f"{ckpt}: {extra[0]} is not in the {MANIFEST} "
                              f"({len(extra)} unlisted file(s))")
    return manifest


def _verify_crc(ckpt: Path, files: list[tuple[str, int]]) -> dict:
    """Check the CRC-32 of `files` ([(relative path, expected CRC-32)], in the manifest's order),
    stopping at the first that fails. Returns {"error": the message naming it or None, "file": its
    path or None, "bytes": how many bytes were read, "files": how many files were checked}."""
    read = checked = 0
    for rel, want in files:
        try:
            crc, n = _crc32_counted(ckpt / rel)
        except OSError as exc:
            return {"error": f"{ckpt}: unreadable ({exc})", "file": rel, "bytes": read,
                    "files": checked}
        read, checked = read + n, checked + 1
        if crc != want:
            return {"error": f"{ckpt}: {rel} fails its CRC-32 check (corrupted)", "file": rel,
                    "bytes": read, "files": checked}
    return {"error": None, "file": None, "bytes": read, "files": checked}


def find_latest(run_dir: str | os.PathLike, check_crc: bool = True, comm=None, *,
                owner: Callable[[str], int | None] | None = None, timeout_s: float | None = None,
                stats: dict | None = None) -> tuple[Path, dict] | None:
    """The newest valid checkpoint and its manifest, or None. Every newer folder that is not
    valid (`validate`, and a state.h5 that `read_state` accepts, of the manifest's step) is
    reported (a warning naming it and why) and passed over; this never raises (but for a
    collective that times out: a rank hung or gone).

    Args:
        comm: None (or one rank): this process alone reads every file for the CRC-32s. The MPI
            communicator of the trainer ranks: collective, every rank calls it and gets the same
            answer. Rank 0 lists the folders and checks each candidate's manifest and file sizes;
            the CRC-32 checks of its files are split over the ranks (`split_files`), each rank
            reads its part, the verdicts meet on rank 0 (one bounded gather) and a checkpoint
            with a file that fails is passed over on every rank, the next older one tried.
        owner: see `split_files` (which rank reads a file itself when loading).
        timeout_s: the bound of each collective (None: transport.mpi's default); where a rank
            may still be reading its part, plus that part's bytes at CRC_FLOOR_BYTES_PER_S.
        stats: a dict, filled with what this rank did: "bytes" and "files" read for CRC-32s
            (over every candidate), "rejected" the messages of the folders passed over.
    """
    if stats is not None:
        stats.update(bytes=0, files=0, rejected=[])
    if comm is None or comm.Get_size() == 1:
        return _find_latest_here(run_dir, check_crc, stats)
    if comm.Get_rank() == 0:
        return _find_latest_root(run_dir, check_crc, comm, owner, timeout_s, stats)
    return _find_latest_other(comm, timeout_s, stats)


# The gather of the CRC-32 verdicts waits for the slowest rank's reads: its bound is the
# collective's plus the time to read the largest part at this rate (a slow shared file system).
CRC_FLOOR_BYTES_PER_S = 32 << 20
# `split_files` keeps the files with an owner on their owner unless that makes the largest part
# more than this many times the largest part of the split by bytes alone.
_OWNER_SLACK = 1.25


def split_files(sizes: dict[str, int], n: int,
                owner: Callable[[str], int | None] | None = None) -> list[list[str]]:
    """The files of a checkpoint ({relative path: size}) split over `n` ranks for their CRC-32
    checks: every file in exactly one part, the parts balanced by bytes, the same on every rank
    (it depends on the names and sizes only). Greedy: the largest file first (ties: by name)
    onto the least-loaded rank (ties: the lowest). `owner(rel)`, a rank or None: the files that
    rank reads itself on load (its own shard files) go to it, the others by bytes after them;
    unless that leaves the largest part over _OWNER_SLACK times the largest of the split by bytes
    alone, which is then used. Each part lists its files in the order of `sizes`."""
    if n < 1:
        raise ValueError(f"split over {n} ranks")

    def greedy(loads: list[int], parts: list[list[str]], rels) -> list[int]:
        for rel in sorted(rels, key=lambda r: (-sizes[r], r)):
            k = min(range(n), key=lambda i: (loads[i], i))
            parts[k].append(rel)
            loads[k] += sizes[rel]
        return loads

    chosen: list[list[str]] = [[] for _ in range(n)]
    by_bytes = greedy([0] * n, chosen, sizes)
    if owner is not None:
        parts: list[list[str]] = [[] for _ in range(n)]
        loads, rest = [0] * n, []
        for rel in sizes:
            k = owner(rel)
            if _is_int(k) and 0 <= k < n:
                parts[k].append(rel)
                loads[k] += sizes[rel]
            else:
                rest.append(rel)
        if max(greedy(loads, parts, rest)) <= _OWNER_SLACK * max(by_bytes):
            chosen = parts
    order = {rel: i for i, rel in enumerate(sizes)}
    return [sorted(part, key=order.__getitem__) for part in chosen]


def _folders(run_dir) -> list[Path]:
    try:
        return list_checkpoints(run_dir)
    except OSError as exc:
        log.warning("cannot list the checkpoints of %s: %s", run_dir, exc)
        return []


def _skip(ckpt: Path, exc: Exception, rejected: list[str]) -> None:
    """Report a checkpoint passed over (a warning) and note why in `rejected`."""
    why = str(exc) if isinstance(exc, CheckpointError) else f"{ckpt}: {type(exc).__name__}: {exc}"
    log.warning("skipping checkpoint: %s; trying the previous one", why)
    rejected.append(why)


def check_plain_data(ckpt: Path) -> None:
    """CheckpointError unless the shards' pickles hold plain data only (safe_pickle.py): called
    before anything of `ckpt` is unpickled, by every loader."""
    try:
        check_dcp(ckpt / SHARDS)
    except UnsafeCheckpoint as exc:
        raise CheckpointError(str(exc)) from None


def _check_state(ckpt: Path, manifest: dict) -> None:
    """The run state matches the manifest, and the shards' pickles are plain data
    (storage/safe_pickle.py: nothing in a crafted checkpoint runs when it is loaded)."""
    state = read_state(ckpt / STATE)
    if state["step"] != manifest["step"]:
        raise CheckpointError(f"{ckpt}: {STATE} is of step {state['step']}, the "
                              f"{MANIFEST} of step {manifest['step']}")
    check_plain_data(ckpt)


def _count(stats: dict | None, verdict: dict) -> None:
    if stats is not None:
        stats["bytes"] += verdict["bytes"]
        stats["files"] += verdict["files"]


def _verify_part(ckpt: Path, files: list[tuple[str, int]]) -> dict:
    """`_verify_crc`, never raising: a verdict for the gather."""
    try:
        return _verify_crc(ckpt, files)
    except Exception as exc:        # noqa: BLE001 -- the verdict of this rank, not a crash
        return {"error": f"{ckpt}: {type(exc).__name__}: {exc}", "file": None, "bytes": 0,
                "files": 0}


def _find_latest_here(run_dir, check_crc: bool, stats: dict | None):
    rejected = stats["rejected"] if stats is not None else []
    for ckpt in _folders(run_dir):
        try:
            manifest = _validate_listing(ckpt)
            if check_crc:
                verdict = _verify_crc(ckpt, [(rel, m["crc32"])
                                             for rel, m in manifest["files"].items()])
                _count(stats, verdict)
                if verdict["error"] is not None:
                    raise CheckpointError(verdict["error"])
            _check_state(ckpt, manifest)
            return ckpt, manifest
        except Exception as exc:        # noqa: BLE001 -- a bad checkpoint must not stop a resume
            _skip(ckpt, exc, rejected)
    return None


def _allowance(parts: list[list[tuple[str, int, int]]]) -> float:
    """Seconds for the largest part's reads at CRC_FLOOR_BYTES_PER_S."""
    return max(sum(size for _, _, size in part) for part in parts) / CRC_FLOOR_BYTES_PER_S


def _find_latest_root(run_dir, check_crc: bool, comm, owner, timeout_s, stats):
    """Rank 0 of the collective `find_latest`: one bcast per candidate (its folder and every
    rank's part), a gather of the verdicts, and a last bcast of the answer."""
    t = coll.DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    rejected: list[str] = []
    found = None
    for ckpt in _folders(run_dir):
        try:
            manifest = _validate_listing(ckpt)
        except Exception as exc:        # noqa: BLE001 -- a bad checkpoint must not stop a resume
            _skip(ckpt, exc, rejected)
            continue
        if check_crc:
            files = manifest["files"]
            parts = [[(rel, files[rel]["crc32"], files[rel]["size"]) for rel in part]
                     for part in split_files({r: m["size"] for r, m in files.items()},
                                             comm.Get_size(), owner)]
            coll.bcast(comm, {"ckpt": str(ckpt), "parts": parts}, root=0, timeout_s=t,
                       what=f"resume: the CRC-32 checks of {ckpt.name} (rank 0 hands them out)")
            mine = _verify_part(ckpt, [(rel, crc) for rel, crc, _ in parts[0]])
            _count(stats, mine)
            verdicts = coll.gather(comm, mine, root=0, timeout_s=t + _allowance(parts),
                                   what=f"resume: the CRC-32 verdicts on {ckpt.name}")
            order = {rel: i for i, rel in enumerate(files)}
            bad = [v for v in verdicts if v["error"] is not None]
            if bad:     # the first failing file in the manifest's order, as one process finds it
                first = min(bad, key=lambda v: order.get(v["file"], -1))
                _skip(ckpt, CheckpointError(first["error"]), rejected)
                continue
        try:
            _check_state(ckpt, manifest)
        except Exception as exc:        # noqa: BLE001 -- a bad checkpoint must not stop a resume
            _skip(ckpt, exc, rejected)
            continue
        found = (ckpt, manifest)
        break
    if stats is not None:
        stats["rejected"] = rejected
    coll.bcast(comm, {"found": (str(found[0]), found[1]) if found else None,
                      "rejected": rejected}, root=0, timeout_s=t,
               what="resume: the checkpoint found (rank 0 decides)")
    return found


def _find_latest_other(comm, timeout_s, stats):
    """A rank but 0 of the collective `find_latest`: check the parts rank 0 hands out until it
    sends the answer."""
    t = coll.DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    me, wait = comm.Get_rank(), t
    while True:
        # after a gather, rank 0 may still be reading its own part
        job = coll.bcast(comm, None, root=0, timeout_s=wait,
                         what="resume: the next checkpoint to check or the one found (from rank 0)")
        if "found" in job:
            break
        ckpt, parts = Path(job["ckpt"]), job["parts"]
        mine = _verify_part(ckpt, [(rel, crc) for rel, crc, _ in parts[me]])
        _count(stats, mine)
        if mine["error"] is not None:
            log.debug("trainer rank %d: %s", me, mine["error"])
        wait = t + _allowance(parts)
        coll.gather(comm, mine, root=0, timeout_s=wait,
                    what=f"resume: the CRC-32 verdicts on {ckpt.name}")
    if stats is not None:
        stats["rejected"] = list(job["rejected"])
    found = job["found"]
    return (Path(found[0]), found[1]) if found else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- writing one

def _rank(comm) -> int:
    return comm.Get_rank() if comm is not None else 0


def begin_save(run_dir: str | os.PathLike, step: int, comm=None) -> Path:
    """The folder of the checkpoint of `step`, empty but for its `megatron/` folder (where the
    shards go). A folder of the same step that a save did not finish is removed first.
    Collective over the trainer ranks: rank 0 makes it, every rank returns once it is there."""
    ckpt = step_dir(run_dir, step)
    if _rank(comm) == 0:
        if ckpt.exists():           # a save of the same step that did not finish
            shutil.rmtree(ckpt)
        (ckpt / SHARDS).mkdir(parents=True)
    _barrier(comm)
    return ckpt


def finish_save(run_dir: str | os.PathLike, step: int, *, scheduler: dict | None,
                controller_state: dict | None, config_yaml: str, optimizer_format: str,
                optimizer_state: bool, keep: int, started: float, comm=None) -> Path:
    """Complete the checkpoint of `step` once its shards are written (collective over the
    trainer ranks); returns its folder. Writes state.h5 (`write_state`, on rank 0, with every
    trainer rank's `rng_state()`), then the manifest (`write_manifest`), then keeps the newest
    `keep` checkpoints.

    Args:
        scheduler: the LR scheduler's state dict (or None); controller_state: the controller's
        state (trainer rank 0 only; see Controller.state); optimizer_format, optimizer_state:
        see `write_state`. started: `time.monotonic()` when the save began (for the log line).
        comm: the MPI communicator of the trainer ranks (None: a single trainer rank).
    """
    rank = _rank(comm)
    ckpt = step_dir(run_dir, step)
    rngs = (coll.gather(comm, rng_state(), root=0, what=f"checkpoint step {step}: RNG states")
            if comm is not None else [rng_state()])
    if rank == 0:
        write_state(ckpt / STATE, step=step, config_yaml=config_yaml, scheduler=scheduler,
                    rng=rngs, controller=controller_state,
                    optimizer_format=optimizer_format, optimizer_state=optimizer_state)
    _barrier(comm)
    manifest = write_manifest(ckpt, step, comm)
    if rank == 0:
        _prune(run_dir, keep)
        log.info("checkpoint step %d written in %.1fs (%.1f MB): %s", step,
                 time.monotonic() - started, manifest["bytes"] / 1e6, ckpt)
    _barrier(comm)
    return ckpt


def write_manifest(ckpt: Path, step: int, comm=None) -> dict | None:
    """manifest.json of every file in `ckpt` (written last, atomically: the checkpoint is
    complete from then on); returns it on rank 0, None on the others. Collective: the CRC-32s
    are split over the trainer ranks (a 32B checkpoint is hundreds of GB)."""
    rank = _rank(comm)
    files = _files(ckpt) if rank == 0 else None
    if comm is not None:
        files = coll.bcast(comm, files, root=0, what=f"checkpoint step {step}: the file list")
        size = comm.Get_size()
    else:
        size = 1
    mine = {rel: {"size": (ckpt / rel).stat().st_size, "crc32": crc32_file(ckpt / rel)}
            for rel in files[rank::size]}
    parts = (coll.gather(comm, mine, root=0, what=f"checkpoint step {step}: CRC-32 of the files")
             if comm is not None else [mine])
    if rank != 0:
        return None
    entries = {k: v for part in parts for k, v in sorted(part.items())}
    manifest = {"format": FORMAT, "step": step, "created": time.time(),
                "files": dict(sorted(entries.items())),
                "bytes": sum(v["size"] for v in entries.values())}
    _write_atomic(ckpt / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def _prune(run_dir, keep: int) -> None:
    """Keep the newest `keep` valid checkpoints (sizes checked); delete every other folder."""
    valid = 0
    for ckpt in list_checkpoints(run_dir):
        if valid < keep:
            try:
                validate(ckpt, check_crc=False)
                valid += 1
                continue
            except CheckpointError:
                pass
        shutil.rmtree(ckpt, ignore_errors=True)


def restore_rng(ckpt: Path, state: dict[str, Any], comm=None) -> None:
    """Restore this trainer rank's RNG states from `state` (`read_state` of `ckpt`). States an
    older version stored as a pickle are never decoded: a warning, and the states stay as
    they are."""
    rank = _rank(comm)
    if rank < len(state["rng"]):
        if state["rng"][rank] is None:
            log.warning("%s: the RNG states were saved by an older version as a Python pickle, "
                        "which is never unpickled (a checkpoint must not be able to run code): "
                        "resuming without restoring them (training continues correctly, but "
                        "not bit-identically to an uninterrupted run)", ckpt)
        else:
            set_rng_state(state["rng"][rank])


def _barrier(comm, what: str = "checkpoint: all trainer ranks") -> None:
    if comm is not None:
        coll.barrier(comm, what=what)
