"""The plan of a weight update: which HF tensors travel in which bucket, from which stage. Pure.

`[(root, bucket), ...]`: every stage's HF tensors, bucketed per stage (`plan_buckets`), stage 0's
buckets first; `root` is the sending stage (its weight-group rank). Computed once per run (shapes
never change); it travels in the MPI weight notice, and both transports follow it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

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
