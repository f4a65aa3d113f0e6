"""CPU placement of the ranks: which cores each role may use and how many compute threads it runs.

`topology.trainer_cpus` / `topology.generator_cpus` name a role's cores on each node, as taskset
writes them ("0", "0-3", "0,2,4-7"); the role's ranks on one node share them in contiguous,
equal parts (`split_cpus`). Empty = keep what the launcher (mpiexec, srun's --cpu-bind) gave.

A bound rank sets its affinity and its thread count to its share: the trainer through
`torch.set_num_threads`, vLLM's CPU workers through the affinity they inherit (their OpenMP
threads bind to the allowed cores). So on one machine the two roles can run on disjoint cores
(asynchronous RL: both compute at once) or on the same cores (the synchronous baseline, where
each phase has every core in turn). On GPU nodes leave both empty: the ranks' work is on their
GPUs, and Slurm places the host threads.
"""
from __future__ import annotations

import os
from typing import Iterable


def parse_cpus(text: str | None, key: str = "cpus") -> list[int]:
    """'0,2-4' → [0, 2, 3, 4]; '' or None → []. A ValueError names `key` for anything else."""
    out: set[int] = set()
    for part in (p.strip() for p in str(text or "").split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{key}: {part!r} is not a CPU number or range (e.g. '0-3,6')") from None
        if a < 0 or b < a:
            raise ValueError(f"{key}: {part!r} is not a CPU range (need 0 <= first <= last)")
        out.update(range(a, b + 1))
    return sorted(out)


def format_cpus(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 5] → '0-2,5'."""
    ids, parts = sorted(set(cpus)), []
    for c in ids:
        if parts and c == parts[-1][1] + 1:
            parts[-1][1] = c
        else:
            parts.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def split_cpus(cpus: Iterable[int], n: int) -> list[list[int]]:
    """`cpus` (sorted) cut into `n` contiguous lists, sizes differing by at most one, the longer
    lists first. With fewer CPUs than lists, list i is [cpus[i % len(cpus)]]: workers share
    CPUs rather than fail to start."""
    ids = sorted(cpus)
    if n < 1 or not ids:
        raise ValueError(f"need n >= 1 and at least one CPU, got n={n}, cpus={ids}")
    if len(ids) < n:
        return [[ids[i % len(ids)]] for i in range(n)]
    size, extra = divmod(len(ids), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(ids[start:end])
        start = end
    return out


def role_cpus(topology, role: str) -> list[int]:
    """The cores configured for `role` ("trainer" | "generator"); [] = not bound."""
    key = f"{role}_cpus"
    return parse_cpus(getattr(topology, key), f"topology.{key}")


def check_cpus(topology, allowed: Iterable[int] | None = None) -> None:
    """Both roles' CPU lists name cores this process may run on (a ValueError names the key)."""
    allowed = set(os.sched_getaffinity(0) if allowed is None else allowed)
    for role in ("trainer", "generator"):
        missing = sorted(set(role_cpus(topology, role)) - allowed)
        if missing:
            raise ValueError(f"topology.{role}_cpus: CPU(s) {format_cpus(missing)} are not "
                             f"available here (allowed: {format_cpus(allowed)})")


# A generator that shares cores with the trainer runs at this nice value (its vLLM processes
# inherit it). vLLM's workers keep polling while the engine is idle (a reader of its shared-memory
# queue spins for a second after each message; measured on the tiny sync recipe: the worker at
# ~50% of a core while the trainer trained), which took the trainer's cores in the synchronous
# baseline; at nice 10 the trainer gets ~90% of a shared core whenever both want it, and the
# generator still has every core while the trainer waits for rollouts.
SHARED_GENERATOR_NICE = 10


def shares_cores(topology) -> bool:
    return bool(set(role_cpus(topology, "trainer")) & set(role_cpus(topology, "generator")))


def bind_rank(topology, role: str, index_on_node: int, ranks_on_node: int) -> list[int] | None:
    """Confine this process to its share of its role's cores and size its compute threads to
    it (a generator sharing cores with the trainer also yields to it: SHARED_GENERATOR_NICE).
    Returns the share, or None when the role is not bound. Call before torch or vLLM start
    their thread pools (the trainer's torch.set_num_threads also works later)."""
    cpus = role_cpus(topology, role)
    if not cpus:
        return None
    mine = split_cpus(cpus, ranks_on_node)[index_on_node]
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    if role == "trainer":
        import torch
        torch.set_num_threads(len(mine))
    elif shares_cores(topology):
        os.nice(SHARED_GENERATOR_NICE)
    return mine


def describe(topology, env: dict | None = None) -> str:
    """One line for the launcher: where each role runs (`env`: the ranks' environment)."""
    env = os.environ if env is None else env
    parts = []
    for role in ("trainer", "generator"):
        cpus = role_cpus(topology, role)
        n = getattr(topology, f"n_{role}s")
        if cpus:
            shares = split_cpus(cpus, n)
            threads = sorted({len(c) for c in shares})
            parts.append(f"{n} {role} rank(s) on CPUs {format_cpus(cpus)}, "
                         f"{'/'.join(map(str, threads))} thread(s) each")
        else:
            parts.append(f"{n} {role} rank(s) unbound, OMP_NUM_THREADS="
                         f"{env.get('OMP_NUM_THREADS', 'unset')}")
    shared = set(role_cpus(topology, "trainer")) & set(role_cpus(topology, "generator"))
    return "; ".join(parts) + (f"; CPUs {format_cpus(shared)} shared by both roles (generators at "
                               f"nice {SHARED_GENERATOR_NICE})" if shared else "")
