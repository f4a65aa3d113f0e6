"""The executor of the vLLM engines that this project starts: vLLM's multiprocess executor, its
workers forked from the engine process (`ForkedWorkersExecutor`).

Named by its path in the engine's arguments (`vllm_engine.FORKED_WORKERS`) and imported by vLLM in
the engine process, a process spawned from the generator rank: no MPI, no project globals.
"""
from __future__ import annotations

import os
import re

import torch
from vllm.platforms import current_platform
from vllm.v1.executor.multiproc_executor import MultiprocExecutor


class ForkedWorkersExecutor(MultiprocExecutor):
    """vLLM's multiprocess executor, its workers forked from the engine process.

    The engine process (EngineCore) is spawned from the generator rank, an MPI process that
    must not fork (`vllm_engine._child_process_environment`); it inherits
    VLLM_WORKER_MULTIPROC_METHOD=spawn, under which each of its workers would import vLLM and
    torch again (~13 s of CPU per worker, at every start and every in-place restart). The
    engine process holds no MPI state and, when it starts its workers, no CUDA context (vLLM
    falls back to spawn itself if one exists: `vllm.utils.system_utils._maybe_force_spawn`)
    and has run no OpenMP region: its workers fork, vLLM's own default on GPUs.

    vLLM's CPU platform binds a worker's OpenMP threads through the variables it sets for that
    worker before starting it (OMP_NUM_THREADS and OMP_PLACES, or GOMP_CPU_AFFINITY /
    KMP_AFFINITY), which the OpenMP runtime reads only when a fresh process loads it. A forked
    worker inherits the engine process's runtime, so on CPU each one applies them itself as it
    starts (`_bind_as_spawned`)."""

    def _init_executor(self) -> None:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        if current_platform.is_cpu():
            os.register_at_fork(after_in_child=_bind_as_spawned)
        super()._init_executor()


def omp_cpus(env) -> list[int]:
    """The CPUs that vLLM's OpenMP variables in `env` bind a worker to ([] if none): OMP_PLACES
    "{0,1}", GOMP_CPU_AFFINITY "0 1" or KMP_AFFINITY "...,proclist=[0,1]"."""
    for key, pattern in (("OMP_PLACES", r"^\{([\d,]+)\}$"), ("GOMP_CPU_AFFINITY", r"^([\d ]+)$"),
                         ("KMP_AFFINITY", r"proclist=\[([\d,]+)\]")):
        found = re.search(pattern, env.get(key, "").strip())
        if found:
            return sorted({int(c) for c in re.split(r"[, ]+", found.group(1)) if c})
    return []


def _bind_as_spawned() -> None:
    """In a worker just forked from the engine process on CPU: what the OpenMP runtime of a
    spawned worker does with vLLM's variables, done by hand: the process on the CPUs they name
    (threads it starts inherit the mask) and OMP_NUM_THREADS threads."""
    cpus = omp_cpus(os.environ)
    if cpus:
        os.sched_setaffinity(0, cpus)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
