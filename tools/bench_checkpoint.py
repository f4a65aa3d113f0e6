"""A training step with its checkpoint: synchronous vs asynchronous (checkpoint.async_save), same run.

    python tools/bench_checkpoint.py [--hidden 768] [--layers 6] [--vocab 32768] [--seqs 8]
                                     [--cycles 3] [--reps 3] [--threads 1] [--dir /tmp]

One trainer (Megatron, TP = PP = 1, gloo world of one, fp32, Adam) on a random Qwen2 of the
given shape, its checkpoint written under `--dir` (the checkpoints' filesystem; default a temp
dir). Each mode runs `--cycles` cycles of one training step (`Actor.train_step` on `--seqs`
sequences, bench_train.py's batch) and one checkpoint, then one more step (the "next step"
the last asynchronous write overlaps), timed as a block; a checkpoint's cost is the block's time
over none's, per cycle:

- none: the steps alone (no checkpoint).
- sync: each step, then `Checkpointer.save` (complete on return: shards, read-back for the
  CRC-32s, state.h5, manifest).
- async: each step, then `Checkpointer.save(wait=False)`: the trainer stalls to plan and stage
  the shards (on CPU: a fork, whose pages are a snapshot), a writer process writes and reads them
  back while the next step trains, the next save first seals it; the block ends with
  `wait()` after its extra step.

The modes alternate (none, sync, async; the order rotated each rep) after one warm-up of each,
so load drift on a shared machine hits all alike. Prints the step's time (none), each mode's
time per step with its checkpoint and that checkpoint's cost (medians of the blocks), the
overlap: 1 - async cost / sync cost (1 = the write is free, 0 = no better than synchronous),
each save's stall (what the trainer waits for), how long an async save took to complete, the
overlap of each rep's blocks alone, the checkpoint's size and the load average.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))      # bench_train's batch

MODES = ("none", "sync", "async")


def make_actor(path: Path, args):
    from areal_hpc.config import TrainConfig
    from areal_hpc.random_models import random_qwen2
    from areal_hpc.train.actor import Actor

    heads = max(1, args.hidden // 64)
    random_qwen2(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=heads,
                 num_key_value_heads=heads, intermediate_size=4 * args.hidden,
                 vocab_size=args.vocab, max_position_embeddings=256,
                 tie_word_embeddings=False).save_pretrained(path)
    return Actor(TrainConfig(lr=1e-5, max_tokens_per_mb=4096), str(path), group_size=8)


def block(actor, batch, mode: str, run_dir: Path, cycles: int, first: int) -> dict:
    """`cycles` steps, each followed by a checkpoint of `mode`, then one more step (which the
    last asynchronous write overlaps) and the wait for that write: the seconds per cycle, and
    the saves' stalls and times to complete."""
    from areal_hpc.train.checkpoint import Checkpointer

    saver = Checkpointer(run_dir, keep=1, async_save=True)
    stalls, writes = [], []
    t0 = time.perf_counter()
    for k in range(cycles + 1):
        actor.train_step(batch)
        if mode == "none" or k == cycles:
            continue
        t1 = time.perf_counter()
        saver.save(first + k, model=actor.model, optimizer=actor.optimizer,
                   scheduler=actor.lr_scheduler, wait=mode == "sync")
        stalls.append(time.perf_counter() - t1)
        if mode == "async" and k:
            writes.append(saver.seconds)
    if saver.wait() is not None:
        writes.append(saver.seconds)
    return {"s": time.perf_counter() - t0, "stall": stalls, "write": writes,
            "staged": saver.staged_bytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seqs", type=int, default=8, help="sequences per step")
    ap.add_argument("--cycles", type=int, default=3, help="step + checkpoint cycles per block")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training step")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    args = ap.parse_args(argv)

    from bench_train import make_batch

    from areal_hpc.storage import checkpoint as ck
    from areal_hpc.train.megatron_model import single_process

    single_process(threads=args.threads)
    load0 = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    try:
        actor = make_actor(work / "model", args)
        params = sum(p.numel() for p in actor.model.parameters())
        batch = make_batch(actor, args.seqs)
        step = 0
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for rep in range(args.reps + 1):                # rep 0: the warm-up, not counted
            order = MODES[rep % 3:] + MODES[:rep % 3]
            for mode in order:
                out = block(actor, batch, mode, work / mode, args.cycles if rep else 1, step + 1)
                step += args.cycles
                if rep:
                    runs[mode].append(out)
                print(f"rep {rep} {mode:5s} block {out['s']:.2f} s", flush=True)
        found = ck.find_latest(work / "sync")
        size = found[1]["bytes"] if found else 0
        blocks = {m: statistics.median(r["s"] for r in runs[m]) for m in MODES}
        step_s = blocks["none"] / (args.cycles + 1)
        cost = {m: (blocks[m] - blocks["none"]) / args.cycles for m in ("sync", "async")}
        cycle = {"none": step_s, **{m: step_s + c for m, c in cost.items()}}
        stall = {m: statistics.median(s for r in runs[m] for s in r["stall"])
                 for m in ("sync", "async")}
        write = statistics.median(w for r in runs["async"] for w in r["write"])
        print(f"\nmodel: {params / 1e6:.0f} M parameters (fp32, Adam); checkpoint "
              f"{size / 1e9:.2f} GB (staged per save: {runs['async'][-1]['staged'] / 1e9:.2f} GB); "
              f"{args.seqs} sequences per step, {args.threads} thread(s); {args.reps} reps x "
              f"{args.cycles} cycles; load average {load0:.1f} before, {os.getloadavg()[0]:.1f} "
              f"after; checkpoints in {work}")
        print(f"{'':8s}{'s/step':>8s}{'checkpoint cost':>17s}{'stall':>8s}")
        for m in MODES:
            extra = f"{cost[m]:+17.2f}{stall[m]:8.2f}" if m in cost else ""
            print(f"{m:8s}{cycle[m]:8.2f}{extra}")
        per_rep = [1 - (a["s"] - n["s"]) / (y["s"] - n["s"])
                   for n, y, a in zip(runs["none"], runs["sync"], runs["async"])]
        print(f"async save complete {write:.2f} s after it began (stall + writer + seal); "
              f"overlap = 1 - async cost / sync cost = "
              f"{1 - cost['async'] / cost['sync']:.2f} (medians), per rep "
              + " ".join(f"{x:.2f}" for x in per_rep))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
