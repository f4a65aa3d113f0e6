"""Trainer → generator weight path: bucket plan, per-stage senders, disk fallback, handshake.

The weight group is {one sender per pipeline stage} ∪ {every vLLM worker of every generator}, a
stateless torch.distributed group (NCCL on GPU, gloo on CPU) beside Megatron's groups and vLLM's
own. Ranks: stage s's sender (the trainer rank with dp = tp = 0 on stage s) is rank s; generator
g's engine spans [pp + g * engine_tp, pp + (g + 1) * engine_tp). The receiver half lives inside
vLLM's worker (`areal_hpc.rollout.vllm_ext.WeightSyncExtension.recv_weights`).

The plan of an update is `[(root, bucket), ...]`: every stage's HF tensors, bucketed per stage
(`plan_buckets`), stage 0's buckets first; `root` is the sending stage. It is computed once per
run (shapes never change) and travels in the MPI weight notice. For each bucket, its stage's
sender packs the bucket's tensors, in order, into ONE flat buffer of the bucket's dtype and
broadcasts it; every other group member receives it (other stages' senders drop it) and cuts it
back into the named tensors. One collective per bucket keeps the latency of hundreds of small
tensors (norms, biases) out of the update; a sender holds at most about two buckets beyond its
own shards (`broadcast_stage` pulls tensors lazily from a TP-gathering iterator and packs bucket
k+1 while bucket k is on the wire; receivers load bucket k while bucket k+1 arrives), so no
process ever holds the model twice, and no stage funnels through another.

Bounded time: the group is created with a timeout that applies to its joining and to every
collective; generators acknowledge each update over MPI (`AckTracker`), and a missing or wrong
acknowledgement becomes a `WeightSyncError` naming the generator rank and host.
"""

from __future__ import annotations

import collections
import math
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

# (hf_name, shape, dtype_str); dtype_str is the torch attribute name, e.g. "bfloat16".
TensorSpec = tuple[str, tuple[int, ...], str]
Bucket = list[TensorSpec]
# [(root, bucket), ...]: the sending stage (weight-group rank) of each bucket, in send order.
Plan = list[tuple[int, Bucket]]


def dtype_from_str(dtype_str: str) -> torch.dtype:
    """"bfloat16" or "torch.bfloat16" → torch.bfloat16."""
    dtype = getattr(torch, dtype_str.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype_str!r}")
    return dtype


def dtype_to_str(dtype: torch.dtype) -> str:
    """torch.bfloat16 → "bfloat16" (the form that travels in bucket metadata)."""
    return str(dtype).removeprefix("torch.")


def spec_numel(shape: Sequence[int]) -> int:
    return math.prod(shape)  # prod(()) == 1: a 0-d tensor holds one element


def bucket_numel(bucket: Bucket) -> int:
    return sum(spec_numel(shape) for _, shape, _ in bucket)


def bucket_dtype(bucket: Bucket) -> str:
    dtypes = {dtype for _, _, dtype in bucket}
    if len(dtypes) != 1:
        raise ValueError(f"a bucket holds exactly one dtype, got {sorted(dtypes)}")
    return dtypes.pop()


