"""One-machine launcher: validate the config, build the tiny model if the recipe needs it, then
start every rank with `mpiexec -n <trainers + generators>`.

    python -m areal_hpc.launch.local configs/tiny_cpu.yaml [key=value ...]
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from .. import stuck
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
    rc = subprocess.run(cmd, env=env).returncode
    flag = stuck.flag_path(cfg.run_dir)
    if rc and flag.exists():        # mpiexec reports the killed ranks' code, not the stuck one's
        line = (flag.read_text(errors="replace").splitlines() or ["a rank"])[0]
        print(f"[launch] {line}: the ranks' stacks are above; rerun the same command to resume "
              f"from the newest checkpoint (exit {stuck.EXIT_STUCK})", file=sys.stderr, flush=True)
        return stuck.EXIT_STUCK
    return rc


if __name__ == "__main__":
    sys.exit(main())
