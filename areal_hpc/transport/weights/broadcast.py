"""The broadcast transport: the weight group, and a stage sender's side of one update.

The receiver half lives inside vLLM's worker (`areal_hpc.rollout.vllm_ext`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..rendezvous import rendezvous_store
from .plan import Bucket, Plan, bucket_dtype, bucket_numel, dtype_from_str, spec_numel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WeightGroupAddress:
    """Where and how the weight group meets: every member joins with the same address and its
    own rank (`Topology.weight_group_address` builds it for a job).

    `join_timeout_s` bounds the wait for every member (generators join once their engine is up:
    minutes at 32B); `timeout_s` bounds every later collective (None: the backend's default;
    NCCL enforces it through its watchdog)."""
    host: str                   # the rendezvous (TCPStore) host: trainer rank 0's
    port: int
    world_size: int             # pp stage senders + every vLLM worker of every generator
    backend: str                # "nccl" or "gloo"
    timeout_s: float | None = None
    join_timeout_s: float | None = None
    # The group's generation: 0 at the job's start, one more each time the group is re-formed
    # (a member's engine was replaced, or a broadcast failed): every member joins the same one.
    generation: int = 0


def init_weight_group(address: WeightGroupAddress, rank: int) -> torch.distributed.ProcessGroup:
    """Join the weight group at `address` as `rank`; blocks until every member has joined.

    A stateless group (`stateless_group`: no torch.distributed global state), so it lives beside
    Megatron's and vLLM's groups. Trainer stage senders join here; vLLM workers through
    `WeightSyncExtension.init_weight_group`. For NCCL, set this process's CUDA device first;
    every member then makes the group's communicator here, with one broadcast of one element,
    under `unpinned_nccl_env` (batch invariance's NCCL pins left out, see there).
    """
    from torch.distributed import PrefixStore

    a, world_size, backend = address, address.world_size, address.backend
    default = torch.distributed.distributed_c10d._get_default_timeout(backend)
    timeout = default if a.timeout_s is None else timedelta(seconds=a.timeout_s)
    join = timeout if a.join_timeout_s is None else timedelta(seconds=a.join_timeout_s)
    store = _store(a, rank, join)
    # Each generation meets under its own prefix in the one store: a re-formed group's keys
    # never meet the failed one's.
    name = "areal_weights" if a.generation == 0 else f"areal_weights.g{a.generation}"
    if a.generation > 0:
        _arrive(store, name, world_size, join)
    store.set_timeout(timeout)
    prefix = PrefixStore(name, store)
    if backend == "gloo":
        return stateless_group(prefix, rank, world_size, timeout, "gloo")
    # NCCL's watchdog gets WATCHDOG_GRACE_S beyond the host's deadline (`finish`), which acts
    # first: it aborts the group and raises, and the update is sent again over a re-formed one.
    with unpinned_nccl_env(), nccl_errors_raised():
        return _join_nccl(prefix, rank, world_size, timeout + timedelta(seconds=WATCHDOG_GRACE_S),
                          join.total_seconds())


# The weight group's store on rank 0, kept for the groups of later generations (rank 0 serves it
# from the job's start to its end; a re-formed group meets in it again).
_MASTER_STORES: dict[tuple[str, int], object] = {}


def _store(a: WeightGroupAddress, rank: int, join):
    """The rendezvous store: at generation 0 every member joins it together (rank 0 serves it);
    a later generation's members connect to the store rank 0 still serves (a restarted engine's
    workers as well as the members that were up)."""
    key = (a.host, a.port)
    if rank == 0 and key in _MASTER_STORES:
        return _MASTER_STORES[key]
    if a.generation == 0 or rank == 0:
        store = rendezvous_store(a.host, a.port, a.world_size, rank == 0, join)
        if rank == 0:
            _MASTER_STORES[key] = store
        return store
    from torch.distributed import TCPStore
    return TCPStore(a.host, a.port, is_master=False, timeout=join, wait_for_workers=False)


def _arrive(store, name: str, world_size: int, join) -> None:
    """Wait, at most `join`, until every member of a re-formed group has reached its store (a
    generation's start-up barrier: the store's own wait for workers serves generation 0 only).
    The group's rendezvous that follows is then bounded by the collective timeout, as at 0."""
    store.set_timeout(join)
    if store.add(f"{name}/arrived", 1) == world_size:
        store.set(f"{name}/all", "1")
    store.wait([f"{name}/all"])


