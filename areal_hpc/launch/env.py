"""What every launcher (mpiexec, the slurm/ batch scripts, submitit) does before the ranks start:
validate the config, its per-GPU memory estimate (`python -m areal_hpc.plan memory`) and its
input paths, build the tiny model if the recipe needs it, and set the ranks' environment. One
place, so the three launchers cannot drift apart.

    eval "$(python -m areal_hpc.launch.env CONFIG.yaml [key=value ...])"

prints `export` lines: the rank environment (only variables not already set, so a user's or a
site's choice wins, except the `deterministic` key's settings, which win over it with one warning
line each on stderr) and, for batch scripts, AREAL_RUN_DIR / AREAL_N_TRAINERS / AREAL_N_GENERATORS
and the GPUs per task of each role (AREAL_GPUS_PER_TRAINER / AREAL_GPUS_PER_GENERATOR).
A bad config prints the error on stderr and exits 2, before any node time is spent on ranks.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from .. import determinism
from ..config import ConfigError, RunConfig
from ..preflight import launcher
from ..storage import disk
from .placement import GENERATOR, TRAINER, gpus_needed

def rank_env(cfg: RunConfig) -> dict[str, str]:
    """Defaults for every rank's environment: one compute thread each on a small CPU box, vLLM's
    caches inside the project (slurm/job.sh sets VLLM_CACHE_ROOT to node-local disk first), the
    KV-cache size from the config, HDF5's file locking off where the run directory's file system
    needs it (NFS, Lustre without flock: storage/disk.py; HDF5 reads it as it starts, so here and
    not in the rank), quiet logs, and the `deterministic` key's settings. The caller's own
    environment takes precedence over these, except over the key's settings (`forced_env`; see
    `merged_env`)."""
    env = {
        "OMP_NUM_THREADS": "1",
        "VLLM_CACHE_ROOT": str(Path(".cache/vllm").resolve()),
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_LOGGING_LEVEL": "WARNING",
        # Megatron warns at import that TransformerEngine/Apex are absent: expected on CPU.
        "PYTHONWARNINGS": "ignore:Transformer Engine and Apex are not installed:UserWarning,"
                          "ignore:Apex is not installed:UserWarning,"
                          "ignore:full scope is deprecated:UserWarning",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    if cfg.rollout.kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.rollout.kv_cache_gib)
    env.update(disk.hdf5_env(cfg.run_dir))
    env.update(forced_env(cfg))
    return env


def forced_env(cfg: RunConfig) -> dict[str, str]:
    """The part of `rank_env` that wins over the caller's environment: the `deterministic` key's
    settings. A site's `NCCL_PROTO` or `CUBLAS_WORKSPACE_CONFIG` would otherwise undo the mode
    without a word."""
    return determinism.rank_env(cfg.topology.device) if cfg.deterministic else {}


def _warn_overrides(forced: dict[str, str]) -> None:
    """One line on stderr for each variable of this environment that `forced` changes."""
    for k, v in forced.items():
        if k in os.environ and os.environ[k] != v:
            print(f"[launch] warning: deterministic: true overrides {k} from the environment: "
                  f"{os.environ[k]} -> {v}", file=sys.stderr, flush=True)


def merged_env(cfg: RunConfig) -> dict[str, str]:
    """The full environment for the ranks: `rank_env` under the current one, `forced_env` over
    it (each variable it changes said on stderr)."""
    forced = forced_env(cfg)
    _warn_overrides(forced)
    return {**rank_env(cfg), **os.environ, **forced}


def export_lines(cfg: RunConfig) -> list[str]:
    """`export K=V` shell lines for the rank-environment defaults not set in this environment,
    and for every variable of `forced_env` (each one it changes said on stderr)."""
    forced = forced_env(cfg)
    _warn_overrides(forced)
    return [f"export {k}={shlex.quote(v)}" for k, v in rank_env(cfg).items()
            if k in forced or k not in os.environ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        cfg = launcher(argv[0], argv[1:])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t = cfg.topology
    print("\n".join([*export_lines(cfg),
                     f"export AREAL_RUN_DIR={shlex.quote(str(cfg.run_dir.resolve()))}",
                     f"export AREAL_N_TRAINERS={t.n_trainers}",
                     f"export AREAL_N_GENERATORS={t.n_generators}",
                     # GPUs per task of each het component (slurm/job.sh's srun --gpus-per-task)
                     f"export AREAL_GPUS_PER_TRAINER={gpus_needed(t, TRAINER, cfg.rollout.engine_tp)}",
                     f"export AREAL_GPUS_PER_GENERATOR={gpus_needed(t, GENERATOR, cfg.rollout.engine_tp)}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
