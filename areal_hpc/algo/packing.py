"""Assign variable-length sequences to token-budgeted micro-batches. Pure Python.

Each micro-batch becomes one padding-free row (sequences concatenated, block-diagonal causal
attention), so its cost grows with its total token count. We want few micro-batches (each one is a
forward/backward launch and, with pipeline parallelism, a bubble) and balanced ones.
"""

from __future__ import annotations

import heapq


def pack_sequences(lengths: list[int], max_tokens_per_mb: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `max_tokens_per_mb` tokens each.

    Starts from the lower bound `ceil(total / budget)` bins. Sequences go longest first into the
    least-loaded bin (balanced loads); if that leaves a sequence with no room, best-fit (the
    fullest bin with room) is tried with the same number of bins, and only then one bin is added.
    A sequence longer than the budget gets a micro-batch of its own.

    Args:
        lengths: tokens per sequence (prompt + output), `[num_seqs]`.
        max_tokens_per_mb: token budget per micro-batch.
    Returns:
        micro-batches, each a sorted list of sequence indices; every index appears exactly once.
        Deterministic: ties break on sequence index, then bin index. Micro-batches are ordered by
        their smallest index so that group-contiguous batches stay roughly in order.
    """
    if max_tokens_per_mb <= 0:
        raise ValueError(f"max_tokens_per_mb must be positive, got {max_tokens_per_mb}")
    if not lengths:
        return []
    if min(lengths) < 0:
        raise ValueError("sequence lengths must be non-negative")

    oversized = [i for i, n in enumerate(lengths) if n > max_tokens_per_mb]
    rest = [i for i, n in enumerate(lengths) if n <= max_tokens_per_mb]
    order = sorted(rest, key=lambda i: (-lengths[i], i))

    total = sum(lengths[i] for i in rest)
    n_bins = max(1, -(-total // max_tokens_per_mb))
    while True:
        bins = _least_loaded(order, lengths, max_tokens_per_mb, n_bins)
        if bins is None:
            bins = _best_fit(order, lengths, max_tokens_per_mb, n_bins)
        if bins is not None:
            break
        n_bins += 1

    mbs = [sorted(b) for b in bins if b] + [[i] for i in oversized]
    return sorted(mbs, key=lambda mb: mb[0])


def _least_loaded(order: list[int], lengths: list[int], budget: int, n_bins: int):
    """Each sequence into the least-loaded bin; None if it is full (then all bins are)."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    heap = [(0, b) for b in range(n_bins)]  # (load, bin index)
    for i in order:
        load, b = heapq.heappop(heap)
        if load + lengths[i] > budget:
            return None
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins


def _best_fit(order: list[int], lengths: list[int], budget: int, n_bins: int):
    """Each sequence into the fullest bin it still fits in; None if it fits in none."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = [0] * n_bins
    for i in order:
        fitting = [b for b in range(n_bins) if loads[b] + lengths[i] <= budget]
        if not fitting:
            return None
        b = max(fitting, key=lambda b: (loads[b], -b))
        bins[b].append(i)
        loads[b] += lengths[i]
    return bins


def ffd_allocate(lengths: list[int], capacity: int, min_groups: int = 1) -> list[list[int]]:
    """First-fit-decreasing: indices into groups of at most `capacity` tokens, >= `min_groups`.

    Longest first, each into the first group it fits; then, while there are fewer than
    `min_groups` groups, the smallest sequence of the most populous group moves to a new one (one
    sequence never exceeds the capacity, so the budget holds). Every index appears exactly once;
    groups are returned as sorted index lists, ordered by their smallest index.

    Raises ValueError for a sequence longer than `capacity` (named by index and length) and when
    there are fewer sequences than `min_groups`.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"sequence {i} has {n} tokens, more than the capacity of {capacity}")
    if len(lengths) < min_groups:
        raise ValueError(f"{len(lengths)} sequences cannot fill min_groups={min_groups} groups")
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    while len(groups) < min_groups:
        donor = max(groups, key=len)
        smallest = min(donor, key=lambda i: (lengths[i], i))
        donor.remove(smallest)
        groups.append([smallest])
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])
