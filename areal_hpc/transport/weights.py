"""Trainer → generator weight broadcast: the bucket layout and the sender half.

The weight group is {trainer rank 0, every vLLM worker of every generator}, a stateless
torch.distributed group (NCCL on GPU, gloo on CPU) that lives beside Megatron's groups and
vLLM's own groups without touching either. The receiver half lives inside vLLM's worker
(`areal_hpc.rollout.vllm_ext.WeightSyncExtension.recv_weights`).

Protocol for one update (both sides hold the same `buckets`, sent beforehand over MPI):
for each bucket, rank 0 packs the bucket's tensors, in order, into ONE flat contiguous buffer
of the bucket's dtype and broadcasts it; receivers allocate the same buffer, receive it and
cut it back into the named tensors. One collective per bucket instead of one per tensor keeps
the launch/latency cost of hundreds of small tensors (norms, biases) out of the update.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

# (hf_name, shape, dtype_str); dtype_str is the torch attribute name, e.g. "bfloat16".
TensorSpec = tuple[str, tuple[int, ...], str]
Bucket = list[TensorSpec]


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


def init_sender_group(
    master_address: str,
    master_port: int,
    world_size: int,
    backend: str,
    timeout_s: float | None = None,
) -> torch.distributed.ProcessGroup:
    """Join the weight group as rank 0 (trainer side). Blocks until all `world_size` ranks join.

    The receivers join the same (address, port) through `VLLMEngine.init_weight_group`.
    For NCCL, set the CUDA device of this process before calling.
    """
    from datetime import timedelta

    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        master_address,
        master_port,
        0,
        world_size,
        backend,
        timeout=None if timeout_s is None else timedelta(seconds=timeout_s),
    )


@dataclass(frozen=True, slots=True)
class BroadcastStats:
    num_buckets: int
    num_bytes: int
    seconds: float


def broadcast_weights(
    group: torch.distributed.ProcessGroup,
    named_tensors: Mapping[str, torch.Tensor],
    buckets: Sequence[Bucket],
) -> BroadcastStats:
    """Broadcast `named_tensors` from rank 0 of `group`, one flat buffer per bucket.

    Every receiver must be inside `recv_weights(buckets)` with the same buckets. The flat
    buffers are allocated on the tensors' device (CUDA tensors for NCCL, CPU for gloo).
    """
    t0 = time.perf_counter()
    num_bytes = 0
    for bucket in buckets:
        dtype = dtype_from_str(bucket_dtype(bucket))
        first = named_tensors[bucket[0][0]]
        flat = torch.empty(bucket_numel(bucket), dtype=dtype, device=first.device)
        offset = 0
        for name, shape, _ in bucket:
            tensor = named_tensors[name]
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(
                    f"{name}: tensor is {tuple(tensor.shape)} {tensor.dtype}, "
                    f"bucket plan says {shape} {dtype}"
                )
            n = spec_numel(shape)
            flat[offset : offset + n].view(shape).copy_(tensor.detach())
            offset += n
        group.broadcast(flat, root=0).wait()
        num_bytes += flat.numel() * flat.element_size()
    if buckets and first.device.type == "cuda":
        torch.cuda.synchronize(first.device)  # so `seconds` measures the transfer, not the launch
    return BroadcastStats(len(buckets), num_bytes, time.perf_counter() - t0)
