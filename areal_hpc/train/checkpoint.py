"""The model and optimizer in a checkpoint: Megatron dist-checkpointing of the `megatron/` shards.

The shards reshard on load: a different TP x PP layout can load the model; the distributed
optimizer's state reshards over DP only. A checkpoint saved before the optimizer's first step (no
Adam state yet) holds the model only. Everything else about a checkpoint (its folder, state.h5,
the manifest and its checksums, validation, pruning) is areal_hpc/storage/checkpoint.py's.

`save` and `load` are collective over the trainer ranks (torch.distributed default group for the
shards, the MPI trainer communicator for small objects); `load_model` runs on one process.
`find_resume` (collective) finds the checkpoint to resume from, every trainer rank checking the
CRC-32s of the shard files it wrote itself.

`Checkpointer` writes a run's checkpoints, synchronously or with Megatron's asynchronous save
(`dist_checkpointing.save(..., async_sharded_save=True)`, scheduled on its `AsyncCallsQueue`):
the step stalls while the shards are planned and staged (copied to host memory on GPUs; on
CPU the writer is a fork of the rank, its pages a snapshot), a writer process writes them and
reads them back for their CRC-32s, and the checkpoint is sealed (Megatron's finalization, then
the manifest) at the first `poll` after the write ended on every rank. Until then the folder
has no manifest: resume never picks it, and a kill falls back to the previous checkpoint.
"""
from __future__ import annotations

import logging
import os
import queue
import re
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from .. import preemption
from ..storage import checkpoint as store
from ..storage.checkpoint import DISTRIBUTED, PLAIN, SHARDS, STATE, CheckpointError
from ..storage.safe_pickle import weights_only_loads
from ..transport import mpi as coll


log = logging.getLogger(__name__)

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
    """Write the checkpoint of `step` (collective over the trainer ranks); returns its folder
    (complete on return: a synchronous `Checkpointer.save`).

    Args:
        model: the Megatron DDP-wrapped model of this rank; optimizer: Megatron's optimizer;
        scheduler: Megatron's OptimizerParamScheduler (or None).
        controller_state: the controller's state (trainer rank 0 only; see Controller.state).
        keep: how many checkpoints to keep (older ones are deleted after this one is valid).
        comm: the MPI communicator of the trainer ranks (None: a single trainer rank).
    """
    return Checkpointer(run_dir, keep=keep, comm=comm).save(
        step, model=model, optimizer=optimizer, scheduler=scheduler,
        controller_state=controller_state, config_yaml=config_yaml)


@dataclass
class _Pending:
    """An asynchronous save in flight."""
    step: int
    folder: Path
    started: float              # time.monotonic() when the save began
    stall_s: float              # what it cost the trainer: planning, staging, state.h5


