"""Checkpoints a preempted or killed job resumes from, with nothing lost and nothing trained twice.

Layout, one folder per training step, under `<run_dir>/checkpoints/`:

  step_00000012/
    megatron/       model + optimizer shards, Megatron dist-checkpointing (the model reshards on
                    load: a different TP x PP layout can load it; the distributed optimizer's
                    state reshards over DP only). Saved before the optimizer's first step (no
                    Adam state yet): the model only.
    state.h5        the run state: step and policy version, the optimizer layout (plain or
                    distributed) and whether its state was written, the LR scheduler, every
                    trainer rank's RNG states, the config, and the controller's state (data
                    cursor, staleness counters, the rollout-log rows of accepted-but-unconsumed
                    groups, the prompts in flight, how many rollout-log rows existed)
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
# How the optimizer shards are laid out (state.h5 attribute `optimizer_format`). PLAIN: Megatron's
# model-space optimizer state (per-parameter tensors). DISTRIBUTED: the distributed optimizer's
# "dp_reshardable" bucket-space state (reshards over DP only, not over TP x PP).
PLAIN = "plain"
DISTRIBUTED = "distributed/dp_reshardable"


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
                rng: list[bytes], controller: dict | None, optimizer_format: str = PLAIN,
                optimizer_state: bool = True) -> None:
    """state.h5: scalars as attributes, arrays as datasets (see the module docstring).
    `optimizer_format`: PLAIN or DISTRIBUTED (how the optimizer shards are laid out);
    `optimizer_state`: False when the optimizer had no state yet (saved before its first step:
    only the model shards were written)."""
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["step"] = step
        f.attrs["optimizer_format"] = optimizer_format
        f.attrs["optimizer_state"] = bool(optimizer_state)
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
    """What `write_state` wrote: step, config_yaml, scheduler, rng (list), controller (dict|None),
    optimizer_format and optimizer_state (None in checkpoints older than these attributes)."""
    with h5py.File(path, "r") as f:
        sched = f.attrs["scheduler_json"]
        opt_state = f.attrs.get("optimizer_state")
        opt_format = f.attrs.get("optimizer_format")
        out = {"step": int(f.attrs["step"]), "created": float(f.attrs["created"]),
               "optimizer_format": str(opt_format) if opt_format is not None else None,
               "optimizer_state": bool(opt_state) if opt_state is not None else None,
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


def _inner(optimizer) -> list:
    """The Megatron optimizers in `optimizer` (itself, or a ChainedOptimizer's)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _dist_optimizers(optimizer) -> list:
    """Megatron's DistributedOptimizer(s) in `optimizer`."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    return [o for o in _inner(optimizer) if isinstance(o, DistributedOptimizer)]


def _optimizer_format(optimizer) -> str:
    return DISTRIBUTED if _dist_optimizers(optimizer) else PLAIN


def _has_state(optimizer, comm=None) -> bool:
    """Whether the optimizer has per-parameter state (Adam moments): False before its first
    step. Agreed over the trainer ranks (every rank must write the same kind of shards)."""
    mine = any(len(o.optimizer.state) > 0 for o in _inner(optimizer))
    if comm is None or comm.Get_size() == 1:
        return mine
    flags = comm.gather(mine, root=0)
    n = comm.bcast(sum(flags) if comm.Get_rank() == 0 else None, root=0)
    if 0 < n < comm.Get_size():
        raise CheckpointError(f"{n} of {comm.Get_size()} trainer ranks have optimizer state, the "
                              "others none: cannot write a consistent checkpoint")
    return n > 0


# The distributed optimizer's state as "dp_reshardable" buckets, each rank's saved and loaded as
# they are (same TP x PP; DP may change). Its default, "fully_sharded_model_space", builds
# ShardedTensors with `flattened_range`, which megatron-core 0.16 rejects ("ShardedTensor.
# flattened_range is not supported"); "fully_reshardable" was reported to fail to load on CPU
# without Apex/TE (KeyError 'step').
_DISTOPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _sharded_state(model, optimizer, is_loading: bool = False, with_optimizer: bool = True) -> dict:
    msd = _module(model).sharded_state_dict()
    if not with_optimizer:
        return {"model": msd}
    dist_opts = _dist_optimizers(optimizer)
    if not dist_opts:
        return {"model": msd, "optimizer": optimizer.sharded_state_dict(msd, is_loading=is_loading)}
    if is_loading:
        # A fresh DistributedOptimizer has no state to load into (and its state_dict() asserts
        # one common step): Megatron's own initialisation, one Adam step on zero gradients. The
        # values it leaves are all overwritten by the load (`step`: _restore_distributed_steps).
        for o in dist_opts:
            if len(o.optimizer.state) == 0:
                o._init_optimizer_states_with_dummy_values()
    return {"model": msd, "optimizer": optimizer.sharded_state_dict(
        msd, is_loading=is_loading, metadata=dict(_DISTOPT_METADATA))}


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
    # Before the optimizer's first step it has no state: only the model is written (Megatron
    # would write a plain optimizer's param groups without any moments, which then fail every
    # load with KeyError '...exp_avg...', and the distributed optimizer's state_dict() asserts).
    with_opt = _has_state(optimizer, comm)
    with CudaToCpuMode(), preemption.shield_children():     # its writer processes
        dist_checkpointing.save(_sharded_state(model, optimizer, with_optimizer=with_opt),
                                str(ckpt / SHARDS))
    rngs = comm.gather(rng_state(), root=0) if comm is not None else [rng_state()]
    if rank == 0:
        write_state(ckpt / STATE, step=step, config_yaml=config_yaml,
                    scheduler=scheduler.state_dict() if scheduler is not None else None,
                    rng=rngs, controller=controller_state,
                    optimizer_format=_optimizer_format(optimizer), optimizer_state=with_opt)
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


def _checkpoint_has_optimizer_state(ckpt: Path, state: dict) -> bool:
    """Whether the shards hold optimizer state. Checkpoints older than the `optimizer_state`
    attribute: whether any optimizer tensor was written (a plain optimizer saved before its
    first step wrote param groups only)."""
    if state["optimizer_state"] is not None:
        return state["optimizer_state"]
    from megatron.core import dist_checkpointing
    keys = dist_checkpointing.load_tensors_metadata(str(ckpt / SHARDS)).keys()
    return any(k.startswith("optimizer.") for k in keys)


def load(ckpt: Path, *, model, optimizer, scheduler=None, comm=None) -> dict[str, Any]:
    """Load shards, optimizer, scheduler and this rank's RNG states (collective); returns the
    run state (`read_state`).

    A checkpoint written before the optimizer's first step loads the model only and leaves the
    optimizer without state (as it was when saved). The optimizer layout must match the run's
    (`train.distributed_optimizer`); a mismatch raises CheckpointError."""
    import torch
    from megatron.core import dist_checkpointing

    from ..train.cpu_compat import CudaToCpuMode
    rank = comm.Get_rank() if comm is not None else 0
    state = read_state(ckpt / STATE)
    saved_fmt = state["optimizer_format"] or PLAIN            # older checkpoints: plain only
    run_fmt = _optimizer_format(optimizer)
    with_opt = _checkpoint_has_optimizer_state(ckpt, state)
    if with_opt and saved_fmt != run_fmt:
        raise CheckpointError(
            f"{ckpt}: its optimizer state was written by the {saved_fmt} optimizer, this run "
            f"uses the {run_fmt} one (train.distributed_optimizer); resume with the setting it "
            f"was written with (or use tools/export_hf.py for the weights only)")
    with CudaToCpuMode():
        loaded = dist_checkpointing.load(
            _sharded_state(model, optimizer, is_loading=True, with_optimizer=with_opt),
            str(ckpt / SHARDS))
        _module(model).load_state_dict(loaded["model"])
        with torch.no_grad():
            if with_opt:
                optimizer.load_state_dict(loaded["optimizer"])
                _restore_distributed_steps(optimizer, loaded["optimizer"])
            else:
                _reset_optimizer(optimizer)
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if rank < len(state["rng"]):
        set_rng_state(state["rng"][rank])
    return state


def _restore_distributed_steps(optimizer, loaded: dict) -> None:
    """Give every parameter of a DistributedOptimizer its own, correct Adam `step` tensor.

    With torch's Adam/AdamW (no Apex/TE), the step lives per parameter (`state[p]["step"]`) and
    Megatron's load leaves it wrong in two ways (megatron-core 0.16.1, distrib_optimizer.py):
    - `load_state_dict` sets the checkpoint's step (saved in the param groups) as ONE tensor,
      `s["step"] = step`, in every parameter's state; torch keeps it uncopied (non-capturable
      step tensors are not cast), so each `step_t += 1` in Adam's per-parameter loop bumps the
      shared counter: after one step on N parameters it has advanced by N, and the bias
      corrections `1 - beta**step` of every parameter are wrong from the first resumed step.
    - `load_parameter_state_from_dp_reshardable` then copies every state entry, `step`
      included, from the dict `sharded_state_dict(is_loading=True)` built before the load; its
      `step` is not saved (a LocalNonpersistentObject), so the copy brings back the loading
      optimizer's own step (1 after `_init_optimizer_states_with_dummy_values`).
    The true step is the param groups' `step` of the loaded checkpoint."""
    import torch
    dist_opts = _dist_optimizers(optimizer)
    if not dist_opts:
        return
    inner = _inner(optimizer)
    if len(inner) == 1:
        per_opt = [loaded]
    else:
        per_opt = ([v for _, v in sorted(loaded.items())] if isinstance(loaded, dict)
                   else list(loaded))
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for o, sd in zip(inner, per_opt):
        if o not in dist_opts:
            continue
        steps = {g["step"] for g in sd["optimizer"]["param_groups"] if "step" in g}
        states = [st for st in o.optimizer.state.values() if "step" in st]
        if not states or not steps:
            continue                    # Apex/TE FusedAdam: the step is in the param groups
        if len(steps) != 1:
            raise CheckpointError(f"distributed optimizer checkpoint with several steps {steps}")
        step = float(steps.pop())
        for st in states:
            st["step"] = torch.tensor(step, dtype=dtype, device=st["step"].device)


def _reset_optimizer(optimizer) -> None:
    """The optimizer as before its first step, on the loaded weights: no per-parameter state,
    main (fp32) params copied from the model params."""
    for o in _inner(optimizer):
        o.optimizer.state.clear()
    optimizer.reload_model_params()


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
