#!/usr/bin/env python
"""Held-out pass@1 / pass@k of a model with vLLM and the run's reward code
(areal_hpc/analysis/evaluate.py).

    python tools/evaluate.py <checkpoint or HF dir> <dataset.jsonl> [--config run/config.yaml]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from areal_hpc.analysis.evaluate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
