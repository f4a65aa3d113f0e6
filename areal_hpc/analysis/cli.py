"""Analyse rollout logs: summary tables, plots, per-trajectory export, decoded samples.

    python tools/analyze_rollouts.py runs/tiny/rollouts.h5                 # one run
    python tools/analyze_rollouts.py runs/sync/rollouts.h5 runs/async/rollouts.h5   # side by side
    python -m areal_hpc.analysis runs/tiny/rollouts.h5 --export parquet --show 5

Works on a log that a running job is still writing (it is read as of the moment it is opened).
Plots and exports go to --out (default: an `analysis/` folder beside the first log).
Exit status: 0 done, 1 nothing to analyse (no trajectories yet), 2 a file is missing, not HDF5,
truncated, or not a rollout log, or a row holds a value that cannot be (one line naming the
file, and the row and field; --skip-bad-rows leaves such rows out, one line each, and goes on).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..storage.rollout_log import RolloutLogError
from .load import label_runs, load_run
from .report import find_tokenizer, print_summary, print_trajectories, show_rows

EXIT_EMPTY, EXIT_BAD_FILE = 1, 2
SHOW_SKIPPED = 20       # bad rows named one per line (--skip-bad-rows); the rest counted


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="analyze_rollouts.py", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("logs", nargs="+", type=Path, metavar="ROLLOUTS.h5")
    ap.add_argument("--out", type=Path, help="folder for plots and exports "
                    "(default: analysis/ beside the first log)")
    ap.add_argument("--no-plots", action="store_true", help="tables only")
    ap.add_argument("--export", choices=("parquet", "csv"),
                    help="write the per-trajectory scalars of all runs to OUT/trajectories.*")
    ap.add_argument("--show", type=int, default=0, metavar="N",
                    help="print N decoded trajectories per run, spread from first to last")
    ap.add_argument("--tokenizer", help="tokenizer directory for --show (default: the run's "
                    "model.path, else <run>/policy)")
    ap.add_argument("--rows", type=int, default=20, metavar="N",
                    help="at most N rows in the per-step and per-version tables (steps are "
                    "grouped beyond that; default 20)")
    ap.add_argument("--skip-bad-rows", action="store_true", help="leave out rows holding a value "
                    "that cannot be (e.g. an inf reward of an older log), each named on stderr, "
                    "instead of refusing the file")
    ap.add_argument("--bin-s", type=float, help="time bin of the throughput table and plot "
                    "(seconds; default: about 12 bins over the run)")
    return ap


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)     # one line, never wrapped
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = _parser().parse_args(argv)
    from rich.console import Console

    console = Console()
    runs = []
    for path in args.logs:
        try:
            runs.append(load_run(path, skip_bad=args.skip_bad_rows))
        except FileNotFoundError:
            return _fail(f"{path}: no such file", EXIT_BAD_FILE)
        except RolloutLogError as e:
            return _fail(str(e), EXIT_BAD_FILE)
        except (OSError, KeyError, ValueError) as e:    # h5py's errors from a damaged file
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            return _fail(f"{path}: damaged rollout log ({first})", EXIT_BAD_FILE)
    for run in runs:
        for row, why in list(run.skipped.items())[:SHOW_SKIPPED]:
            print(f"{run.path}: row {row} left out: {why}", file=sys.stderr)
        if len(run.skipped) > SHOW_SKIPPED:
            print(f"{run.path}: {len(run.skipped) - SHOW_SKIPPED} more bad rows left out",
                  file=sys.stderr)
    label_runs(runs)
    empty = [r for r in runs if r.traj.empty]
    for r in empty:
        print(f"{r.path}: no trajectories yet", file=sys.stderr)
    runs = [r for r in runs if not r.traj.empty]
    if not runs:
        return EXIT_EMPTY

    print_summary(console, runs, max_rows=args.rows, bin_s=args.bin_s)
    out = args.out or args.logs[0].parent / "analysis"
    if not args.no_plots:
        from .plots import write_plots      # matplotlib: only when plotting
        paths = write_plots(runs, out, args.bin_s)
        console.print(f"plots: {', '.join(str(p) for p in paths)}", highlight=False)
    if args.export:
        path = export(runs, out, args.export)
        console.print(f"export: {path} ({sum(len(r.traj) for r in runs):,} rows)", highlight=False)
    for run in runs if args.show > 0 else []:
        print_trajectories(console, run, show_rows(len(run.traj), args.show),
                           find_tokenizer(run, args.tokenizer))
    return 0


def export(runs, out_dir: Path, fmt: str) -> Path:
    """Per-trajectory scalars of all runs (load.COLUMNS; `run` tells them apart) to
    OUT/trajectories.parquet or .csv."""
    import pandas as pd
    out_dir.mkdir(parents=True, exist_ok=True)
    df = pd.concat([r.traj for r in runs], ignore_index=True)
    df["finish_reason"] = df["finish_reason"].astype(str)
    path = out_dir / f"trajectories.{fmt}"
    if fmt == "parquet":
        df.to_parquet(path, index=False)
    else:
        df.to_csv(path, index=False)
    return path


if __name__ == "__main__":
    sys.exit(main())
