"""Checkpoints a preempted or killed job resumes from, with nothing lost and nothing trained twice.

Layout, one folder per training step, under `<run_dir>/checkpoints/`:

  step_00000012/
    megatron/       model + optimizer shards, Megatron dist-checkpointing (reshards on load: a
                    different TP x PP layout can load it)
    state.h5        the run state: step and policy version, the LR scheduler, every trainer rank's
                    RNG states, the config, and the controller's state (data cursor, staleness
                    counters, the rollout-log rows of accepted-but-unconsumed groups, the prompts
                    in flight, how many rollout-log rows existed)
    manifest.json   written last, atomically (write, fsync, rename): every file with its size and
                    CRC-32. A folder without a valid manifest is not a checkpoint.

The rollout log is flushed before the checkpoint is written (`RolloutWriter` flushes per batch),
so every row the state refers to is on disk. Only the newest `keep` checkpoints are kept.

`save` and `load` are collective over the trainer ranks (torch.distributed default group for the
shards, the MPI trainer communicator for small objects); `find_latest` runs on one rank.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .. import preemption

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
STATE = "state.h5"
SHARDS = "megatron"
FORMAT = "areal_hpc checkpoint"
_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be used; the message says which and why."""


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
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def _files(ckpt: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))


def validate(ckpt: Path, check_crc: bool = True) -> dict:
    """The manifest of a complete checkpoint; CheckpointError naming what is wrong otherwise."""
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST} (the save did not finish)")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{ckpt}: unreadable {MANIFEST} ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt}: {MANIFEST} is not an areal_hpc checkpoint manifest")
    for rel, meta in manifest["files"].items():
        p = ckpt / rel
        if not p.is_file():
            raise CheckpointError(f"{ckpt}: {rel} is missing")
        size = p.stat().st_size
        if size != meta["size"]:
            raise CheckpointError(f"{ckpt}: {rel} has {size} bytes, the manifest says {meta['size']}")
        if check_crc and crc32_file(p) != meta["crc32"]:
            raise CheckpointError(f"{ckpt}: {rel} fails its CRC-32 check (corrupted)")
    return manifest


def find_latest(run_dir: str | os.PathLike, check_crc: bool = True) -> tuple[Path, dict] | None:
    """The newest valid checkpoint and its manifest, or None. Every newer folder that is not
    valid is reported (a warning naming it and why) and passed over."""
    for ckpt in list_checkpoints(run_dir):
        try:
            return ckpt, validate(ckpt, check_crc)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s; trying the previous one", exc)
    return None


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


# ---------------------------------------------------------------------------- run state

def rng_state() -> bytes:
    """This process's RNG states (python, numpy, torch CPU and, where present, CUDA)."""
    import torch
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return pickle.dumps(state)


def set_rng_state(blob: bytes) -> None:
    import torch
    state = pickle.loads(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_state(path: Path, *, step: int, config_yaml: str, scheduler: dict | None,
                rng: list[bytes], controller: dict | None) -> None:
    """state.h5: scalars as attributes, arrays as datasets (see the module docstring)."""
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["step"] = step
        f.attrs["created"] = time.time()
        f.attrs["config_yaml"] = config_yaml
        f.attrs["scheduler_json"] = json.dumps(scheduler) if scheduler is not None else ""
        g = f.create_group("rng")
        for rank, blob in enumerate(rng):
            g.create_dataset(f"trainer_rank_{rank}", data=np.frombuffer(blob, dtype=np.uint8))
        if controller is not None:
            c = f.create_group("controller")
            for key, value in controller.items():
                if isinstance(value, np.ndarray):
                    c.create_dataset(key, data=value)
                else:
                    c.attrs[key] = value
        f.flush()
        os.fsync(f.id.get_vfd_handle())


def read_state(path: Path) -> dict[str, Any]:
    """What `write_state` wrote: step, config_yaml, scheduler, rng (list), controller (dict|None)."""
    with h5py.File(path, "r") as f:
        sched = f.attrs["scheduler_json"]
        out = {"step": int(f.attrs["step"]), "created": float(f.attrs["created"]),
               "config_yaml": str(f.attrs["config_yaml"]),
               "scheduler": json.loads(sched) if sched else None,
               "rng": [f["rng"][k][()].tobytes() for k in sorted(f["rng"], key=lambda k: int(k.rsplit("_", 1)[1]))],
               "controller": None}
        if "controller" in f:
            c = f["controller"]
            ctrl = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in c.attrs.items()}
            ctrl.update({k: c[k][()] for k in c})
            out["controller"] = ctrl
    return out


