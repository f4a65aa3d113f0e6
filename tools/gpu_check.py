"""A prepared check of the trainer on one GPU: Megatron + NCCL, varlen vs mask, step time / MFU,
peak memory. Results print as markdown tables (ready for BENCHMARKS.md) to stdout and to
`$OUT/gpu_check.txt` (or `--out`), written as they come, so a run cut short keeps what it did.

    python tools/gpu_check.py [--quick]              # one GPU (bash tools/gpu_check.sh sets up)
    python tools/gpu_check.py --device cpu --tiny    # the same code paths on CPU: a dry run

Imports: the standard library at module level; torch, numpy, transformers, Megatron-core and
areal_hpc inside the checks. vLLM is not needed (the lent GPU machine has none).

Checks, each timed and guarded (a failure is printed and the next check runs):
1. Megatron-core on CUDA with NCCL (world size 1), bf16, tp = pp = 1: `Actor` builds on a small
   Qwen2 and one `train_step` runs (attention=mask, the path that needs nothing new).
2. train.attention=varlen vs mask, same weights and batch (one small pack): max |Δ log-prob|
   of `compute_logprobs`, and the first train step's loss and grad norm of each; bf16 and fp32.
3. Train-step time, tokens/s and MFU of a Qwen2.5-0.5B-shaped model (hidden 896, ffn 4864,
   24 layers, 14 heads / 2 kv heads, vocab 151936, tied embeddings, rope_theta 1e6, q/k/v bias;
   random weights, built here with transformers and saved to a temp dir) on 4k- and 16k-token
   packs, recompute off and full (uniform, 1 layer), attention varlen; 1 warm-up + 3 timed steps.
   prox=behaviour, so a step is exactly one forward/backward over the pack + one optimizer step.
   FLOPs and MFU are the planner's, one definition (areal_hpc/plan/budget.py: `pack_flops` over
   this pack's sequence lengths, `mfu`): the layers' forward + backward (3 forwards, causal
   attention 2 * len^2 * heads * head_dim per layer and sequence forward), the output layer at
   the output tokens only in 4 forwards (8 V h per token: train/logprobs.py recomputes each
   chunk's logits in backward), and full recompute's extra forward; MFU = FLOPs / (step
   seconds * peak), the peak the dense bf16 of `--gpu` in the planner's table (default h200).
4. Peak memory of each case of 3 (`torch.cuda.max_memory_allocated`, reset after the Actor is
   built, so it includes weights, grads, Adam state and activations) against the memory model
   (`areal_hpc.plan.trainer_estimates` for the same config; its CUDA-context, NCCL,
   fragmentation and weight-sync terms are left out of the comparison, and shown).
5. What `deterministic: true` costs the trainer (areal_hpc/determinism.py): check 3's first pack
   again, recompute off, in a child process that has the mode's environment from its start
   (cuBLAS workspace, NCCL algorithm and protocol; they win over the inherited environment, as
   in the launchers) and builds its Actor in Megatron's
   deterministic_mode with torch's deterministic algorithms; its step time side by side with
   check 3's of this run, and whether its two timed steps' losses repeat in a second child.
6-9. What the job does when things go wrong on GPUs (tools/gpu_faults.py, its docstring): the
   NCCL version against deterministic mode's floor; how long a SIGKILLed process's GPU memory
   takes to come back (an engine restart waits for it); the weight group with a worker killed
   between and inside updates (the host's deadline, the abort, the re-formed group); P2P between
   ranks that narrowed CUDA_VISIBLE_DEVICES to their own GPU. Checks 8 and 9 need 2+ GPUs (3 for
   a TP-2 engine) and say so on fewer; the dry run runs 8 on gloo.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, without installing areal_hpc

# areal_hpc.determinism's CUDA environment (imported after the sys.path line above)
from areal_hpc.determinism import rank_env as _deterministic_env  # noqa: E402

DETERMINISTIC_ENV = _deterministic_env("cuda")

# Qwen2.5-0.5B's dimensions (config.json of the released model), random weights.
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                  rms_norm_eps=1e-6, max_position_embeddings=32768)
SMALL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True, rope_theta=1e6,
             rms_norm_eps=1e-6, max_position_embeddings=32768)
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, rope_theta=1e6,
            rms_norm_eps=1e-6, max_position_embeddings=4096)


# ---------------------------------------------------------------- output

class Report:
    """Lines to stdout and, appended and flushed at once, to the results file."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        with self.path.open("a") as f:
            f.write(text + "\n")

    def table(self, header: list[str], rows: list[list]) -> None:
        self("| " + " | ".join(header) + " |")
        self("|" + "|".join("---" for _ in header) + "|")
        for row in rows:
            self("| " + " | ".join(str(c) for c in row) + " |")
        self()


