"""Paired comparisons of training objectives over seeds: `paired_table`.

tools/bench_async_vs_sync.py --ablation runs every objective of a seed with the same seeds
(train.seed, data.seed, per-request sampling seeds), so two objectives draw the same prompts
and samples until their policies diverge (common random numbers). Their per-seed differences
then vary less than two independent cells do, and a paired interval (Student t over the n
differences) is narrower than the unpaired (Welch) one over the same runs; the table shows
both, with the pooled sd of the two cells, so the gain from pairing is visible.

Pure: the records are tools/bench_async_vs_sync.py's (`run_efficiency` plus setting, seed, ok,
overrides); the t quantiles are scipy's.
"""
from __future__ import annotations

import math
import statistics

from scipy import stats

from ..train.diagnostics import measured
from .efficiency import COLLAPSE_REWARD, mean_skipping

LEVEL = 0.95
# overrides that tell the runs of one cell apart, not the cell: the seeds, η, the objective
# and the placement (the tool's own, per machine)
PER_RUN = ("train.seed", "data.seed", "rollout.max_staleness", "train.off_policy", "train.prox",
           "topology.trainer_cpus", "topology.generator_cpus")


# --- Student t -------------------------------------------------------------------------------

def t_quantile(p: float, df: float) -> float:
    """The t such that P(T <= t) = p, Student's t with `df` > 0 degrees of freedom (any real
    df, as Welch's interval needs; inf: the normal quantile)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    return float(stats.norm.ppf(p) if math.isinf(df) else stats.t.ppf(p, df))


# --- intervals ---------------------------------------------------------------------------------

def paired_interval(diffs: list[float], level: float = LEVEL) -> dict:
    """n, mean and sd of per-pair differences, and the Student t interval of their mean
    (lo, hi: None with fewer than 2 pairs; the mean itself when every difference is equal)."""
    n = len(diffs)
    out = {"n": n, "mean": statistics.mean(diffs) if n else None, "sd": None, "lo": None, "hi": None}
    if n >= 2:
        out["sd"] = statistics.stdev(diffs)
        half = t_quantile(0.5 + level / 2, n - 1) * out["sd"] / math.sqrt(n)
        out["lo"], out["hi"] = out["mean"] - half, out["mean"] + half
    return out


def welch_interval(a: list[float], b: list[float], level: float = LEVEL) -> dict:
    """mean(a) - mean(b) with the unpaired (Welch-Satterthwaite) t interval: the runs treated as
    independent samples (lo, hi: None unless both have 2 or more; the difference itself when
    both sds are 0)."""
    out = {"mean": statistics.mean(a) - statistics.mean(b) if a and b else None,
           "lo": None, "hi": None, "df": None}
    if len(a) >= 2 and len(b) >= 2:
        va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
        se = math.sqrt(va + vb)
        if se == 0:
            out["lo"] = out["hi"] = out["mean"]
            return out
        out["df"] = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
        half = t_quantile(0.5 + level / 2, out["df"]) * se
        out["lo"], out["hi"] = out["mean"] - half, out["mean"] + half
    return out


def pooled_sd(a: list[float], b: list[float]) -> float | None:
    """The two samples' pooled standard deviation (None with fewer than 3 values in all)."""
    dof = len(a) + len(b) - 2
    if dof < 1 or len(a) < 1 or len(b) < 1:
        return None
    ss = sum((x - statistics.mean(a)) ** 2 for x in a) + sum((x - statistics.mean(b)) ** 2 for x in b)
    return math.sqrt(ss / dof)


# --- records -----------------------------------------------------------------------------------

def last2_heldout(r: dict):
    """A record's mean of its last 2 held-out evaluations (None without any)."""
    curve = r.get("held_curve") or []
    return mean_skipping(a for _, a in curve[-2:])[0] if curve else None


def reward_last10(r: dict):
    """A record's mean batch reward over its last 10 steps, null or NaN steps skipped."""
    if "reward_last10" in r:
        return r["reward_last10"]
    return mean_skipping((r.get("reward_curve") or [])[-10:])[0]


# (label, value of a record; None or NaN: no value)
MEASURES = (("final held-out acc", lambda r: r.get("final_acc")),
            ("held-out, last 2 evals", last2_heldout),
            ("batch reward, last 10 steps", reward_last10))


