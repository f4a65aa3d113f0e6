#!/usr/bin/env python
"""Convert GSM8K, MATH / AIME / DeepScaleR, APPS and LiveCodeBench layouts (jsonl, parquet, arrow or
a local HF datasets directory) into this project's jsonl rows (areal_hpc/data/prepare.py).

    python tools/prepare_data.py <src> <dst.jsonl> [--layout gsm8k|math|apps|livecodebench] [--skip-bad]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from areal_hpc.data.prepare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
