"""Saving and finding the checkpoints a preempted or killed job resumes from: the collective
saves over the trainer ranks (the run state, the manifest with its CRC-32s split over the ranks,
the swap of a replaced checkpoint, pruning) and the collective search for the newest valid one.
What a checkpoint folder is, its manifest and the one-process checks are in
storage/manifest.py; this module's callers find that module's names here too.

The rollout log is flushed before the checkpoint is written (`RolloutWriter` flushes per batch),
so every row the state refers to is on disk. Only the newest `keep` checkpoints are kept.

A save is `begin_save` (the empty folder), the shards, then `finish_save` (state.h5, manifest,
pruning), both collective over the trainer ranks (the MPI trainer communicator); an asynchronous
one writes state.h5 when it begins (`write_run_state`: the step's RNG states and controller
state, not the later ones) and `seal`s the folder once the shards are written on every rank. A
save of a step whose complete checkpoint exists is written beside it (`step_N.next`, which no
reader lists) and replaces it only when sealed: a kill meanwhile leaves the complete one. A
load reads `read_state` and restores each rank's RNG states with `restore_rng`. `find_latest`
runs on one process, or collectively over the trainer ranks, which then split the CRC-32 checks
of each candidate's files by bytes (`split_files`). Nothing here knows a model or an optimizer.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from ..transport import mpi as coll
from .manifest import (MANIFEST, REPLACED, SHARDS, STAGED, STATE, STEP_PREFIX,  # noqa: F401
                       check_plain_data, check_state, crc32_file, fsync_dir, list_checkpoints,
                       listed_files, step_dir, step_of, take_sums, validate, validate_listing,
                       verify_crc, write_atomic, write_sums)
from .run_dir import CHECKPOINTS
from .run_state import (DISTRIBUTED, FORMAT, PLAIN, CheckpointError, ControllerState,  # noqa: F401
                        is_int, read_state, rng_state, set_rng_state, write_state)

log = logging.getLogger(__name__)

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
            if is_int(k) and 0 <= k < n:
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


def _count(stats: dict | None, verdict: dict) -> None:
    if stats is not None:
        stats["bytes"] += verdict["bytes"]
        stats["files"] += verdict["files"]


def _verify_part(ckpt: Path, files: list[tuple[str, int]]) -> dict:
    """`verify_crc`, never raising: a verdict for the gather."""
    try:
        return verify_crc(ckpt, files)
    except Exception as exc:        # noqa: BLE001 -- the verdict of this rank, not a crash
        return {"error": f"{ckpt}: {type(exc).__name__}: {exc}", "file": None, "bytes": 0,
                "files": 0}


def _find_latest_here(run_dir, check_crc: bool, stats: dict | None):
    rejected = stats["rejected"] if stats is not None else []
    for ckpt in _folders(run_dir):
        try:
            manifest = validate_listing(ckpt)
            if check_crc:
                verdict = verify_crc(ckpt, [(rel, m["crc32"])
                                             for rel, m in manifest["files"].items()])
                _count(stats, verdict)
                if verdict["error"] is not None:
                    raise CheckpointError(verdict["error"])
            check_state(ckpt, manifest)
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
            manifest = validate_listing(ckpt)
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
            check_state(ckpt, manifest)
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


# ---------------------------------------------------------------------------- writing one

def _rank(comm) -> int:
    return comm.Get_rank() if comm is not None else 0


def begin_save(run_dir: str | os.PathLike, step: int, comm=None) -> Path:
    """The folder to write the checkpoint of `step` into, empty but for its `megatron/` folder
    (where the shards go): `step_dir`, or `step_N.next` beside a complete checkpoint of the same
    step (which stays until `seal` replaces it). A folder of the step that a save did not finish
    is removed first. Collective over the trainer ranks: rank 0 makes it, every rank returns it
    once it is there."""
    final = step_dir(run_dir, step)
    folder = None
    if _rank(comm) == 0:
        folder = final
        for leftover in (_sibling(final, STAGED), _sibling(final, REPLACED)):
            shutil.rmtree(leftover, ignore_errors=True)
        if final.exists():
            try:
                validate_listing(final)
                folder = _sibling(final, STAGED)    # complete: keep it until the new one is
            except CheckpointError:
                shutil.rmtree(final)                # a save of the same step that did not finish
        (folder / SHARDS).mkdir(parents=True)
    if comm is not None:
        folder = Path(coll.bcast(comm, str(folder) if folder else None, root=0,
                                 what=f"checkpoint step {step}: its folder"))
    return folder


def link_shards(run_dir: str | os.PathLike, step: int, comm=None) -> tuple[Path, dict] | None:
    """A new checkpoint of `step` begun beside its complete one (`begin_save`), with the old one's
    `megatron/` files as hard links (no byte copied: for a save of the same weights and optimizer
    with a new run state); returns (the folder, the manifest entries of the linked files, on rank
    0; {} elsewhere), or None where there is no complete checkpoint of `step` or the filesystem
    refuses hard links. Collective over the trainer ranks."""
    folder = begin_save(run_dir, step, comm)
    final = step_dir(run_dir, step)
    linked: dict | None = None
    if _rank(comm) == 0 and folder != final:
        try:
            files = validate_listing(final)["files"]
            linked = {rel: meta for rel, meta in files.items() if rel.startswith(SHARDS + "/")}
            for rel in linked:
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                os.link(final / rel, folder / rel)
        except (OSError, CheckpointError) as exc:
            log.info("checkpoint step %d: the shards of %s not linked (%s); writing them", step,
                     final, exc)
            linked = None
    ok = linked is not None
    if comm is not None:
        ok = coll.bcast(comm, ok, root=0, what=f"checkpoint step {step}: shards linked")
    return (folder, linked or {}) if ok else None     # else: begin_save again, writing them


def _sibling(ckpt: Path, suffix: str) -> Path:
    return ckpt.with_name(ckpt.name + suffix)


def finish_save(run_dir: str | os.PathLike, step: int, *, scheduler: dict | None,
                controller_state: dict | None, config_yaml: str, optimizer_format: str,
                optimizer_state: bool, keep: int, started: float, comm=None,
                folder: Path | None = None) -> Path:
    """Complete the checkpoint of `step` once its shards are written (collective over the
    trainer ranks); returns its folder: `write_run_state`, then `seal`.

    Args:
        scheduler: the LR scheduler's state dict (or None); controller_state: the controller's
        state (trainer rank 0 only; see Controller.state); optimizer_format, optimizer_state:
        see `write_state`. started: `time.monotonic()` when the save began (for the log line).
        comm: the MPI communicator of the trainer ranks (None: a single trainer rank).
        folder: what `begin_save` returned (default `step_dir`).
    """
    folder = step_dir(run_dir, step) if folder is None else folder
    write_run_state(folder, step, scheduler=scheduler, controller_state=controller_state,
                    config_yaml=config_yaml, optimizer_format=optimizer_format,
                    optimizer_state=optimizer_state, comm=comm)
    return seal(run_dir, step, folder, keep=keep, started=started, comm=comm)


def write_run_state(folder: Path, step: int, *, scheduler: dict | None,
                    controller_state: dict | None, config_yaml: str, optimizer_format: str,
                    optimizer_state: bool, comm=None) -> None:
    """state.h5 of `step` in `folder` (`write_state`, on rank 0, with every trainer rank's
    `rng_state()` as it is now); collective over the trainer ranks. Arguments: `finish_save`'s."""
    rngs = (coll.gather(comm, rng_state(), root=0, what=f"checkpoint step {step}: RNG states")
            if comm is not None else [rng_state()])
    if _rank(comm) == 0:
        write_state(folder / STATE, step=step, config_yaml=config_yaml, scheduler=scheduler,
                    rng=rngs, controller=controller_state,
                    optimizer_format=optimizer_format, optimizer_state=optimizer_state)
    _barrier(comm)


