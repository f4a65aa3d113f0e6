"""Weight update (gather + broadcast + load into a running vLLM engine) vs a raw broadcast.

    python tools/bench_weights.py [--sizes tiny,small,medium] [--reps 5] [--bucket-mb 1024]
                                  [--breakdown]

One trainer (Megatron, TP = PP = 1, gloo world of one) and one vLLM engine (CPU, its worker
joins the weight group as rank 1), both on this machine, fp32. For each model size, a random
Qwen2 is written to a temp dir and loaded by both; then, alternating after one warm-up each:

- ours: the trainer's path: `Actor.iter_hf_weights` (gather under HF names) →
  `broadcast_stage` (buckets) while the engine runs `update_weights` (abort, reload through
  vLLM's layerwise reload, prefix-cache reset, resume); timed until both sides are done.
- raw: one `broadcast` of the same number of bytes in one flat buffer into the same worker
  (`WeightSyncExtension.recv_flat`), nothing gathered, nothing loaded.

Prints the median of each, their ratio, and the generator pause per update. The default bucket
size here is 1 GiB (`--bucket-mb 1024`, not the config's 256 MiB): the models here then fit in
one bucket and nothing pipelines; pass a smaller `--bucket-mb` to see the pipelined path.

`--breakdown` also times each phase alone, in the same alternation: gather (`iter_hf_weights`),
gather + pack (`broadcast_stage` against a group that sends nothing), the wire in the plan's
buckets (pre-packed buffers, received into fresh buffers and dropped), and vLLM's layerwise
reload from buffers already in the worker (no wire). It sends functions to the worker, which
needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set here for the engine this tool starts).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

# hidden, layers, heads (head_dim 32 for vLLM's CPU attention), intermediate, vocab
SIZES = {
    "tiny": (64, 2, 2, 128, 128),
    "small": (256, 4, 8, 1024, 8192),
    "medium": (512, 8, 16, 2048, 32768),
    "large": (1024, 12, 32, 4096, 32768),
}


def make_model(path: Path, size: str) -> int:
    from areal_hpc.random_models import random_qwen2

    hidden, layers, heads, inter, vocab = SIZES[size]
    model = random_qwen2(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def in_thread(fn, *args):
    """Run fn(*args) beside the caller; returns a join() that gives its result."""
    box = {}

    def run():
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # surfaced by join()
            box["err"] = e

    t = threading.Thread(target=run)
    t.start()

    def join():
        t.join()
        if "err" in box:
            raise box["err"]
        return box["out"]
    return join


class _NoWire:
    """A weight group that sends nothing: `broadcast_stage` against it is gather + pack alone."""

    class _Done:
        def wait(self):
            return True

    def broadcast(self, flat, root):
        return self._Done()


def _worker_recv_buckets(worker, plan) -> float:
    """In the vLLM worker: take the plan's buckets off the wire into fresh buffers, drop them."""
    import torch

    from areal_hpc.transport.weights import bucket_dtype, bucket_numel, dtype_from_str

    t0 = time.perf_counter()
    for root, bucket in plan:
        flat = torch.empty(bucket_numel(bucket), dtype=dtype_from_str(bucket_dtype(bucket)))
        worker.weight_group.broadcast(flat, root=root).wait()
    return time.perf_counter() - t0


def _worker_reload(worker, plan) -> float:
    """In the vLLM worker: vLLM's layerwise reload alone, from buckets already in memory (fresh
    buffers, as the receiver hands them over; the values are small constants)."""
    import torch

    from areal_hpc.transport.weights import bucket_dtype, bucket_numel, dtype_from_str, spec_numel

    flats = [torch.full((bucket_numel(b),), 1e-3, dtype=dtype_from_str(bucket_dtype(b))) for _, b in plan]

    def tensors():
        for (_, bucket), flat in zip(plan, flats):
            offset = 0
            for name, shape, _ in bucket:
                n = spec_numel(shape)
                yield name, flat[offset : offset + n].view(tuple(shape))
                offset += n

    t0 = time.perf_counter()
    worker.reload_weights(weights_iterator=tensors())
    return time.perf_counter() - t0


