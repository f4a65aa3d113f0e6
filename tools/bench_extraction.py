#!/usr/bin/env python
"""Answer and code extraction on degenerate completions: the one-pass scans (`last_boxed`,
`fenced_blocks`) against what they replaced (a rescan from every unclosed `\\boxed{`; a regular
expression that backtracks over the rest of the text at every unclosed fence), side by side.

    python tools/bench_extraction.py [--sizes 4096 16384 65536] [--old-max 65536]

Texts: N bytes of unclosed boxes (`\\boxed{` repeated) and of unclosed fences ("``` " repeated),
what a looping policy writes; the time of one call each (best of 3). The old ones are run up
to --old-max bytes only (they are quadratic).
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_hpc.reward.code import fenced_blocks  # noqa: E402
from areal_hpc.data.answers import last_boxed  # noqa: E402

_FENCE_REGEX = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def old_last_boxed(text: str):
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 1, start + 7
        while i < len(text):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + 7:i]
            i += 1
        start = text.rfind("\\boxed{", 0, start)
    return None


def old_fences(text: str):
    return [(m.group(1), m.group(2)) for m in _FENCE_REGEX.finditer(text)]


def best_of(fn, text: str, n: int = 3) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn(text)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536, 1 << 20])
    ap.add_argument("--old-max", type=int, default=65536)
    args = ap.parse_args(argv)
    print("| text | bytes | one pass s | old s | old / one pass |")
    print("|---|---|---|---|---|")
    for what, unit, new, old in (("unclosed \\boxed{", "\\boxed{", last_boxed, old_last_boxed),
                                 ("unclosed ```", "``` ", fenced_blocks, old_fences)):
        for size in args.sizes:
            text = unit * (size // len(unit))
            t_new = best_of(new, text)
            t_old = best_of(old, text, 1) if size <= args.old_max else None
            ratio = f"{t_old / t_new:,.0f}" if t_old else "-"
            print(f"| {what} | {size:,} | {t_new:.4f} | {'-' if t_old is None else f'{t_old:.3f}'} "
                  f"| {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
