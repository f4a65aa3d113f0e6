"""Asynchronous vs synchronous RL at equal hardware, and the η × π_prox ablation, on this machine.

    python tools/bench_async_vs_sync.py --seeds 0,1,2 --steps 40                 # item 1, tiny task
    python tools/bench_async_vs_sync.py --task longtail --seeds 0,1,2            # long-tailed lengths
    python tools/bench_async_vs_sync.py --ablation --etas 0,1,2,4,8 --seeds 0,1  # η × π_prox
    python tools/bench_async_vs_sync.py --ablation --etas 2,8 --objectives decoupled,naive,trust_region \
        --seeds 0,1,2 --out abl.json train.ppo_minibatches=4      # η × train.off_policy
    python tools/bench_async_vs_sync.py --paired abl.json [more.json ...]   # paired differences
    python tools/bench_async_vs_sync.py --paired abl.json --baseline naive  # (or all: every pair)
    python tools/bench_async_vs_sync.py --table abl.json            # mean ± sd per cell
    python tools/bench_async_vs_sync.py --compare results.json      # the planner beside the runs
    python tools/bench_async_vs_sync.py --plot results.json docs/x.png
    python tools/bench_async_vs_sync.py --tail-eval results.json    # final policies on the tail

Every setting is the tiny recipe (configs/tiny_cpu.yaml) through the real launcher (mpiexec,
Megatron-core, vLLM), one run after another, the settings interleaved within each seed so that
load drifting on a shared box hits them alike. The CPU placement is the launcher's
(`topology.trainer_cpus` / `generator_cpus`, printed by it):

- `sync`: rollout.mode=sync with both roles on every core: each phase (generate a whole batch,
  then train on it) has all cores in turn: the colocated synchronous baseline.
- `async-T/G`: rollout.mode=async with the trainer on T cores and the generator on the other G.
- `sync-split`: rollout.mode=sync on disjoint cores (what a plain sync run did before).

Per run (from its metrics.jsonl, generators.json, eval.json and rollouts.h5): training wall time
(the trainer's clock from its first step, held-out evaluations excluded), steps/hour, trained
tokens/s, generator busy share (generating over its span from the first prompt until the last
batch is taken: generating + weight-update pauses + idle + loop work, held-out evaluations set
apart), engine busy share (of the same span, the time its vLLM engine had training requests,
weight-update pauses apart: the EngineCore generates in its own process while the loop works),
trainer idle share (waiting for rollouts / wall), staleness mean / p95 of trained samples,
dropped-stale groups, final held-out accuracy, and the time to a target accuracy (held-out,
every --eval-every steps; and on the training batches' accuracy, a 5-step moving mean).

The **ideal bound** of a run is computed from its own measured component rates: generation
tokens/s while busy, training seconds per step, the update's blocking seconds on the trainer
(train + update) and on the generator (loading a version: it cannot generate meanwhile), tokens
generated per step. Async on disjoint cores, with g = generation per step / its rate + load and
t = train + update: steps × max(g, t) + min(g, t) (the pipeline's fill or drain: the first batch
is generated before any step, the last step trains after the last batch), as the throughput
planner's bound (`pipelined_bound` in areal_hpc.plan.throughput); sync: steps × (generation per
step / rate + train + update). No schedule of the same work at the same rates does better.
`of_ideal_no_load` is the earlier, stricter form, which treats loading weights as free for the
generator. Results go to --out (JSON, one record per run) and a markdown table.

The ablation (--ablation) runs every setting of a seed with the same seeds (train.seed,
data.seed) and per-request sampling seeds (rollout.per_request_seeds=true unless an override
sets it), so two objectives draw the same samples until their policies diverge (common random
numbers). `--paired` (also printed at the end of an ablation) compares them seed by seed:
per (regime, η) cell and pair of objectives, the per-seed differences' mean, sd, paired t
interval, the pooled sd and the unpaired (Welch) interval over the same runs
(areal_hpc/analysis/paired.py); failed runs are listed, not dropped. A run "collapsed"
(`collapse_point` in areal_hpc/analysis/efficiency.py) where a held-out evaluation falls below
half the initial one or the 5-step mean batch reward below 0.02; means over steps skip the
steps whose diagnostic is null or NaN and the tables say how many.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from areal_hpc.cpus import format_cpus  # noqa: E402

from areal_hpc.analysis.efficiency import (WINDOW, first_time_at, measured, moving_mean,  # noqa: E402
                                           run_efficiency)
from areal_hpc.analysis.paired import last2_heldout, paired_table, reward_last10  # noqa: E402


def settings(cpus: list[int], splits: list[int]) -> dict[str, list[str]]:
    """name → overrides. `splits`: trainer core counts for the async runs."""
    every = format_cpus(cpus)
    out = {"sync": ["rollout.mode=sync", f"topology.trainer_cpus={every}",
                    f"topology.generator_cpus={every}"]}
    for t in splits:
        tr, gen = cpus[:t], cpus[t:]
        out[f"async-{t}/{len(gen)}"] = ["rollout.mode=async", f"topology.trainer_cpus={format_cpus(tr)}",
                                        f"topology.generator_cpus={format_cpus(gen)}"]
    if len(cpus) >= 2:
        out["sync-split"] = ["rollout.mode=sync", f"topology.trainer_cpus={format_cpus(cpus[:1])}",
                             f"topology.generator_cpus={format_cpus(cpus[1:])}"]
    return out


def longtail_data(out: Path, seed: int = 1, n: int = 2000, max_terms: int = 40) -> tuple[Path, Path]:
    """The tiny task with a longer tail of term counts (2..max_terms terms, P(k) ∝ 1/k): a few
    problems take many times the median's tokens, as reasoning traces do."""
    from areal_hpc.data.tiny_task import make_problems
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, s, count in (("train", seed, n), ("heldout", seed + 1000, 200)):
        rows = make_problems(count, s, max_terms=max_terms, tail_exponent=1.0)
        p = out / f"{name}.jsonl"
        p.write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n"
                             for r in rows))
        paths.append(p)
    return paths[0], paths[1]


