"""Our train step vs bare Megatron forward/backward on the same packed tokens, same run.

    python tools/bench_train.py [--model models/tiny] [--seqs 128] [--max-tokens-per-mb 512]
                                [--reps 5] [--prox recompute] [--threads 1] [--profile]
                                [--attention varlen|mask]
    python tools/bench_train.py --sweep 256,512,1024,2048,4096 [--attentions varlen,mask] [--reps 3]

`--sweep`: the same batch (same tokens per step) at each pack size (`max_tokens_per_mb`) and
attention path, each case in a fresh process: median step time, tokens/s, the tokens/s ratio to
the smallest pack of the same path (pack sizes interleaved in one process per path), and the
peak resident memory a step adds over the process's memory after building the model
(ru_maxrss, so each reading has its own process).

One process (gloo, world size 1). The batch is like the tiny job's: `--seqs` sequences in groups
of 8, prompts of 20-40 tokens, outputs long-tailed around 45 tokens (at most 96).

- ours: `Actor.train_step` (advantages, planning and packing, π_prox, decoupled-PPO loss over
  packed micro-batches, optimizer step, statistics).
- bare: the same model, DDP wrapper and optimizer, on the micro-batches ours packs (built
  beforehand, not timed): Megatron's schedule with the model's own loss (`labels` -> per-token
  cross entropy, summed over output tokens), then the optimizer step; with `--prox recompute`
  also one forward-only pass over the same micro-batches first, as ours does for π_prox.

The two alternate (ours, bare, ours, bare, ...) after one warm-up each, so load drift on a shared
machine hits both alike; the ratio of the medians is what to read. Prints ours' own breakdown
(packing, π_prox, forward/backward, optimizer) as well; `--profile` adds torch.profiler's top
operators of one more step of ours, and the share of attention scores that the block-diagonal
mask throws away.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def make_batch(actor, n: int, seed: int = 0) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = actor.hf_config["vocab_size"]
    seqs = []
    for _ in range(n):
        prompt = rng.integers(2, vocab, rng.integers(20, 41))
        output = rng.integers(2, vocab, int(min(np.ceil(rng.lognormal(np.log(45), 0.35)), 96)))
        seqs.append({"prompt_tokens": prompt, "output_tokens": output, "reward": float(rng.integers(0, 2))})
    current = actor.compute_logprobs(seqs)
    for s, lp in zip(seqs, current):
        s["behav_logprobs"] = lp + rng.normal(0, 0.05, len(lp)).astype(np.float32)
        s["versions"] = np.zeros(len(lp), np.int64)
    return seqs


def bare_step(actor, micro_batches, recompute: bool) -> None:
    """Megatron's own path on pre-packed micro-batches: (forward-only,) forward/backward, step."""

    from areal_hpc.train.megatron_model import output_hidden_states

    output_hidden_states(actor.model, False)  # the model's own logits and loss
    try:
        _bare_step(actor, micro_batches, recompute)
    finally:
        output_hidden_states(actor.model, True)


