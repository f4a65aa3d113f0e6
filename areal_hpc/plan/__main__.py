"""The planner's CLI.

    python -m areal_hpc.plan memory CONFIG [key=value ...] [--gpu-mem 80GiB]
    python -m areal_hpc.plan throughput CONFIG [key=value ...] [--from-run DIR] [--search] ...
    python -m areal_hpc.plan time CONFIG [key=value ...] --gpu h100 [--mfu 0.35] ...
    python -m areal_hpc.plan placement CONFIG [key=value ...] --script slurm/areal_7b.sh

`memory`: per-GPU memory estimate (exit 2 when a rank does not fit; `memory.py`).
`throughput`: simulated steps/hour, async vs the sync baseline (`throughput.py`).
`time`: estimated seconds per training step on a named GPU, whether the checkpoint cadence
and the preemption signal's lead fit the job's time limit, and what a hard preemption loses
with each way to checkpoint (`budget.py`).
`placement`: which rank holds which GPUs and cores under a batch script's #SBATCH layout, whether
they overlap, and whether the nodes have the CPUs asked (each node's count from `sinfo`, or
`--cores-per-node N`; `areal_hpc.launch.placement`; on the cluster itself: `sbatch S --dry-run`).
Bad input: one line `error: ...` on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import sys

from . import budget, memory_cli, throughput_cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m areal_hpc.plan",
                                 description="memory and throughput models of a run")
    sub = ap.add_subparsers(dest="cmd", required=True)
    memory_cli.add_memory_parser(sub)
    throughput_cli.add_parser(sub)
    budget.add_time_parser(sub)
    from ..launch import placement     # a front door above the planner's floor (UP in tests/test_imports.py)
    placement.add_parser(sub)
    args, extra = ap.parse_known_args(argv)     # key=value overrides may follow the options
    if any(e.startswith("-") for e in extra):
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides += extra
    from rich.console import Console

    console = Console(width=max(Console().width, 120))
    if args.cmd == "memory":
        return memory_cli.memory_command(args, console)
    if args.cmd == "time":
        return budget.time_command(args, console)
    if args.cmd == "placement":
        return placement.plan_command(args, console)
    return throughput_cli.throughput_command(args, console)


if __name__ == "__main__":
    sys.exit(main())