@contextlib.contextmanager
def guarded(report: Report, name: str, status: dict):
    """Run a check; on failure print the error and the end of its traceback, and go on."""
    report(f"## {name}")
    report()
    t0 = time.perf_counter()
    try:
        yield
        status[name] = f"ok ({time.perf_counter() - t0:.1f} s)"
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then the next check runs
        tb = traceback.format_exc().strip().splitlines()
        report(f"**FAILED** after {time.perf_counter() - t0:.1f} s: `{type(exc).__name__}: "
               f"{str(exc).splitlines()[0] if str(exc) else ''}`")
        report()
        report("```")
        for line in tb[-12:]:
            report(line)
        report("```")
        report()
        status[name] = f"FAILED: {type(exc).__name__}"
    finally:
        free_memory()


def fmt(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.{digits}g}" if abs(x) < 1e-2 or abs(x) >= 1e5 else f"{x:.{digits}f}"
    return str(x)


# ---------------------------------------------------------------- setup

class Env:
    def __init__(self, device: str, tiny: bool, dtype: str, deterministic: bool = False, gpu=None):
        self.deterministic = deterministic      # --deterministic: check 5's child
        self.gpu = gpu                          # the planner's Gpu (budget.GPUS) whose peak MFU uses
        self.device = device
        self.tiny = tiny
        self.dtype = dtype  # the parameter dtype of checks 1 and 3
        self.cuda = device == "cuda"
        self.tmp = Path(tempfile.mkdtemp(prefix="areal_gpu_check_"))

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def make_model(env: Env, dims: dict, name: str, dtype: str | None = None) -> str:
    """A random-weight Qwen2 (HF directory: config.json + model.safetensors) in `dtype` (default
    the checks' parameter dtype), built with transformers on the check's device. Cached per name."""
    import torch

    from areal_hpc.random_models import random_qwen2

    out = env.tmp / name
    if (out / "config.json").exists():
        return str(out)
    with torch.device("cuda" if env.cuda else "cpu"):
        model = random_qwen2(**dims, hidden_act="silu", attention_dropout=0.0, use_cache=False,
                             bos_token_id=1, eos_token_id=2)
    model = model.to(torch.bfloat16 if (dtype or env.dtype) == "bfloat16" else torch.float32)
    model.save_pretrained(out)
    del model
    free_memory()
    return str(out)


def make_seqs(n_tokens: int, n_seqs: int, vocab: int, seed: int = 0) -> list[dict]:
    """`n_seqs` sequences of `n_tokens` tokens in all (lengths varying about 2x), prompts an eighth
    of each; rewards 0/1, both present (one GRPO group: group_size = n_seqs)."""
    import numpy as np

    from areal_hpc.random_models import random_seqs

    rng = np.random.default_rng(seed)
    w = rng.uniform(0.5, 1.5, n_seqs)
    lens = np.maximum(np.floor(w / w.sum() * n_tokens).astype(int), 4)
    lens[-1] += n_tokens - lens.sum()
    return random_seqs([int(n) for n in lens], vocab, rng, low=3)


