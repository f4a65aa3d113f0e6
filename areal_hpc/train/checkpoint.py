"""The model and optimizer in a checkpoint: Megatron dist-checkpointing of the `megatron/` shards.

The shards reshard on load: a different TP x PP layout can load the model; the distributed
optimizer's state reshards over DP only. A checkpoint saved before the optimizer's first step (no
Adam state yet) holds the model only. Everything else about a checkpoint (its folder, state.h5,
the manifest and its checksums, validation, pruning) is areal_hpc/storage/checkpoint.py's.

`save` and `load` are collective over the trainer ranks (torch.distributed default group for the
shards, the MPI trainer communicator for small objects); `load_model` runs on one process.
`find_resume` (collective) finds the checkpoint to resume from, every trainer rank checking the
CRC-32s of the shard files it wrote itself.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from .. import preemption
from ..storage import checkpoint as store
from ..storage.checkpoint import DISTRIBUTED, PLAIN, SHARDS, STATE, CheckpointError
from ..transport import mpi as coll


# torch dist-checkpointing names the shard files `[prefix]__<rank>_<n>.distcp`, by the writer's
# torch.distributed rank: the trainer rank (the default group is over the trainer ranks).
_SHARD_FILE = re.compile(r"__(\d+)_\d+\.distcp$")


def shard_owner(rel: str) -> int | None:
    """The trainer rank that wrote the file `rel` (a path inside a checkpoint folder) of the
    `megatron/` shards, and reads most of it again on a resume with the same layout; None for
    any other file."""
    if not rel.startswith(SHARDS + "/"):
        return None
    m = _SHARD_FILE.search(rel.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def find_resume(run_dir: str | os.PathLike, comm=None, timeout_s: float | None = None,
                stats: dict | None = None) -> tuple[Path, dict] | None:
    """The newest valid checkpoint of `run_dir` and its manifest, or None, on every trainer rank
    (collective over `comm`, the MPI trainer communicator): `find_latest` of
    areal_hpc/storage/checkpoint.py with the CRC-32 checks split over the ranks, each rank taking
    the shard files it wrote (`shard_owner`) while that keeps the parts balanced by bytes, the
    other files by bytes. A file that fails its check rejects the checkpoint on every rank, and
    the next older one is tried. `timeout_s`, `stats`: see `find_latest`."""
    return store.find_latest(run_dir, comm=comm, owner=shard_owner, timeout_s=timeout_s,
                             stats=stats)


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
    flags = coll.gather(comm, mine, root=0, what="checkpoint: optimizer state on each rank")
    n = coll.bcast(comm, sum(flags) if comm.Get_rank() == 0 else None, root=0,
                   what="checkpoint: ranks with optimizer state")
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

    from .cpu_compat import CudaToCpuMode
    t0 = time.monotonic()
    ckpt = store.begin_save(run_dir, step, comm)
    # Before the optimizer's first step it has no state: only the model is written (Megatron
    # would write a plain optimizer's param groups without any moments, which then fail every
    # load with KeyError '...exp_avg...', and the distributed optimizer's state_dict() asserts).
    with_opt = _has_state(optimizer, comm)
    # Its writer processes (and the results Manager process Megatron starts at the first save
    # and keeps) must outlive USR1 and TERM: they write the checkpoint a preemption asks for.
    with CudaToCpuMode(), preemption.shield_children(term=True):
        dist_checkpointing.save(_sharded_state(model, optimizer, with_optimizer=with_opt),
                                str(ckpt / SHARDS))
    return store.finish_save(
        run_dir, step, scheduler=scheduler.state_dict() if scheduler is not None else None,
        controller_state=controller_state, config_yaml=config_yaml,
        optimizer_format=_optimizer_format(optimizer), optimizer_state=with_opt, keep=keep,
        started=t0, comm=comm)


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
    run state (`read_state` of areal_hpc/storage/checkpoint.py).

    A checkpoint written before the optimizer's first step loads the model only and leaves the
    optimizer without state (as it was when saved). The optimizer layout must match the run's
    (`train.distributed_optimizer`); a mismatch raises CheckpointError."""
    import torch
    from megatron.core import dist_checkpointing

    from .cpu_compat import CudaToCpuMode
    store.check_plain_data(ckpt)    # before Megatron unpickles anything of it
    state = store.read_state(ckpt / STATE)
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
    store.restore_rng(ckpt, state, comm)
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

    from .cpu_compat import CudaToCpuMode
    store.check_plain_data(ckpt)    # before Megatron unpickles anything of it
    with CudaToCpuMode():
        loaded = dist_checkpointing.load({"model": _module(model).sharded_state_dict()},
                                         str(ckpt / SHARDS))
        _module(model).load_state_dict(loaded["model"])
