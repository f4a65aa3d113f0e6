"""The summary as rich tables, and decoded trajectories (`--show`)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..storage import run_dir as run_files
from ..storage.rollout_log import STATUS_NAMES, RolloutReader
from . import summary as S
from .load import RunData


def _fmt(value, spec: str = "{:.3f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return spec.format(value)


def _range(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}–{last}"


def _table(title: str) -> Table:
    """A table whose title fits on one line however narrow its columns are."""
    return Table(title=title, title_justify="left", min_width=len(title))


def overview_table(runs: list[RunData]) -> Table:
    """One column per run, one row per OVERVIEW_FIELDS entry."""
    table = _table("rollouts")
    table.add_column("")
    for run in runs:
        table.add_column(run.label, justify="right")
    numbers = [S.overview(run) for run in runs]
    for key, label, spec in S.OVERVIEW_FIELDS:
        table.add_row(label, *(_fmt(n[key], spec) for n in numbers))
    return table


def _grouped_table(title: str, df, columns: list[tuple[str, object]]) -> Table:
    """A by_step / by_version frame as a table: `columns` are (header, row → cell text)."""
    table = _table(title)
    for header, _ in columns:
        table.add_column(header, justify="right")
    for r in df.itertuples():
        table.add_row(*(cell(r) for _, cell in columns))
    return table


_GROUP_COLUMNS = [
    ("trajs", lambda r: f"{r.trajectories:,}"),
    ("reward", lambda r: _fmt(r.reward, "{:+.3f}")),
    ("accuracy", lambda r: _fmt(r.accuracy)),
    ("len mean", lambda r: _fmt(r.length_mean, "{:.1f}")),
]


def step_table(run: RunData, max_rows: int) -> Table:
    return _grouped_table(
        f"{run.label}: per training step (trajectories it trained on)", S.by_step(run, max_rows),
        [("step", lambda r: _range(r.first, r.last)), *_GROUP_COLUMNS,
         ("staleness", lambda r: _fmt(r.staleness_mean, "{:.2f}")),
         ("time s", lambda r: _fmt(r.time_s, "{:.1f}"))])


def version_table(run: RunData, max_rows: int) -> Table:
    return _grouped_table(
        f"{run.label}: per policy version (that started the trajectory)",
        S.by_version(run, max_rows),
        [("version", lambda r: _range(r.first, r.last)), *_GROUP_COLUMNS,
         ("interrupted", lambda r: _fmt(r.interrupted_share, "{:.1%}")),
         ("trained", lambda r: f"{r.trained:,}")])


def generator_tables(run: RunData, bin_s: float | None) -> list[Table]:
    gen = S.per_generator(run)
    totals = _table(f"{run.label}: generators")
    for name in ("rank", "trajs", "output tokens", "tokens/s", "reward errors"):
        totals.add_column(name, justify="right")
    for r in gen.itertuples():
        totals.add_row(str(r.Index), f"{r.trajectories:,}", f"{r.output_tokens:,}",
                       _fmt(r.tokens_per_s, "{:,.1f}"), f"{r.reward_errors:,}")
    tput = S.throughput(run, bin_s)
    w = tput.attrs.get("bin_s", 0)
    over_time = _table(f"{run.label}: tokens/s per generator ({w:g} s bins)")
    over_time.add_column("time s", justify="right")
    for rank in tput.columns:
        over_time.add_column(f"rank {rank}", justify="right")
    for t, row in tput.iterrows():
        over_time.add_row(f"{t:g}–{t + w:g}", *(_fmt(v, "{:,.1f}") for v in row))
    return [totals, over_time]


def error_table(run: RunData) -> Table | None:
    errs = S.reward_errors(run)
    if errs.empty:
        return None
    table = _table(f"{run.label}: reward-service errors")
    table.add_column("count", justify="right")
    table.add_column("error")
    for r in errs.itertuples():
        table.add_row(f"{r.count:,}", escape(r.error))
    return table


def engine_table(run: RunData) -> Table | None:
    """The steps at which engines were restarted after a fault (None when none were)."""
    df = S.engine_restarts(run)
    if df.empty:
        return None
    table = _table(f"{run.label}: vLLM engines restarted after a fault")
    for name in ("step", "restarted", "so far", "generators live"):
        table.add_column(name, justify="right")
    for r in df.itertuples():
        live = "" if r.generators_live is None or r.generators_live != r.generators_live \
            else f"{int(r.generators_live)}"
        table.add_row(str(r.step), str(r.new), str(r.restarts), live)
    return table


def print_summary(console: Console, runs: list[RunData], *, max_rows: int = 20,
                  bin_s: float | None = None) -> None:
    """Everything the summary shows: the overview side by side, then each run's tables."""
    console.print(overview_table(runs))
    for run in runs:
        tables = [step_table(run, max_rows), version_table(run, max_rows),
                  *generator_tables(run, bin_s), engine_table(run), error_table(run)]
        for table in tables:
            if table is not None:
                console.print(table)