def seal(run_dir: str | os.PathLike, step: int, folder: Path, *, keep: int, started: float,
         comm=None, known: dict | None = None) -> Path:
    """Make `folder` (from `begin_save`, its shards and state.h5 written on every rank) the
    complete checkpoint of `step`: the manifest (`write_manifest`, `known`: see there), then,
    for a `step_N.next` folder, the swap with the complete checkpoint it replaces, then the
    newest `keep` checkpoints kept (`_prune`). Collective over the trainer ranks; returns the
    checkpoint's folder."""
    rank = _rank(comm)
    manifest = write_manifest(folder, step, comm, known)
    ckpt = step_dir(run_dir, step)
    if rank == 0:
        if folder != ckpt:
            _swap(ckpt, folder)
        _prune(run_dir, keep, newest=step)
        log.info("checkpoint step %d written in %.1fs (%.1f MB): %s", step,
                 time.monotonic() - started, manifest["bytes"] / 1e6, ckpt)
    _barrier(comm)
    return ckpt


def _swap(ckpt: Path, staged: Path) -> None:
    """`staged` (complete) in place of the complete checkpoint `ckpt`: two renames, then the old
    one deleted. A kill between the renames (microseconds) leaves neither listed: resume then
    takes the previous checkpoint."""
    old = _sibling(ckpt, REPLACED)
    shutil.rmtree(old, ignore_errors=True)
    if ckpt.exists():
        os.rename(ckpt, old)
    os.rename(staged, ckpt)
    fsync_dir(ckpt.parent)
    shutil.rmtree(old, ignore_errors=True)


