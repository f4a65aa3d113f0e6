"""Assign variable-length sequences to token-budgeted groups (micro-batches, minibatches, data-
parallel shares). Pure Python.

Each micro-batch becomes one padding-free row (sequences concatenated, block-diagonal causal
attention), so its cost grows with its total token count. We want few micro-batches (each one is a
forward/backward launch and, with pipeline parallelism, a bubble) and balanced ones (with pipeline
or data parallelism the slowest micro-batch or rank sets the pace).
"""

from __future__ import annotations

import bisect
import heapq


def balanced_allocate(
    lengths: list[int], capacity: int, min_groups: int = 1, divisor: int = 1
) -> list[list[int]]:
    """Indices into exactly `k` groups of at most `capacity` tokens, loads as equal as cheaply can be.

    `k` is the number of groups first-fit-decreasing needs (`ffd_allocate`), raised to
    `min_groups` and rounded up to a multiple of `divisor` (AReaL's `n_mbs` / `n_mbs_divisor`:
    equal counts on every data-parallel rank, a multiple of the pipeline size). With `k` fixed,
    sequences go longest first into the least-loaded group (LPT). If one does not fit there, FFD's
    own grouping (split up to `k` groups) is used instead: it fits by construction. Then
    `_rebalance` moves or swaps sequences between the fullest and the emptiest group while that
    narrows their gap (LPT leaves gaps of up to one short sequence; with few sequences per
    micro-batch that is several percent).

    Args:
        lengths: tokens per sequence, `[num_seqs]`.
        capacity: token budget per group; `sum(lengths)` (or more) means no budget.
    Returns:
        `k` sorted index lists, every index exactly once; non-empty groups ordered by their
        smallest index, then the empty ones (there are empty groups only when there are fewer
        sequences than `k`). Deterministic: ties break on sequence index, then group index.
    Raises:
        ValueError for a sequence longer than `capacity` (named by index and length).
    """
    if min_groups < 1 or divisor < 1:
        raise ValueError(f"min_groups and divisor must be >= 1, got {min_groups} and {divisor}")
    witness = ffd_allocate(lengths, capacity, min_groups=0)
    k = max(len(witness), min_groups)
    k = -(-k // divisor) * divisor
    groups = _least_loaded(lengths, capacity, k)
    if groups is None:
        groups = ffd_allocate(lengths, capacity, min_groups=k)
    _rebalance(groups, lengths, capacity)
    non_empty = sorted((sorted(g) for g in groups if g), key=lambda g: g[0])
    return non_empty + [[] for _ in range(k - len(non_empty))]


def _least_loaded(lengths: list[int], capacity: int, k: int) -> list[list[int]] | None:
    """Longest first, each into the least-loaded of `k` groups; None if it does not fit there."""
    groups: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, g) for g in range(k)]  # (load, group index)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, g = heapq.heappop(heap)
        if load + lengths[i] > capacity:
            return None
        groups[g].append(i)
        heapq.heappush(heap, (load + lengths[i], g))
    return groups


def _rebalance(groups: list[list[int]], lengths: list[int], capacity: int) -> None:
    """In place: lower the fullest group by moving one of its sequences to a less loaded group,
    or swapping it for a shorter one there, until no such transfer helps.

    With the fullest group `hi` and another group `g` (least loaded first), a transfer of d tokens
    (a moved length, or the difference of two swapped lengths) with 0 < d < load[hi] - load[g]
    and room for it in `g` strictly lowers the sum of squared loads, so the loop ends. d is taken
    as close to half that gap as possible.
    """
    loads = [sum(lengths[i] for i in g) for g in groups]
    while True:
        hi = max(range(len(groups)), key=lambda g: (loads[g], -g))
        for g in sorted(range(len(groups)), key=lambda g: (loads[g], g)):
            gap = loads[hi] - loads[g]
            if gap <= 1:
                return
            move = _best_transfer(groups[hi], groups[g], lengths, gap, capacity - loads[g])
            if move is not None:
                break
        else:
            return
        i, j = move
        groups[hi].remove(i)
        groups[g].append(i)
        d = lengths[i]
        if j is not None:
            groups[g].remove(j)
            groups[hi].append(j)
            d -= lengths[j]
        loads[hi] -= d
        loads[g] += d


def _best_transfer(src: list[int], dst: list[int], lengths: list[int], gap: int, room: int):
    """(i from src, j from dst or None for a plain move) whose transfer d is nearest gap / 2
    with 0 < d < gap and d <= room; None if there is none."""
    by_len = sorted(dst, key=lambda j: (lengths[j], j))
    dst_lens = [lengths[j] for j in by_len]
    best, best_err = None, None
    for i in sorted(src):
        a = lengths[i]
        pos = bisect.bisect_left(dst_lens, a - gap / 2)
        options = [(a, None)] + [(a - dst_lens[p], by_len[p]) for p in (pos - 1, pos) if 0 <= p < len(by_len)]
        for d, j in options:
            if 0 < d < gap and d <= room and (best_err is None or abs(d - gap / 2) < best_err):
                best, best_err = (i, j), abs(d - gap / 2)
    return best


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