def close_weight_group(group) -> None:
    """Tear down a weight group before its next generation is formed: NCCL's communicator
    aborted (a collective stuck on a dead member is given up), gloo's pairs closed. Never
    raises: the group is being given up because something already failed."""
    if group is None:
        return
    for name in ("abort", "shutdown"):
        fn = getattr(group, name, None)
        if fn is not None:
            with contextlib.suppress(Exception):
                fn()
            return


def _join_nccl(prefix, rank: int, world_size: int, timeout,
               join_s: float) -> torch.distributed.ProcessGroup:
    """The NCCL weight group, its communicator made now: torch makes a group's communicator at
    its first collective, and NCCL reads its environment then, so the first update would
    otherwise make it outside `unpinned_nccl_env`. One element broadcast from rank 0 does it,
    waited for on the host within the join's bound."""
    group = stateless_group(prefix, rank, world_size, timeout, "nccl")
    work = group.broadcast(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())),
                           root=0)
    finish(work, join_s, group, "joining the NCCL weight group (its first broadcast)",
           "weights.join_timeout_s")
    return group


def stateless_group(store, rank: int, world_size: int, timeout, backend: str):
    """A process group over `store` that touches no torch.distributed global state (no default
    group, no group registry), so it lives beside Megatron's and vLLM's: torch's ProcessGroup
    with one backend registered for its device, as vLLM makes its own stateless groups. torch
    alone: a trainer rank, or a machine without vLLM (tools/gpu_faults.py), can make it."""
    from torch.distributed import ProcessGroup

    pg = ProcessGroup(store, rank, world_size)
    if backend == "gloo":
        from torch.distributed.distributed_c10d import ProcessGroupGloo
        impl = ProcessGroupGloo(store, rank, world_size, timeout=timeout)
        kind, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
    else:
        from torch.distributed.distributed_c10d import ProcessGroupNCCL
        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        impl = ProcessGroupNCCL(store, rank, world_size, options)
        kind, device = ProcessGroup.BackendType.NCCL, torch.device("cuda")
    pg._set_default_backend(kind)
    impl._set_sequence_number_for_group()
    pg._register_backend(device, kind, impl)
    return pg


# What NCCL's watchdog gives a weight-group collective beyond weights.timeout_s, the host's own
# deadline (`finish`): the host gives up first, aborts the communicator and raises, which the
# update's sender and receivers handle; the watchdog is the backstop for a host that cannot.
WATCHDOG_GRACE_S = 60.0
# The longest pause between two looks at a collective in flight (`finish`): small beside a
# bucket's time on the wire (a 1 GiB bucket takes ~20 ms over NVLink, ~40 ms at 25 GB/s).
POLL_S = 0.002


class WireTimeout(TimeoutError):
    """A weight-group collective not complete on the host within its bound: a member is gone
    or stuck. The group has been aborted when this is raised; it is not used again."""


def finish(work, timeout_s: float | None, group, what: str, key: str = "weights.timeout_s") -> None:
    """Wait on the host until `work` (a collective of `group`) completes, at most `timeout_s`
    (None: the backend's own wait), then raise what it failed with, if it did.

    On NCCL `Work.wait()` neither blocks the host nor raises: it orders the current stream
    after the collective, and a broadcast that waits on a dead peer then holds the device until
    the watchdog ends the process. So completion is polled (`is_completed`, an event query)
    against a deadline; when it passes, the group is aborted (its kernels waiting on the dead
    peer return) and `WireTimeout` is raised. On gloo the same loop runs: gloo's work completes
    with its error on its own thread, and `wait()` raises it."""
    if timeout_s is None:
        work.wait()
        return
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while not work.is_completed():
        if time.monotonic() >= deadline:
            close_weight_group(group)
            raise WireTimeout(f"{what}: not complete after {timeout_s:g} s ({key}): "
                              f"a member of the weight group is gone or stuck; the group is "
                              f"aborted")
        time.sleep(pause)
        pause = min(2 * pause, POLL_S)
    work.wait()


