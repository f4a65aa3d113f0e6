"""One-machine launcher: validate the config, build the tiny model if the recipe needs it, then
start every rank with `mpiexec -n <trainers + generators>`.

    python -m areal_hpc.launch.local configs/tiny_cpu.yaml [key=value ...]
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..config import ConfigError, check_paths, load

TINY_MODEL = Path("models/tiny")


def rank_env(cfg) -> dict[str, str]:
    """Environment for every rank: one compute thread each on a small CPU box, vLLM's caches
    inside the project, the KV-cache size from the config."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if cfg.rollout.kv_cache_gib is not None:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.rollout.kv_cache_gib))
    env.setdefault("VLLM_CACHE_ROOT", str(Path(".cache/vllm").resolve()))
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # Megatron warns at import that TransformerEngine/Apex are absent: expected on CPU.
    env.setdefault("PYTHONWARNINGS", "ignore:Transformer Engine and Apex are not installed:UserWarning,"
                                     "ignore:Apex is not installed:UserWarning,"
                                     "ignore:full scope is deprecated:UserWarning")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def ensure_tiny_model(cfg) -> None:
    if Path(cfg.model.path).resolve() == TINY_MODEL.resolve() and not (TINY_MODEL / "config.json").exists():
        print(f"[launch] building the tiny model in {TINY_MODEL} (once, a few minutes)", flush=True)
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--out", str(TINY_MODEL)], check=True)


def mpiexec() -> str:
    exe = Path(sys.executable).parent / "mpiexec"
    return str(exe) if exe.exists() else (shutil.which("mpiexec") or "mpiexec")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    config, overrides = argv[0], argv[1:]
    try:
        cfg = load(config, overrides)
        ensure_tiny_model(cfg)
        check_paths(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n = cfg.topology.n_trainers + cfg.topology.n_generators
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "areal_hpc.main",
           config, *overrides]
    print(f"[launch] {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, env=rank_env(cfg)).returncode


if __name__ == "__main__":
    sys.exit(main())
