"""`deterministic: true`: one key for every setting that makes a run repeat bit for bit on GPUs.

On CPU a synchronous run already repeats with per-request sampling seeds (README, What repeats):
the CPU kernels give one result for one input. On GPUs four more things vary from run to run,
and each has a switch in the pinned stack (every name below was read in the installed sources,
and `tests/test_determinism.py` checks that each is still there):

- the engine's kernels depend on the batch around a request (split-K matmuls, attention splits,
  reductions whose order follows the batch size): vLLM 0.32's batch-invariant mode,
  `VLLM_BATCH_INVARIANT=1` (vllm/envs.py; the GPU worker calls `init_batch_invariance` in
  vllm/model_executor/determinism/batch_invariant.py, which installs batch-invariant
  matmul/softmax/mean kernels, fixes the attention split and pins NCCL settings for the
  engine's own communicators: `pin_nccl_env` in vllm/utils/nccl.py. The weight group, shared
  with the trainer, is made without them, under vLLM's `unpinned_nccl_env`, else the update
  may hang: transport/weights/broadcast.py);
- Megatron's kernels with non-deterministic backward passes: megatron-core 0.16.1's
  `deterministic_mode` (ModelParallelConfig; the embedding's backward without atomics in
  tensor_parallel/layers.py). The trainer builds Megatron's local layer spec, not
  TransformerEngine's (train/attention.py), so TransformerEngine's switch
  (`NVTE_ALLOW_NONDETERMINISTIC_ALGO`) has nothing to act on and is not set;
- cuBLAS's split-K workspaces: `CUBLAS_WORKSPACE_CONFIG=:4096:8` (what torch's
  `use_deterministic_algorithms` asks for on CUDA), and torch's deterministic algorithms;
- NCCL's algorithm and protocol choice, which changes the reduction order of the trainer's
  gradient all-reduces and reduce-scatters: `NCCL_ALGO=Ring`, `NCCL_PROTO=Simple`.

and the sampling itself: the key turns `rollout.per_request_seeds` on (a sample's random numbers
from its own seed, not from the engine's shared stream).

The mode's variables win over the environment the ranks inherit, each override said on stderr
(launch/env.py): a site's `NCCL_PROTO` would otherwise undo the mode without a word.

On CUDA the mode needs NCCL >= 2.29.7 (`NCCL_FLOOR`): vLLM makes the weight group without its
pinned settings through NCCL_NO_CACHE, which older NCCLs lack (vllm/utils/nccl.py
`_nccl_has_no_cache`), and with them the weight update may hang. `check_nccl`, through
`summary`, refuses an older one in the launchers' preflight, before any rank starts: the
version belongs to the installed stack (the venv's NCCL wheel, which every rank loads), and is
read without a GPU (a library call), so the submitting host knows it. It reads the NCCL library
that torch loaded, as vLLM does (`ncclGetVersion`; also VLLM_NCCL_SO_PATH's where set), not
`torch.cuda.nccl.version()` first: that is the NCCL torch was built with, and an NCCL wheel
upgraded to meet the floor would still be refused by it; it is the fallback where the library
cannot be asked. A build without NCCL (a CPU torch) is not checked.

What it costs: per-request seeds about 10% of the tiny model's generation throughput on CPU
(BENCHMARKS.md); the GPU settings' cost is measured by `tools/gpu_check.py` (check 5, the
trainer's step with and without them) when a GPU is lent. It is off by default.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from .config import ConfigError

# NCCL_NO_CACHE arrived in NCCL 2.29.7: vLLM's batch invariance can make the weight group without
# the NCCL settings it pins only from there (vllm/utils/nccl.py; transport/weights/broadcast.py).
NCCL_FLOOR = (2, 29, 7)


@dataclass(frozen=True)
class Setting:
    what: str
    env: dict[str, str]         # rank environment (CUDA only); empty: set in code
    source: str                 # where the pinned stack reads it


SETTINGS = (
    Setting("vLLM batch-invariant kernels", {"VLLM_BATCH_INVARIANT": "1"},
            "vllm 0.32 vllm/envs.py, vllm/model_executor/determinism/batch_invariant.py"),
    Setting("Megatron deterministic mode", {},
            "megatron-core 0.16.1 ModelParallelConfig.deterministic_mode (train/megatron_model.py)"),
    Setting("cuBLAS deterministic workspace", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
            "torch.use_deterministic_algorithms' requirement on CUDA"),
    Setting("torch deterministic algorithms", {},
            "torch.use_deterministic_algorithms(True) in the trainer (train/actor.py)"),
    Setting("fixed NCCL algorithm and protocol", {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"},
            "NCCL's environment (the trainer's all-reduce / reduce-scatter order)"),
    Setting("per-request sampling seeds", {}, "rollout.per_request_seeds (rollout/vllm_engine.py)"),
)


def rank_env(device: str) -> dict[str, str]:
    """The deterministic mode's environment for every rank: the CUDA settings, or nothing on CPU
    (vLLM's batch-invariant kernels are GPU kernels; its CPU platform ignores the mode)."""
    if device != "cuda":
        return {}
    return {k: v for s in SETTINGS for k, v in s.env.items()}


def seeded(cfg) -> bool:
    """Whether samples draw from per-request seeds: rollout.per_request_seeds, or the mode."""
    return bool(cfg.rollout.per_request_seeds or cfg.deterministic)


def enable_torch(device: str) -> None:
    """torch's deterministic algorithms in this process (the trainer, on CUDA): an op without a
    deterministic implementation then raises instead of varying. On CPU nothing is changed."""
    if device == "cuda":
        import torch
        torch.use_deterministic_algorithms(True)


def _release(version) -> str:
    return ".".join(map(str, version))


def nccl_problem(found: tuple | None, where: str = "") -> str | None:
    """One line when `found` (NCCL's (major, minor, patch), as torch.cuda.nccl.version() gives
    it; None: no NCCL, a CPU build) is below NCCL_FLOOR, else None. `where`: how it was read."""
    if found is None or tuple(found[:3]) >= NCCL_FLOOR:
        return None
    return (f"config key 'deterministic': true on CUDA needs NCCL >= {_release(NCCL_FLOOR)}, found "
            f"NCCL {_release(found[:3])}{f' ({where})' if where else ''}: vLLM's batch invariance "
            f"pins NCCL settings in its engine and makes the weight group without them only through "
            f"NCCL_NO_CACHE (NCCL {_release(NCCL_FLOOR)}), else the weight update may hang; install "
            f"NCCL >= {_release(NCCL_FLOOR)} (the nvidia-nccl wheel torch loads) or set "
            f"deterministic: false")


def _decode(code: int) -> tuple[int, int, int]:
    """ncclGetVersion's number: major*10000 + minor*100 + patch (major*1000 + ... before 2.9)."""
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def installed_nccl() -> tuple[tuple[int, ...], str] | None:
    """(the lowest NCCL version the ranks would run, how it was read), or None on a torch
    without CUDA (a CPU build: no NCCL). Imports torch."""
    import torch
    if torch.version.cuda is None:
        return None
    found = []
    for lib in dict.fromkeys(filter(None, ("libnccl.so.2", os.environ.get("VLLM_NCCL_SO_PATH")))):
        code = ctypes.c_int()
        try:        # the soname finds the libnccl.so.2 that importing torch loaded (its wheel's)
            failed = ctypes.CDLL(lib).ncclGetVersion(ctypes.byref(code))
        except (OSError, AttributeError):
            continue
        if not failed and code.value > 0:
            found.append((_decode(code.value), f"ncclGetVersion of {lib}"))
    if not found:
        try:
            found.append((tuple(torch.cuda.nccl.version()[:3]),
                          "torch.cuda.nccl.version(), the NCCL torch was built with"))
        except (AttributeError, RuntimeError):     # a CUDA torch built without NCCL
            return None
    return min(found)


def check_nccl(device: str) -> None:
    """ConfigError naming `deterministic` when CUDA's NCCL (`installed_nccl`) is below
    NCCL_FLOOR; nothing off CUDA or without NCCL."""
    if device != "cuda":
        return
    got = installed_nccl()
    problem = nccl_problem(*got) if got is not None else None
    if problem:
        raise ConfigError(problem)


def summary(device: str) -> str:
    """The preflight's one line: what the mode sets here and what it costs. On CUDA it first
    refuses an NCCL below the floor (`check_nccl`): the launchers' preflight calls it for
    `deterministic: true`, before any rank starts."""
    check_nccl(device)
    if device != "cuda":
        return ("deterministic: per-request sampling seeds on (about 10% of the tiny model's "
                "generation throughput on CPU); on CPU nothing else is needed")
    env = " ".join(f"{k}={v}" for k, v in rank_env(device).items())
    return (f"deterministic: per-request seeds, Megatron deterministic_mode, torch deterministic "
            f"algorithms, {env}; costs generation and step time (tools/gpu_check.py check 5 "
            "measures the trainer's share)")
