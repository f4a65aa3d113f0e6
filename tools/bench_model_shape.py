"""A Qwen2.5-0.5B-shaped model through one whole training step and one weight update, on CPU.

    python tools/bench_model_shape.py [--shape 0.5b|tiny] [--pack 1024] [--seqs 8] [--reps 0]
                                      [--no-weights] [--model-dir DIR] [--bucket-mb 256]
                                      [--max-model-len 2048] [--kv-cache-gib 1] [--threads 2]

    python tools/bench_model_shape.py --shape tiny            # smoke test (a minute or two)
    python tools/bench_model_shape.py --pack 1024 --model-dir /tmp/qwen05b   # the real one

`--shape 0.5b` has Qwen2.5-0.5B's dimensions (hidden 896, ffn 4864, 24 layers, 14 heads / 2 kv
heads, head_dim 64, vocab 151,936, tied embeddings, rope_theta 1e6, rms_norm_eps 1e-6, q/k/v
biases, max_position_embeddings 32768: ~494 M parameters, ~2 GB in fp32); `tiny` is the same
architecture scaled down (head_dim 32, the smallest vLLM's CPU attention has). Random weights,
float32, built with transformers and saved to a temp dir (or to `--model-dir`, reused when it
already holds a model); the tokenizer is byte-level (no merges) with Qwen's special tokens at
Qwen's ids, the vocabulary rows beyond it padding, as in Qwen2.5 (loadable by vLLM).

In this process (world size 1, gloo, fp32, `--threads` torch threads):

1. the real `areal_hpc.train.actor.Actor`, config `TrainConfig` defaults (attention auto =
   varlen, logprob_chunk_tokens 2048, prox recompute, lr 1e-4) except `max_tokens_per_mb =
   --pack`; one GRPO group of `--seqs` sequences of `--pack / --seqs` tokens (an eighth prompt;
   rewards 0/1), so one micro-batch of exactly `--pack` tokens; behaviour log-probs = the
   actor's own (one forward before the step) plus noise;
2. the first `train_step` is the measured one (it also creates Adam's state), then `--reps`
   more; each with its pack / prox (recompute forward) / fwd+bwd / optimizer seconds;
3. memory: RSS after the imports and torch.distributed (RSS0), after building the Actor
   (baseline), the peak over the first step (VmHWM, reset with /proc/self/clear_refs just before
   it) and `ru_maxrss` (the process's lifetime peak) after it, and the peak over each of the
   `--reps` steps (VmHWM reset before each). Measured trainer footprint = peak - RSS0 (weights,
   grads, Adam, activations, log-prob chunks, and whatever the allocator keeps). The first
   step creates Adam's state only at its optimizer step, after the activations are freed, so
   its peak is lower than a later step's (where the state exists through forward/backward, as
   the memory model assumes): pass `--reps 1` for the steady-state peak;
4. the memory model's prediction (`areal_hpc.plan.trainer_estimates(cfg, Arch.from_hf(...))`,
   device cpu, float32, the same pack): its terms, its total without the weight-sync term
   (what a training step alone needs) against the measured footprint of the step, and with it
   against the peak over step + update. On CPU the model has no CUDA context / NCCL term; its
   `fragmentation` is CPU_FRAGMENTATION of the dynamic part. RSS0 (Python, torch, Megatron
   libraries: not modelled) is subtracted from the measurement;
5. unless `--no-weights`: a vLLM engine (areal_hpc.rollout.vllm_engine, fp32, kv_cache_gib
   `--kv-cache-gib`, max_model_len `--max-model-len`) started after the step; its worker joins the
   weight group; one update with the trainer's path (`Actor.iter_hf_weights` ->
   `broadcast_stage` in `--bucket-mb` buckets, while the engine runs `update_weights`), timed
   until both sides are done; then vLLM's log-probs of a short sampled continuation against HF
   transformers' on the trained weights (`Actor.hf_state_dict()` loaded into the HF model), max
   |delta|, beside HF's own change between the initial and trained weights on the same tokens
   (how far apart the two versions are, so the match means something); the RSS of the engine's
   processes, beside the memory model's generator terms.

Prints markdown tables. Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "tools"))
from bench_memory import _reset_peak, _status, _trim  # noqa: E402
from bench_weights import in_thread  # noqa: E402

GiB = 2**30
QWEN_EOS = 151_643  # <|endoftext|>

SHAPES = {
    # Qwen2.5-0.5B's config.json dimensions
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True, rope_theta=1e6,
                 rms_norm_eps=1e-6, max_position_embeddings=32768),
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True, rope_theta=1e6,
                 rms_norm_eps=1e-6, max_position_embeddings=4096),
}


# ------------------------------------------------------------------------------ memory

def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


# ------------------------------------------------------------------------------ model

def make_model(path: Path, shape: str) -> dict:
    """Random Qwen2 of `shape` + byte-level tokenizer in `path`; returns config.json."""
    from areal_hpc.random_models import qwen_byte_tokenizer, save_random_qwen2

    dims = SHAPES[shape]
    eos = min(QWEN_EOS, dims["vocab_size"] - 3)
    qwen_byte_tokenizer(path, eos, dims["max_position_embeddings"])
    save_random_qwen2(path, **dims, hidden_act="silu", attention_dropout=0.0, initializer_range=0.02,
                      bos_token_id=eos, eos_token_id=eos, dtype="float32")
    _trim()
    return json.loads((path / "config.json").read_text())


def make_seqs(pack: int, n_seqs: int, vocab: int, seed: int = 0) -> list[dict]:
    """`n_seqs` sequences of `pack` tokens in all (lengths differ by at most one), an eighth of
    each the prompt; rewards 0/1 alternating (one GRPO group)."""
    import numpy as np

    from areal_hpc.random_models import random_seqs

    lens = [pack // n_seqs + (i < pack % n_seqs) for i in range(n_seqs)]
    return random_seqs(lens, vocab, np.random.default_rng(seed))


# ------------------------------------------------------------------------------ helpers

def run_config(model_dir: str, args):
    """The run config of this benchmark (the Actor's train section and the memory model's input)."""
    from areal_hpc.config import load

    return load(None, [
        f"model.path={model_dir}", "model.dtype=float32", "data.train_path=unused.jsonl",
        "topology.device=cpu", "topology.gpu_mem_gib=0", "topology.n_trainers=1", "topology.tp=1",
        "topology.pp=1", "topology.n_generators=1", f"train.max_tokens_per_mb={args.pack}",
        f"rollout.group_size={args.seqs}", "train.batch_prompts=1", "rollout.max_concurrent_prompts=1",
        # the config requires max_tokens_per_mb >= rollout.max_model_len; with kv_cache_gib set the
        # generator's terms do not depend on it (the engine itself gets --max-model-len)
        f"rollout.max_model_len={min(args.max_model_len, args.pack)}", f"rollout.kv_cache_gib={args.kv_cache_gib}",
        f"weights.bucket_mb={args.bucket_mb}",
    ])


def predict(cfg, hf: dict) -> dict:
    from areal_hpc import plan

    arch = plan.Arch.from_hf(hf)
    with_sync = plan.trainer_estimates(cfg, arch, weight_sync=True)[0]
    step_only = plan.trainer_estimates(cfg, arch, weight_sync=False)[0]
    gen = plan.generator_estimate(cfg, arch, None)
    return {"arch": arch, "with_sync": with_sync, "step_only": step_only, "generator": gen}


def hf_logprobs(model, prompt, output) -> "np.ndarray":  # noqa: F821 - numpy imported inside
    """log_softmax(logits) (temperature 1) of each output token given its context."""
    import numpy as np
    import torch

    ids = np.concatenate([prompt, output]).astype(np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(ids)[None]).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    p = len(prompt)
    return logp[p - 1: -1].gather(1, torch.from_numpy(ids[p:])[:, None])[:, 0].double().numpy()


def engine_rss(engine) -> list[tuple[int, str, int]]:
    """(pid, name, RSS bytes) of each process the engine started."""
    import psutil

    out = []
    for p in engine.processes():
        try:
            out.append((p.pid, p.name(), p.memory_info().rss))
        except psutil.NoSuchProcess:
            pass
    return out


# ------------------------------------------------------------------------------ the benchmark

def bench_trainer(args, model_dir: str, hf: dict, res: dict):
    import numpy as np

    from areal_hpc.train.actor import Actor

    cfg = run_config(model_dir, args)
    res["cfg"] = cfg
    _trim()
    res["rss0"] = _status("VmRSS")
    t0 = time.perf_counter()
    actor = Actor(cfg.train, model_dir, group_size=args.seqs, temperature=1.0, device="cpu", dtype="float32")
    res["build_s"] = time.perf_counter() - t0
    _trim()
    res["rss_built"] = _status("VmRSS")
    res["maxrss_built"] = _maxrss()
    res["n_params"] = sum(p.numel() for p in actor.model.parameters())
    print(f"[bench] Actor built in {res['build_s']:.1f} s: RSS {gib(res['rss_built'])} GiB "
          f"(RSS0 {gib(res['rss0'])})", flush=True)

    seqs = make_seqs(args.pack, args.seqs, min(hf["vocab_size"], QWEN_EOS), seed=1)
    t0 = time.perf_counter()
    rng = np.random.default_rng(2)
    for s, lp in zip(seqs, actor.compute_logprobs(seqs)):
        s["behav_logprobs"] = (lp + rng.normal(0, 0.05, len(lp))).astype(np.float32)
    res["behav_s"] = time.perf_counter() - t0
    _trim()
    res["rss_pre_step"] = _status("VmRSS")
    res["hwm_reset"] = _reset_peak()
    steps = []
    for i in range(1 + args.reps):
        if i:
            _trim()
            rss_before = _status("VmRSS")
            _reset_peak()
        else:
            rss_before = res["rss_pre_step"]
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        stats = actor.train_step(seqs, version=i)
        wall = time.perf_counter() - t0
        hwm = _status("VmHWM") if res["hwm_reset"] else None
        if i == 0:
            res["hwm_step"] = hwm
            res["maxrss_step"] = _maxrss()
            _trim()
            res["rss_after_step"] = _status("VmRSS")
        steps.append({"wall_s": wall, "rss_before": rss_before, "hwm": hwm,
                      "load": (load0, os.getloadavg()[0]), **stats})
        print(f"[bench] step {i}: {wall:.2f} s (pack {stats['pack_seconds']:.2f}, prox "
              f"{stats['prox_seconds']:.2f}, fwd+bwd {stats['fwd_bwd_seconds']:.2f}, optim "
              f"{stats['optim_seconds']:.2f}); loss {stats['loss']:.4f}, grad norm {stats['grad_norm']:.4f}",
              flush=True)
    res["steps"] = steps
    res["tokens"] = sum(len(s["prompt_tokens"]) + len(s["output_tokens"]) for s in seqs)
    res["lens"] = sorted({len(s["prompt_tokens"]) + len(s["output_tokens"]) for s in seqs})
    return actor


def bench_weights(args, actor, model_dir: str, hf: dict, res: dict) -> None:
    import numpy as np
    import torch

    from areal_hpc.rollout.vllm_engine import VLLMEngine
    from areal_hpc.transport.rendezvous import free_port
    from areal_hpc.transport import weights as wsync

    t0 = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=args.max_model_len,
                        kv_cache_gib=args.kv_cache_gib, seed=0, max_num_seqs=8)
    res["engine_start_s"] = time.perf_counter() - t0
    print(f"[bench] vLLM engine up in {res['engine_start_s']:.1f} s", flush=True)
    try:
        rng = np.random.default_rng(3)
        vocab = min(hf["vocab_size"], QWEN_EOS)
        prompt = rng.integers(0, vocab, 12).tolist()
        engine.submit("before", prompt, 8, temperature=1.0, ignore_eos=True)
        while engine.has_unfinished():
            engine.step()
        res["engine_rss_before"] = engine_rss(engine)

        port = free_port()
        address = wsync.WeightGroupAddress("127.0.0.1", port, 2, "gloo", 600, 600)
        joined = in_thread(engine.init_weight_group, address, 1)
        group = wsync.init_weight_group(address, 0)
        joined()
        specs = [(k, tuple(v.shape), wsync.dtype_to_str(v.dtype)) for k, v in actor.iter_hf_weights()]
        plan = wsync.plan_stages([specs], args.bucket_mb << 20)
        res["update_bytes"] = wsync.plan_bytes(plan)
        res["update_buckets"] = len(plan)
        res["update_tensors"] = len(specs)
        _trim()
        rss = _status("VmRSS")
        hwm_ok = _reset_peak()
        engine.submit("interrupted", prompt, 32, temperature=1.0, ignore_eos=True)  # aborted by the update
        engine.step()
        t0 = time.perf_counter()
        gen = in_thread(engine.update_weights, 1, plan)
        sent = wsync.broadcast_stage(group, plan, 0, actor.iter_hf_weights(), "cpu")
        paused = gen()
        res["update_s"] = time.perf_counter() - t0
        res["update_send_s"] = sent.seconds
        res["update_pause_s"] = paused
        res["update_rss_increase"] = (_status("VmHWM") - rss) if hwm_ok else None
        res["hwm_update"] = _status("VmHWM") if hwm_ok else None
        res["maxrss_update"] = _maxrss()
        print(f"[bench] weight update: {res['update_s']:.2f} s ({res['update_bytes'] / 2**20:.0f} MiB, "
              f"{len(plan)} buckets); generator paused {paused:.2f} s", flush=True)
        while engine.has_unfinished():
            engine.step()
        res["engine_rss_after"] = engine_rss(engine)

        engine.submit("check", prompt, 16, temperature=1.0, ignore_eos=True)
        done = []
        while engine.has_unfinished():
            done += engine.step()
        (sample,) = [s for s in done if s.request_id == "check"]
        res["check_versions"] = sorted(set(sample.versions.tolist()))
    finally:
        engine.shutdown()

    # HF transformers on the initial, then the trained weights (engine gone: its memory is free)
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lp_init = hf_logprobs(model, sample.prompt_tokens, sample.output_tokens)
    trained = actor.hf_state_dict()
    missing, unexpected = model.load_state_dict(trained, strict=False)
    del trained
    res["hf_missing"] = [k for k in missing if k != "lm_head.weight" or not hf["tie_word_embeddings"]]
    res["hf_unexpected"] = list(unexpected)
    if hf["tie_word_embeddings"]:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    lp_trained = hf_logprobs(model, sample.prompt_tokens, sample.output_tokens)
    vllm_lp = sample.behav_logprobs.astype(np.float64)
    res["check_tokens"] = len(vllm_lp)
    res["check_prompt"] = len(sample.prompt_tokens)
    res["dlp_vllm_hf"] = float(np.abs(vllm_lp - lp_trained).max())
    res["dlp_vllm_hf_init"] = float(np.abs(vllm_lp - lp_init).max())
    res["dlp_hf_init_trained"] = float(np.abs(lp_trained - lp_init).max())
    del model
    _trim()


def report(args, hf: dict, res: dict) -> None:
    pred = res.get("pred")
    steps = res["steps"]
    s0 = steps[0]
    print(f"\n## bench_model_shape: shape {args.shape}, pack {args.pack}, {args.seqs} seqs, "
          f"{args.threads} threads (CPU, fp32, gloo, world size 1)\n")
    print(f"Model: {res['n_params'] / 1e6:.1f} M params (Megatron), hidden {hf['hidden_size']}, ffn "
          f"{hf['intermediate_size']}, {hf['num_hidden_layers']} layers, {hf['num_attention_heads']}/"
          f"{hf['num_key_value_heads']} heads, vocab {hf['vocab_size']}, tied {hf['tie_word_embeddings']}. "
          f"Batch: {args.seqs} seqs of {'/'.join(map(str, res['lens']))} tokens = {res['tokens']} tokens in "
          f"{s0['n_micro_batches']} micro-batch(es), {s0['n_tokens']} output tokens. Actor build "
          f"{res['build_s']:.1f} s; behaviour log-probs (one forward) {res['behav_s']:.1f} s.\n")
    print("| step | wall s | stats seconds | pack s | prox s | fwd+bwd s | optim s | tokens/s | loss | grad norm "
          "| RSS before GiB | peak (VmHWM) GiB | load avg (start, end) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, st in enumerate(steps):
        print(f"| {i}{' (measured, first)' if i == 0 else ''} | {st['wall_s']:.2f} | {st['seconds']:.2f} | "
              f"{st['pack_seconds']:.3f} | {st['prox_seconds']:.2f} | {st['fwd_bwd_seconds']:.2f} | "
              f"{st['optim_seconds']:.2f} | {res['tokens'] / st['wall_s']:.0f} | {st['loss']:.4f} | "
              f"{st['grad_norm']:.4f} | {gib(st['rss_before'])} | {gib(st['hwm'])} | "
              f"{st['load'][0]:.1f}, {st['load'][1]:.1f} |")
    print(f"\n(load average: of the whole machine, {os.cpu_count()} CPUs; other processes than this one count.)")
    rss0 = res["rss0"]
    hwm = res["hwm_step"] if res["hwm_reset"] else None
    print("\nTrainer process memory (GiB):\n")
    print("| RSS0 (imports + dist) | after Actor build | before step | peak over step 0 (VmHWM) | "
          "ru_maxrss after step 0 | step's increase over baseline | measured footprint (peak - RSS0) |")
    print("|---|---|---|---|---|---|---|")
    peak = hwm if hwm is not None else res["maxrss_step"]
    print(f"| {gib(rss0)} | {gib(res['rss_built'])} | {gib(res['rss_pre_step'])} | {gib(hwm)} | "
          f"{gib(res['maxrss_step'])} | {gib(peak - res['rss_built'])} | {gib(peak - rss0)} |")
    if pred is None:
        print(f"\nMemory model unavailable: {res.get('pred_error')}")
    else:
        ws, so = pred["with_sync"], pred["step_only"]
        print(f"\nMemory model (areal_hpc.plan.trainer_estimates, device cpu, float32, max_tokens_per_mb "
              f"{args.pack}, weights.bucket_mb {args.bucket_mb}), trainer stage 0, GiB; arch "
              f"{pred['arch'].total_params / 1e6:.1f} M params:\n")
        print("| term | predicted | (alt) |")
        print("|---|---|---|")
        for t in ws.terms:
            print(f"| {t.name} | {gib(t.bytes)} | {'' if t.concurrent else 'alt'} |")
        print(f"| **total, step alone (weight_sync=False)** | **{gib(so.total)}** | |")
        print(f"| **total with weight sync** | **{gib(ws.total)}** | |")
        print("\n(alt): peaks at different times, only the largest counts. CUDA context and NCCL are 0 "
              "on CPU; fragmentation = CPU_FRAGMENTATION x dynamic part.\n")
        meas = peak - rss0
        print("| compared | measured GiB | predicted GiB | measured / predicted |")
        print("|---|---|---|---|")
        print(f"| after build (params + grad buffer) - RSS0 vs params + grads | {gib(res['rss_built'] - rss0)} | "
              f"{gib(so.term('params').bytes + so.term('grads').bytes)} | "
              f"{(res['rss_built'] - rss0) / (so.term('params').bytes + so.term('grads').bytes):.2f} |")
        print(f"| peak over step 0 - RSS0 vs total (step alone) | {gib(meas)} | {gib(so.total)} | "
              f"{meas / so.total:.2f} |")
        for i, st in enumerate(steps[1:], 1):   # Adam's state exists during their fwd/bwd
            if st["hwm"] is not None:
                m = st["hwm"] - rss0
                print(f"| peak over step {i} (steady state) - RSS0 vs total (step alone) | {gib(m)} | "
                      f"{gib(so.total)} | {m / so.total:.2f} |")
        if res.get("update_rss_increase") is not None:
            # steady state after the step (params, grads, Adam) + the update's transient; not the
            # vLLM libraries the engine's import loads into this process before the update
            m2 = res["rss_after_step"] - rss0 + res["update_rss_increase"]
            print(f"| (RSS after step 0 - RSS0) + update's increase vs total with weight sync | {gib(m2)} | "
                  f"{gib(ws.total)} | {m2 / ws.total:.2f} |")
            print(f"| peak over update - RSS before it vs weight sync buffers | {gib(res['update_rss_increase'])} | "
                  f"{gib(ws.term('weight sync buffers').bytes)} | "
                  f"{res['update_rss_increase'] / max(ws.term('weight sync buffers').bytes, 1):.2f} |")
        print(f"\nRSS0 = {gib(rss0)} GiB (Python, torch, Megatron, transformers; not a term of the model) is "
              f"subtracted from the measurements.")
    if args.no_weights:
        print("\nWeight update: skipped (--no-weights).")
        return
    if "update_s" not in res:
        print(f"\nWeight update: FAILED ({res.get('weights_error')})")
        return
    print(f"\nWeight update into a running vLLM engine (fp32, kv_cache_gib {args.kv_cache_gib}, max_model_len "
          f"{args.max_model_len}; engine start {res['engine_start_s']:.1f} s):\n")
    print("| bytes | tensors | buckets | update s (both sides done) | sender broadcast_stage s | "
          "generator pause s | trainer RSS increase GiB |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {res['update_bytes'] / 2**20:.0f} MiB | {res['update_tensors']} | {res['update_buckets']} | "
          f"{res['update_s']:.2f} | {res['update_send_s']:.2f} | {res['update_pause_s']:.2f} | "
          f"{gib(res['update_rss_increase'])} |")
    if "dlp_vllm_hf" not in res:
        print(f"\nLog-prob check / engine RSS: FAILED ({res.get('weights_error')})")
        return
    print(f"\nLog-prob check: vLLM (after the update; token versions {res['check_versions']}) vs HF "
          f"transformers on the trained weights (Actor.hf_state_dict), {res['check_prompt']}-token prompt, "
          f"{res['check_tokens']} sampled tokens, temperature 1:\n")
    print("| max abs d: vLLM vs HF trained | vLLM vs HF initial | HF initial vs HF trained |")
    print("|---|---|---|")
    print(f"| {res['dlp_vllm_hf']:.2e} | {res['dlp_vllm_hf_init']:.2e} | {res['dlp_hf_init_trained']:.2e} |")
    if res["hf_missing"] or res["hf_unexpected"]:
        print(f"\nHF load_state_dict: missing {res['hf_missing'][:5]}, unexpected {res['hf_unexpected'][:5]}")
    print("\nvLLM engine processes, RSS GiB (before the update / after it):\n")
    print("| pid | process | RSS before | RSS after |")
    print("|---|---|---|---|")
    after = {pid: rss for pid, _, rss in res["engine_rss_after"]}
    for pid, name, rss in res["engine_rss_before"]:
        print(f"| {pid} | {name} | {gib(rss)} | {gib(after.get(pid))} |")
    tot_b = sum(r for _, _, r in res["engine_rss_before"])
    tot_a = sum(r for _, _, r in res["engine_rss_after"])
    print(f"| | **sum** | **{gib(tot_b)}** | **{gib(tot_a)}** |")
    if pred is not None:
        g = pred["generator"]
        print("\nMemory model, generator (one vLLM worker), GiB: "
              + ", ".join(f"{t.name} {gib(t.bytes)}" for t in g.terms if t.bytes)
              + f"; total {gib(g.total)} (the engine-core process and the libraries of both are not terms).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--pack", type=int, default=1024, help="tokens of the one micro-batch")
    ap.add_argument("--seqs", type=int, default=8, help="sequences in the pack (one GRPO group)")
    ap.add_argument("--reps", type=int, default=0, help="train steps after the measured first one")
    ap.add_argument("--no-weights", action="store_true", help="skip the vLLM engine and the weight update")
    ap.add_argument("--model-dir", help="build the model here, or reuse the one already here")
    ap.add_argument("--bucket-mb", type=int, default=None, help="weight-update bucket (default: the config's)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the trainer")
    args = ap.parse_args()

    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from areal_hpc.config import WeightSyncConfig
    from areal_hpc.transport.rendezvous import free_port
    from areal_hpc.train.megatron_model import init_megatron_parallel
    import areal_hpc.train.actor  # noqa: F401  (imported before RSS0, so RSS0 holds the libraries)

    if args.bucket_mb is None:
        args.bucket_mb = WeightSyncConfig().bucket_mb
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    tmp = None
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_model_shape_")
        model_dir = Path(tmp.name) / args.shape
    if (model_dir / "config.json").exists() and (model_dir / "tokenizer_config.json").exists():
        hf = json.loads((model_dir / "config.json").read_text())
        want = SHAPES[args.shape]
        if any(hf.get(k) != v for k, v in want.items() if k != "rope_theta"):
            sys.exit(f"{model_dir} holds a model of another shape than {args.shape}")
        print(f"[bench] reusing the model in {model_dir}", flush=True)
    else:
        t0 = time.perf_counter()
        hf = make_model(model_dir, args.shape)
        print(f"[bench] built and saved the {args.shape} model in {time.perf_counter() - t0:.1f} s "
              f"({model_dir})", flush=True)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    res: dict = {}
    try:
        cfg = run_config(str(model_dir), args)
        init_megatron_parallel(1, 1, seed=cfg.train.seed, backend="gloo")
        actor = bench_trainer(args, str(model_dir), hf, res)
        try:
            res["pred"] = predict(res["cfg"], hf)
        except Exception as exc:  # noqa: BLE001 - reported instead of the prediction
            res["pred"], res["pred_error"] = None, f"{type(exc).__name__}: {exc}"
        if not args.no_weights:
            try:
                bench_weights(args, actor, str(model_dir), hf, res)
            except Exception as exc:  # noqa: BLE001 - the trainer's results are still reported
                import traceback

                traceback.print_exc()
                res["weights_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        report(args, hf, res)
        print(f"\ntotal {time.perf_counter() - t_start:.0f} s", flush=True)
    finally:
        dist.destroy_process_group()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