def cell_of(rec: dict) -> tuple[str, int, str] | None:
    """(regime, η, objective) of an ablation record (setting "eta<η>-<objective>"), None for
    other records. The regime: the task and the overrides shared by the runs of a cell (every
    override but PER_RUN's)."""
    setting = rec.get("setting", "")
    if not setting.startswith("eta") or "-" not in setting:
        return None
    eta, objective = setting[3:].split("-", 1)
    over = [o for o in rec.get("overrides", []) if o.split("=", 1)[0] not in PER_RUN]
    return " ".join([f"task={rec.get('task', '?')}", *over]), int(eta), objective


def _short_regimes(regimes: list[str]) -> dict[str, str]:
    """Each regime as the settings in which the regimes differ ("(default)": not overridden)."""
    parsed = {r: dict(p.split("=", 1) for p in r.split(" ")) for r in regimes}
    keys = dict.fromkeys(k for d in parsed.values() for k in d)
    differ = [k for k in keys if len({d.get(k) for d in parsed.values()}) > 1]
    return {r: " ".join(f"{k}={d.get(k, '(default)')}" for k in differ) for r, d in parsed.items()}


def _fmt(x, spec: str = "{:.3f}") -> str:
    return spec.format(x) if measured(x) else "–"


def _interval(lo, hi) -> str:
    return "–" if lo is None else f"[{lo:+.3f}, {hi:+.3f}]"


def compare(a: dict[int, dict], b: dict[int, dict], value, level: float = LEVEL,
            names: tuple[str, str] = ("A", "B")) -> dict:
    """Objective A's runs against B's (seed → record each) on one measure (`value` of a
    record). Seeds whose two runs both finished and both have a value are the pairs; the others
    are listed (`failed`: seed → why, `n_failed` / `n_missing` / `n_no_value`: seeds with a
    failed run / a run missing / a finished run without a value). The unpaired (Welch) interval
    and the pooled sd are over the same paired runs, so the two intervals differ only by the
    pairing."""
    failed, xa, xb = {}, [], []
    counts = {"n_failed": 0, "n_missing": 0, "n_no_value": 0}
    for seed in sorted(set(a) | set(b)):
        why = []
        for name, runs in zip(names, (a, b)):
            r = runs.get(seed)
            if r is None:
                why.append(f"no {name} run")
            elif not r.get("ok"):
                why.append(f"{name} failed")
            elif not measured(value(r)):
                why.append(f"{name} without a value")
        for k, word in (("n_failed", "failed"), ("n_missing", "run"), ("n_no_value", "value")):
            counts[k] += any(w.endswith(word) for w in why)
        if why:
            failed[seed] = ", ".join(why)
        else:
            xa.append(float(value(a[seed])))
            xb.append(float(value(b[seed])))
    paired = paired_interval([x - y for x, y in zip(xa, xb)], level)
    welch = welch_interval(xa, xb, level) if xa else {"mean": None, "lo": None, "hi": None, "df": None}
    sd = pooled_sd(xa, xb)
    return {"seeds": len(set(a) | set(b)), "failed": failed, **counts, "a": xa, "b": xb, "paired": paired,
            "welch": welch, "pooled_sd": sd,
            "in_pooled_sd": paired["mean"] / sd if sd and paired["mean"] is not None else None}


def _collapses(runs: dict[int, dict]) -> str:
    ok = [r for r in runs.values() if r.get("ok")]
    where = [f"seed {s} at step {r.get('collapsed_at', '?')}" + (f", {r['collapsed_by']}" if r.get("collapsed_by") else "")
             for s, r in sorted(runs.items()) if r.get("ok") and r.get("collapsed")]
    return f"{len(where)} of {len(ok)}" + (f" ({'; '.join(where)})" if where else "")


def _runs_line(runs: dict[int, dict]) -> str:
    bad = [s for s, r in sorted(runs.items()) if not r.get("ok")]
    return (f"{len(runs) - len(bad)} of {len(runs)} ok"
            + (f" ({len(bad)} failed: seed {', '.join(map(str, bad))})" if bad else ""))


