"""Padding waste and micro-batch imbalance of the trainer's packing vs pad-to-longest.

    python tools/bench_packing.py [--seed 0] [--reps 5]

For each scenario, one training step's sequence lengths are drawn (long-tailed: lognormal output
lengths capped at the generation limit) and planned exactly as the Actor does
(`algo.packing.balanced_allocate`: `ppo_minibatches` minibatches → data-parallel shares →
micro-batches of at most `max_tokens_per_mb` tokens, the count equal on every rank and a multiple
of pp). The baseline splits each minibatch into contiguous data-parallel shares in arrival order.

- waste: padding tokens / all token slots computed. Ours is padding-free (sequences concatenated
  into one row per micro-batch), so 0 by construction; the baseline pads every micro-batch to its
  longest sequence (as many arrival-order sequences as the token budget allows, padding included).
- imbalance: max / mean - 1 of the real tokens per micro-batch (worst data-parallel rank), and of
  the real tokens per data-parallel rank (the slowest rank sets the step time).
- micro-batches: per rank and minibatch, against the lower bound ceil(tokens / budget) of the
  fullest rank. Worst case over minibatches and draws throughout.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from areal_hpc.algo.packing import balanced_allocate  # noqa: E402

# name: (sequences per step, prompt tokens (lo, hi), output median, output sigma, output cap,
#        max_tokens_per_mb, dp, pp, ppo_minibatches)
SCENARIOS = {
    "tiny job (16x8 seqs, 1 rank)": (128, (20, 40), 45, 0.35, 96, 512, 1, 1, 1),
    "long tail, 1 rank": (512, (50, 300), 400, 1.0, 8192, 16384, 1, 1, 1),
    "7B recipe (dp8 pp4, 4 minibatches)": (8192, (50, 400), 1500, 1.0, 27648, 30720, 8, 4, 4),
    "32B recipe (dp2 pp8, 4 minibatches)": (16384, (50, 400), 2000, 1.0, 27648, 30720, 2, 8, 4),
}


def draw_lengths(rng, n, prompt, median, sigma, cap) -> list[int]:
    p = rng.integers(prompt[0], prompt[1] + 1, n)
    o = np.minimum(np.ceil(rng.lognormal(math.log(median), sigma, n)), cap).astype(int)
    return (p + o).tolist()


def minibatches(lengths: list[int], n: int) -> list[list[int]]:
    """The Actor's minibatches: token-balanced, `n` of them."""
    return [[lengths[i] for i in g] for g in balanced_allocate(lengths, sum(lengths), min_groups=n)]


def ours(lengths: list[int], budget: int, dp: int, pp: int) -> dict:
    """The Actor's plan of one minibatch: data-parallel shares, then equal micro-batch counts."""
    shares = balanced_allocate(lengths, max(sum(lengths), 1), min_groups=dp)
    share_lens = [[lengths[i] for i in s] for s in shares]
    k = max(len(balanced_allocate(sl, budget, divisor=pp)) for sl in share_lens)  # all-reduce max
    mb_loads, rank_loads = [], []
    for sl in share_lens:
        mbs = balanced_allocate(sl, budget, min_groups=k, divisor=pp)
        mb_loads.append([sum(sl[i] for i in mb) for mb in mbs])
        rank_loads.append(sum(sl))
    worst_mb = max(max(lo) / np.mean(lo) - 1 for lo in mb_loads)
    bound = math.ceil(max(rank_loads) / budget)
    return {"waste": 0.0, "mb_imbalance": worst_mb,
            "dp_imbalance": max(rank_loads) / np.mean(rank_loads) - 1, "n_mb": k, "bound": bound}


def pad_to_longest(lengths: list[int], budget: int, dp: int) -> dict:
    """Arrival order, contiguous data-parallel shares; each micro-batch padded to its longest."""
    per_rank = np.array_split(np.asarray(lengths), dp)
    slots = real = 0
    mb_imb, counts, rank_loads = [], [], []
    for share in per_rank:
        loads, mb, longest = [], [], 0
        for n in share.tolist():
            if mb and max(longest, n) * (len(mb) + 1) > budget:
                loads.append(sum(mb))
                slots += longest * len(mb)
                mb, longest = [], 0
            mb.append(n)
            longest = max(longest, n)
        loads.append(sum(mb))
        slots += longest * len(mb)
        real += int(share.sum())
        mb_imb.append(max(loads) / np.mean(loads) - 1)
        counts.append(len(loads))
        rank_loads.append(int(share.sum()))
    return {"waste": 1 - real / slots, "mb_imbalance": max(mb_imb),
            "dp_imbalance": max(rank_loads) / np.mean(rank_loads) - 1, "n_mb": max(counts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5, help="draws per scenario (worst case reported)")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    print("| scenario | packing | waste | micro-batch imbalance | DP imbalance | micro-batches / rank / minibatch |")
    print("|---|---|---|---|---|---|")
    for name, (n, prompt, med, sigma, cap, budget, dp, pp, n_mini) in SCENARIOS.items():
        runs = {"ours": [], "pad-to-longest": []}
        for _ in range(args.reps):
            lengths = draw_lengths(rng, n, prompt, med, sigma, cap)
            for mb in minibatches(lengths, n_mini):
                runs["ours"].append(ours(mb, budget, dp, pp))
                runs["pad-to-longest"].append(pad_to_longest(mb, budget, dp))
        for label, rs in runs.items():
            worst = {k: max(r[k] for r in rs) for k in rs[0]}
            n_mb = f"{worst['n_mb']}" + (f" (bound {worst['bound']})" if "bound" in worst else "")
            print(f"| {name} | {label} | {100 * worst['waste']:.1f}% | "
                  f"{100 * worst['mb_imbalance']:.1f}% | {100 * worst['dp_imbalance']:.2f}% | {n_mb} |")


if __name__ == "__main__":
    main()