def show_rows(n_rows: int, n: int) -> list[int]:
    """`n` rows spread evenly from the first to the last (what the model wrote as it trained)."""
    if n <= 0 or n_rows == 0:
        return []
    return sorted(set(np.linspace(0, n_rows - 1, min(n, n_rows)).round().astype(int).tolist()))


def find_tokenizer(run: RunData, explicit: str | None = None):
    """The run's tokenizer: `explicit`, else the config's model.path (as given, from the current
    directory), else the trained policy next to the log (<run>/policy). None if none loads."""
    from transformers import AutoTokenizer
    candidates = [explicit] if explicit else [run.model_path, str(run.path.parent / run_files.POLICY)]
    for c in candidates:
        if c and any((Path(c) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            try:
                return AutoTokenizer.from_pretrained(c)
            except (OSError, ValueError):
                continue
    return None


def print_trajectories(console: Console, run: RunData, rows: list[int], tokenizer) -> None:
    """Decoded prompt and answer of each row, with its reward and versions."""
    if tokenizer is None:
        console.print(f"[yellow]{escape(run.label)}: no tokenizer found (pass --tokenizer DIR); "
                      "showing token ids[/yellow]")
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else \
        (lambda ids: " ".join(map(str, ids.tolist())))
    t = run.traj
    with RolloutReader(run.path) as reader:
        for i in rows:
            info = t.iloc[i]
            row = reader[int(info.row)]         # the file's row (--skip-bad-rows leaves gaps)
            v = row["versions"][row["versions"] >= 0]      # an observation token has none (-1)
            versions = _span(v) + (" (interrupted)" if v.size and v.min() != v.max() else "")
            c = row["consumed_step"]
            step = f"step {c}" if c >= 0 else STATUS_NAMES.get(c, f"not trained ({c})")
            head = (f"[bold]{escape(run.label)} row {info.row}[/bold]  prompt {row['prompt_id']} "
                    f"sample {row['sample_idx']}  reward {row['reward']:+.2f}  versions {versions}"
                    f"  {step}  finish {row['finish_reason']}  rank {row['generator_rank']}  "
                    f"{info.output_len} tokens")
            if row["reward_error"]:
                head += f"  [red]reward error: {escape(row['reward_error'])}[/red]"
            console.print(head)
            console.print(f"  [cyan]prompt[/cyan] {escape(decode(row['prompt_tokens']))}")
            if (row.get("turn_is_sample") is None or len(row["turn_is_sample"]) <= 1) \
                    and not row.get("tool_calls"):
                console.print(f"  [green]answer[/green] {escape(decode(row['output_tokens']))}")
            else:
                _print_turns(console, row, decode)


def _span(v) -> str:
    """Versions as the viewer writes them: "3", "3→5", or "–" for none."""
    if not v.size:
        return "–"
    return f"{v.min()}" if v.min() == v.max() else f"{v.min()}→{v.max()}"


def _print_turns(console: Console, row: dict, decode) -> None:
    """A multi-turn episode, turn by turn: each model turn with its versions and how many of
    its tokens are trained (loss mask 1), each observation with how many are masked (0), then
    its tool calls."""
    start = 0
    for k, (end, sampled) in enumerate(zip(row["turn_ends"], row["turn_is_sample"]), 1):
        end = int(end)
        ids, mask = row["output_tokens"][start:end], row["loss_mask"][start:end]
        if sampled:
            what = (f"[green]turn {k}, model[/green] ({len(ids)} tokens, versions "
                    f"{_span(row['versions'][start:end])}, {int(mask.sum())} trained)")
        else:
            what = f"[magenta]turn {k}, observation[/magenta] ({len(ids)} tokens, {int((mask == 0).sum())} masked)"
        console.print(f"  {what} {escape(decode(ids))}")
        start = end
    for c in row.get("tool_calls") or []:
        done = f"[red]error: {escape(c['error'])}[/red]" if c["error"] else "ran"
        console.print(f"  [yellow]tool[/yellow] {escape(c['name'])}({escape(c['args'])}): "
                      f"{c['output_bytes']} B in {c['seconds']:.2f} s, {done}")