class Checkpointer:
    """The checkpoints of one run, written synchronously or asynchronously (the module
    docstring). Every method but `abandon` is collective over the trainer ranks: every rank calls
    it at the same point of the loop.

    At most one save is in flight: a save first completes the one before it (`wait`). A save of
    the step this Checkpointer completed last (a preemption's, right after a periodic one) must
    hold the same model and optimizer: it links that checkpoint's shards (no byte written) and
    writes only the new run state (`storage.checkpoint.link_shards`); the complete one is
    replaced only once the new one is sealed.

    Args:
        run_dir: the run's directory; keep: the checkpoints kept (older ones are deleted once
            a newer one is complete); comm: the MPI communicator of the trainer ranks (None: a
            single trainer rank).
        async_save: `save(wait=False)` writes asynchronously (checkpoint.async_save).
        max_host_bytes: the most bytes any rank may stage for an asynchronous save; a save
            above it on any rank is synchronous (0: no bound).
        space: storage/disk.py `SaveSpace`: each save first checks that the run directory has
            room for it (raising `disk.NoSpace` on every rank before any byte of it is written);
            None: no check.
    """

    def __init__(self, run_dir: str | os.PathLike, *, keep: int = 2, comm=None,
                 async_save: bool = False, max_host_bytes: int = 0, space=None):
        self.run_dir, self.keep, self.comm = Path(run_dir), keep, comm
        self.space = space
        self.async_save, self.max_host_bytes = async_save, max_host_bytes
        self.rank = comm.Get_rank() if comm is not None else 0
        self.seconds = 0.0      # the last complete save's time, as a synchronous one takes it
        self.staged_bytes = 0   # what this rank's last save staged (host memory when async)
        self._queue = None      # Megatron's AsyncCallsQueue, at the first asynchronous save
        self._pending: _Pending | None = None
        self._sealed: tuple[int, Path] | None = None     # (step, folder) completed last
        self._warned = False
        _results_queue(async_save)

    @property
    def pending(self) -> int | None:
        """The step of the save in flight, or None."""
        return self._pending.step if self._pending else None

    def save(self, step: int, *, model, optimizer, scheduler=None,
             controller_state: dict | None = None, config_yaml: str = "",
             wait: bool = True) -> Path | None:
        """Checkpoint `step`: its folder once complete (`wait`, or a synchronous save), None
        while an asynchronous one is in flight. The run state (state.h5: RNG states, scheduler,
        controller state) is of this moment either way. Arguments: see `save` (the function)."""
        from megatron.core import dist_checkpointing

        from .cpu_compat import CudaToCpuMode     # torch: not at this module's import
        self.wait()
        if self.space is not None:      # the one in flight sealed and pruned; nothing of this one yet
            self.space.check(step, relink=self._sealed is not None and self._sealed[0] == step,
                             comm=self.comm)
        t0 = time.monotonic()
        comm = self.comm
        # Before the optimizer's first step it has no state: only the model is written (Megatron
        # would write a plain optimizer's param groups without any moments, which then fail every
        # load with KeyError '...exp_avg...', and the distributed optimizer's state_dict() asserts).
        with_opt = _has_state(optimizer, comm)
        run_state = partial(store.write_run_state, step=step,
                            scheduler=scheduler.state_dict() if scheduler is not None else None,
                            controller_state=controller_state, config_yaml=config_yaml,
                            optimizer_format=_optimizer_format(optimizer),
                            optimizer_state=with_opt, comm=comm)
        linked = (store.link_shards(self.run_dir, step, comm)
                  if self._sealed is not None and self._sealed[0] == step else None)
        if linked is not None:
            folder, known = linked
            run_state(folder)
            return self._seal(step, folder, t0, known)
        folder = store.begin_save(self.run_dir, step, comm)
        # Megatron's writer processes (and the results Manager process it starts at the first
        # save and keeps) must outlive USR1 and TERM: they write the checkpoint a preemption
        # asks for, or finish an asynchronous one within a hard preemption's grace time.
        with CudaToCpuMode(), preemption.shield_children(term=True):
            request = dist_checkpointing.save(
                _sharded_state(model, optimizer, with_optimizer=with_opt), str(folder / SHARDS),
                async_sharded_save=True)
        run_state(folder)
        if request.async_fn is not None:
            request = request._replace(async_fn=partial(_write_then_sum, request.async_fn,
                                                        folder, self.rank))
        self.staged_bytes = staged_bytes(request)
        if not (self.async_save and not wait and self._may_stage(step)):
            with CudaToCpuMode(), preemption.shield_children(term=True):
                request.execute_sync()
            return self._seal(step, folder, t0)
        if self._queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
            self._queue = AsyncCallsQueue()
        with CudaToCpuMode(), preemption.shield_children(term=True):
            self._queue.schedule_async_request(request)
        self._pending = _Pending(step, folder, t0, time.monotonic() - t0)
        return None

    def poll(self) -> Path | None:
        """Seal the save in flight if its write has ended on every rank (never waits for it);
        returns its folder then, else None."""
        return self._finalize(blocking=False)

    def wait(self) -> Path | None:
        """Wait for the save in flight to be written and seal it; its folder, or None if none
        was in flight."""
        return self._finalize(blocking=True)

    def abandon(self) -> None:
        """Drop the save in flight without sealing it (this rank alone: an error path, or a
        test of a kill): its writer process is killed, its folder stays without a manifest (never
        a checkpoint) until a later save of that step or pruning removes it."""
        if self._pending is None:
            return
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        while self._queue.async_calls:
            call = self._queue.async_calls.popleft()
            process = getattr(call.async_caller, "process", None)
            call.async_caller.close(abort=True)
            if process is not None:
                process.join()
        results = filesystem_async._results_queue      # the write's results, if it got that far
        while results is not None and not results.empty():
            results.get_nowait()
        self._pending = None

    def _may_stage(self, step: int) -> bool:
        """Whether every rank's staged bytes are within `max_host_bytes` (collective); rank 0
        warns once when they are not."""
        sizes = (coll.gather(self.comm, self.staged_bytes, root=0,
                             what=f"checkpoint step {step}: staged bytes")
                 if self.comm is not None else [self.staged_bytes])
        ok = None
        if self.rank == 0:
            ok = not self.max_host_bytes or max(sizes) <= self.max_host_bytes
            if not ok and not self._warned:
                self._warned = True
                log.warning("checkpoint step %d: an asynchronous save would hold %.1f GiB of "
                            "host memory on a trainer rank, over checkpoint.async_max_host_gb="
                            "%.1f: saving synchronously", step, max(sizes) / 2**30,
                            self.max_host_bytes / 2**30)
        if self.comm is not None:
            ok = coll.bcast(self.comm, ok, root=0, what=f"checkpoint step {step}: async or not")
        return ok

    def _finalize(self, blocking: bool) -> Path | None:
        from .cpu_compat import CudaToCpuMode     # torch: not at this module's import
        pending = self._pending
        if pending is None:
            return None
        try:
            with CudaToCpuMode():
                done = self._queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException:
            self._pending = None        # Megatron's finalization failed on every rank
            raise
        if not done:
            return None
        self._pending = None
        return self._seal(pending.step, pending.folder, pending.started, stall_s=pending.stall_s)

    def _seal(self, step: int, folder: Path, t0: float, known: dict | None = None,
              stall_s: float | None = None) -> Path:
        """The manifest (with the CRC-32s this rank's writer read back), the swap with a
        complete checkpoint of the same step, pruning (`storage.checkpoint.seal`)."""
        sums, write_s = store.take_sums(folder, self.rank)
        t_seal = time.monotonic()
        ckpt = store.seal(self.run_dir, step, folder, keep=self.keep, started=t0,
                          comm=self.comm, known={**sums, **(known or {})})
        now = time.monotonic()
        # a synchronous save's time: what the mid-step decision expects a preemption's to take
        self.seconds = (now - t0 if stall_s is None
                        else stall_s + (write_s or 0.0) + now - t_seal)
        self._sealed = (step, ckpt)
        return ckpt


