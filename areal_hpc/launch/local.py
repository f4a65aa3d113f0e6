"""One-machine launcher: validate the config, build the tiny model if the recipe needs it, then
start every rank with `mpiexec -n <trainers + generators>`.

    python -m areal_hpc.launch.local configs/tiny_cpu.yaml [key=value ...]
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from ..config import ConfigError
from ..cpus import check_cpus, describe
from ..preflight import launcher
from .env import merged_env


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
        cfg = launcher(config, overrides)
        check_cpus(cfg.topology)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n = cfg.topology.n_trainers + cfg.topology.n_generators
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "areal_hpc.main",
           config, *overrides]
    env = merged_env(cfg)
    print(f"[launch] {' '.join(cmd)}", flush=True)
    print(f"[launch] {describe(cfg.topology, env)}", flush=True)
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