@contextlib.contextmanager
def nccl_errors_raised():
    """Where the NCCL weight group is made: torch reads TORCH_NCCL_ASYNC_ERROR_HANDLING when a
    ProcessGroupNCCL is constructed. Its default (3, skip clean-up) has the watchdog end the
    whole process when a collective times out; 2 (clean-up only) aborts the communicator and
    fails the collective's work instead, which `finish` raises, so a timed-out update is an
    error the sender handles even if the watchdog sees it first. Only this group is made so:
    the trainer's Megatron groups keep the process-wide setting."""
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    before = os.environ.get(key)
    os.environ[key] = "2"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def unpinned_nccl_env() -> contextlib.AbstractContextManager:
    """Where the NCCL weight group is made: vLLM's `vllm.utils.nccl.unpinned_nccl_env()` when
    batch invariance is on (`VLLM_BATCH_INVARIANT=1`, set by `deterministic: true` on CUDA),
    else nothing.

    With it on, vLLM's GPU worker pins NCCL settings for its own communicators (one channel,
    its own algorithm and protocol: `pin_nccl_env` in `init_batch_invariance`). NCCL does not
    reconcile them across ranks, so a communicator shared with the trainer's senders, which do
    not pin them, must be made without them, or the weight broadcast may hang. Outside a worker
    that pinned them (the trainer's senders) vLLM's context changes nothing. vLLM can unpin
    only with NCCL >= 2.29.7 (NCCL_NO_CACHE); with an older NCCL it says so once, and the pins
    then apply to this group too. A vLLM without the context gets a warning: the group is then
    made with the pins (tests/test_determinism.py checks the installed vLLM has it)."""
    try:
        import vllm.envs
    except ImportError:     # no vLLM here (a trainer node, tools/gpu_faults.py): nothing pinned
        return contextlib.nullcontext()
    if not vllm.envs.VLLM_BATCH_INVARIANT:
        return contextlib.nullcontext()
    try:
        from vllm.utils.nccl import unpinned_nccl_env as vllm_unpinned
    except ImportError:
        log.warning("this vLLM has no vllm.utils.nccl.unpinned_nccl_env: the weight group is made "
                    "with the NCCL settings that batch invariance pins in its worker, which the "
                    "trainer's senders do not set; the weight update may hang")
        return contextlib.nullcontext()
    return vllm_unpinned()


def init_sender_group(address: WeightGroupAddress) -> torch.distributed.ProcessGroup:
    """Join the weight group as rank 0 (a single sender: one stage, or a test)."""
    return init_weight_group(address, 0)


@dataclass(frozen=True, slots=True)
class BroadcastStats:
    num_buckets: int  # buckets this rank sent
    num_bytes: int  # bytes this rank sent
    seconds: float  # wall time of the whole plan (all stages), on this rank


def _pack(bucket: Bucket, take, flat: torch.Tensor) -> None:
    """Copy `take(name)` for every tensor of `bucket`, in order, into `flat` (the bucket's
    dtype, exactly `bucket_numel(bucket)` elements)."""
    offset = 0
    for name, shape, _ in bucket:
        tensor = take(name)
        if tuple(tensor.shape) != shape or tensor.dtype != flat.dtype:
            raise ValueError(
                f"{name}: tensor is {tuple(tensor.shape)} {tensor.dtype}, plan says {shape} {flat.dtype}"
            )
        n = spec_numel(shape)
        flat[offset : offset + n].view(shape).copy_(tensor.detach())
        offset += n


