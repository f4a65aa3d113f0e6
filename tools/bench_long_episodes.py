"""Long multi-turn episodes with a slow tool whose latency is long-tailed, on the tiny model:
asynchronous against synchronous on the same work, and the effect of env.max_episodes. This is
the case asynchronous RL exists for: in sync mode every step waits for its slowest episode (the
longest one, behind the slowest tool calls); in async mode the engine goes on with other
episodes and later prompts meanwhile.

    python tools/bench_long_episodes.py --out long_episodes.json [--steps 6] [--settings ...]
    python tools/bench_long_episodes.py --table long_episodes.json

Every run is configs/tiny_cpu.yaml through the real launcher (mpiexec, Megatron-core, vLLM, one
environment process per episode) with `SlowTool` below as env.fn: 8-16 model turns per episode
(drawn per question), each answered after a lognormal delay (median 0.2 s, sigma 1, capped at
5 s: most answers are quick, a few take seconds), the reward whether the last turn holds the
answer. The same steps, prompts per step and samples per prompt in every setting (the same
trained episodes); the settings are run one after another, interleaved when repeated. Per run
(analysis/efficiency.py `run_efficiency` on its directory): wall time, engine busy share
(the engine generating / the generator's time), trained episodes per second, trained tokens per
second, the trainer's idle share, mean staleness.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "tools"))

from bench_tool_task import launch  # noqa: E402

ENV = '''
import hashlib
import math
import random
import time

from areal_hpc.env.base import Step, ToolCall


class SlowTool:
    """min_turns..max_turns model turns (drawn per question), each but the last answered by a
    tool after a lognormal delay (median median_s, sigma, capped at cap_s); the reward: the
    answer in the last turn."""

    def __init__(self, min_turns=8, max_turns=16, median_s=0.2, sigma=1.0, cap_s=5.0):
        self.min_turns, self.max_turns = min_turns, max_turns
        self.median_s, self.sigma, self.cap_s = median_s, sigma, cap_s

    def reset(self, row):
        seed = int(hashlib.sha256(row["question"].encode()).hexdigest()[:16], 16)
        self.rng = random.Random(seed ^ random.getrandbits(32))
        self.turns = self.rng.randint(self.min_turns, self.max_turns)
        self.n, self.answer = 0, str(row["answer"])
        return row["question"]

    def step(self, text, ids):
        self.n += 1
        if self.n >= self.turns:
            return Step(done=True, reward=float(self.answer in text))
        wait = min(self.cap_s, self.median_s * math.exp(self.sigma * self.rng.gauss(0.0, 1.0)))
        time.sleep(wait)
        out = f" t{self.n}:"
        return Step(observation=out, tool=ToolCall("slow", "", len(out), wait, None))
'''

BASE = ["rollout.max_new_tokens=12", "rollout.max_model_len=512", "env.max_episode_tokens=512",
        "env.max_turns=16", "env.call_timeout_s=30", "train.batch_prompts=4",
        "rollout.group_size=4", "data.eval_path=null", "checkpoint.every_steps=0"]
SETTINGS = {
    "async, max_episodes 32": ["env.max_episodes=32"],
    "sync, max_episodes 32": ["rollout.mode=sync", "env.max_episodes=32"],
    "async, max_episodes 4": ["env.max_episodes=4"],
    "sync, max_episodes 4": ["rollout.mode=sync", "env.max_episodes=4"],
}


def run(env_file: Path, model: str, overrides: list[str], out: Path, name: str, steps: int,
        timeout: float) -> tuple[int, float]:
    return launch(["configs/tiny_cpu.yaml", f"model.path={model}",
                   f"data.train_path={model}/train.jsonl", f"env.fn={env_file}:SlowTool",
                   f"train.total_steps={steps}", *BASE, *overrides], out, name, timeout)


def measure(run_dir: Path, mode: str) -> dict:
    from areal_hpc.analysis.efficiency import run_efficiency
    from areal_hpc.analysis.load import load_run
    from areal_hpc.storage.run_dir import RunDir

    eff = run_efficiency(run_dir, mode, target=1.0)
    t = load_run(RunDir(run_dir).rollouts).traj
    trained = t[t["consumed_step"] >= 0]
    return {"wall_s": eff["wall_s"], "engine_busy": eff["engine_busy"], "gen_busy": eff["gen_busy"],
            "episodes_s": len(trained) / eff["wall_s"], "trained_tok_s": eff["trained_tok_s"],
            "trainer_idle": eff["trainer_idle"], "stale_mean": eff["stale_mean"],
            "turns_mean": float(trained["turns"].mean()), "episodes": len(trained)}


def table(results: list[dict]) -> str:
    rows = ["| setting | wall (s) | engine busy | episodes/s | trained tokens/s | trainer idle | "
            "staleness | model turns per episode |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["figures"]
        rows.append(f"| {r['setting']} | {m['wall_s']:.0f} | {m['engine_busy']:.0%} | "
                    f"{m['episodes_s']:.2f} | {m['trained_tok_s']:.1f} | {m['trainer_idle']:.0%} | "
                    f"{m['stale_mean']:.2f} | {m['turns_mean']:.1f} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="results JSON (appended to as runs finish)")
    ap.add_argument("--table", type=Path, help="print the table of a results JSON and exit")
    ap.add_argument("--model", default="models/tiny", help="a make_tiny_model.py output")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if args.out is None:
        ap.error("--out is required")
    if not (ROOT / args.model / "config.json").exists():
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--out", args.model], cwd=ROOT,
                       check=True)
    results = json.loads(args.out.read_text()) if args.out.exists() else []
    with tempfile.TemporaryDirectory() as tmp:
        env_file = Path(tmp) / "slow_tool.py"
        env_file.write_text(ENV)
        for rep in range(args.repeats):
            for setting in args.settings:
                name = f"long_{rep}_{len(results)}"
                rc, secs = run(env_file, str(ROOT / args.model), SETTINGS[setting], Path(tmp), name,
                               args.steps, args.timeout)
                if rc != 0:
                    print(f"{setting}: exit {rc} after {secs:.0f} s", flush=True)
                    continue
                mode = "sync" if "rollout.mode=sync" in SETTINGS[setting] else "async"
                figures = measure(Path(tmp) / name, mode)
                results.append({"setting": setting, "repeat": rep, "process_s": secs,
                                "figures": figures})
                args.out.write_text(json.dumps(results, indent=2) + "\n")
                print(f"{setting}: {json.dumps(figures)}", flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
