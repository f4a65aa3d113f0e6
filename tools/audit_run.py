#!/usr/bin/env python
"""Audit a finished or stopped run directory: the pipeline's guarantees checked from its files
(areal_hpc/audit/). Exit status 0 all hold, 1 one is violated, 2 an input is unreadable.

    python tools/audit_run.py runs/tiny [--no-crc]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from areal_hpc.audit import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
