"""The numbers of the summary, computed from a `RunData` (pure: no I/O, no printing).

Percentiles are nearest-rank (numpy's "inverted_cdf"): always a value that occurred, so a p95
staleness of 1 means 95 % of the tokens were at most one version old.

Time is seconds since the run's first submitted prompt (min t_submit); a training step's time is
when the last trajectory it trained on finished (its batch was complete then).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..storage.episode_log import DISCARD_CAUSES
from ..storage.rollout_log import DROPPED_STALE, FAILED, PARTIAL
from .load import RunData

# reward/pool.py reports a call killed at its deadline as "timeout after <s> s".
TIMEOUT_PREFIX = "timeout"

# (key, label, format) of `overview`, in display order.
OVERVIEW_FIELDS = (
    ("trajectories", "trajectories", "{:,}"),
    ("prompts", "prompts (groups)", "{:,}"),
    ("output_tokens", "output tokens", "{:,}"),
    ("prompt_tokens", "prompt tokens", "{:,}"),
    ("steps", "training steps", "{:,}"),
    ("trained", "trajectories trained on", "{:,}"),
    ("pending", "pending (not yet trained on)", "{:,}"),
    ("dropped_stale", "dropped as too stale", "{:,}"),
    ("failed", "failed: no sampled token (the environment), never trained", "{:,}"),
    ("partial", "partial rows (preempted mid-generation, continued later; not counted here)",
     "{:,}"),
    ("reward_mean", "reward mean", "{:+.4f}"),
    ("accuracy", "accuracy (reward > 0.5)", "{:.4f}"),
    ("interrupted_share", "interrupted (span > 1 version)", "{:.2%}"),
    ("staleness_mean", "staleness per token: mean", "{:.3f}"),
    ("staleness_p50", "  p50", "{:g}"),
    ("staleness_p95", "  p95", "{:g}"),
    ("staleness_max", "  max", "{:g}"),
    ("traj_staleness_mean", "staleness per trajectory (oldest token): mean", "{:.3f}"),
    ("traj_staleness_max", "  max", "{:g}"),
    ("length_mean", "output length: mean", "{:.1f}"),
    ("length_p50", "  p50", "{:g}"),
    ("length_p90", "  p90", "{:g}"),
    ("length_p99", "  p99", "{:g}"),
    ("length_max", "  max", "{:g}"),
    ("truncated_share", "cut at max_new_tokens", "{:.2%}"),
    ("wall_s", "wall time, first submit → last end (s)", "{:.1f}"),
    ("tokens_per_s", "generation tokens/s (all generators)", "{:,.1f}"),
    ("reward_errors", "reward-service errors (scored 0)", "{:,}"),
    ("reward_timeouts", "  of which timeouts", "{:,}"),
    ("discarded", "episodes discarded (env.on_error)", "{:,}"),
    *((f"discarded_{c}", f"  {c}", "{:,}") for c in DISCARD_CAUSES[1:]),
    ("turns_mean", "model turns per trajectory: mean", "{:.2f}"),
    ("tool_calls", "tool calls", "{:,}"),
    ("tool_errors", "  failed", "{:,}"),
    ("tool_seconds", "  seconds in all", "{:,.1f}"),
)


def percentile(values, q: float) -> float:
    """Nearest-rank q-th percentile (0..100) of `values`; NaN when empty."""
    values = np.asarray(values)
    if values.size == 0:
        return math.nan
    return float(np.percentile(values, q, method="inverted_cdf"))


def hist_percentile(hist: dict[int, int], q: float) -> float:
    """Nearest-rank q-th percentile of a value → count histogram; NaN when empty."""
    if not hist:
        return math.nan
    vals = np.array(sorted(hist))
    cum = np.cumsum([hist[v] for v in vals])
    rank = max(math.ceil(q / 100 * cum[-1]), 1)
    return float(vals[np.searchsorted(cum, rank)])


def _t0(traj: pd.DataFrame) -> float:
    return float(traj["t_submit"].min()) if len(traj) else 0.0


def overview(run: RunData) -> dict[str, float]:
    """The run at a glance: counts, reward, staleness, lengths, time, reward-service errors
    (keys: OVERVIEW_FIELDS). Reward, accuracy and lengths are over every logged trajectory;
    staleness over the trained ones."""
    t, hist = run.generated, run.token_staleness
    consumed = t["consumed_step"]
    trained = t[consumed >= 0]
    discard = t["discard"].astype(str)
    errors = t["reward_error"].astype(str).where(discard == "", "")     # an episode's: discarded
    n_tok = sum(hist.values())
    wall = float(t["t_end"].max() - _t0(t)) if len(t) else 0.0
    out_tokens = int(t["output_len"].sum())
    return {
        "trajectories": len(t),
        "prompts": int(t["prompt_id"].nunique()),
        "output_tokens": out_tokens,
        "prompt_tokens": int(t["prompt_len"].sum()),
        "steps": int(trained["consumed_step"].nunique()),
        "trained": len(trained),
        "pending": int((consumed == -1).sum()),
        "dropped_stale": int((consumed == DROPPED_STALE).sum()),
        "failed": int((consumed == FAILED).sum()),
        "partial": int((run.traj["consumed_step"] == PARTIAL).sum()),
        "reward_mean": float(t["reward"].mean()) if len(t) else math.nan,
        "accuracy": float(t["correct"].mean()) if len(t) else math.nan,
        "interrupted_share": float(t["interrupted"].mean()) if len(t) else math.nan,
        "staleness_mean": sum(k * v for k, v in hist.items()) / n_tok if n_tok else math.nan,
        "staleness_p50": hist_percentile(hist, 50),
        "staleness_p95": hist_percentile(hist, 95),
        "staleness_max": float(max(hist)) if hist else math.nan,
        "traj_staleness_mean": float(trained["staleness"].mean()) if len(trained) else math.nan,
        "traj_staleness_max": float(trained["staleness"].max()) if len(trained) else math.nan,
        "length_mean": float(t["output_len"].mean()) if len(t) else math.nan,
        "length_p50": percentile(t["output_len"], 50),
        "length_p90": percentile(t["output_len"], 90),
        "length_p99": percentile(t["output_len"], 99),
        "length_max": float(t["output_len"].max()) if len(t) else math.nan,
        "truncated_share": float((t["finish_reason"] == "length").mean()) if len(t) else math.nan,
        "wall_s": wall,
        "tokens_per_s": out_tokens / wall if wall > 0 else math.nan,
        "reward_errors": int((errors != "").sum()),
        "reward_timeouts": int(errors.str.startswith(TIMEOUT_PREFIX).sum()),
        "discarded": int((discard != "").sum()),
        **{f"discarded_{c}": int((discard == c).sum()) for c in DISCARD_CAUSES[1:]},
        # multi-turn episodes (a single-turn sample: one turn, no tool call)
        "turns_mean": float(t["turns"].mean()) if len(t) else math.nan,
        "tool_calls": int(t["tool_calls"].sum()),
        "tool_errors": int(t["tool_errors"].sum()),
        "tool_seconds": float(t["tool_seconds"].sum()),
    }


def _bin_keys(keys: pd.Series, max_rows: int) -> tuple[pd.Series, int]:
    """Consecutive integer keys grouped into at most `max_rows` equal-width bins; returns each
    row's bin start and the width."""
    lo, hi = int(keys.min()), int(keys.max())
    width = max(1, math.ceil((hi - lo + 1) / max_rows))
    return lo + (keys - lo) // width * width, width


