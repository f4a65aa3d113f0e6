"""How efficiently a finished run used its machines, from its run directory (metrics.jsonl,
generators.json, eval.json, rollouts.h5): `run_efficiency`."""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from ..storage.run_dir import RunDir
from ..transport.messages import LOOP_WORK
from .load import load_run

WINDOW = 5      # training-accuracy moving mean, in steps


def first_time_at(points: list[tuple[float, float]], target: float) -> float | None:
    """The first time (of (time, value) points in order) the value reaches `target`."""
    return next((t for t, v in points if v >= target), None)


def run_efficiency(run: Path, mode: str, target: float) -> dict:
    """A finished run's efficiency from its directory: wall time and steps/h, the generators'
    time split and busy shares, the trainer's idle share, the ideal bound (`pipelined_bound`
    for async, the phases' sum for sync), staleness and drops, lengths, the held-out and
    training-accuracy curves and the time each first reaches `target`, the off-policy
    diagnostics of the last 10 steps, and whether the run collapsed (`mode`: "sync" or
    "async"). What tools/bench_async_vs_sync.py records per run."""
    from ..plan.calibration import read_metrics
    from ..plan.throughput import pipelined_bound
    rd = RunDir(run)
    steps = read_metrics(rd.path)
    gens, evals = rd.read_generators(), rd.read_all_evals()
    wall = steps[-1]["elapsed_s"]
    n = len(steps)
    busy = sum(g.seconds["busy"] for g in gens)
    pause = sum(g.seconds["pause"] for g in gens)
    idle = sum(g.idle_s() for g in gens)
    other = sum(g.loop_work() for g in gens)            # the generator loop's own work
    loop = {k: sum(g.seconds.get(k, 0.0) for g in gens) for k in LOOP_WORK}
    gen_tokens = sum(g.tokens for g in gens)
    train_s = float(np.mean([s["seconds"] for s in steps]))
    sync_s = float(np.mean([s["weight_sync_s"] for s in steps]))
    wait = sum(s["wait_s"] for s in steps)
    trained_tokens = sum(s["n_tokens"] for s in steps)
    gen_rate = gen_tokens / busy if busy else float("nan")       # tokens/s while generating
    per_step = gen_tokens / n
    load_s = pause / n / max(1, len(gens))     # a generator's pause to load one version
    if mode == "sync":
        ideal = n * (per_step / gen_rate + train_s + sync_s)
        ideal_no_load = ideal
    else:
        ideal = pipelined_bound(n, per_step / gen_rate + load_s, train_s + sync_s)
        ideal_no_load = pipelined_bound(n, per_step / gen_rate, train_s + sync_s)
    data = load_run(rd.rollouts)
    t = data.traj
    trained = t[t["consumed_step"] >= 0]
    dropped = t[t["consumed_step"] == -2]
    st = trained["staleness"].to_numpy(dtype=float)
    elapsed = {s["version"]: s["elapsed_s"] for s in steps}
    held = [(elapsed[e["step"]], e["accuracy"]) for e in evals if e.get("step") in elapsed]
    acc = np.array([s["accuracy"] for s in steps])
    moving = np.convolve(acc, np.ones(WINDOW) / WINDOW, mode="valid") if n >= WINDOW else []
    train_curve = [(steps[i + WINDOW - 1]["elapsed_s"], float(v)) for i, v in enumerate(moving)]
    final = next((e for e in evals if e.get("label") == "final"), {})
    return {
        "steps": n, "wall_s": wall, "steps_per_h": 3600 * n / wall,
        "trained_tok_s": trained_tokens / wall,
        "gen_busy": statistics.mean(g.busy_share() for g in gens),
        "engine_busy": statistics.mean(g.engine_share()
                                       for g in gens),
        "gen_seconds": {"busy": busy, "pause": pause, "idle": idle, "other": other},
        "gen_loop_seconds": loop,
        "trainer_idle": wait / wall, "train_s": train_s, "sync_s": sync_s,
        "gen_tok_s_busy": gen_rate, "gen_tokens_per_step": per_step,
        "ideal_s": ideal, "of_ideal": ideal / wall, "load_s": load_s,
        "ideal_no_load_s": ideal_no_load, "of_ideal_no_load": ideal_no_load / wall,
        "stale_mean": float(st.mean()) if len(st) else 0.0,
        "stale_p95": float(np.percentile(st, 95)) if len(st) else 0.0,
        "dropped_groups": int(len(dropped) // max(1, int(data.config["rollout"]["group_size"]))),
        "dropped_len": float(dropped["output_len"].mean()) if len(dropped) else None,
        "dropped_reward": float(dropped["reward"].mean()) if len(dropped) else None,
        "trained_len": float(trained["output_len"].mean()),
        "trained_reward": float(trained["reward"].mean()),
        "len_median": float(t["output_len"].median()), "len_p99": float(t["output_len"].quantile(0.99)),
        "final_acc": final.get("accuracy"), "initial_acc": evals[0].get("accuracy") if evals else None,
        "held_curve": held, "train_curve": train_curve,
        "t_target_heldout": first_time_at(held, target),
        "t_target_train": first_time_at(train_curve, target),
        "clip_frac": float(np.mean([s.get("clip_frac", 0.0) for s in steps])),
        "imp_weight_mean": float(np.mean([s.get("imp_weight_mean", 1.0) for s in steps])),
        "behav_dropped_frac": float(np.mean([s.get("dropped_frac", 0.0) for s in steps])),
        "reward_curve": [s["reward"] for s in steps],
        # the off-policy diagnostics, mean over the last 10 steps (absent in older runs: NaN)
        **{f"{k}_last10": float(np.mean([s.get(k, np.nan) for s in steps[-10:]]))
           for k in ("ess", "seq_ess", "kl_behav", "truncated_frac", "response_len")},
        "zero_var_groups": int(sum(s.get("zero_var_groups", 0) for s in steps)),
        "no_signal_steps": int(sum(s.get("no_signal_steps", 0) for s in steps)),
        # a collapse: the last 10 steps' batch reward at (nearly) zero
        "collapsed": bool(np.mean([s["reward"] for s in steps[-10:]]) < 0.02),
    }
