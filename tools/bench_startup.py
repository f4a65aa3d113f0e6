#!/usr/bin/env python
"""What the test suite pays to start its real components, each in a fresh process, the median of
`--reps` runs (seconds of wall clock, and the CPU seconds of the processes it started; the box
should be quiet):

  import_vllm     `import vllm` (every vLLM process pays it: the rank, its EngineCore, each worker)
  engine          a VLLMEngine on the tiny model up (EngineCore spawned, its worker forked:
                  areal_hpc/rollout/vllm_workers.py), then shut down
  engine_spawned  the same with vLLM's own executor, the worker spawned (as before the fork)
  megatron        a one-rank trainer: gloo world, Megatron's groups, the tiny model's Actor built
  mpi_world       `mpiexec -n 2 python -m mpi4py` with a barrier
  tiny_model      tools/make_tiny_model.py --steps 30 (the suite's `tiny_model`, built once a run)
  tiny_job        the tiny job of one step through the launcher (mpiexec, trainer + generator):
                  the start-up of every e2e attempt, plus one step, the evals and the export
  slurm_cluster   tools/local_slurm.sh up, then down (once a run: the Slurm modules' group)

Usage: python tools/bench_startup.py [--reps 3] [--only engine,engine_spawned,tiny_job] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

ENGINE = """
import sys
from areal_hpc.rollout import vllm_engine
from areal_hpc.rollout.vllm_engine import VLLMEngine
if len(sys.argv) > 2:
    vllm_engine.FORKED_WORKERS = sys.argv[2]   # "mp": vLLM's executor, spawned workers on CPU
def main():
    e = VLLMEngine(sys.argv[1], dtype="float32", max_model_len=512)
    e.shutdown()
if __name__ == "__main__":
    main()
"""

MEGATRON = """
import sys
from areal_hpc.config import load
from areal_hpc.train.megatron_model import single_process
from areal_hpc.train.trainer import make_actor
m = sys.argv[1]
cfg = load("configs/tiny_cpu.yaml", [f"model.path={m}", f"data.train_path={m}/train.jsonl"])
single_process()
make_actor(cfg, None)
"""

MPI_WORLD = "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _timed(cmd: list[str], timeout: float = 900, cpu: list | None = None) -> float:
    """Seconds `cmd` took; the CPU seconds of its reaped processes appended to `cpu`."""
    t0, c0 = time.perf_counter(), _cpu_s()
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    took = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])}…: exit {r.returncode}\n{r.stderr[-3000:]}")
    if cpu is not None:
        cpu.append(_cpu_s() - c0)
    return took


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="import_vllm,engine,megatron,mpi_world,tiny_model,tiny_job,slurm_cluster")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from areal_hpc.launch.local import mpiexec

    work = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    model = work / "tiny"
    build = [PY, "tools/make_tiny_model.py", "--out", str(model), "--steps", "30"]
    cases = {
        "import_vllm": lambda i: [PY, "-c", "import vllm"],
        "engine": lambda i: [PY, "-c", ENGINE, str(model)],
        "engine_spawned": lambda i: [PY, "-c", ENGINE, str(model), "mp"],
        "megatron": lambda i: [PY, "-c", MEGATRON, str(model)],
        "mpi_world": lambda i: [mpiexec(), "-n", "2", PY, "-m", "mpi4py", "-c", MPI_WORLD],
        "tiny_model": lambda i: [PY, "tools/make_tiny_model.py", "--out", str(work / f"m{i}"), "--steps", "30"],
        "tiny_job": lambda i: [PY, "-m", "areal_hpc.launch.local", "configs/tiny_cpu.yaml", f"model.path={model}",
                               f"data.train_path={model}/train.jsonl", f"data.eval_path={model}/heldout.jsonl",
                               f"output_dir={work}", f"name=job{i}", "train.total_steps=1", "train.batch_prompts=3",
                               "rollout.group_size=2", "rollout.max_new_tokens=24", "data.eval_limit=4",
                               "data.eval_samples=1"],
    }
    only = args.only.split(",")
    if {"engine", "engine_spawned", "megatron", "tiny_job"} & set(only):
        _timed(build)
    results = {}
    for name in only:
        if name == "slurm_cluster":
            tool = str(ROOT / "tools/local_slurm.sh")
            if subprocess.run([tool, "status"], capture_output=True).returncode == 0:
                print("slurm_cluster: a cluster already runs here; not measured", file=sys.stderr)
                continue
            ups, downs = [], []
            for _ in range(args.reps):
                ups.append(_timed([tool, "up"]))
                downs.append(_timed([tool, "down"]))
            results[name] = {"median_s": statistics.median(ups), "runs_s": ups,
                             "down_median_s": statistics.median(downs)}
        else:
            cpu: list[float] = []
            runs = [_timed(cases[name](i), cpu=cpu) for i in range(args.reps)]
            results[name] = {"median_s": statistics.median(runs), "runs_s": runs,
                             "cpu_median_s": statistics.median(cpu)}
        r = results[name]
        print(f"{name:14s} median {r['median_s']:6.1f} s   runs " + " ".join(f"{x:.1f}" for x in r["runs_s"])
              + (f"   CPU median {r['cpu_median_s']:.1f} s" if "cpu_median_s" in r else ""), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