def with_behav(actor, seqs: list[dict], noise: float = 0.05, seed: int = 1) -> list[dict]:
    """`behav_logprobs` = the actor's own log-probs plus a little noise (ratios near 1)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for s, lp in zip(seqs, actor.compute_logprobs(seqs)):
        s["behav_logprobs"] = (lp + rng.normal(0, noise, len(lp))).astype(np.float32)
    return seqs


def build_actor(env: Env, model_dir: str, dtype: str, group_size: int, **train):
    from areal_hpc.config import TrainConfig
    from areal_hpc.train.actor import Actor

    cfg = TrainConfig(lr=1e-5, seed=1, ppo_minibatches=1, **train)
    return Actor(cfg, model_dir, tp=1, pp=1, group_size=group_size, device=env.device, dtype=dtype,
                 deterministic=env.deterministic)


# ---------------------------------------------------------------- checks

def check_environment(report: Report, env: Env) -> None:
    import torch

    from importlib import metadata

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    rows = [["python", platform.python_version()], ["torch", torch.__version__],
            ["torch CUDA", torch.version.cuda or "-"]]
    if env.cuda:
        nccl = torch.cuda.nccl.version()
        rows += [["NCCL", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)],
                 ["GPU", f"{torch.cuda.get_device_name(0)} "
                         f"({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"]]
    for dist in ("megatron-core", "transformers", "safetensors", "omegaconf", "numpy",
                 "transformer-engine", "vllm"):
        rows.append([dist, version(dist)])
    try:
        from areal_hpc.train.attention import varlen_call_plan, varlen_kernel

        dt = torch.bfloat16 if env.dtype == "bfloat16" else torch.float32
        rows.append(["varlen kernel", varlen_kernel(torch.device(env.device), dt)])
        rows.append(["varlen_attn call", varlen_call_plan()])
    except Exception as exc:  # noqa: BLE001
        rows.append(["varlen kernel", f"unavailable ({type(exc).__name__})"])
    rows.append(["mode", f"device={env.device}, dtype={env.dtype}" + (", tiny" if env.tiny else "")])
    report.table(["", "version"], rows)
    if env.cuda and shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60).stdout
        report("```")
        for line in smi.rstrip().splitlines():
            report(line)
        report("```")
        report()


def check_megatron(report: Report, env: Env) -> None:
    """1. Actor on this device (NCCL on CUDA), one train step."""
    import torch

    dims = TINY if env.tiny else SMALL
    t0 = time.perf_counter()
    model_dir = make_model(env, dims, "small")
    t_model = time.perf_counter() - t0
    n_tokens, n_seqs = (256, 4) if env.tiny else (2048, 8)
    t0 = time.perf_counter()
    actor = build_actor(env, model_dir, env.dtype, n_seqs, attention="mask", max_tokens_per_mb=n_tokens,
                        prox="recompute")
    t_build = time.perf_counter() - t0
    seqs = with_behav(actor, make_seqs(n_tokens, n_seqs, dims["vocab_size"]))
    env.sync()
    t0 = time.perf_counter()
    stats = actor.train_step(seqs)
    env.sync()
    t_step = time.perf_counter() - t0
    backend = torch.distributed.get_backend()
    ok = all(math.isfinite(stats[k]) for k in ("loss", "grad_norm"))
    report.table(
        ["backend", "dtype", "model", "tokens", "build s", "step s", "loss", "grad norm", "finite"],
        [[backend, env.dtype, f"h{dims['hidden_size']} L{dims['num_hidden_layers']} (HF save {t_model:.1f} s)",
          stats["n_tokens"], fmt(t_build), fmt(t_step), fmt(stats["loss"], 4), fmt(stats["grad_norm"], 4), ok]])
    del actor
    if not ok:
        raise RuntimeError(f"non-finite loss or grad norm: {stats}")


def check_varlen_vs_mask(report: Report, env: Env, dtypes: list[str]) -> None:
    """2. attention=varlen vs mask on the same weights and batch."""
    import numpy as np

    dims = TINY if env.tiny else QWEN25_05B
    n_tokens, n_seqs = (192, 4) if env.tiny else (1024, 6)
    rows = []
    for dtype in dtypes:
        model_dir = make_model(env, dims, f"compare_{dtype}", dtype)
        results = {}
        seqs = None
        for attention in ("mask", "varlen"):
            actor = build_actor(env, model_dir, dtype, n_seqs, attention=attention,
                                max_tokens_per_mb=n_tokens, prox="recompute")
            if seqs is None:  # behaviour log-probs from the mask (reference) model, used by both
                seqs = with_behav(actor, make_seqs(n_tokens, n_seqs, dims["vocab_size"], seed=2))
            lp = np.concatenate(actor.compute_logprobs(seqs))
            t0 = time.perf_counter()
            stats = actor.train_step(seqs)
            env.sync()
            results[attention] = (lp, stats, time.perf_counter() - t0)
            del actor
            free_memory()
        (lp_m, st_m, t_m), (lp_v, st_v, t_v) = results["mask"], results["varlen"]
        d = np.abs(lp_v.astype(np.float64) - lp_m)
        rows.append([dtype, f"{n_seqs} seqs / {n_tokens} tok", fmt(float(d.max()), 3), fmt(float(d.mean()), 3),
                     fmt(st_m["loss"], 6), fmt(st_v["loss"], 6), fmt(abs(st_v["loss"] - st_m["loss"]), 3),
                     fmt(st_m["grad_norm"], 5), fmt(st_v["grad_norm"], 5), fmt(t_m), fmt(t_v)])
    report.table(["dtype", "pack", "max abs d logprob", "mean abs d logprob", "loss mask", "loss varlen",
                  "abs d loss", "grad norm mask", "grad norm varlen", "step s mask", "step s varlen"], rows)


def step_mfu(dims: dict, train, seqs: list[dict], seconds: float, gpu=None) -> tuple[float, float | None]:
    """(TFLOP/s, MFU) of a train step over `seqs` (trained as TrainConfig `train` says) that
    took `seconds`: the planner's FLOP model over this pack (`budget.pack_flops`) and its MFU
    (`budget.mfu`) at the peak of `gpu` (a `budget.Gpu`; None: no MFU)."""
    from areal_hpc.plan import Arch
    from areal_hpc.plan.budget import mfu, pack_flops

    fl = pack_flops(Arch.from_hf(dims, "the check's model"),
                    [len(s["prompt_tokens"]) + len(s["output_tokens"]) for s in seqs],
                    sum(len(s["output_tokens"]) for s in seqs), train)
    return fl.total / seconds / 1e12, (mfu(fl, seconds, gpu) if gpu is not None else None)


# Terms of the memory model that the caching allocator's max_memory_allocated does not see
# (CUDA context, NCCL, allocator fragmentation) or that this check does not exercise (weights sync).
NOT_ALLOCATED_TERMS = ("CUDA context", "NCCL + NVLS buffers", "fragmentation", "weight sync buffers",
                       "weight gather, TP peers")


def predicted_trainer(env: Env, dims: dict, model_dir: str, train: dict, n_tokens: int) -> dict:
    """The memory model's per-GPU trainer estimate for this case (`areal_hpc.plan`:
    `trainer_estimates(cfg, Arch.from_hf(config.json))`, stage 0 of tp = pp = dp = 1), in GiB:
    `total` (everything), `allocated` (without NOT_ALLOCATED_TERMS: what max_memory_allocated
    measures) and `terms` {name: GiB}. Raises if areal_hpc.plan or that API is absent: the
    table then shows why, and nothing is guessed."""
    from areal_hpc import plan
    from areal_hpc.config import load

    overrides = [f"model.path={model_dir}", f"model.dtype={env.dtype}", "data.train_path=unused.jsonl",
                 f"topology.device={env.device}", "topology.n_trainers=1", "topology.tp=1", "topology.pp=1",
                 f"topology.trainer_backend={'nccl' if env.cuda else 'gloo'}",
                 f"topology.weight_backend={'nccl' if env.cuda else 'gloo'}",
                 "train.attention=varlen", f"train.max_tokens_per_mb={n_tokens}", "train.prox=behaviour",
                 f"rollout.max_model_len={n_tokens}"]
    overrides += [f"train.{k}={v}" for k, v in train.items()]
    cfg = load(None, overrides)
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    est = plan.trainer_estimates(cfg, plan.Arch.from_hf(hf))[0]
    gib = 2.0**30
    kept = [t for t in est.terms if t.name not in NOT_ALLOCATED_TERMS]
    alt = [t.bytes for t in kept if not t.concurrent]
    allocated = sum(t.bytes for t in kept if t.concurrent) + max(alt, default=0.0)
    return {"total": est.total / gib, "allocated": allocated / gib,
            "terms": {t.name + ("" if t.concurrent else " (alt)"): t.bytes / gib for t in est.terms}}


def check_throughput(report: Report, env: Env, packs: list[int], timed: int,
                     recompute: list[str] | None = None) -> list[dict]:
    """3. step time, tokens/s, MFU; and the measurements for 4."""
    import numpy as np
    import torch

    dims = TINY if env.tiny else QWEN25_05B
    model_dir = make_model(env, dims, "qwen25_05b" if not env.tiny else "tiny")
    recomputes = {
        "off": {},
        "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    }
    recomputes = {k: v for k, v in recomputes.items() if k in (recompute or recomputes)}
    rows, cases = [], []
    for n_tokens in packs:
        n_seqs = max(4, n_tokens // 2048)  # sequences of ~1-2k tokens (4k: 4, 16k: 8)
        for name, extra in recomputes.items():
            case = {"tokens": n_tokens, "recompute": name, "train": extra, "model_dir": model_dir}
            try:
                t0 = time.perf_counter()
                actor = build_actor(env, model_dir, env.dtype, n_seqs, attention="varlen",
                                    max_tokens_per_mb=n_tokens, prox="behaviour", **extra)
                build_s = time.perf_counter() - t0
                seqs = with_behav(actor, make_seqs(n_tokens, n_seqs, dims["vocab_size"], seed=3))
                env.sync()
                if env.cuda:
                    case["static_gib"] = torch.cuda.memory_allocated() / 2**30
                    torch.cuda.reset_peak_memory_stats()
                times, fb, opt = [], [], []
                for i in range(1 + timed):
                    env.sync()
                    t0 = time.perf_counter()
                    stats = actor.train_step(seqs)
                    env.sync()
                    case.setdefault("losses", []).append(float(stats["loss"]))
                    if i:  # step 0 warms up
                        times.append(time.perf_counter() - t0)
                        fb.append(stats["fwd_bwd_seconds"])
                        opt.append(stats["optim_seconds"])
                if env.cuda:
                    case["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                    case["reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
                step = float(np.median(times))
                tflops, mfu = step_mfu(dims, actor.cfg, seqs, step, env.gpu if env.cuda else None)
                case.update(ok=True, n_seqs=n_seqs, step_s=step)
                rows.append([n_tokens, n_seqs, name, fmt(build_s), fmt(step, 4), fmt(float(np.median(fb)), 4),
                             fmt(float(np.median(opt)), 4), f"{n_tokens / step:,.0f}", fmt(tflops, 4),
                             f"{100 * mfu:.1f}%" if mfu is not None else "-", fmt(stats["loss"], 4)])
                del actor
            except Exception as exc:  # noqa: BLE001 - one case failing leaves the others
                tb = traceback.format_exc().strip().splitlines()
                case.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                rows.append([n_tokens, n_seqs, name, "FAILED", case["error"][:120], "", "", "", "", "", ""])
                print("\n".join(tb[-12:]), file=sys.stderr, flush=True)
                with contextlib.suppress(NameError):    # the case failed before building it
                    del actor  # noqa: F821
            finally:
                free_memory()
            cases.append(case)
    if env.deterministic:
        report("deterministic: true (Megatron deterministic_mode, torch deterministic algorithms, "
               "environment: " + ", ".join(f"{k}={os.environ.get(k, '-')}" for k in DETERMINISTIC_ENV)
               + ")")
        report()
    h = dims["hidden_size"]
    report(f"Model: hidden {h}, ffn {dims['intermediate_size']}, {dims['num_hidden_layers']} layers, "
           f"{dims['num_attention_heads']}/{dims['num_key_value_heads']} heads, vocab {dims['vocab_size']}, "
           f"{env.dtype}, attention varlen, prox=behaviour; median of {timed} steps after 1 warm-up.")
    report()
    report.table(["pack tokens", "seqs", "recompute", "build s", "step s", "fwd+bwd s", "optim s", "tokens/s",
                  "TFLOP/s (plan/budget.py)", f"MFU ({env.gpu.name}, {env.gpu.bf16_flops / 1e12:.0f} TFLOP/s)"
                  if env.cuda else "MFU", "loss"], rows)
    return cases


def check_memory(report: Report, env: Env, cases: list[dict]) -> None:
    """4. measured peak vs the memory model."""
    dims = TINY if env.tiny else QWEN25_05B
    rows, terms, errors = [], {}, set()
    for c in cases:
        key = f"{c['tokens']}/{c['recompute']}"
        try:
            pred = predicted_trainer(env, dims, c["model_dir"], c["train"], c["tokens"])
            terms[key] = pred["terms"]
        except Exception as exc:  # noqa: BLE001 - no estimate: say why, compute nothing
            pred = None
            errors.add(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        peak = c.get("peak_gib")
        rows.append([c["tokens"], c["recompute"], fmt(c.get("static_gib")), fmt(peak), fmt(c.get("reserved_gib")),
                     fmt(pred and pred["allocated"]), fmt(pred and pred["total"]),
                     fmt(pred["allocated"] / peak) if pred and peak else "-",
                     "" if c.get("ok") else "case failed"])
    if not env.cuda:
        report("(CPU: torch.cuda.max_memory_allocated does not apply; measured columns are '-'.)")
        report()
    for e in sorted(errors):
        report(f"Memory model unavailable: `{e}`")
        report()
    report("Predicted allocated = the model's total without " + ", ".join(NOT_ALLOCATED_TERMS)
           + " (not seen by max_memory_allocated, or not exercised here).")
    report()
    report.table(["pack tokens", "recompute", "after build GiB", "peak alloc GiB", "peak reserved GiB",
                  "predicted alloc GiB", "predicted total GiB", "predicted / measured alloc", "note"], rows)
    if terms:
        names = list(dict.fromkeys(n for t in terms.values() for n in t))
        report("Memory model terms (GiB):")
        report()
        report.table(["term", *terms], [[n, *(fmt(t.get(n)) for t in terms.values())] for n in names])


def check_deterministic(report: Report, env: Env, cases: list[dict], pack: int, timed: int,
                        out: Path, children: int = 2) -> None:
    """5. check 3's first pack with `deterministic: true`, in `children` child processes (two:
    whether their losses repeat; one, with --quick: the cost only)."""
    base = next((c for c in cases if c["tokens"] == pack and c["recompute"] == "off" and c.get("ok")), None)
    runs = []
    for k in range(1, children + 1):
        folder = out.parent / f"deterministic_{k}"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--device", env.device, "--only", "3",
               "--packs", str(pack), "--steps", str(timed), "--recompute", "off", "--deterministic",
               "--out", str(folder / "gpu_check.txt"), *(["--tiny"] if env.tiny else [])]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        data = json.loads((folder / "gpu_check.json").read_text()) if (folder / "gpu_check.json").exists() else {}
        case = next((c for c in data.get("cases", []) if c.get("ok")), None)
        if case is None:
            raise RuntimeError(f"the deterministic child failed (exit {r.returncode}): "
                               f"{(r.stderr or r.stdout).strip().splitlines()[-1:] or ['no output']}")
        runs.append(case)
    same = [a == b for a, b in zip(runs[0]["losses"], runs[-1]["losses"])] if len(runs) > 1 else []
    rows = [["off (check 3)", fmt(base and base["step_s"], 4), "1.00" if base else "-", "-"]]
    for k, c in enumerate(runs, 1):
        rows.append([f"on, child {k}", fmt(c["step_s"], 4),
                     fmt(c["step_s"] / base["step_s"]) if base else "-",
                     ", ".join(f"{x:.9g}" for x in c["losses"])])
    repeat = (f"The two children's losses {'repeat bit for bit' if all(same) else 'DIFFER'} "
              f"({sum(same)} of {len(same)} steps)." if same else "One child (--quick): no repeat check.")
    report(f"Pack {pack} tokens, recompute off, median of {timed} steps after 1 warm-up; step time "
           f"with the mode / without: the cost. {repeat}")
    report()
    report.table(["deterministic", "step s", "vs off", "losses (warm-up, timed)"], rows)


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small model and packs (the CPU dry run)")
    ap.add_argument("--quick", action="store_true", help="4k pack only, 2 timed steps, bf16 compare only")
    ap.add_argument("--packs", type=int, nargs="+", help="pack sizes for check 3 (default 4096 16384)")
    ap.add_argument("--steps", type=int, help="timed steps per case in check 3 (default 3)")
    ap.add_argument("--only", type=int, nargs="+", choices=range(1, 10), help="run only these checks")
    ap.add_argument("--recompute", choices=["off", "full"], nargs="+", help="check 3's cases (default both)")
    ap.add_argument("--deterministic", action="store_true",
                    help="the Actor in `deterministic: true` (check 5 runs itself with it)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--gpu", default="h200", help="the GPU whose dense bf16 peak MFU is taken at, from "
                    "the planner's table (areal_hpc/plan/budget.py GPUS: h100, h200, a100, b200)")
    ap.add_argument("--out", help="results file (default $OUT/gpu_check.txt, else runs/gpu_check/gpu_check.txt)")
    args = ap.parse_args(argv)

    out = Path(args.out) if args.out else (
        Path(os.environ["OUT"]) / "gpu_check.txt" if os.environ.get("OUT") else ROOT / "runs/gpu_check/gpu_check.txt")
    from areal_hpc.config import ConfigError
    from areal_hpc.plan.budget import GPUS, gpu_spec

    try:
        gpu = gpu_spec(args.gpu, "--gpu")
    except ConfigError:
        print(f"error: --gpu: unknown GPU {args.gpu!r}; one of {', '.join(GPUS)} (the planner's "
              f"table, areal_hpc/plan/budget.py)", file=sys.stderr)
        return 2
    report = Report(out)
    t_start = time.perf_counter()
    if args.deterministic:      # before torch starts: cuBLAS and NCCL read these once
        os.environ.update(DETERMINISTIC_ENV)    # over a site's own, as areal_hpc.launch.env does
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        report("error: --device cuda but torch.cuda.is_available() is False (use --device cpu --tiny)")
        return 2
    env = Env(args.device, args.tiny, "bfloat16" if args.device == "cuda" else "float32", args.deterministic, gpu)
    if args.tiny:
        packs, timed = args.packs or ([256] if args.quick else [256, 512]), args.steps or (2 if args.quick else 3)
    else:
        packs, timed = args.packs or ([4096] if args.quick else [4096, 16384]), args.steps or (2 if args.quick else 3)
    dtypes = [env.dtype] if (args.quick or not env.cuda) else ["bfloat16", "float32"]
    only = set(args.only or range(1, 10))

    report(f"# areal_hpc GPU check ({time.strftime('%Y-%m-%d %H:%M:%S')}, {platform.node()})")
    report()
    status: dict[str, str] = {}
    with guarded(report, "Environment", status):
        check_environment(report, env)
    with guarded(report, "Distributed init", status):
        from areal_hpc.train.megatron_model import single_process

        # the tools' and tests' one-rank world and Megatron's groups (seed 1: the Actors' train.seed)
        single_process(seed=1, threads=args.threads, backend="nccl" if env.cuda else "gloo")
        report(f"torch.distributed: {torch.distributed.get_backend()}, world size {torch.distributed.get_world_size()}")
        report()
    if 1 in only:
        with guarded(report, "1. Megatron-core train step", status):
            check_megatron(report, env)
    if 2 in only:
        with guarded(report, "2. attention varlen vs mask", status):
            check_varlen_vs_mask(report, env, dtypes)
    cases: list[dict] = []
    if 3 in only:
        with guarded(report, "3. Train-step time, tokens/s, MFU", status):
            cases = check_throughput(report, env, packs, timed, args.recompute)
    if 4 in only:
        with guarded(report, "4. Peak memory vs the memory model", status):
            check_memory(report, env, cases)
    if 5 in only:
        with guarded(report, "5. deterministic: true, its cost and repeat", status):
            check_deterministic(report, env, cases, packs[0], timed, out, 1 if args.quick else 2)
    faults = {}
    if only & {6, 7, 8, 9}:
        sys.path.insert(0, str(ROOT / "tools"))
        import gpu_faults
        for k, name, fn in ((6, "6. NCCL version", gpu_faults.check_nccl_version),
                            (7, "7. GPU memory after a SIGKILL", gpu_faults.check_memory_release),
                            (8, "8. weight group with a dead member", gpu_faults.check_weight_group),
                            (9, "9. P2P between ranks with narrowed devices", gpu_faults.check_p2p)):
            if k in only:
                with guarded(report, name, status):
                    faults[k] = fn(report, env.cuda)
    report("## Summary")
    report()
    report.table(["check", "result"], [[k, v] for k, v in status.items()])
    report(f"total {time.perf_counter() - t_start:.1f} s; results in {out}")
    with contextlib.suppress(Exception):
        (out.parent / "gpu_check.json").write_text(json.dumps({"status": status, "cases": cases,
                                                               "faults": faults}, indent=1, default=str))
    shutil.rmtree(env.tmp, ignore_errors=True)
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()
    return 0 if all(v.startswith("ok") for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
