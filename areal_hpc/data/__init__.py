"""Prompt datasets: jsonl files on disk and the synthetic tiny task."""

from areal_hpc.data.jsonl import load_jsonl
from areal_hpc.data.tiny_task import make_problems

__all__ = ["load_jsonl", "make_problems"]