def _table(traj: pd.DataFrame, key: str, max_rows: int, extra: dict, t0: float) -> pd.DataFrame:
    """Rows grouped by `key` (binned to at most `max_rows`), the common columns plus `extra`
    (name → function of the groupby); `_time` is t_end − t0."""
    if traj.empty:
        return pd.DataFrame()
    t = traj.assign(_time=traj["t_end"] - t0)
    start, width = _bin_keys(t[key], max_rows)
    g = t.groupby(start.rename("first"))
    out = pd.DataFrame({
        "last": g[key].max(),
        "trajectories": g.size(),
        "reward": g["reward"].mean(),
        "accuracy": g["correct"].mean(),
        "length_mean": g["output_len"].mean(),
        **{name: fn(g) for name, fn in extra.items()},
    })
    out.attrs["width"] = width
    return out.reset_index()


def by_step(run: RunData, max_rows: int = 20) -> pd.DataFrame:
    """Reward and accuracy of the trajectories each training step trained on, one row per step
    (or per `width` consecutive steps when there are more than `max_rows`): first, last,
    trajectories, reward, accuracy, length_mean, staleness_mean (per trajectory, oldest token),
    time_s (when the step's batch was complete)."""
    t = run.traj
    trained = t[t["consumed_step"] >= 0]
    return _table(trained, "consumed_step", max_rows, {
        "staleness_mean": lambda g: g["staleness"].mean(),
        "time_s": lambda g: g["_time"].max(),
    }, _t0(t))


