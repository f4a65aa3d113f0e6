"""What one attempt of the tiny job costs, process by process: the CPU seconds of the launcher,
each rank, vLLM's engine and worker processes and whatever else the job starts, and the wall time.

A job attempt's start-up is most of what the test suite spends (each end-to-end test starts one
or more), so this is where start-up cost is measured. Several checkouts are measured side by side,
alternating, so that a difference is not the machine's drift between runs:

    python tools/bench_attempt.py MODEL_DIR [--repeat 3] [--checkout DIR ...]

MODEL_DIR: a tiny model (tools/make_tiny_model.py). Each checkout runs its own code with this
interpreter (default: this one). Prints one line per run and the medians per checkout.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("launcher", "trainer", "generator", "EngineCore", "Worker", "other")


def kind(p: psutil.Process, launcher_pid: int) -> str:
    """What process `p` of the job is (the tiny job's rank 0 trains, rank 1 generates)."""
    text, name = " ".join(p.cmdline()), p.name()
    if p.pid == launcher_pid:
        return "launcher"
    if "EngineCore" in name or "EngineCore" in text:
        return "EngineCore"
    if "Worker" in name or "Worker" in text:
        return "Worker"
    if "areal_hpc.main" in text:
        return "trainer" if p.environ().get("PMI_RANK") == "0" else "generator"
    return "other"


def attempt(checkout: Path, model: str, out: Path, name: str, steps: int) -> dict:
    """Run the tiny job once from `checkout`; CPU seconds by kind of process, and the wall time."""
    args = [sys.executable, "-m", "areal_hpc.launch.local", "configs/tiny_cpu.yaml", f"model.path={model}",
            f"data.train_path={model}/train.jsonl", f"data.eval_path={model}/heldout.jsonl",
            f"output_dir={out}", f"name={name}", f"train.total_steps={steps}", "data.eval_limit=4",
            "data.eval_samples=1"]
    t0 = time.monotonic()
    proc = subprocess.Popen(args, cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root, seen = psutil.Process(proc.pid), {}
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                cpu = p.cpu_times()
                seen[p.pid] = (kind(p, proc.pid), cpu.user + cpu.system)    # its latest name
            except psutil.Error:
                pass
        time.sleep(0.2)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: the job failed (exit {proc.returncode})")
    res = {k: 0.0 for k in KINDS}
    for k, cpu in seen.values():
        res[k] += cpu
    res["total"] = sum(res[k] for k in KINDS)
    res["wall"] = wall
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a tiny model directory (tools/make_tiny_model.py)")
    ap.add_argument("--checkout", action="append", type=Path, help="a checkout to measure (default: this one); repeatable")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    checkouts = a.checkout or [ROOT]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results: dict[Path, list[dict]] = {c: [] for c in checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeat):
            for c in checkouts:
                r = attempt(c, a.model, Path(tmp) / c.name, f"r{i}", a.steps)
                results[c].append(r)
                print(f"{c}: run {i}: " + ", ".join(f"{k} {r[k]:.1f}" for k in (*KINDS, "total", "wall")), flush=True)
    print(f"\nmedians over {a.repeat} run(s), CPU seconds by process (wall: seconds):")
    print("| checkout | " + " | ".join((*KINDS, "CPU total", "wall")) + " |")
    print("|" + "---|" * (len(KINDS) + 3))
    for c, rs in results.items():
        print(f"| {c.name} | " + " | ".join(f"{statistics.median(r[k] for r in rs):.1f}"
                                             for k in (*KINDS, "total", "wall")) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