def broadcast_stage(
    group: torch.distributed.ProcessGroup,
    plan: Plan,
    stage: int,
    tensors: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str,
    timeout_s: float | None = None,
) -> BroadcastStats:
    """Take part in every bucket of `plan` as stage `stage`'s sender (weight-group rank `stage`).

    This stage's buckets are packed from `tensors` (pulled lazily: a tensor is held only until
    its bucket is packed) and broadcast; other stages' buckets are received and dropped, since a
    broadcast needs every group member. Every receiver must be in `recv_weights(plan)`.

    Two buckets are in flight: bucket k+1 is gathered and packed while bucket k's broadcast is
    on the wire (gloo runs it on its own thread; NCCL on its own stream), into two buffers that
    are reused for the whole plan, so the sender holds at most its two largest buckets' bytes
    beyond the tensors of the bucket being packed. A bucket of one contiguous tensor is sent
    from that tensor, without a copy: `tensors` must not change a tensor it has produced until
    this returns. Each bucket is waited for on the host (`finish`): at most `timeout_s` once
    its turn comes (None: the backend's own wait, which on NCCL does not block), else the group
    is aborted and `WireTimeout` raised; what the backend raises otherwise; `ValueError` when
    `tensors` does not match the plan.
    """
    t0 = time.perf_counter()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # as tensors report it
    source: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
    held: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        while name not in held:
            try:
                got, tensor = next(source)
            except StopIteration:
                raise ValueError(f"stage {stage} produced no tensor {name!r}") from None
            held[got] = tensor
        return held.pop(name)

    # Raw bytes, viewed as each bucket's dtype. Reused rather than allocated per bucket: a
    # fresh host buffer costs a page fault per 4 KiB, several times the copy into it.
    buffers: list[torch.Tensor | None] = [None, None]
    in_flight: collections.deque = collections.deque()  # the broadcasts' Work, oldest first
    sent = num_bytes = 0
    for k, (root, bucket) in enumerate(plan):
        if len(in_flight) == 2:     # bucket k-2 off the wire: its buffer is free
            finish(in_flight.popleft(), timeout_s, group, f"weight bucket {k - 2} of {len(plan)}")
        dtype = dtype_from_str(bucket_dtype(bucket))
        nbytes = bucket_numel(bucket) * dtype.itemsize
        flat = None
        if root == stage and len(bucket) == 1:
            # A one-tensor bucket goes on the wire as it is, when it can: no pack copy.
            name, shape, _ = bucket[0]
            tensor = take(name)
            if (tensor.is_contiguous() and tensor.device == device
                    and tuple(tensor.shape) == shape and tensor.dtype == dtype):
                flat = tensor.detach().view(-1)
            else:
                held[name] = tensor  # for _pack: it copies it, or names the mismatch
        if flat is None:
            slot = k % 2
            if buffers[slot] is None or buffers[slot].numel() < nbytes:
                buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            flat = buffers[slot][:nbytes].view(dtype)
            if root == stage:
                _pack(bucket, take, flat)
        if root == stage:
            sent += 1
            num_bytes += nbytes
        in_flight.append(group.broadcast(flat, root=root))
    while in_flight:
        k = len(plan) - len(in_flight)
        finish(in_flight.popleft(), timeout_s, group, f"weight bucket {k} of {len(plan)}")
    for _ in source:  # TP peers gather in lock step: run the iterator to its end
        pass
    if held:
        raise ValueError(f"stage {stage} produced tensors outside the plan: {sorted(held)[:5]}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # so `seconds` measures the transfer, not the launch
    return BroadcastStats(sent, num_bytes, time.perf_counter() - t0)


def broadcast_weights(
    group: torch.distributed.ProcessGroup,
    named_tensors: Mapping[str, torch.Tensor],
    buckets: Sequence[Bucket],
    timeout_s: float | None = None,
) -> BroadcastStats:
    """`broadcast_stage` for a single sender (rank 0) holding every tensor already."""
    device = next(iter(named_tensors.values())).device if named_tensors else "cpu"
    return broadcast_stage(group, [(0, list(b)) for b in buckets], 0, named_tensors.items(), device,
                           timeout_s)


# ------------------------------------------------------------------ disk fallback