def by_version(run: RunData, max_rows: int = 20) -> pd.DataFrame:
    """Reward and accuracy by the policy version that started each trajectory (its first token),
    over every logged trajectory: first, last (version range of the row), trajectories, reward,
    accuracy, length_mean, interrupted_share, trained (how many a step used)."""
    t = run.generated[run.generated["version_first"] >= 0]     # -1: no output token at all
    t = t.assign(_trained=t["consumed_step"] >= 0)
    return _table(t, "version_first", max_rows, {
        "interrupted_share": lambda g: g["interrupted"].mean(),
        "trained": lambda g: g["_trained"].sum(),
    }, _t0(run.generated))


def nice_bin(span_s: float, bins: int = 12) -> float:
    """A round bin width (1, 2 or 5 × 10^k seconds) giving about `bins` bins over `span_s`."""
    raw = max(span_s / bins, 1e-3)
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def throughput(run: RunData, bin_s: float | None = None) -> pd.DataFrame:
    """Output tokens per second per generator rank over time: index = bin start (s since the
    run's first submit), one column per rank. A trajectory's tokens are spread evenly over
    [t_first_token, t_end] (all at t_end when that is one instant); the last bin is divided by
    the part of it the run covers."""
    t = run.generated
    if t.empty:
        return pd.DataFrame()
    t0 = _t0(t)
    span = float(t["t_end"].max() - t0)
    w = bin_s or nice_bin(span)
    nb = max(1, math.ceil(span / w))
    edges = np.arange(nb + 1) * w
    cols = {}
    for rank, g in t.groupby("generator_rank"):
        a = g["t_first_token"].to_numpy() - t0
        b = g["t_end"].to_numpy() - t0
        n = g["output_len"].to_numpy().astype(np.float64)
        spread = b > a
        tokens = np.zeros(nb)
        if spread.any():
            aa, bb, nn = a[spread], b[spread], n[spread]
            cum = np.array([(nn * np.clip((e - aa) / (bb - aa), 0, 1)).sum() for e in edges])
            tokens += np.diff(cum)
        if (~spread).any():
            k = np.minimum((b[~spread] // w).astype(int), nb - 1)
            tokens += np.bincount(k, weights=n[~spread], minlength=nb)
        cols[int(rank)] = tokens
    widths = np.minimum(edges[1:], max(span, 1e-9)) - edges[:-1]
    out = pd.DataFrame({r: v / widths for r, v in cols.items()}, index=edges[:-1])
    out.index.name = "t_s"
    out.attrs["bin_s"] = w
    return out


def per_generator(run: RunData) -> pd.DataFrame:
    """Per generator rank: trajectories, output tokens, tokens/s over the run's wall time,
    reward errors."""
    t = run.generated
    wall = overview(run)["wall_s"]
    g = t.groupby("generator_rank")
    return pd.DataFrame({
        "trajectories": g.size(),
        "output_tokens": g["output_len"].sum(),
        "tokens_per_s": g["output_len"].sum() / wall if wall > 0 else math.nan,
        "reward_errors": g["reward_error"].apply(lambda e: int((e.astype(str) != "").sum())),
    })


def reward_errors(run: RunData) -> pd.DataFrame:
    """Distinct reward-service errors with their counts, most frequent first."""
    e = run.generated["reward_error"].astype(str)
    counts = e[e != ""].value_counts()
    return pd.DataFrame({"error": counts.index, "count": counts.to_numpy()})


def engine_restarts(run: RunData) -> pd.DataFrame:
    """The steps at which a generator's vLLM engine had been restarted after a fault (the
    metrics' running total grew): step, restarts so far, generators live then. Empty when no
    engine was restarted (or the run has no metrics.jsonl)."""
    rows, before = [], 0
    for m in run.metrics:
        total = int(m.get("engine_restarts") or 0)
        if total > before:
            rows.append({"step": int(m["step"]), "restarts": total, "new": total - before,
                         "generators_live": m.get("generators_live")})
        before = max(before, total)
    return pd.DataFrame(rows, columns=["step", "restarts", "new", "generators_live"])
