#!/usr/bin/env python
"""Make the tiny model (areal_hpc/tiny_model.py says what it is):

    python tools/make_tiny_model.py --out models/tiny [--seed 0] [--steps N] [--minutes M]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from areal_hpc.tiny_model import main  # noqa: E402

if __name__ == "__main__":
    main()
