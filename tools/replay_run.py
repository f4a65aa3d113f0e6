#!/usr/bin/env python
"""Replay a run's training from its rollout log, without generators: the same batches, in the
same order, through the same trainer code; per step the replayed loss / grad_norm beside the
logged ones (areal_hpc/replay.py). Exit status 0, 1 (--check: a loss differs by more than the
tolerance), 2 (the run cannot be replayed; one line says why).

    python tools/replay_run.py runs/tiny [--steps N] [--out DIR] [--check] [--tol T]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from areal_hpc.replay import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
