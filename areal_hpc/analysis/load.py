"""A rollout log read into per-trajectory scalars, in bounded memory, also while it is written.

The token arrays of a large run do not fit in memory (10^10 tokens), so they are read in blocks of
whole rows, `BLOCK_TOKENS` tokens at most, and reduced on the way: each trajectory's first and
last token version and how many times its version changed, and a histogram of per-token
staleness. Everything else in a row is already one scalar.

A log that a running job is still writing is read as of the moment it is opened: the commit
marker (`traj/output_end`) is read once and every column is cut to that many rows.

A row holding a value that cannot be (an inf reward, stored by a writer before the log refused
them, or a hostile file) is an error naming the file, the row and the field; with `skip_bad`
(`--skip-bad-rows`) such rows are left out of every table, plot and export and named in
`RunData.skipped`.
"""
from __future__ import annotations

import collections
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from tqdm import tqdm

from ..storage.episode_log import DISCARD_CAUSES, mask_between
from ..storage.run_dir import RunDir
from ..storage.rollout_log import (FINISH_REASONS, PARTIAL, RolloutLogError, RolloutReader,
                                   damage_is_an_error)

log = logging.getLogger(__name__)

BLOCK_TOKENS = 1 << 24     # int32 versions: 64 MiB per block

# One row per trajectory; the columns of `--export`.
COLUMNS = (
    "run", "row", "prompt_id", "sample_idx", "generator_rank", "reward", "correct",
    "reward_error", "finish_reason", "prompt_len", "output_len", "version_first", "version_last",
    "version_changes", "interrupted", "consumed_step", "staleness", "t_submit", "t_first_token",
    "t_end", "latency_s", "sampled_len", "turns", "tool_calls", "tool_errors", "tool_seconds",
    "discard",
)


@dataclass
class RunData:
    """One rollout log, reduced.

    `traj`: one row per trajectory, `COLUMNS`: `correct` is reward > 0.5 (the controller's
    accuracy); `version_first`/`version_last` the policy versions of its first and last output
    token, `version_changes` how often the version changed in between (weight updates it lived
    through); `interrupted` whether it spans more than one version; `consumed_step` the training
    step that used it (-1 pending, -2 dropped as stale, -3 rolled back, -4 partial); `staleness` consumed_step minus its
    oldest token's version for consumed rows (as the controller's bound), NaN otherwise; times
    are time.time() seconds. Multi-turn episodes (storage/episode_log.py): `sampled_len` the
    output tokens the model sampled (trained; the others are observations, version -1, which
    the oldest version and the staleness leave out), `turns` its model turns (1 for a
    single-turn sample), `tool_calls`, `tool_errors` and `tool_seconds` its tool calls' count,
    failures and wall-clock seconds.
    `token_staleness`: staleness value → number of output tokens with it, over consumed rows
    (training step − the token's version)."""

    path: Path
    label: str
    config: dict
    traj: pd.DataFrame
    token_staleness: dict[int, int] = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)   # metrics.jsonl beside the log, if any
    evals: list[dict] = field(default_factory=list)     # eval.json beside the log, if any
    skipped: dict[int, str] = field(default_factory=dict)   # row -> why, left out (skip_bad)

    @property
    def generated(self) -> pd.DataFrame:
        """`traj` without its PARTIAL rows (samples as far as they got at a preemption, which a
        later row continues and so holds again): the rows that statistics count."""
        return self.traj[self.traj["consumed_step"] != PARTIAL]

    @property
    def model_path(self) -> str | None:
        return (self.config.get("model") or {}).get("path")


