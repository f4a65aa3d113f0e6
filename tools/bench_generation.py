"""Generator throughput: our engine wrapper vs bare `vllm.LLM.generate`, same prompts, same run.

    python tools/bench_generation.py [--model models/tiny] [--prompts 256] [--n 4] [--reps 3]
    python tools/bench_generation.py --seeds both [--prompts 64] [--n 8]   # seeds' cost
    python tools/bench_generation.py --busy [key=value ...]    # busy fraction in an async job
    python tools/bench_generation.py --runs-ahead [--model models/tiny]   # the engine, unstepped

Both engines are up at once and measured in alternation (bare, ours, bare, ours, ...), so the
ratio is not skewed by the machine's load drifting between two separate runs. Our side is the
generator's own path: one request per sample, a per-token version and behaviour log-prob
bookkeeping, `step()` driven from Python. Prints tokens/s per repetition and the median ratio.

`--seeds on|off|both`: per-request sampling seeds (rollout.per_request_seeds). `on`/`off`: our
side with or without them, against bare vLLM as above. `both`: our engine twice, without seeds
(vLLM's defaults) and with them (each sample its own seed; on CPU without chunked prefill), both
up at once and measured in alternation, each prompt's samples submitted as the generator does
(one group), every sample max_new_tokens long (ignore_eos: the same work on both sides); prints
tokens/s and tokens per CPU-second (this process and the engine's, the measure that a shared
box's load disturbs least) of each, and the median ratios seeded/unseeded.

`--busy` instead runs the tiny async job (configs/tiny_cpu.yaml plus overrides) and reports each
generator's busy fraction: time generating / (generating + weight-update pauses + idle + loop
work), from the first training prompt until the last batch is taken; held-out evaluation time
is excluded; and the engine's own busy share (the time it had training requests, weight loads
apart), which also counts the loop's work: the EngineCore generates in its own process.

`--runs-ahead` shows that: one batch of samples generated with `step()` called back to back,
then the same batch with the caller asleep for as long as that took before it steps at all. If
the EngineCore went on generating meanwhile, the steps after the sleep only drain what it made.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def busy_fraction(overrides: list[str]) -> None:
    """Run the tiny async job; print each generator's time split and the trainer's wait share
    (the trainer waiting on rollouts = generation is the bottleneck, and vice versa)."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "areal_hpc.launch.local", "configs/tiny_cpu.yaml",
               "name=bench-busy", f"output_dir={out}", *overrides]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        run = Path(out) / "bench-busy"
        from areal_hpc.storage.run_dir import RunDir
        gens, steps = RunDir(run).read_generators(), RunDir(run).read_metrics()
    for g in gens:
        sec = g.seconds
        print(f"generator rank {g.rank}: engine busy {100 * g.engine_share():.1f}%, loop in its step "
              f"{100 * g.busy_share():.1f}% (generating "
              f"{sec['busy']:.1f}s, pauses {sec['pause']:.1f}s, idle {g.idle_s():.1f}s of which waiting on "
              f"scores {sec.get('idle_scoring', 0.0):.1f}s, loop work {g.loop_work():.1f}s), "
              f"{g.tokens} tokens")
    wait = sum(s["wait_s"] for s in steps)
    train = sum(s["seconds"] + s["weight_sync_s"] for s in steps)
    print(f"trainer: waited for rollouts {wait:.1f}s, trained + synced {train:.1f}s "
          f"({100 * wait / (wait + train):.0f}% waiting) over {len(steps)} steps")


