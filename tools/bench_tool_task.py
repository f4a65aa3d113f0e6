"""The tiny task with a calculator tool (examples/calculator/), measured: with and without the tool,
asynchronous and synchronous, on this machine.

    python tools/bench_tool_task.py --seeds 0 --out tool_task.json
    python tools/bench_tool_task.py --table tool_task.json

Every run is examples/calculator/config.yaml through the real launcher (mpiexec, Megatron-core,
vLLM, the calculator's processes), on the model pre-trained with a calculator call in 40% of its
solutions (models/tiny_tool, built once). `tool`: env.fn=calculator, the call's result comes back
as a masked observation; `no tool`: env.fn unset, single-turn, the model writes the result itself.
Settings are interleaved within a seed. Per run: held-out accuracy before and after (eval.json,
the tool available at evaluation as in training), the training batches' accuracy over the first
and last 10 steps, the share of trajectories that open a call ("[" in the model's output) over
the first and last 10 steps, the accuracy of those with a call and without one over the last 10
steps, tool calls that failed, and the wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from areal_hpc.data.tiny_task import OPEN_TAG  # noqa: E402

CONFIG = "examples/calculator/config.yaml"
SETTINGS = {
    "tool, async": [],
    "no tool, async": ["env.fn=null"],
    "tool, sync": ["rollout.mode=sync"],
    "no tool, sync": ["env.fn=null", "rollout.mode=sync"],
}
WINDOW = 10


def run(overrides: list[str], out: Path, name: str, timeout: float) -> tuple[int, float]:
    return launch([CONFIG, *overrides], out, name, timeout)


def launch(args: list[str], out: Path, name: str, timeout: float) -> tuple[int, float]:
    """`python -m areal_hpc.launch.local CONFIG overrides...` as run `name` in `out`, one
    OpenMP thread per rank: (exit code, seconds); a failure's output's end on stderr."""
    cmd = [sys.executable, "-m", "areal_hpc.launch.local", args[0], f"name={name}",
           f"output_dir={out}", *args[1:]]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
    return r.returncode, time.monotonic() - t0


def measure(run_dir: Path) -> dict:
    """The figures of one finished run, from its files."""
    from transformers import AutoTokenizer

    from areal_hpc.storage.rollout_log import RolloutReader
    from areal_hpc.storage.run_dir import RunDir

    tok = AutoTokenizer.from_pretrained(ROOT / "models/tiny_tool")
    files = RunDir(run_dir)
    evals = {e["label"]: e["accuracy"] for e in files.read_all_evals()}
    steps = files.read_metrics()
    last = len(steps) - WINDOW
    out = {"heldout_initial": evals.get("initial"), "heldout_final": evals.get("final"),
           "train_acc_first": float(np.mean([s["accuracy"] for s in steps[:WINDOW]])),
           "train_acc_last": float(np.mean([s["accuracy"] for s in steps[last:]]))}
    rows = {"first": [], "last": []}
    failed = 0
    with RolloutReader(files.rollouts) as r:
        consumed = r.column("consumed_step")
        for i in np.flatnonzero(consumed >= 0):
            x = r[int(i)]
            failed += sum(1 for c in x["tool_calls"] if c["error"])
            sampled = x["output_tokens"][x["loss_mask"] == 1]
            called = OPEN_TAG in tok.decode(sampled)
            if consumed[i] < WINDOW:
                rows["first"].append((called, x["reward"]))
            elif consumed[i] >= last:
                rows["last"].append((called, x["reward"]))
    for part, got in rows.items():
        out[f"call_share_{part}"] = float(np.mean([c for c, _ in got]))
    with_call = [rw for c, rw in rows["last"] if c]
    without = [rw for c, rw in rows["last"] if not c]
    out["acc_last_with_call"] = float(np.mean(with_call)) if with_call else None
    out["acc_last_without_call"] = float(np.mean(without)) if without else None
    out["failed_calls"] = failed
    return out


def table(records: list[dict]) -> str:
    def f(x, spec="{:.3f}"):
        return "–" if x is None else spec.format(x)
    lines = ["| setting | seed | held-out before → after | train acc first → last 10 steps | "
             "calls first → last 10 steps | acc with / without a call (last 10) | failed calls | "
             "wall s |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r['setting']} | {r['seed']} | {f(r['heldout_initial'])} → {f(r['heldout_final'])} | "
            f"{f(r['train_acc_first'])} → {f(r['train_acc_last'])} | "
            f"{f(r['call_share_first'], '{:.0%}')} → {f(r['call_share_last'], '{:.0%}')} | "
            f"{f(r['acc_last_with_call'])} / {f(r['acc_last_without_call'])} | "
            f"{r['failed_calls']} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--out", type=Path, default=Path("tool_task.json"))
    ap.add_argument("--runs", type=Path, default=None, help="folder for the runs (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--table", type=Path, default=None, help="print the table of a results file")
    ap.add_argument("overrides", nargs="*", help="key=value, for every run")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    import tempfile
    runs = args.runs or Path(tempfile.mkdtemp(prefix="tool_task_"))
    records = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for setting, extra in SETTINGS.items():
            name = f"s{seed}_" + setting.replace(", ", "_").replace(" ", "")
            code, secs = run([f"train.seed={seed}", f"data.seed={seed}", *extra, *args.overrides],
                             runs, name, args.timeout)
            rec = {"setting": setting, "seed": seed, "exit": code, "seconds": secs}
            if code == 0:
                rec |= measure(runs / name)
            records.append(rec)
            print(f"{setting} seed {seed}: exit {code}, {secs:.0f} s", flush=True)
            args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(table([r for r in records if r["exit"] == 0]))


if __name__ == "__main__":
    main()