# ---------------------------------------------------------------------------- save / load

def _module(model):
    """The model under Megatron's DDP wrapper (whose own state-dict keys carry `module.`)."""
    return model.module if hasattr(model, "module") else model


def _sharded_state(model, optimizer, is_loading: bool = False) -> dict:
    msd = _module(model).sharded_state_dict()
    return {"model": msd, "optimizer": optimizer.sharded_state_dict(msd, is_loading=is_loading)}


def save(run_dir: str | os.PathLike, step: int, *, model, optimizer, scheduler=None,
         controller_state: dict | None = None, config_yaml: str = "", keep: int = 2,
         comm=None) -> Path:
    """Write the checkpoint of `step` (collective over the trainer ranks); returns its folder.

    Args:
        model: the Megatron DDP-wrapped model of this rank; optimizer: Megatron's optimizer;
        scheduler: Megatron's OptimizerParamScheduler (or None).
        controller_state: the controller's state (trainer rank 0 only; see Controller.state).
        keep: how many checkpoints to keep (older ones are deleted after this one is valid).
        comm: the MPI communicator of the trainer ranks (None: a single trainer rank).
    """
    from megatron.core import dist_checkpointing

    from ..train.cpu_compat import CudaToCpuMode
    rank = comm.Get_rank() if comm is not None else 0
    ckpt = step_dir(run_dir, step)
    t0 = time.monotonic()
    if rank == 0:
        if ckpt.exists():           # a save of the same step that did not finish
            shutil.rmtree(ckpt)
        (ckpt / SHARDS).mkdir(parents=True)
    _barrier(comm)
    with CudaToCpuMode(), preemption.shield_children():     # its writer processes
        dist_checkpointing.save(_sharded_state(model, optimizer), str(ckpt / SHARDS))
    rngs = comm.gather(rng_state(), root=0) if comm is not None else [rng_state()]
    if rank == 0:
        write_state(ckpt / STATE, step=step, config_yaml=config_yaml,
                    scheduler=scheduler.state_dict() if scheduler is not None else None,
                    rng=rngs, controller=controller_state)
    _barrier(comm)
    # CRC-32 of every file, split over the trainer ranks (a 32B checkpoint is hundreds of GB).
    files = _files(ckpt) if rank == 0 else None
    if comm is not None:
        files = comm.bcast(files, root=0)
        size = comm.Get_size()
    else:
        size = 1
    mine = {rel: {"size": (ckpt / rel).stat().st_size, "crc32": crc32_file(ckpt / rel)}
            for rel in files[rank::size]}
    parts = comm.gather(mine, root=0) if comm is not None else [mine]
    if rank == 0:
        entries = {k: v for part in parts for k, v in sorted(part.items())}
        manifest = {"format": FORMAT, "step": step, "created": time.time(),
                    "files": dict(sorted(entries.items())),
                    "bytes": sum(v["size"] for v in entries.values())}
        _write_atomic(ckpt / MANIFEST, json.dumps(manifest, indent=1))
        _prune(run_dir, keep)
        log.info("checkpoint step %d written in %.1fs (%.1f MB): %s", step,
                 time.monotonic() - t0, manifest["bytes"] / 1e6, ckpt)
    _barrier(comm)
    return ckpt


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


def load(ckpt: Path, *, model, optimizer, scheduler=None, comm=None) -> dict[str, Any]:
    """Load shards, optimizer, scheduler and this rank's RNG states (collective); returns the
    run state (`read_state`)."""
    import torch
    from megatron.core import dist_checkpointing

    from ..train.cpu_compat import CudaToCpuMode
    rank = comm.Get_rank() if comm is not None else 0
    state = read_state(ckpt / STATE)
    with CudaToCpuMode():
        loaded = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True),
                                         str(ckpt / SHARDS))
        _module(model).load_state_dict(loaded["model"])
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if rank < len(state["rng"]):
        set_rng_state(state["rng"][rank])
    return state


def load_model(ckpt: Path, model) -> None:
    """Load only the model shards (e.g. to export the policy); works for any TP x PP layout."""
    from megatron.core import dist_checkpointing

    from ..train.cpu_compat import CudaToCpuMode
    with CudaToCpuMode():
        loaded = dist_checkpointing.load({"model": _module(model).sharded_state_dict()},
                                         str(ckpt / SHARDS))
        _module(model).load_state_dict(loaded["model"])


def _barrier(comm) -> None:
    if comm is not None:
        comm.Barrier()