def plan_buckets(
    named_shapes_dtypes: Iterable[tuple[str, Sequence[int], str]], bucket_bytes: int
) -> list[Bucket]:
    """Split tensors into broadcast buckets. Pure and deterministic.

    Tensors are grouped by dtype (dtypes in order of first appearance) and, within a dtype,
    packed greedily in input order: a bucket is closed when the next tensor would push it past
    `bucket_bytes`. A tensor larger than `bucket_bytes` gets a bucket of its own. Input order is
    kept inside a dtype on purpose: vLLM's layerwise reload holds a layer's tensors until the
    whole layer has arrived, so sending in state-dict (layer) order bounds receiver memory.

    Args:
        named_shapes_dtypes: (hf_name, shape, dtype_str) per tensor, e.g. in HF state-dict order.
        bucket_bytes: soft cap on one bucket's payload, in bytes (> 0).
    Returns:
        buckets; each a non-empty list of (hf_name, shape as tuple of int, dtype_str), one dtype.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    by_dtype: dict[str, list[TensorSpec]] = {}
    seen: set[str] = set()
    for name, shape, dtype_str in named_shapes_dtypes:
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        seen.add(name)
        # Normalising here also makes a bad dtype fail on the trainer, not on every generator.
        dtype_str = dtype_to_str(dtype_from_str(dtype_str))
        by_dtype.setdefault(dtype_str, []).append((name, tuple(int(s) for s in shape), dtype_str))

    buckets: list[Bucket] = []
    for dtype_str, specs in by_dtype.items():
        itemsize = dtype_from_str(dtype_str).itemsize
        current: Bucket = []
        current_bytes = 0
        for spec in specs:
            nbytes = spec_numel(spec[1]) * itemsize
            if current and current_bytes + nbytes > bucket_bytes:
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(spec)
            current_bytes += nbytes
        if current:
            buckets.append(current)
    return buckets



def plan_stages(stage_specs: Sequence[Iterable[tuple[str, Sequence[int], str]]], bucket_bytes: int) -> Plan:
    """The update plan: stage s's tensors in `plan_buckets(stage_specs[s])`, rooted at s.

    Args:
        stage_specs: per pipeline stage, (hf_name, shape, dtype_str) in the order its sender
            produces them. A name must not appear in two stages.
    """
    plan: Plan = []
    seen: set[str] = set()
    for stage, specs in enumerate(stage_specs):
        for bucket in plan_buckets(specs, bucket_bytes):
            names = {name for name, _, _ in bucket}
            if names & seen:
                raise ValueError(f"stage {stage} repeats tensors of an earlier stage: {sorted(names & seen)}")
            seen |= names
            plan.append((stage, bucket))
    return plan


def plan_bytes(plan: Plan) -> int:
    return sum(bucket_numel(b) * dtype_from_str(bucket_dtype(b)).itemsize for _, b in plan)


def init_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float | None = None,
    join_timeout_s: float | None = None,
) -> torch.distributed.ProcessGroup:
    """Join the weight group as `rank`; blocks until all `world_size` ranks have joined.

    A stateless group (no torch.distributed global state), so it lives beside Megatron's and
    vLLM's groups. `join_timeout_s` bounds the wait for every member (generators join once their
    engine is up: minutes at 32B); `timeout_s` bounds every later collective (None: the
    backend's default; NCCL enforces it through its watchdog). Trainer stage senders join here;
    vLLM workers through `WeightSyncExtension.init_weight_group`. For NCCL, set this process's
    CUDA device first.
    """
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore
    from vllm.distributed.utils import init_gloo_process_group

    default = torch.distributed.distributed_c10d._get_default_timeout(backend)
    timeout = default if timeout_s is None else timedelta(seconds=timeout_s)
    join = timeout if join_timeout_s is None else timedelta(seconds=join_timeout_s)
    store = TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=join,
        wait_for_workers=True,
    )
    store.set_timeout(timeout)
    prefix = PrefixStore("areal_weights", store)
    if backend == "gloo":
        return init_gloo_process_group(prefix, rank, world_size, timeout)
    from vllm.platforms import current_platform

    return current_platform.stateless_init_device_torch_dist_pg(
        backend=backend, prefix_store=prefix, group_rank=rank, group_size=world_size, timeout=timeout
    )


def init_sender_group(
    master_address: str,
    master_port: int,
    world_size: int,
    backend: str,
    timeout_s: float | None = None,
) -> torch.distributed.ProcessGroup:
    """Join the weight group as rank 0 (a single sender: one stage, or a test)."""
    return init_weight_group(master_address, master_port, 0, world_size, backend, timeout_s)


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
    this returns. Raises what the backend raises when the group's timeout passes (from the wait
    on the oldest bucket in flight); `ValueError` when `tensors` does not match the plan.
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
        if len(in_flight) == 2:
            in_flight.popleft().wait()  # bucket k-2 is off the wire: its buffer is free
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
        in_flight.popleft().wait()
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
) -> BroadcastStats:
    """`broadcast_stage` for a single sender (rank 0) holding every tensor already."""
    device = next(iter(named_tensors.values())).device if named_tensors else "cpu"
    return broadcast_stage(group, [(0, list(b)) for b in buckets], 0, named_tensors.items(), device)


# ------------------------------------------------------------------ disk fallback


def version_dir(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def write_stage(
    root: str | os.PathLike, version: int, plan: Plan, stage: int, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Path:
    """Write stage `stage`'s buckets of `plan` as safetensors files under `version_dir`.

    One file per bucket (`s{stage:03d}-b{index:05d}.safetensors`), each written under a
    temporary name and renamed, so a reader never sees a partial file and a writer holds at
    most one bucket. The caller publishes the directory only after every stage returned.
    """
    from safetensors.torch import save_file

    out = version_dir(root, version)
    out.mkdir(parents=True, exist_ok=True)
    source = iter(tensors)
    held: dict[str, torch.Tensor] = {}
    for index, (owner, bucket) in enumerate(plan):
        if owner != stage:
            continue
        chunk = {}
        for name, _, _ in bucket:
            while name not in held:
                got, tensor = next(source)
                held[got] = tensor
            chunk[name] = held.pop(name).detach().to("cpu").contiguous()
        path = out / f"s{stage:03d}-b{index:05d}.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        save_file(chunk, str(tmp), metadata={"format": "pt", "version": str(version)})
        os.replace(tmp, path)
    for _ in source:
        pass
    return out


def prune_versions(root: str | os.PathLike, keep: int) -> None:
    """Delete every version directory under `root` except `keep` (the one generators run)."""
    keep_dir = version_dir(root, keep)
    for d in Path(root).glob("v*"):
        if d.is_dir() and d != keep_dir:
            shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------ handshake


class WeightSyncError(RuntimeError):
    """A weight update did not complete on every generator in time; the job must stop."""


@dataclass
class AckTracker:
    """The generators' acknowledgements of weight updates (fed from MPI by the controller).

    A generator sends {"version", "phase": "started"} when it begins loading an update and
    {"version", "phase": "loaded", "paused_s"} once the engine runs the new weights.
    `expected` maps generator world rank → host name.
    """

    expected: dict[int, str]
    started: dict[int, int] = field(default_factory=dict)  # rank → newest version started
    loaded: dict[int, int] = field(default_factory=dict)  # rank → newest version loaded
    paused_s: dict[int, float] = field(default_factory=dict)  # rank → pause of its newest load

    def record(self, rank: int, msg: dict) -> None:
        if msg["phase"] == "started":
            self.started[rank] = msg["version"]
        else:
            self.loaded[rank] = msg["version"]
            self.paused_s[rank] = msg.get("paused_s", 0.0)

    def complete(self, version: int) -> bool:
        return all(self.loaded.get(r, -1) >= version for r in self.expected)

    def check(self, version: int, waited_s: float, cause: BaseException | None = None) -> None:
        """Raise `WeightSyncError` unless every generator runs exactly `version`."""
        wrong = {r: v for r, v in self.loaded.items() if r in self.expected and v > version}
        lines = [f"generator rank {r} (host {self.expected[r]}) reports version {v}"
                 for r, v in sorted(wrong.items())]
        for r, host in sorted(self.expected.items()):
            if self.loaded.get(r, -1) >= version:
                continue
            if self.started.get(r, -1) >= version:
                lines.append(f"generator rank {r} (host {host}) started loading but did not finish")
            else:
                lines.append(f"generator rank {r} (host {host}) never started loading")
        if not lines and cause is None:
            return
        what = f"weight update to version {version} failed after {waited_s:.1f} s"
        if cause is not None:
            what += f" ({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})"
        raise WeightSyncError("; ".join([what, *lines]) if lines else what) from cause