def bench(size: str, reps: int, bucket_mb: int, work: Path, breakdown: bool = False) -> dict:
    import torch

    from areal_hpc.config import TrainConfig
    from areal_hpc.rollout.vllm_engine import VLLMEngine
    from areal_hpc.transport.rendezvous import free_port
    from areal_hpc.train.actor import Actor
    from areal_hpc.transport import weights as wsync

    model_dir = work / size
    n_params = make_model(model_dir, size)
    actor = Actor(TrainConfig(), str(model_dir))
    engine = VLLMEngine(str(model_dir), dtype="float32", max_model_len=256, kv_cache_gib=1)
    try:
        port = free_port()
        address = wsync.WeightGroupAddress("127.0.0.1", port, 2, "gloo", 600, 600)
        joined = in_thread(engine.init_weight_group, address, 1)
        group = wsync.init_weight_group(address, 0)
        joined()
        specs = [(k, tuple(v.shape), wsync.dtype_to_str(v.dtype)) for k, v in actor.iter_hf_weights()]
        plan = wsync.plan_stages([specs], bucket_mb << 20)
        nbytes = wsync.plan_bytes(plan)
        flat = torch.zeros(nbytes // 4, dtype=torch.float32)
        ours, raw, pauses = [], [], []
        phases: dict[str, list[float]] = {"gather": [], "pack": [], "wire": [], "reload": []}
        packed = [torch.zeros(wsync.bucket_numel(b), dtype=wsync.dtype_from_str(wsync.bucket_dtype(b)))
                  for _, b in plan] if breakdown else []
        for rep in range(reps + 1):     # rep 0: warm-up
            if breakdown:
                t0 = time.perf_counter()
                for _ in actor.iter_hf_weights():
                    pass
                t_gather = time.perf_counter() - t0
                t_pack = wsync.broadcast_stage(_NoWire(), plan, 0, actor.iter_hf_weights(), "cpu").seconds
                t0 = time.perf_counter()
                gen = in_thread(engine.collective_rpc, _worker_recv_buckets, None, (plan,))
                for (root, _), buf in zip(plan, packed):
                    group.broadcast(buf, root=root).wait()
                gen()
                t_wire = time.perf_counter() - t0
                (t_reload,) = engine.collective_rpc(_worker_reload, args=(plan,))
                if rep:
                    for key, t in zip(phases, (t_gather, t_pack, t_wire, t_reload)):
                        phases[key].append(t)
            engine.submit(f"r{rep}", [5, 6, 7, 8], 16, ignore_eos=True)  # interrupted by the update
            t0 = time.perf_counter()
            gen = in_thread(engine.update_weights, rep + 1, plan)
            wsync.broadcast_stage(group, plan, 0, actor.iter_hf_weights(), "cpu")
            paused = gen()
            t_ours = time.perf_counter() - t0
            while engine.has_unfinished():
                engine.step()
            t0 = time.perf_counter()
            gen = in_thread(engine.collective_rpc, "recv_flat", None, (flat.numel(), "float32"))
            group.broadcast(flat, root=0).wait()
            gen()
            t_raw = time.perf_counter() - t0
            if rep:
                ours.append(t_ours)
                raw.append(t_raw)
                pauses.append(paused)
    finally:
        engine.shutdown()
    o, r = statistics.median(ours), statistics.median(raw)
    return {"size": size, "params": n_params, "bytes": nbytes, "buckets": len(plan), "ours_s": o,
            "raw_s": r, "ratio": o / r, "pause_s": statistics.median(pauses),
            **{f"{k}_s": statistics.median(v) for k, v in phases.items() if v}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,small,medium")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--breakdown", action="store_true", help="also time each phase alone")
    args = ap.parse_args()
    import os

    if args.breakdown:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


    from areal_hpc.train.megatron_model import single_process

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    single_process(threads=args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            rows.append(bench(size, args.reps, args.bucket_mb, Path(tmp), args.breakdown))
            r = rows[-1]
            print(f"{r['size']}: {r['params'] / 1e6:.1f} M params, {r['bytes'] / 2**20:.1f} MiB in "
                  f"{r['buckets']} bucket(s): ours {r['ours_s'] * 1e3:.1f} ms, raw broadcast "
                  f"{r['raw_s'] * 1e3:.1f} ms, ratio {r['ratio']:.2f}; generator pause "
                  f"{r['pause_s'] * 1e3:.1f} ms", flush=True)
    print("\n| model | params | MiB | buckets | gather+broadcast+load | raw broadcast | ratio | pause |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['params'] / 1e6:.1f} M | {r['bytes'] / 2**20:.1f} | {r['buckets']} | "
              f"{r['ours_s'] * 1e3:.1f} ms | {r['raw_s'] * 1e3:.1f} ms | {r['ratio']:.2f} | "
              f"{r['pause_s'] * 1e3:.1f} ms |")
    if args.breakdown:
        print("\nEach phase alone (medians; ms):\n")
        print("| model | buckets | gather | gather+pack | wire in buckets | vLLM reload | raw broadcast |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['size']} | {r['buckets']} | {r['gather_s'] * 1e3:.1f} | {r['pack_s'] * 1e3:.1f} | "
                  f"{r['wire_s'] * 1e3:.1f} | {r['reload_s'] * 1e3:.1f} | {r['raw_s'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()
