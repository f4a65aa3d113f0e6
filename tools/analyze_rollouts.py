#!/usr/bin/env python
"""Analyse rollout logs: summary tables, plots, export, decoded samples (areal_hpc/analysis/cli.py).

    python tools/analyze_rollouts.py runs/tiny/rollouts.h5 [more.h5 ...] [--export parquet] [--show 5]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from areal_hpc.analysis.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