TAIL_BUCKETS = ((2, 10), (11, 20), (21, 40))     # term counts: the pre-trained range, the tail


def tail_eval(path: Path, per_k: int = 6, samples: int = 4) -> None:
    """Evaluate the final policy of every run in a results file on a held-out set that weighs
    the tail: `per_k` problems for every term count 2..40 (uniform in k, unlike the training
    distribution's P(k) ∝ 1/k), `samples` each, with the run's own sampling settings; accuracy
    per bucket of term counts (TAIL_BUCKETS) is added to the records (`tail_acc`) and printed."""
    import random
    from areal_hpc.analysis.evaluate import EvalSettings, evaluate
    from areal_hpc.config import load
    from areal_hpc.data.prompts import load_prompts
    from areal_hpc.data.tiny_task import format_question
    data = json.loads(path.read_text())
    rng = random.Random(4242)
    problems = []
    for k in range(TAIL_BUCKETS[0][0], TAIL_BUCKETS[-1][1] + 1):
        for _ in range(per_k):
            terms = [rng.randint(0, 9) for _ in range(k)]
            problems.append({"question": format_question(terms), "answer": str(sum(terms))})
    held = Path(tempfile.mkdtemp(prefix="tail_eval_")) / "tail.jsonl"
    held.write_text("".join(json.dumps(p) + "\n" for p in problems))
    terms_of = [q["question"].count("+") + 1 for q in problems]
    for rec in (r for r in data["records"] if r.get("ok")):
        run = Path(rec["run_dir"])
        s = EvalSettings.from_config(load(str(run / "config.yaml")))
        s.samples, s.limit = samples, 0
        rows = load_prompts(str(held), s.kind, s.question_key, s.answer_key)
        res = evaluate(run / "policy", rows, s, progress=False)
        acc = {}
        for lo, hi in TAIL_BUCKETS:
            c = [res["correct"][i] for i, k in enumerate(terms_of) if lo <= k <= hi]
            acc[f"{lo}-{hi}"] = sum(c) / (samples * len(c))
        acc["all"] = res["accuracy"]
        rec["tail_acc"] = acc
        print(f"[tail] {rec['setting']} seed {rec['seed']}: "
              + ", ".join(f"{k} terms {v:.3f}" for k, v in acc.items()), flush=True)
        path.write_text(json.dumps(data, indent=1, default=str))