def _bare_step(actor, micro_batches, recompute: bool) -> None:
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from areal_hpc.train.cpu_compat import CudaToCpuMode

    def loss_func(mb, per_token_loss):  # [1, S] cross entropy from the model's output layer
        return per_token_loss[0, mb.out_pos].sum(), torch.tensor(mb.n_tokens, dtype=torch.int), {}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        labels = torch.roll(mb.tokens, -1, dims=1)  # position p predicts token p + 1
        return model(mb.tokens, mb.position_ids, mb.attention_mask, labels=labels,
                     packed_seq_params=mb.packed_seq_params), partial(loss_func, mb)

    def forward_only_step(data_iterator, model):
        mb = next(data_iterator)
        return (model(mb.tokens, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params),
                lambda out: (out.sum() * 0, {}))

    def run(step_func, forward_only):
        with CudaToCpuMode():
            get_forward_backward_func()(
                forward_step_func=step_func, data_iterator=iter(micro_batches), model=[actor.model],
                num_microbatches=len(micro_batches), micro_batch_size=1, forward_only=forward_only,
                seq_length=max(mb.tokens.shape[1] for mb in micro_batches))

    if recompute:
        with torch.no_grad():
            run(forward_only_step, forward_only=True)
    actor.model.zero_grad_buffer()
    actor.optimizer.zero_grad()
    run(forward_step, forward_only=False)
    with CudaToCpuMode():
        actor.optimizer.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--max-tokens-per-mb", default="512")
    ap.add_argument("--prox", default="recompute", choices=["recompute", "loglinear", "behaviour"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--attention", default="varlen", choices=["varlen", "mask"])
    ap.add_argument("--sweep", help="comma-separated pack sizes: one fresh process per case")
    ap.add_argument("--attentions", default="varlen,mask", help="with --sweep")
    ap.add_argument("--random", metavar="HIDDEN,LAYERS",
                    help="instead of --model: a random Qwen2 of this width and depth (head dim 32, "
                         "GQA 4:1, vocab 1024), built in a temporary directory")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a sweep case
    args = ap.parse_args()
    if args.random:
        args.model = random_model(*(int(x) for x in args.random.split(",")))
    if args.sweep:
        return sweep(args)

    import numpy as np
    import torch

    from areal_hpc.config import TrainConfig
    from areal_hpc.train.actor import Actor
    from areal_hpc.train.megatron_model import single_process

    packs = [int(x) for x in str(args.max_tokens_per_mb).split(",")]
    args.max_tokens_per_mb = packs[0]
    cfg = TrainConfig(lr=3e-4, max_tokens_per_mb=max(packs), prox=args.prox, attention=args.attention)
    single_process(cfg.seed, threads=args.threads)
    actor = Actor(cfg, args.model, group_size=8)
    seqs = make_batch(actor, args.seqs)
    actor.cfg.max_tokens_per_mb = args.max_tokens_per_mb
    if args.one:
        return one_case(actor, seqs, args.reps, packs)
    n_out = torch.tensor([len(s["output_tokens"]) for s in seqs])
    per_token = {"behav_logprobs": [s["behav_logprobs"] for s in seqs],
                 "advantages": [np.zeros(int(n), np.float32) for n in n_out]}
    micro_batches = [mb for minibatch in actor.plan_step(seqs, per_token) for mb in minibatch]
    tokens = sum(len(s["prompt_tokens"]) + len(s["output_tokens"]) for s in seqs)
    print(f"batch: {len(seqs)} sequences, {tokens} tokens ({int(n_out.sum())} output), "
          f"{len(micro_batches)} micro-batches of <= {args.max_tokens_per_mb} tokens, prox={args.prox}, "
          f"threads={args.threads}")

    ours, bare, parts = [], [], []
    for rep in range(args.reps + 1):  # rep 0 warms both up
        t0 = time.perf_counter()
        stats = actor.train_step(seqs)
        t1 = time.perf_counter()
        bare_step(actor, micro_batches, recompute=args.prox == "recompute")
        t2 = time.perf_counter()
        if rep:
            ours.append(t1 - t0)
            bare.append(t2 - t1)
            parts.append(stats)
            print(f"rep {rep}: ours {t1 - t0:.3f} s, bare {t2 - t1:.3f} s, ratio {(t1 - t0) / (t2 - t1):.3f}")
    med = {k: statistics.median(p[k] for p in parts)
           for k in ("pack_seconds", "prox_seconds", "fwd_bwd_seconds", "optim_seconds", "seconds")}
    print(f"median: ours {statistics.median(ours):.3f} s, bare {statistics.median(bare):.3f} s, "
          f"ours / bare {statistics.median(ours) / statistics.median(bare):.3f}")
    print("ours, median seconds: " + ", ".join(f"{k.removesuffix('_seconds')} {v:.3f}" for k, v in med.items()))
    if args.profile:
        profile(actor, seqs, micro_batches)


def random_model(hidden: int, layers: int) -> str:
    import tempfile

    from areal_hpc.random_models import save_random_qwen2

    heads = max(hidden // 32, 4)
    return save_random_qwen2(tempfile.mkdtemp(prefix="bench_train_model_"), vocab_size=1024,
                             hidden_size=hidden, intermediate_size=hidden * 3,
                             num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=max(heads // 4, 1), max_position_embeddings=8192)


def one_case(actor, seqs, reps: int, packs: list[int]) -> None:
    """A sweep process, one JSON line per pack size. With one pack size: the peak RSS one
    `train_step` adds over the memory after building the model. With several: step times,
    the pack sizes interleaved (a, b, c, a, b, c, ...) so that load drift hits all alike."""
    import json
    import resource

    import psutil

    base = psutil.Process().memory_info().rss
    times = {p: [] for p in packs}
    stats = {}
    for rep in range(reps + 1):  # rep 0 warms up
        for pack in packs:
            actor.cfg.max_tokens_per_mb = pack
            t0 = time.perf_counter()
            stats[pack] = actor.train_step(seqs)
            if rep:
                times[pack].append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = sum(len(s["prompt_tokens"]) + len(s["output_tokens"]) for s in seqs)
    for pack in packs:
        print("RESULT " + json.dumps({
            "pack": pack, "seconds": statistics.median(times[pack]) if times[pack] else None,
            "tokens": tokens, "micro_batches": stats[pack]["n_micro_batches"],
            "peak_added_mib": max(peak - base, 0) / 2**20 if len(packs) == 1 else None}))


def sweep(args) -> None:
    import json
    import subprocess

    packs = [int(x) for x in args.sweep.split(",")]

    def run(attention, case_packs, reps):
        cmd = [sys.executable, __file__, "--one", "--model", args.model, "--seqs", str(args.seqs),
               "--max-tokens-per-mb", ",".join(map(str, case_packs)), "--reps", str(reps),
               "--prox", args.prox, "--threads", str(args.threads), "--attention", attention]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [json.loads(x[7:]) for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not lines:
            raise SystemExit(f"{attention} {case_packs}: failed\n{out.stderr[-3000:]}")
        return {r["pack"]: r for r in lines}

    rows = {}
    for attention in args.attentions.split(","):
        timed = run(attention, packs, args.reps)  # one process: pack sizes interleaved
        for pack in packs:
            mem = run(attention, [pack], 0)[pack]  # a fresh process per peak-memory reading
            rows[attention, pack] = r = {**timed[pack], "peak_added_mib": mem["peak_added_mib"]}
            print(f"{attention:>6} {pack:>5}: {r['seconds']:.3f} s, {r['tokens'] / r['seconds']:.0f} "
                  f"tokens/s, peak +{r['peak_added_mib']:.0f} MiB", flush=True)
    print(f"\n{args.seqs} sequences, prox {args.prox}, threads {args.threads}, median of {args.reps} "
          f"(pack sizes interleaved in one process per path)\n")
    print("| attention | pack | micro-batches | step | tokens/s | vs smallest pack | peak added |")
    print("|---|---|---|---|---|---|---|")
    for (attention, pack), r in rows.items():
        base = rows[attention, packs[0]]
        ratio = (r["tokens"] / r["seconds"]) / (base["tokens"] / base["seconds"])
        print(f"| {attention} | {pack} | {r['micro_batches']} | {r['seconds']:.3f} s | "
              f"{r['tokens'] / r['seconds']:.0f} | {ratio:.2f}x | {r['peak_added_mib']:.0f} MiB |")


def profile(actor, seqs, micro_batches) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        actor.train_step(seqs)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
    # Each micro-batch computes S x S attention scores; only each sequence's own L x L block is used.
    full = sum(mb.tokens.shape[1] ** 2 for mb in micro_batches)
    used = sum(n * n for mb in micro_batches for n in _segment_lengths(mb))
    if actor.attention == "mask":
        print(f"attention scores inside a sequence's own block: {used / full:.3f} of those computed")
    else:
        print(f"packed attention computes each sequence's own block only: {used / full:.3f} of "
              f"what the dense mask would compute")


def _segment_lengths(mb) -> list[int]:
    """Token count of each sequence packed in `mb` (from its position ids, which restart at 0)."""
    pos = mb.position_ids[0].tolist()
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    return [b - a for a, b in zip(starts, starts[1:])]


if __name__ == "__main__":
    main()