def runs_ahead(model: str, samples: int = 32, max_new_tokens: int = 200) -> None:
    """Seconds to generate one batch stepping back to back, and with the caller asleep first."""
    from areal_hpc.rollout.vllm_engine import VLLMEngine

    eng = VLLMEngine(model, dtype="float32", max_model_len=512, kv_cache_gib=0.25)

    def batch(label: str, sleep_s: float) -> float:
        eng.submit_group([f"{label}:{i}" for i in range(samples)], list(range(5, 25)),
                         max_new_tokens=max_new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        time.sleep(sleep_s)
        t1, calls = time.perf_counter(), 0
        while eng.has_unfinished():
            eng.step()
            calls += 1
        t2 = time.perf_counter()
        print(f"{label}: asleep {t1 - t0:.3f} s, then {calls} step() calls in {t2 - t1:.3f} s; "
              f"total {t2 - t0:.3f} s", flush=True)
        return t2 - t0

    batch("warm-up", 0.0)
    stepped = batch("stepped", 0.0)
    batch("asleep first", stepped)
    batch("stepped again", 0.0)
    eng.shutdown()


def seeds_cost(args) -> None:
    """Our engine without and with per-request seeds, side by side (see the module's doc)."""
    from transformers import AutoTokenizer

    from areal_hpc.data.jsonl import load_jsonl
    from areal_hpc.rollout.seeds import group_seed
    from areal_hpc.rollout.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(args.model)
    rows = load_jsonl(f"{args.model}/train.jsonl")[: args.prompts]
    prompts = [tok(r["question"], add_special_tokens=False)["input_ids"] for r in rows]
    common = dict(dtype=args.dtype, max_model_len=256, seed=0, enforce_eager=True,
                  kv_cache_gib=args.kv_cache_gib)
    engines = {"off": VLLMEngine(args.model, **common),
               "on": VLLMEngine(args.model, per_request_seeds=True, **common)}

    def cpu_s(eng) -> float:
        """CPU seconds so far of this process and the engine's (a shared box's load slows the
        wall clock of both sides alike, but not how much CPU a token takes)."""
        import psutil
        procs = [psutil.Process()] + eng.processes()
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    def run(which: str, rep: int) -> tuple[int, float, float]:
        eng, t0, c0 = engines[which], time.perf_counter(), cpu_s(engines[which])
        for i, p in enumerate(prompts):
            seeds = None
            if which == "on":   # another prompt id each repetition: fresh draws, as in a run
                s0 = group_seed(0, "train", rep * len(prompts) + i)
                seeds = [s0 + j for j in range(args.n)]
            eng.submit_group([f"{rep}:{i}:{j}" for j in range(args.n)], p,  # equal work
                             max_new_tokens=args.max_new_tokens, temperature=1.0,
                             ignore_eos=True, seeds=seeds)
        tokens = 0
        while eng.has_unfinished():
            tokens += sum(len(s.output_tokens) for s in eng.step())
        return tokens, time.perf_counter() - t0, cpu_s(eng) - c0

    run("off", -1), run("on", -1)                       # warm-up
    out = []
    for rep in range(args.reps):
        (t_off, s_off, c_off), (t_on, s_on, c_on) = run("off", rep), run("on", rep)
        out.append({"rep": rep, "off_tok_s": t_off / s_off, "on_tok_s": t_on / s_on,
                    "ratio": (t_on / s_on) / (t_off / s_off), "off_tokens": t_off,
                    "on_tokens": t_on, "off_tok_cpu_s": t_off / c_off,
                    "on_tok_cpu_s": t_on / c_on, "cpu_ratio": (t_on / c_on) / (t_off / c_off)})
        print(f"rep {rep}: seeds off {t_off / s_off:8.1f} tok/s ({t_off} tokens, "
              f"{t_off / c_off:.0f} per CPU-s) | seeds on {t_on / s_on:8.1f} tok/s ({t_on} "
              f"tokens, {t_on / c_on:.0f} per CPU-s) | ratio {out[-1]['ratio']:.3f}, per CPU-s "
              f"{out[-1]['cpu_ratio']:.3f}", flush=True)
    ratio = statistics.median(r["ratio"] for r in out)
    cpu_ratio = statistics.median(r["cpu_ratio"] for r in out)
    print(f"median ratio seeds on/off: {ratio:.3f} (tokens/s), {cpu_ratio:.3f} (tokens per CPU-s)")
    print(json.dumps({"args": vars(args), "reps": out, "median_ratio": ratio,
                      "median_cpu_ratio": cpu_ratio}))
    for eng in engines.values():
        eng.shutdown()


def main() -> None:
    if "--busy" in sys.argv:
        return busy_fraction([a for a in sys.argv[1:] if a != "--busy"])
    if "--runs-ahead" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--runs-ahead", action="store_true")
        ap.add_argument("--model", default="models/tiny")
        return runs_ahead(ap.parse_args().model)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seeds", choices=("off", "on", "both"), default="off",
                    help="per-request sampling seeds on our side; both: ours without vs with")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0, help="--seeds both: per engine")
    args = ap.parse_args()
    if args.seeds == "both":
        return seeds_cost(args)

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from areal_hpc.data.jsonl import load_jsonl
    from areal_hpc.rollout.seeds import group_seed
    from areal_hpc.rollout.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(args.model)
    rows = load_jsonl(f"{args.model}/train.jsonl")[: args.prompts]
    prompts = [tok(r["question"], add_special_tokens=False)["input_ids"] for r in rows]
    common = dict(dtype=args.dtype, max_model_len=256, seed=0, enforce_eager=True)

    bare = LLM(model=args.model, logprobs_mode="processed_logprobs", **common)
    ours = VLLMEngine(args.model, per_request_seeds=args.seeds == "on", **common)
    sp = SamplingParams(n=1, temperature=1.0, max_tokens=args.max_new_tokens, logprobs=0)

    def run_bare() -> tuple[int, float]:
        reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(args.n)]
        t0 = time.perf_counter()
        outs = bare.generate(reqs, sp, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0

    def run_ours() -> tuple[int, float]:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            for j in range(args.n):
                seed = None if args.seeds == "off" else group_seed(0, "train", i) + j
                ours.submit(f"b:{i}:{j}", p, max_new_tokens=args.max_new_tokens, temperature=1.0,
                            seed=seed)
        tokens = 0
        while ours.has_unfinished():
            tokens += sum(len(s.output_tokens) for s in ours.step())
        return tokens, time.perf_counter() - t0

    run_bare(), run_ours()                              # warm-up
    rows_out = []
    for rep in range(args.reps):
        (tb, sb), (to, so) = run_bare(), run_ours()
        rows_out.append({"rep": rep, "bare_tok_s": tb / sb, "ours_tok_s": to / so,
                         "ratio": (to / so) / (tb / sb), "bare_tokens": tb, "ours_tokens": to})
        print(f"rep {rep}: bare vLLM {tb / sb:8.1f} tok/s ({tb} tokens) | ours {to / so:8.1f} tok/s "
              f"({to} tokens) | ratio {rows_out[-1]['ratio']:.3f}", flush=True)
    ratio = statistics.median(r["ratio"] for r in rows_out)
    print(f"median ratio ours/bare: {ratio:.3f}")
    print(json.dumps({"args": vars(args), "reps": rows_out, "median_ratio": ratio}))
    ours.shutdown()


if __name__ == "__main__":
    main()