def write_manifest(ckpt: Path, step: int, comm=None, known: dict | None = None) -> dict | None:
    """manifest.json of every file in `ckpt` (written last, atomically: the checkpoint is
    complete from then on); returns it on rank 0, None on the others. Collective: the CRC-32s
    are split over the trainer ranks (a 32B checkpoint is hundreds of GB). `known`: {relative
    path: {size, crc32}} this rank already has (its writer read back the files it wrote:
    `write_sums`; or the entries of linked files), each used while the file has that size;
    every other file is read here."""
    rank = _rank(comm)
    parts = (coll.gather(comm, known or {}, root=0, what=f"checkpoint step {step}: the known "
                         f"CRC-32s") if comm is not None else [known or {}])
    have, todo = {}, None
    if rank == 0:
        files = listed_files(ckpt)
        for part in parts:
            have.update({rel: m for rel, m in part.items() if rel in files})
        have = {rel: m for rel, m in have.items() if (ckpt / rel).stat().st_size == m["size"]}
        todo = [rel for rel in files if rel not in have]
    if comm is not None:
        todo = coll.bcast(comm, todo, root=0, what=f"checkpoint step {step}: the files to read")
        size = comm.Get_size()
    else:
        size = 1
    mine = {rel: {"size": (ckpt / rel).stat().st_size, "crc32": crc32_file(ckpt / rel)}
            for rel in todo[rank::size]}
    parts = (coll.gather(comm, mine, root=0, what=f"checkpoint step {step}: CRC-32 of the files")
             if comm is not None else [mine])
    if rank != 0:
        return None
    entries = dict(have)
    for part in parts:
        entries.update(part)
    manifest = {"format": FORMAT, "step": step, "created": time.time(),
                "files": dict(sorted(entries.items())),
                "bytes": sum(v["size"] for v in entries.values())}
    write_atomic(ckpt / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def _prune(run_dir, keep: int, newest: int | None = None) -> None:
    """Keep the newest `keep` valid checkpoints (sizes checked) up to step `newest` (default:
    all); delete every other folder up to it, and the `step_N.next` / `step_N.old` leftovers of a
    save killed before its seal. A folder of a later step is left alone: a save in flight, whose
    checkpoint is not complete yet, neither counts among the `keep` nor is deleted."""
    valid = 0
    for ckpt in list_checkpoints(run_dir):
        if newest is not None and step_of(ckpt) > newest:
            continue
        if valid < keep:
            try:
                validate(ckpt, check_crc=False)
                valid += 1
                continue
            except CheckpointError:
                pass
        shutil.rmtree(ckpt, ignore_errors=True)
    root = Path(run_dir) / CHECKPOINTS
    for suffix in (STAGED, REPLACED):
        for leftover in root.glob(f"{STEP_PREFIX}*{suffix}"):
            step = step_of(leftover.with_name(leftover.name[:-len(suffix)]))
            if step is not None and (newest is None or step <= newest):
                shutil.rmtree(leftover, ignore_errors=True)


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
