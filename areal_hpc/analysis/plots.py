"""The summary's plots as PNG files; several runs share each plot (one curve per run).

Small figures on purpose (about 100 kB): they are meant to be committed next to a README or
pasted into a report. Matplotlib runs headless (Agg).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from . import summary as S  # noqa: E402
from .load import RunData  # noqa: E402

DPI = 80
SMOOTH_SPAN = 10        # steps of the smoothed training reward


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_reward(runs: list[RunData], path: Path, max_rows: int = 200) -> Path:
    """Reward and accuracy of each training step's batch, against the step and against wall time
    (when the step's batch was complete)."""
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), sharey="row")
    for run in runs:
        df = S.by_step(run, max_rows)
        if df.empty:
            continue
        step = (df["first"] + df["last"]) / 2
        for row, key in enumerate(("reward", "accuracy")):
            axes[row, 0].plot(step, df[key], marker=".", label=run.label)
            axes[row, 1].plot(df["time_s"], df[key], marker=".", label=run.label)
    for row, key in enumerate(("reward", "accuracy")):
        axes[row, 0].set_ylabel(f"{key} (batch mean)")
        axes[row, 0].set_xlabel("training step")
        axes[row, 1].set_xlabel("wall time since first prompt (s)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0, 0].legend()
    return _save(fig, path)


def plot_staleness(runs: list[RunData], path: Path) -> Path:
    """Share of trained tokens by staleness (training step − the token's version)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        hist = run.token_staleness
        total = sum(hist.values())
        if not total:
            continue
        vals = np.array(sorted(hist))
        ax.bar(vals + (i - (len(runs) - 1) / 2) * width, [hist[v] / total for v in vals],
               width=width, label=run.label)
    ax.set_xlabel("staleness at consumption (versions)")
    ax.set_ylabel("share of trained tokens")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return _save(fig, path)


def plot_lengths(runs: list[RunData], path: Path) -> Path:
    """Output length distribution (share of trajectories), with each run's p99 marked."""
    fig, ax = plt.subplots(figsize=(6, 4))
    top = max((int(r.generated["output_len"].max()) for r in runs if len(r.generated)), default=1)
    step = max(1, -(-(top + 1) // 60))        # whole tokens per bin, at most ~60 bins
    bins = np.arange(0, top + step + 1, step)
    for run in runs:
        lens = run.generated["output_len"].to_numpy()
        if not lens.size:
            continue
        line = ax.hist(lens, bins=bins, weights=np.full(lens.size, 1 / lens.size),
                       histtype="step", linewidth=1.5, label=run.label)[2][0]
        ax.axvline(S.percentile(lens, 99), color=line.get_edgecolor(), linestyle=":")
    ax.set_xlabel("output length (tokens); dotted: p99")
    ax.set_ylabel("share of trajectories")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_throughput(runs: list[RunData], path: Path, bin_s: float | None = None) -> Path:
    """Generation tokens/s of each generator rank over wall time."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        tput = S.throughput(run, bin_s)
        if tput.empty:
            continue
        mid = tput.index + tput.attrs["bin_s"] / 2
        for rank in tput.columns:
            ax.plot(mid, tput[rank], marker=".", label=f"{run.label} rank {rank}")
    ax.set_xlabel("wall time since first prompt (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def smoothed(values, span: int = SMOOTH_SPAN) -> np.ndarray:
    """Exponential moving average with TensorBoard-like weight 1 - 2/(span + 1), debiased
    (the first points are not pulled towards 0)."""
    return pd.Series(values, dtype=np.float64).ewm(span=span, adjust=True).mean().to_numpy()


def plot_learning(runs: list[RunData], path: Path) -> Path:
    """From metrics.jsonl and eval.json beside each log: held-out accuracy by step, the
    training reward raw (faint) and smoothed, and the off-policy diagnostics that precede a
    collapse (effective sample size, KL(π_behav‖π_θ), share of the batch cut at
    max_new_tokens)."""
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    for run in runs:
        m = run.metrics
        ev = [e for e in run.evals if "accuracy" in e]
        if ev:
            axes[0, 0].plot([e["step"] for e in ev], [e["accuracy"] for e in ev], marker="o",
                            label=run.label)
        if not m:
            continue
        step = np.array([r["step"] + 1 for r in m])
        def series(key: str) -> np.ndarray:       # null (not measured) and absent: gaps
            return np.array([np.nan if r.get(key) is None else r[key] for r in m], dtype=float)

        reward = series("reward")
        line = axes[0, 1].plot(step, reward, alpha=0.3)[0]
        axes[0, 1].plot(step, smoothed(reward), color=line.get_color(), label=run.label)
        for key, style in (("ess", "-"), ("seq_ess", ":")):
            if key in m[0]:
                axes[1, 0].plot(step, series(key), style, color=line.get_color(),
                                label=f"{run.label} {key}")
        if "kl_behav" in m[0]:
            axes[1, 1].plot(step, series("kl_behav"), color=line.get_color(),
                            label=f"{run.label} KL(π_behav‖π_θ)")
        if "truncated_frac" in m[0]:
            axes[1, 1].plot(step, series("truncated_frac"), "--",
                            color=line.get_color(), label=f"{run.label} cut at max_new_tokens")
    axes[0, 0].set_ylabel("held-out accuracy")
    axes[0, 1].set_ylabel(f"training reward (EMA over ~{SMOOTH_SPAN} steps)")
    axes[1, 0].set_ylabel("effective sample size (share)")
    axes[1, 0].set_ylim(0, 1.05)
    axes[1, 1].set_ylabel("KL / share")
    for ax in axes.flat:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return _save(fig, path)


def has_episodes(run: RunData) -> bool:
    """Whether `run` logged multi-turn episodes (a trajectory with several turns or a tool call)."""
    t = run.generated
    return bool(len(t)) and bool((t["turns"] > 1).any() or (t["tool_calls"] > 0).any())


def plot_episodes(runs: list[RunData], path: Path) -> Path:
    """Multi-turn episodes: the share of trajectories by model turns, and per training step the
    tool calls per trajectory and the share of them that failed."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        t = run.generated
        if not len(t):
            continue
        turns = t["turns"].value_counts(normalize=True).sort_index()
        left.plot(turns.index, turns.to_numpy(), marker="o", label=run.label)
        trained = t[t["consumed_step"] >= 0]
        if len(trained):
            by = trained.groupby("consumed_step")
            calls = by["tool_calls"].sum()
            right.plot(calls.index, calls / by.size(), marker=".", label=f"{run.label} calls")
            failed = by["tool_errors"].sum() / calls.where(calls > 0)
            right.plot(failed.index, failed, linestyle="--", label=f"{run.label} failed share")
    left.set_xlabel("model turns per trajectory")
    left.set_ylabel("share of trajectories")
    left.xaxis.get_major_locator().set_params(integer=True)
    right.set_xlabel("training step")
    right.set_ylabel("tool calls per trajectory; failed share")
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def write_plots(runs: list[RunData], out_dir: Path, bin_s: float | None = None) -> list[Path]:
    """All plots into `out_dir` (created): reward.png, staleness.png, lengths.png,
    throughput.png, learning.png where a run directory holds metrics.jsonl or eval.json, and
    episodes.png where a run logged multi-turn episodes. Returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_reward(runs, out_dir / "reward.png"),
             plot_staleness(runs, out_dir / "staleness.png"),
             plot_lengths(runs, out_dir / "lengths.png"),
             plot_throughput(runs, out_dir / "throughput.png", bin_s)]
    if any(r.metrics or r.evals for r in runs):
        paths.append(plot_learning(runs, out_dir / "learning.png"))
    if any(has_episodes(r) for r in runs):
        paths.append(plot_episodes(runs, out_dir / "episodes.png"))
    return paths
