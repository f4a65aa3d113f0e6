"""How efficiently a finished run used its machines, from its run directory (metrics.jsonl,
generators.json, eval.json, rollouts.h5): `run_efficiency`; and whether it collapsed:
`collapse_point`."""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from ..plan.calibration import read_metrics
from ..plan.throughput import pipelined_bound
from ..storage.run_dir import RunDir
from ..train.diagnostics import measured
from ..transport.messages import LOOP_WORK
from .load import load_run

WINDOW = 5      # training-accuracy moving mean, in steps
COLLAPSE_REWARD = 0.02      # a 5-step mean batch reward below this is (nearly) zero
COLLAPSE_HELD_FRAC = 0.5    # a held-out evaluation below this share of the initial one
# per-step diagnostics that a step with nothing to measure writes as null (or NaN)
LAST10 = ("ess", "seq_ess", "kl_behav", "truncated_frac", "response_len")
WHOLE_RUN = {"clip_frac": ("clip_frac", 0.0), "imp_weight_mean": ("imp_weight_mean", 1.0),
             "behav_dropped_frac": ("dropped_frac", 0.0)}     # record key: (metrics key, if absent)


def first_time_at(points: list[tuple[float, float]], target: float) -> float | None:
    """The first time (of (time, value) points in order) the value reaches `target`."""
    return next((t for t, v in points if v >= target), None)


def mean_skipping(values) -> tuple[float, int]:
    """The mean of `values` with None and NaN skipped (NaN when nothing is left), and how many
    were skipped."""
    values = list(values)
    kept = [float(v) for v in values if measured(v)]
    return (float(np.mean(kept)) if kept else float("nan")), len(values) - len(kept)


def step_mean(steps: list[dict], key: str, absent=None) -> tuple[float, int]:
    """`mean_skipping` of one metrics.jsonl field over `steps`. A step without the field (a run
    from before it was logged) counts as `absent`, or is left out uncounted when that is None;
    a null or NaN field (nothing to measure at that step) is skipped and counted."""
    return mean_skipping(s[key] if key in s else absent for s in steps if key in s or absent is not None)


def moving_mean(values: list, window: int = WINDOW) -> list[float]:
    """The `window`-value moving mean (one per complete window, the first ending at index
    window - 1), None and NaN skipped within each window (NaN when a window has no value)."""
    return [mean_skipping(values[i - window + 1:i + 1])[0] for i in range(window - 1, len(values))]


def collapse_point(rewards: list, evals: list[dict], steps: list[int] | None = None,
                   window: int = WINDOW) -> tuple[int | None, str | None]:
    """Where a run collapsed: (the step, what showed it), or (None, None). A run collapsed at
    the first point where a held-out evaluation after the first one (`evals`, eval.json's, in
    order; `step` is the policy version) scores below COLLAPSE_HELD_FRAC of the first one
    ("held-out"), or the batch reward's `window`-step moving mean (`rewards`, one per step,
    None/NaN skipped) falls below COLLAPSE_REWARD, checked from the first complete window on
    ("reward"). `steps`: each reward's step number, counted as the evaluations count versions
    (default 1, 2, ...). A collapse that recovers later still counts; a run whose last 10
    steps' mean reward is below COLLAPSE_REWARD (the old rule) has a 5-step window below it."""
    steps = list(range(1, len(rewards) + 1)) if steps is None else steps
    found = []
    initial = evals[0].get("accuracy") if evals else None
    if measured(initial) and initial > 0:
        found += [(e["step"], "held-out") for e in evals[1:]
                  if measured(e.get("accuracy")) and e["accuracy"] < COLLAPSE_HELD_FRAC * initial]
    found += [(steps[i + window - 1], "reward") for i, m in enumerate(moving_mean(rewards, window))
              if measured(m) and m < COLLAPSE_REWARD]
    return min(found, key=lambda f: f[0]) if found else (None, None)


def run_efficiency(run: Path, mode: str, target: float) -> dict:
    """A finished run's efficiency from its directory: wall time and steps/h, the generators'
    time split and busy shares, the trainer's idle share, the ideal bound (`pipelined_bound`
    for async, the phases' sum for sync), staleness and drops, lengths, the held-out and
    training-accuracy curves and the time each first reaches `target`, the off-policy
    diagnostics of the last 10 steps, and whether and where the run collapsed (`collapse_point`)
    (`mode`: "sync" or "async"). What tools/bench_async_vs_sync.py records per run.

    Every mean over steps skips the steps whose field is null or NaN (a diagnostic with nothing
    to measure at that step); `diag_skipped` (whole-run means) and `diag_skipped_last10` (the
    last 10 steps') count them per field."""
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
    moving = moving_mean([s.get("accuracy") for s in steps])
    train_curve = [(steps[i + WINDOW - 1]["elapsed_s"], v) for i, v in enumerate(moving) if measured(v)]
    final = next((e for e in evals if e.get("label") == "final"), {})
    rewards = [s.get("reward") for s in steps]
    collapsed_at, collapsed_by = collapse_point(rewards, evals, [s.get("version", s["step"] + 1) for s in steps])
    whole = {rec: step_mean(steps, key, absent) for rec, (key, absent) in WHOLE_RUN.items()}
    last10 = {k: step_mean(steps[-10:], k) for k in LAST10}
    reward10 = mean_skipping(rewards[-10:])
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
        # whole-run means of the per-step diagnostics (absent in older runs: the ideal value)
        **{k: v for k, (v, _) in whole.items()},
        "reward_curve": rewards, "reward_last10": reward10[0],
        # the off-policy diagnostics, mean over the last 10 steps (absent in older runs: NaN)
        **{f"{k}_last10": v for k, (v, _) in last10.items()},
        # steps skipped by those means: the field null or NaN
        "diag_skipped": {k: c for k, (_, c) in whole.items()},
        "diag_skipped_last10": {"reward": reward10[1], **{k: c for k, (_, c) in last10.items()}},
        "zero_var_groups": int(sum(s.get("zero_var_groups") or 0 for s in steps)),
        "no_signal_steps": int(sum(s.get("no_signal_steps") or 0 for s in steps)),
        # a collapse (`collapse_point`): where, and whether the held-out or the reward showed it
        "collapsed": collapsed_at is not None, "collapsed_at": collapsed_at, "collapsed_by": collapsed_by,
    }