def _config(text: str) -> dict:
    try:
        cfg = yaml.safe_load(text) if text else {}
    except yaml.YAMLError:
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _row_blocks(ends: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Row ranges [r0, r1) of at most `budget` output tokens each (at least one row)."""
    blocks, r0 = [], 0
    n = len(ends)
    while r0 < n:
        base = int(ends[r0 - 1]) if r0 else 0
        r1 = int(np.searchsorted(ends, base + budget, side="right"))
        r1 = max(r1, r0 + 1)
        blocks.append((r0, r1))
        r0 = r1
    return blocks


def version_blocks(reader: RolloutReader, ends: np.ndarray, block_tokens: int):
    """``(r0, r1, v, start, stop)`` for blocks of whole rows [r0, r1) of at most `block_tokens`
    output tokens: ``v`` their /tokens/versions (int64), checked non-negative (`reader.check`:
    with its skip_bad, a row with a negative one is recorded in `reader.bad`); row r0 + i's
    tokens are ``v[start[i]:stop[i]]``. A large run's tokens do not fit in
    memory, so every reader of versions goes a block at a time. RolloutLogError names the file
    (and the row) for a damaged log."""
    n = len(ends)
    with damage_is_an_error(reader.path, "/tokens/versions"):
        ds = reader.f["tokens/versions"]
        ds.refresh()
    total = int(ends[-1]) if n else 0
    if ds.shape[0] < total:
        raise RolloutLogError(f"{reader.path}: damaged rollout log (/tokens/versions has "
                              f"{ds.shape[0]} entries, the offsets need {total})")
    for r0, r1 in _row_blocks(ends, block_tokens):
        t0 = int(ends[r0 - 1]) if r0 else 0
        with damage_is_an_error(reader.path, "/tokens/versions"):
            v = ds[t0: int(ends[r1 - 1])].astype(np.int64)
        stop = ends[r0:r1] - t0
        reader.check("versions", v, stop, first=r0)     # a policy version is a training step
        yield r0, r1, v, np.concatenate([[0], stop[:-1]]), stop


def _reduce_versions(reader: RolloutReader, ends: np.ndarray, consumed: np.ndarray,
                     block_tokens: int, progress: bool):
    """Per row: the versions of its first and last token, its oldest version, how many times
    the version changed; and the per-token staleness histogram of consumed rows (but the bad
    ones `reader` records). One pass over /tokens/versions in blocks of whole rows. Rows
    without tokens get version -1."""
    n = len(ends)
    first, last, oldest = (np.full(n, -1, dtype=np.int64) for _ in range(3))
    changes, sampled = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    big = np.iinfo(np.int64).max
    hist: collections.Counter = collections.Counter()
    total = int(ends[-1]) if n else 0
    with tqdm(total=total, unit="tok", unit_scale=True, desc=f"reading {reader.path.name}",
              delay=2.0, disable=not progress, file=sys.stderr, leave=False) as bar:
        for r0, r1, v, start, stop in version_blocks(reader, ends, block_tokens):
            has = stop > start
            if has.any():
                first[r0:r1][has] = v[start[has]]
                last[r0:r1][has] = v[stop[has] - 1]
                low = np.minimum.reduceat(np.where(v >= 0, v, big), start[has])  # sampled
                oldest[r0:r1][has] = np.where(low == big, -1, low)
                t0 = int(ends[r0 - 1]) if r0 else 0
                mask = mask_between(reader, t0, t0 + int(stop[-1]))
                sampled[r0:r1][has] = np.add.reduceat(mask, start[has])
                steps = np.concatenate([[0], np.cumsum(v[1:] != v[:-1])])   # changes up to a token
                changes[r0:r1][has] = steps[stop[has] - 1] - steps[start[has]]
            row = np.repeat(np.arange(r1 - r0), stop - start)                # each token's row
            step = consumed[r0:r1][row]
            good = ~np.isin(np.arange(r0, r1), np.fromiter(reader.bad, np.int64, len(reader.bad)))
            used = (step >= 0) & good[row] & (v >= 0)     # an observation token: no version
            vals, counts = np.unique(step[used] - v[used], return_counts=True)
            hist.update(dict(zip(vals.tolist(), counts.tolist())))
            bar.update(len(v))
    return first, last, oldest, changes, sampled, dict(sorted(hist.items()))


def _episode_counts(reader: RolloutReader, out_len: np.ndarray) -> dict[str, np.ndarray]:
    """Per row: model turns, tool calls, failed tool calls, tool seconds (episode_log.py)."""
    n = len(out_len)
    turns = (out_len > 0).astype(np.int64)         # a single-turn sample: one model turn
    if not n:
        return {"turns": turns, "tool_calls": turns, "tool_errors": turns,
                "tool_seconds": np.zeros(0)}
    t_end, c_end = (reader.column(c)[:n].astype(np.int64) for c in ("turns_end", "tools_end"))
    f = reader.f
    with damage_is_an_error(reader.path, "/turns, /tools"):
        is_sample = f["turns/is_sample"][:int(t_end[-1])] if "turns" in f else np.zeros(0)
        tools = {k: f[f"tools/{k}"][:int(c_end[-1])] if "tools" in f else np.zeros(0)
                 for k in ("error", "seconds")}

    def per_row(values, end):           # the sum of each row's entries [end[i-1], end[i])
        a = np.concatenate([[0], end[:-1]])
        sums = np.add.reduceat(np.append(values, 0).astype(np.float64), np.minimum(a, len(values)))
        return np.where(end > a, sums, 0.0)
    stored = t_end > np.concatenate([[0], t_end[:-1]])
    turns[stored] = per_row(is_sample, t_end)[stored].astype(np.int64)
    return {"turns": turns, "tool_calls": np.diff(c_end, prepend=0),
            "tool_errors": per_row(np.asarray(tools["error"]) != b"", c_end).astype(np.int64),
            "tool_seconds": per_row(tools["seconds"], c_end)}


def load_run(path: str | Path, label: str | None = None, *, block_tokens: int = BLOCK_TOKENS,
             progress: bool = True, skip_bad: bool = False) -> RunData:
    """Read one rollout log into a `RunData` (see there for the columns).

    Raises FileNotFoundError (no such file) or RolloutLogError (not HDF5, truncated, another
    program's file, internally inconsistent, or, unless `skip_bad`, a row holding a value that
    cannot be); both name the file. With `skip_bad` such rows are left out, each named in
    `RunData.skipped` and the count logged."""
    path = Path(path)
    with RolloutReader(path, skip_bad=skip_bad) as r:
        config = _config(r.config_yaml)
        label = label or str(config.get("name") or path.parent.name)
        ends = r.column("output_end")
        n = len(ends)
        col = lambda name: r.column(name)[:n]
        prompt_end = col("prompt_end")
        if n and (np.any(np.diff(ends) < 0) or np.any(np.diff(prompt_end) < 0)):
            raise RolloutLogError(f"{path}: damaged rollout log (offsets go backwards)")
        consumed = col("consumed_step").astype(np.int64)
        c = {name: col(name) for name in ("prompt_id", "sample_idx", "generator_rank", "reward",
                                          "finish_reason", "t_submit", "t_first_token", "t_end",
                                          "reward_error", "discard")}
        # the fields first, so that the staleness histogram leaves out every bad row (skip_bad)
        first, last, oldest, changes, sampled, hist = _reduce_versions(
            r, ends, consumed, block_tokens, progress)
        episodes = _episode_counts(r, np.diff(ends, prepend=0))
        reward = c["reward"].astype(np.float64)
        finish = np.where(c["finish_reason"] < len(FINISH_REASONS), c["finish_reason"], 0)
        t_submit, t_end = c["t_submit"], c["t_end"]
        traj = pd.DataFrame({
            "run": label,
            "row": np.arange(n),
            "prompt_id": c["prompt_id"],
            "sample_idx": c["sample_idx"],
            "generator_rank": c["generator_rank"],
            "reward": reward,
            "correct": reward > 0.5,
            "reward_error": [e.decode("utf-8", "replace") for e in c["reward_error"]],
            "finish_reason": pd.Categorical.from_codes(finish, FINISH_REASONS),
            "prompt_len": np.diff(prompt_end, prepend=0),
            "output_len": np.diff(ends, prepend=0),
            "version_first": first,
            "version_last": last,
            "version_changes": changes,
            "interrupted": changes > 0,
            "consumed_step": consumed,
            "staleness": np.where(consumed >= 0, consumed - oldest, np.nan),
            "t_submit": t_submit,
            "t_first_token": c["t_first_token"],
            "t_end": t_end,
            "latency_s": t_end - t_submit,
            "sampled_len": sampled,
            **episodes,
            "discard": pd.Categorical.from_codes(
                np.where(c["discard"] < len(DISCARD_CAUSES), c["discard"], 0), DISCARD_CAUSES),
        }, columns=list(COLUMNS))
        skipped = dict(sorted(r.bad.items()))
    if skipped:
        traj = traj[~traj["row"].isin(list(skipped))].reset_index(drop=True)
        log.warning("%s: %d bad rows left out (first: row %d: %s)", path, len(skipped),
                    *next(iter(skipped.items())))
    beside = RunDir(path.parent)
    try:
        metrics, evals = beside.read_metrics(), beside.read_all_evals()
    except (OSError, ValueError) as exc:     # the log is what is analysed; these are extras
        log.warning("%s: metrics.jsonl / eval.json unreadable (%s): no learning curves", path.parent, exc)
        metrics, evals = [], []
    return RunData(path=path, label=label, config=config, traj=traj, token_staleness=hist,
                   metrics=metrics, evals=evals, skipped=skipped)


def label_runs(runs: list[RunData]) -> None:
    """Give runs shown side by side short, distinct labels (in place): the run name from the
    config, else the run directory's name, else the file's path."""
    for pick in (lambda r: str(r.config.get("name") or r.path.parent.name),
                 lambda r: r.path.parent.name, lambda r: str(r.path)):
        labels = [pick(r) for r in runs]
        if len(set(labels)) == len(labels):
            break
    else:
        labels = [f"{i}:{r.path}" for i, r in enumerate(runs)]
    for run, label in zip(runs, labels):
        run.label = label
        run.traj["run"] = label