def run_job(overrides: list[str], out_dir: Path, name: str, timeout: float,
            root: Path = ROOT) -> tuple[int, float, str, float]:
    """Run one job from the checkout `root` (its package first on the path); returns (exit
    code, seconds, the launcher's placement line, CPU seconds of the whole job: every process of
    it, reaped through mpiexec)."""
    import resource
    cmd = [sys.executable, "-m", "areal_hpc.launch.local", "configs/tiny_cpu.yaml",
           f"name={name}", f"output_dir={out_dir}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if root != ROOT:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    placement = next((ln for ln in r.stdout.splitlines() if "rank(s)" in ln and "[launch]" in ln), "")
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
    return r.returncode, time.monotonic() - t0, placement, cpu


def compare(path: Path) -> None:
    """The throughput planner (areal_hpc.plan.throughput) beside the measured runs of a results
    file: each run replayed from its own measured rates (`calibrate`), and the speedup predicted
    from the async runs alone (the sync baseline at linearly scaled rates, the planner's default)."""
    from areal_hpc.config import load
    from areal_hpc.plan.calibration import calibrate
    from areal_hpc.plan.throughput import predict
    data = json.loads(path.read_text())
    rows, by = [], {}
    for rec in (r for r in data["records"] if r.get("ok")):
        run = Path(rec["run_dir"])
        cfg = load(str(run / "config.yaml"))
        rates = calibrate(run)
        sync = cfg.rollout.mode == "sync"
        pred = predict(cfg, rates, steps=rec["steps"], sync_gen_scale=1.0, sync_train_scale=1.0)
        mine = pred.sync if sync else pred.async_
        cross = None if sync else predict(cfg, rates, steps=rec["steps"])
        by.setdefault(rec["setting"], []).append((rec, mine, cross))
        rows.append(f"| {rec['setting']} | {rec['seed']} | {rec['wall_s']:.1f} | {mine.wall_s:.1f} | "
                    f"{rec['gen_busy']:.2f} | {rec.get('engine_busy', float('nan')):.2f} | "
                    f"{mine.gen_busy_frac:.2f} | {rec['stale_mean']:.2f} | "
                    f"{mine.staleness_mean:.2f} |")
    print("| setting | seed | measured wall s | predicted wall s | measured gen busy | engine busy | "
          "predicted | measured stale mean | predicted |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for base in (k for k in by if k.startswith("sync")):
        m_sync = statistics.mean(r["wall_s"] for r, _, _ in by[base])
        p_sync = statistics.mean(p.wall_s for _, p, _ in by[base])
        for key, items in by.items():
            if key.startswith("async"):
                m = m_sync / statistics.mean(r["wall_s"] for r, _, _ in items)
                p = p_sync / statistics.mean(p.wall_s for _, p, _ in items)
                line = (f"speedup {key} vs {base}: measured {m:.2f}×, planner from each run's "
                        f"rates {p:.2f}× ({100 * (p / m - 1):+.0f}%)")
                if base == "sync":
                    c = statistics.mean(x.speedup for _, _, x in items)
                    line += (f", planner from the async runs alone (sync at linearly scaled "
                             f"rates) {c:.2f}× ({100 * (c / m - 1):+.0f}%)")
                print(line)


def plot(path: Path, out: Path) -> None:
    """Held-out accuracy against the training clock (async/sync results) or the batches' reward
    per step (ablation results), one line per run, to a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = json.loads(path.read_text())
    recs = [r for r in data["records"] if r.get("ok")]
    keys = list(dict.fromkeys(r["setting"] for r in recs))
    colours = {k: plt.cm.tab10(i % 10) for i, k in enumerate(keys)}
    ablation = any(k.startswith("eta") for k in keys)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in recs:
        label = r["setting"] if r["seed"] == min(x["seed"] for x in recs if x["setting"] == r["setting"]) else None
        if ablation:
            y = moving_mean(r["reward_curve"], WINDOW)
            ax.plot(np.arange(len(y)) + WINDOW, y, color=colours[r["setting"]], label=label, lw=1)
        else:
            curve = [(0.0, r["initial_acc"]), *r["held_curve"]]
            if r.get("final_acc") is not None:
                curve.append((r["wall_s"], r["final_acc"]))
            ax.plot(*zip(*curve), marker="o", color=colours[r["setting"]], label=label, lw=1)
    ax.set_xlabel("training step" if ablation else "training wall time, s (held-out evaluations excluded)")
    ax.set_ylabel(f"batch reward ({WINDOW}-step mean)" if ablation else "held-out accuracy")
    ax.set_title(f"{data['records'][0]['task']} task, {data['args']['steps']} steps, "
                 f"{len({r['seed'] for r in recs})} seed(s)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def _fmt(x, spec="{:.3g}") -> str:
    return "–" if x is None or (isinstance(x, float) and not np.isfinite(x)) else spec.format(x)


def _ms(values: list, spec="{:.3g}") -> str:
    values = [v for v in values if measured(v)]
    if not values:
        return "–"
    if len(values) == 1:
        return spec.format(values[0])
    return f"{spec.format(statistics.mean(values))} ± {spec.format(statistics.stdev(values))}"


def table(records: list[dict], keys: list[str]) -> str:
    """Mean ± sd over seeds per setting."""
    cols = [("wall s", "wall_s", "{:.1f}"), ("ideal s", "ideal_s", "{:.1f}"),
            ("of ideal", "of_ideal", "{:.2f}"), ("of ideal, load free", "of_ideal_no_load", "{:.2f}"),
            ("steps/h", "steps_per_h", "{:.0f}"),
            ("trained tok/s", "trained_tok_s", "{:.0f}"), ("gen busy", "gen_busy", "{:.2f}"),
            ("engine busy", "engine_busy", "{:.2f}"), ("trainer idle", "trainer_idle", "{:.2f}"),
            ("stale mean", "stale_mean", "{:.2f}"),
            ("stale p95", "stale_p95", "{:.1f}"), ("dropped", "dropped_groups", "{:.0f}"),
            ("final acc", "final_acc", "{:.3f}"), ("t→target held-out s", "t_target_heldout", "{:.1f}"),
            ("t→target train s", "t_target_train", "{:.1f}")]
    lines = ["| setting | seeds | " + " | ".join(c[0] for c in cols) + " |",
             "|---" * (len(cols) + 2) + "|"]
    for key in keys:
        rs = [r for r in records if r["setting"] == key and r.get("ok")]
        seeds = _seeds(records, key)
        if not rs:
            lines.append(f"| {key} | {seeds} |" + " |" * len(cols))
            continue
        lines.append(f"| {key} | {seeds} | " + " | ".join(_ms([r.get(c[1]) for r in rs], c[2]) for c in cols) + " |")
    return "\n".join(lines)


def _seeds(records: list[dict], key: str) -> str:
    """A setting's finished runs, and its failed ones by seed."""
    runs = [r for r in records if r["setting"] == key]
    bad = [str(r["seed"]) for r in runs if not r.get("ok")]
    return str(len(runs)) if not bad else f"{len(runs) - len(bad)} of {len(runs)} ({len(bad)} failed: seed {', '.join(bad)})"


def _skipped(rs: list[dict], field: str, key: str) -> int:
    """Steps skipped by a mean over steps (its field null or NaN), over the runs `rs`."""
    return sum((r.get(field) or {}).get(key, 0) for r in rs)


def _collapsed(rs: list[dict]) -> str:
    at = [f"at {r.get('collapsed_at', '?')}" for r in rs if r.get("collapsed")]
    return f"{len(at)} of {len(rs)}" + (f" ({', '.join(at)})" if at else "")


def eta_plot(out: Path, paths: list[Path]) -> None:
    """The ablation over η: final held-out accuracy and the last 10 steps' batch reward, mean ±
    sd over seeds, one line per π_prox, from the ablation results files given (cells repeated
    across files are pooled), to a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells: dict[tuple[str, int], list[dict]] = {}
    for path in paths:
        for r in json.loads(path.read_text())["records"]:
            if r.get("ok") and r["setting"].startswith("eta"):
                eta, prox = r["setting"][3:].split("-", 1)
                cells.setdefault((prox, int(eta)), []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    measures = (("final held-out accuracy", lambda r: r["final_acc"]),
                ("batch reward, last 10 steps", reward_last10))
    all_etas = sorted({e for _, e in cells})
    for ax, (title, value) in zip(axes, measures):
        for i, prox in enumerate(dict.fromkeys(p for p, _ in sorted(cells))):
            etas = [e for e in all_etas if (prox, e) in cells]
            ys = [[value(r) for r in cells[(prox, e)]] for e in etas]
            sds = [np.std(y, ddof=1) if len(y) > 1 else 0.0 for y in ys]
            ax.errorbar(etas, [np.mean(y) for y in ys], yerr=sds, marker="o", capsize=3, lw=1,
                        color=plt.cm.tab10(i), alpha=0.9,
                        label="behaviour (naive PPO)" if prox == "behaviour" else prox)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xticks(all_etas, [str(e) for e in all_etas])
        ax.set_xlabel("η (max staleness)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    n = sorted({len(v) for v in cells.values()})
    axes[0].legend(fontsize=8, title="π_prox / train.off_policy")
    fig.suptitle(f"η × objective, mean ± sd over {'/'.join(map(str, n))} seeds per cell", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def ablation_table(records: list[dict]) -> str:
    """η × π_prox: accuracy, the last steps' batch reward, and the off-policy statistics."""
    cols = [("final held-out acc", lambda r: r["final_acc"], "{:.3f}"),
            # steps 30 and 40 at the default cadence: half the noise of one evaluation
            ("held-out, last 2 evals", last2_heldout, "{:.3f}"),
            ("batch reward, last 10 steps", reward_last10, "{:.3f}", ("diag_skipped_last10", "reward")),
            ("clip frac", lambda r: r["clip_frac"], "{:.4f}", ("diag_skipped", "clip_frac")),
            ("w = π_prox/π_behav, mean", lambda r: r["imp_weight_mean"], "{:.3f}",
             ("diag_skipped", "imp_weight_mean")),
            ("tokens given no weight", lambda r: r["behav_dropped_frac"], "{:.5f}",
             ("diag_skipped", "behav_dropped_frac")),
            ("stale mean", lambda r: r["stale_mean"], "{:.2f}"),
            ("dropped groups", lambda r: r["dropped_groups"], "{:.0f}"),
            ("ESS, last 10", lambda r: r.get("ess_last10", np.nan), "{:.3f}", ("diag_skipped_last10", "ess")),
            ("KL(π_behav‖π_θ) k3, last 10", lambda r: r.get("kl_behav_last10", np.nan), "{:.4f}",
             ("diag_skipped_last10", "kl_behav")),
            ("cut at max_new_tokens, last 10", lambda r: r.get("truncated_frac_last10", np.nan), "{:.3f}",
             ("diag_skipped_last10", "truncated_frac")),
            ("collapsed", lambda r: r, _collapsed),
            ("wall s", lambda r: r["wall_s"], "{:.1f}")]
    lines = ["| η | π_prox / train.off_policy | seeds | " + " | ".join(c[0] for c in cols) + " |",
             "|---" * (len(cols) + 3) + "|"]
    for key in dict.fromkeys(r["setting"] for r in records):
        rs = [r for r in records if r["setting"] == key and r.get("ok")]
        eta, prox = key[3:].split("-", 1)
        cells = []
        for _, get, fmt, *skip in cols:
            v = [get(r) for r in rs]
            cell = _ms(v, fmt) if isinstance(fmt, str) else fmt(v)
            k = _skipped(rs, *skip[0]) if skip else 0
            cells.append(cell + (f" ({k} steps skipped)" if k else ""))
        lines.append(f"| {eta} | {prox} | {_seeds(records, key)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=("tiny", "longtail"), default="tiny")
    ap.add_argument("--max-terms", type=int, default=40, help="longtail: most terms of a problem")
    ap.add_argument("--max-new-tokens", type=int, default=416,
                    help="longtail: rollout.max_new_tokens (the tiny model's context is 512; prompts "
                         "of 40 terms are 81 tokens)")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eta", default="1", help="η of the async runs (item 1); several, comma-"
                    "separated: one async setting each (async-T/G, async-T/G-eta2, ...)")
    ap.add_argument("--splits", default="1", help="trainer core counts of the async runs")
    ap.add_argument("--only", default="", help="comma-separated setting names to run")
    ap.add_argument("--ablation", action="store_true", help="η × π_prox instead (async-1/1)")
    ap.add_argument("--etas", default="0,1,2,4,8")
    ap.add_argument("--prox", default="recompute,loglinear,behaviour")
    ap.add_argument("--objectives", default="", help="train.off_policy values to compare "
                    "(π_prox: recompute) instead of --prox")
    ap.add_argument("--target", type=float, default=0.3, help="accuracy for time-to-target")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-limit", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default: print only)")
    ap.add_argument("--compare", type=Path, default=None,
                    help="print the throughput planner beside the runs of this results file")
    ap.add_argument("--plot", type=Path, nargs=2, metavar=("RESULTS", "PNG"), default=None,
                    help="plot the runs of a results file")
    ap.add_argument("--eta-plot", type=Path, nargs="+", metavar=("PNG", "RESULTS"), default=None,
                    help="plot the ablation over η (held-out accuracy, batch reward) from these "
                         "ablation results files")
    ap.add_argument("--paired", type=Path, nargs="+", default=None, metavar="RESULTS",
                    help="paired differences between the objectives of ablation results files "
                         "(merged), seed by seed, per (regime, η) cell")
    ap.add_argument("--baseline", default="trust_region",
                    help="--paired: compare every objective with this one (all: every pair)")
    ap.add_argument("--table", type=Path, default=None,
                    help="print the table of a results file (with this --target)")
    ap.add_argument("--tail-eval", type=Path, default=None,
                    help="evaluate the final policies of a results file on a held-out set uniform "
                         "in term count (2..40 terms), accuracy per bucket, added to the file")
    ap.add_argument("overrides", nargs="*", help="key=value for every run")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare)
        return 0
    if args.tail_eval:
        tail_eval(args.tail_eval)
        return 0
    if args.eta_plot:
        eta_plot(args.eta_plot[0], args.eta_plot[1:])
        return 0
    if args.plot:
        plot(*args.plot)
        return 0
    if args.paired:
        recs = [r for path in args.paired for r in json.loads(path.read_text())["records"]]
        print(f"{', '.join(map(str, args.paired))}: {len(recs)} runs")
        print(paired_table(recs, args.baseline))
        return 0
    if args.table:      # a results file again, with this --target
        data = json.loads(args.table.read_text())
        recs = data["records"]
        for r in (r for r in recs if r.get("ok")):
            r["t_target_heldout"] = first_time_at(r["held_curve"], args.target)
            r["t_target_train"] = first_time_at(r["train_curve"], args.target)
        print(f"{args.table}: target accuracy {args.target}")
        if any(r["setting"].startswith("eta") for r in recs):
            print(ablation_table(recs))
        else:
            print(table(recs, list(dict.fromkeys(r["setting"] for r in recs))))
        return 0
    cpus = sorted(os.sched_getaffinity(0))
    base = [f"train.total_steps={args.steps}", f"data.eval_every_steps={args.eval_every}",
            f"data.eval_limit={args.eval_limit}", "data.eval_samples=2", "checkpoint.every_steps=0"]
    work = Path(tempfile.mkdtemp(prefix="bench_avs_"))
    if args.task == "longtail":
        train, held = longtail_data(work / "data", max_terms=args.max_terms)
        n_new = args.max_new_tokens
        base += [f"data.train_path={train}", f"data.eval_path={held}", f"rollout.max_new_tokens={n_new}",
                 f"rollout.max_model_len={n_new + 96}", "train.max_tokens_per_mb=2048"]
    if args.ablation:     # common random numbers: the same sampling seeds for every setting
        if not any(o.startswith("rollout.per_request_seeds=") for o in args.overrides):
            base.append("rollout.per_request_seeds=true")
        split = settings(cpus, [1])["async-1/1"]
        if args.objectives:
            runs = {f"eta{e}-{o}": [*split, f"rollout.max_staleness={e}", f"train.off_policy={o}"]
                    for e in map(int, args.etas.split(",")) for o in args.objectives.split(",")}
        else:
            runs = {f"eta{e}-{p}": [*split, f"rollout.max_staleness={e}", f"train.prox={p}"]
                    for e in map(int, args.etas.split(",")) for p in args.prox.split(",")}
    else:
        etas = [int(x) for x in args.eta.split(",")]
        runs = {}
        for k, v in settings(cpus, [int(x) for x in args.splits.split(",")]).items():
            if not k.startswith("async"):
                runs[k] = v
                continue
            for i, e in enumerate(etas):    # the first η keeps the plain name
                runs[k if i == 0 else f"{k}-eta{e}"] = [*v, f"rollout.max_staleness={e}"]
    if args.only:
        runs = {k: v for k, v in runs.items() if k in args.only.split(",")}
    records = []
    for seed in map(int, args.seeds.split(",")):
        for key, over in runs.items():
            name = f"{key.replace('/', '_')}-s{seed}"
            ov = [*base, *over, f"train.seed={seed}", f"data.seed={seed}", *args.overrides]
            code, total_s, placement, cpu_s = run_job(ov, work, name, args.timeout)
            rec = {"setting": key, "seed": seed, "task": args.task, "overrides": ov, "ok": code == 0,
                   "process_s": total_s, "placement": placement, "run_dir": str(work / name),
                   "cpu_s": cpu_s, "cpu_per_wall": cpu_s / total_s}
            if code == 0:
                rec.update(run_efficiency(work / name, "sync" if "mode=sync" in " ".join(over) else "async",
                                   args.target))
            records.append(rec)
            print(f"[bench] {name}: exit {code}, {total_s:.0f}s; "
                  + (f"wall {rec['wall_s']:.1f}s (ideal {rec['ideal_s']:.1f}s), busy {rec['gen_busy']:.2f}, "
                     f"final acc {_fmt(rec['final_acc'])}, stale {rec['stale_mean']:.2f}, "
                     f"dropped {rec['dropped_groups']}" if code == 0 else "FAILED"), flush=True)
            if args.out:
                args.out.write_text(json.dumps({"cpus": cpus, "args": vars(args) | {"out": str(args.out)},
                                                "records": records}, indent=1, default=str))
    print()
    print(f"task {args.task}, {args.steps} steps, CPUs {format_cpus(cpus)}; "
          f"command: python tools/bench_async_vs_sync.py {' '.join(sys.argv[1:])}")
    print(ablation_table(records) if args.ablation else table(records, list(runs)))
    if args.ablation:
        print()
        print(paired_table(records, args.baseline))
    if not args.ablation:
        by = {k: [r for r in records if r["setting"] == k and r.get("ok")] for k in runs}
        if by.get("sync"):
            sync_wall = statistics.mean(r["wall_s"] for r in by["sync"])
            for k, rs in by.items():
                if rs and k != "sync":
                    print(f"speedup {k} vs sync: {sync_wall / statistics.mean(r['wall_s'] for r in rs):.2f}×")
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