def _write_then_sum(write, folder: Path, rank: int, *args, **kwargs) -> None:
    """Megatron's write of this rank's shards (`write(*args)`: FileSystemWriterAsync's, args =
    [rank, write buckets, results queue]), then their CRC-32s read back for the manifest
    (`storage.checkpoint.write_sums`): in the writer process of an asynchronous save, beside
    the training, not at the seal."""
    t0 = time.monotonic()
    write(*args, **kwargs)
    store.write_sums(folder, rank, [Path(bucket[0]) for bucket in args[1]],
                     time.monotonic() - t0)


def staged_bytes(request) -> int:
    """The bytes this rank's save writes, which an asynchronous save holds in host memory until
    written: the tensors and byte items of its write buckets (FileSystemWriterAsync:
    `async_fn_args` = [rank, buckets, results queue], a bucket = (file, key, (byte items,
    tensor items))). On GPUs they are copied to host memory when the save is scheduled; on CPU
    the writer is a fork of the rank, whose pages the next step's updates copy (as many bytes
    at most)."""
    if request.async_fn is None:
        return 0
    total = 0
    for _, _, (byte_items, tensor_items) in request.async_fn_args[1]:
        for _, data in byte_items:
            with data.getbuffer() as view:
                total += view.nbytes
        total += sum(t.numel() * t.element_size() for _, t in tensor_items)
    return total


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

    from .cpu_compat import CudaToCpuMode     # torch: not at this module's import
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
    with CudaToCpuMode(), weights_only_loads():    # whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says
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

    from .cpu_compat import CudaToCpuMode     # torch: not at this module's import
    store.check_plain_data(ckpt)    # before Megatron unpickles anything of it
    with CudaToCpuMode(), weights_only_loads():
        loaded = dist_checkpointing.load({"model": _module(model).sharded_state_dict()},
                                         str(ckpt / SHARDS))
        _module(model).load_state_dict(loaded["model"])


_ASYNC_SAVER = False     # an asynchronous Checkpointer was made in this process


def _results_queue(async_save: bool) -> None:
    """Megatron's torch_dist writer hands every save's results back through one module-wide
    queue, which it makes at the first save with a multiprocessing Manager: a server process
    spawned from the trainer rank, a fresh interpreter (~3 s of CPU, and of the first save's
    time, on every rank at every attempt). When every save is synchronous, that queue is written
    and read by the saving process alone (its writer processes answer through a queue of their
    own), so an in-process queue serves. An asynchronous save's writer is a forked process: in a
    process with an asynchronous saver, Megatron's Manager queue is kept."""
    global _ASYNC_SAVER
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    _ASYNC_SAVER = _ASYNC_SAVER or async_save
    if _ASYNC_SAVER:
        if isinstance(filesystem_async._results_queue, queue.Queue):
            filesystem_async._results_queue = None
    elif filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