def paired_table(records: list[dict], baseline: str = "trust_region", level: float = LEVEL) -> str:
    """Markdown: for every (regime, η) cell of ablation records, each objective against
    `baseline` ("all": every pair) on MEASURES, per-seed differences A − B: n pairs, the mean
    and sd of the differences, the paired Student t interval, the pooled sd of the two cells and
    the difference in its units, the unpaired (Welch) interval over the same runs, and the ratio
    of the two intervals' widths. Runs per objective (failures listed), collapses
    (`collapse_point`) and steps skipped for want of a value are noted per cell. A seed run
    twice in a cell (records merged from several files) keeps its last finished run."""
    cells: dict[tuple[str, int], dict[str, dict[int, dict]]] = {}
    repeated: dict[tuple[str, int], list[str]] = {}
    for r in records:
        key = cell_of(r)
        if key is None:
            continue
        runs = cells.setdefault(key[:2], {}).setdefault(key[2], {})
        old = runs.get(r["seed"])
        if old is not None:
            repeated.setdefault(key[:2], []).append(f"{key[2]} seed {r['seed']}")
            if old.get("ok") and not r.get("ok"):
                continue
        runs[r["seed"]] = r
    if not cells:
        return "(no ablation records: settings named eta<η>-<objective>)"
    short = _short_regimes(list(dict.fromkeys(k[0] for k in cells)))
    pct = f"{100 * level:g}%"
    out = [f"Paired differences A − B over seeds (runs of one seed share train.seed, data.seed and, "
           f"with rollout.per_request_seeds=true, the sampling seeds); {pct} intervals (Student t). "
           f"All columns are over the n pairs. Collapsed: a held-out evaluation below half the "
           f"initial one, or the 5-step mean batch reward below {COLLAPSE_REWARD}."]
    if len(short) == 1:
        out.append(f"\nRegime: {next(iter(short))}")
    for (regime, eta), objs in cells.items():
        head = f"η = {eta}" + (f", {short[regime]}" if len(short) > 1 else "")
        out += ["", f"### {head}", ""]
        out.append("runs: " + "; ".join(f"{o} {_runs_line(runs)}" for o, runs in objs.items()))
        out.append("\ncollapsed: " + "; ".join(f"{o} {_collapses(runs)}" for o, runs in objs.items()))
        skipped = {o: sum((r.get("diag_skipped_last10") or {}).get("reward", 0) for r in runs.values() if r.get("ok"))
                   for o, runs in objs.items()}
        if any(skipped.values()):
            out.append("\nbatch reward, last 10 steps: steps without a value skipped: "
                       + "; ".join(f"{o} {k}" for o, k in skipped.items() if k))
        if (regime, eta) in repeated:
            out.append("\nrun more than once (the last finished run kept): " + "; ".join(repeated[(regime, eta)]))
        if baseline == "all":
            names = list(objs)
            pairs = [(a, b) for i, b in enumerate(names) for a in names[i + 1:]]
        elif baseline in objs:
            pairs = [(o, baseline) for o in objs if o != baseline]
        else:
            out.append(f"\n(no {baseline} runs in this cell: no pairs; --baseline names another objective, or all)")
            continue
        out += ["", "| A − B | measure | pairs | not paired | mean A | mean B | mean diff | sd diff | "
                f"{pct} CI paired | pooled sd | diff / pooled sd | {pct} CI unpaired (Welch) | "
                "width paired / unpaired |", "|---" * 13 + "|"]
        for a_name, b_name in pairs:
            for label, value in MEASURES:
                c = compare(objs[a_name], objs[b_name], value, level, (a_name, b_name))
                p, w = c["paired"], c["welch"]
                miss = ", ".join(f"{c[k]} of {c['seeds']} {word}" for k, word in
                                 (("n_failed", "failed"), ("n_missing", "not run"), ("n_no_value", "without a value"))
                                 if c[k])
                miss = (f"{miss} (" + "; ".join(f"seed {s}: {why}" for s, why in c["failed"].items()) + ")"
                        if miss else "0")
                ratio = ((p["hi"] - p["lo"]) / (w["hi"] - w["lo"])
                         if p["lo"] is not None and w["lo"] is not None and w["hi"] > w["lo"] else None)
                out.append(f"| {a_name} − {b_name} | {label} | {p['n']} | {miss} | "
                           f"{_fmt(statistics.mean(c['a']) if c['a'] else None)} | "
                           f"{_fmt(statistics.mean(c['b']) if c['b'] else None)} | "
                           f"{_fmt(p['mean'], '{:+.3f}')} | {_fmt(p['sd'])} | {_interval(p['lo'], p['hi'])} | "
                           f"{_fmt(c['pooled_sd'])} | {_fmt(c['in_pooled_sd'], '{:+.2f}')} | "
                           f"{_interval(w['lo'], w['hi'])} | {_fmt(ratio, '{:.2f}')} |")
    return "\n".join(out)
