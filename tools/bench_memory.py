"""The memory model (`areal_hpc.plan`) against measured memory of the real trainer, on CPU.

    python tools/bench_memory.py [--cases 256x1024,512x2048,1024x4096] [--layers 4]
                                 [--vocab 16384] [--attention varlen|mask] [--workdir DIR]
                                 [--set train.recompute_granularity=full ...]
    python tools/bench_memory.py --saved [--attention varlen|mask]

Each case `HIDDENxTOKENS` is a random Qwen2 (built here with transformers and saved; nothing is
downloaded: head dim 64, heads hidden/64, kv heads heads/4, ffn 5.5 x hidden, `--layers`
layers, `--vocab` tokens, untied) and one packed micro-batch of TOKENS tokens (8 sequences of
TOKENS/8, a quarter prompt). In a fresh process per case (world size 1, gloo, fp32 on CPU, one
thread): the resident memory before building `areal_hpc.train.actor.Actor` (RSS0), after
building it, then one warm-up `train_step` (Adam's state is created at the first optimizer
step), the peak counter reset (`/proc/self/clear_refs`), a second `train_step`, and its peak
(VmHWM). Measured = peak - RSS0: the trainer's whole steady-state footprint. Predicted: the plan
of the same config (device cpu, float32, one pack of TOKENS tokens, prox recompute), trainer
stage 0. Prints a markdown table.

`--saved`: the activation shape terms alone: bytes the real Megatron layers save for backward
(autograd saved-tensor hooks, unique storages, parameters excluded) per token and layer, fp32
and bf16, against `plan.layer_activation_bytes` (CPU kernels).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

GiB = 2**30


def _status(key: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _trim() -> None:
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def make_model(out: Path, hidden: int, layers: int, vocab: int, max_pos: int) -> dict:
    from areal_hpc.random_models import save_random_qwen2

    heads = hidden // 64
    save_random_qwen2(out, vocab_size=vocab, hidden_size=hidden,
                      intermediate_size=int(5.5 * hidden) // 128 * 128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                      max_position_embeddings=max_pos, tie_word_embeddings=False,
                      torch_dtype="float32")
    return json.loads((out / "config.json").read_text())


def case_overrides(model_dir: str, tokens: int, attention: str, extra: list[str] = ()) -> list[str]:
    """The run config of one case: one pack of `tokens` tokens (8 sequences of tokens/8)."""
    return [*_base(model_dir, tokens, attention), *extra]


def _base(model_dir: str, tokens: int, attention: str) -> list[str]:
    return [f"model.path={model_dir}", "model.dtype=float32", "data.train_path=unused.jsonl",
            "topology.device=cpu", "topology.gpu_mem_gib=0", f"train.max_tokens_per_mb={tokens}",
            f"rollout.max_model_len={tokens // 8}", "rollout.group_size=8", "train.batch_prompts=1",
            "train.prox=recompute", f"train.attention={attention}"]


def worker(model_dir: str, tokens: int, attention: str, extra: list[str]) -> None:
    import numpy as np

    from areal_hpc.config import load
    from areal_hpc.train.megatron_model import single_process

    cfg = load(None, case_overrides(model_dir, tokens, attention, extra))
    single_process(cfg.train.seed)
    from areal_hpc.train.actor import Actor  # imports first, so RSS0 holds the libraries

    _trim()
    rss0 = _status("VmRSS")
    actor = Actor(cfg.train, model_dir, group_size=8, temperature=1.0, device="cpu", dtype="float32")
    _trim()
    rss_built = _status("VmRSS")
    rng = np.random.default_rng(0)
    vocab = actor.hf_config["vocab_size"]
    n = tokens // 8
    seqs = [{"prompt_tokens": rng.integers(2, vocab, n // 4), "output_tokens": rng.integers(2, vocab, n - n // 4),
             "reward": float(i % 2), "behav_logprobs": np.full(n - n // 4, -5.0, np.float32)} for i in range(8)]
    t0 = time.perf_counter()
    actor.train_step(seqs)                      # warm-up: Adam state appears at its first step
    _trim()
    rss_warm = _status("VmRSS")
    _reset_peak()
    stats = actor.train_step(seqs, version=1)
    peak = _status("VmHWM")
    print(json.dumps({"rss0": rss0, "built": rss_built - rss0, "warm": rss_warm - rss0,
                      "peak": peak - rss0, "micro_batches": stats["n_micro_batches"],
                      "seconds": time.perf_counter() - t0}), flush=True)


def predict(model_dir: str, tokens: int, attention: str, extra: list[str]):
    from areal_hpc import plan
    from areal_hpc.config import load

    est = plan.estimate(load(None, case_overrides(model_dir, tokens, attention, extra)), weight_sync=False)
    return est, est.trainer[0]


def run_cases(args) -> None:
    from areal_hpc import plan

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_memory_"))
    rows = []
    for case in args.cases.split(","):
        hidden, tokens = (int(x) for x in case.lower().split("x"))
        model_dir = work / f"qwen2_h{hidden}_l{args.layers}_v{args.vocab}"
        if not (model_dir / "config.json").exists():
            make_model(model_dir, hidden, args.layers, args.vocab, max(tokens, 256))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        r = subprocess.run([sys.executable, __file__, "--worker", str(model_dir), str(tokens), args.attention,
                            *(f"--set={x}" for x in args.set)],
                           capture_output=True, text=True, env=env, cwd=ROOT)
        if r.returncode != 0:
            sys.exit(f"case {case} failed:\n{r.stderr[-3000:]}")
        m = json.loads(r.stdout.strip().splitlines()[-1])
        est, stage = predict(str(model_dir), tokens, args.attention, args.set)
        static = sum(stage.term(k).bytes for k in ("params", "grads"))
        rows.append((case, est.arch, stage, static, m))
        print(f"[bench_memory] {case}: predicted {stage.total / GiB:.3f} GiB, measured {m['peak'] / GiB:.3f} GiB "
              f"({m['seconds']:.0f} s)", file=sys.stderr, flush=True)
    print(f"\n`python tools/bench_memory.py --cases {args.cases} --layers {args.layers} --vocab {args.vocab} "
          f"--attention {args.attention}{''.join(' --set ' + x for x in args.set)}` (CPU, fp32, world size 1, one thread; measured = VmHWM of the "
          f"second train_step - RSS before building the Actor)\n")
    print("| case (hidden x pack) | params | predicted static (params+grads) | measured after build "
          "| predicted peak GiB | measured peak GiB | ratio measured/predicted |")
    print("|---|---|---|---|---|---|---|")
    for case, arch, stage, static, m in rows:
        print(f"| {case} ({arch.layers} layers, ffn {arch.ffn}, vocab {arch.vocab}) | "
              f"{arch.total_params / 1e6:.1f} M | {static / GiB:.3f} | {m['built'] / GiB:.3f} | "
              f"{stage.total / GiB:.3f} | {m['peak'] / GiB:.3f} | {m['peak'] / stage.total:.2f} |")
    print("\npredicted terms (GiB):")
    for case, _, stage, _, _ in rows:
        print(f"- {case}: " + ", ".join(f"{t.name}{'' if t.concurrent else ' (alt)'} {t.bytes / GiB:.3f}"
                                        for t in stage.terms if t.bytes))
    del plan


# ------------------------------------------------------------------------------ --saved

def saved_worker(attention: str) -> None:
    import torch

    from areal_hpc import plan
    from areal_hpc.train import cpu_compat
    from areal_hpc.train.attention import packed_seq_params
    from areal_hpc.train.megatron_model import build_gpt_model, single_process

    single_process()
    hf = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=704,
              vocab_size=1000, num_hidden_layers=2, max_position_embeddings=4096, rms_norm_eps=1e-6)
    arch = plan.Arch.from_hf(hf)
    s, n_seq = 1024, 4
    for dtype, b in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = build_gpt_model(hf, params_dtype=dtype, attention=attention, device="cpu")
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        per_layer = []
        for n_layers in (1, 2):         # the difference of 2 and 1 layers: one layer's share
            seen = {}

            def pack(t, seen=seen):
                st = t.untyped_storage()
                if st.data_ptr() not in params:
                    seen.setdefault(st.data_ptr(), st.nbytes())
                return t

            tok = torch.randint(0, 1000, (1, s))
            pos = torch.arange(s)[None]
            lens = [s // n_seq] * n_seq
            mask, psp = None, None
            if attention == "mask":
                seg = torch.repeat_interleave(torch.arange(n_seq), torch.tensor(lens))
                mask = (torch.ones(s, s, dtype=torch.bool).triu(1) | (seg[:, None] != seg[None, :]))[None, None]
            else:
                psp = packed_seq_params(lens, "cpu")
            layers = model.decoder.layers
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cpu_compat.CudaToCpuMode():
                x = model.embedding(tok, pos)
                rope = model.rotary_pos_emb(s)
                for layer in list(layers)[:n_layers]:
                    x, _ = layer(x, attention_mask=mask, rotary_pos_emb=rope, packed_seq_params=psp)
            per_layer.append(sum(seen.values()))
        measured = (per_layer[1] - per_layer[0]) / s
        kernel = plan.varlen_kernel("cpu", "float32" if b == 4 else "bfloat16")
        predicted = plan.layer_activation_bytes(arch, b, 1, False, attention, kernel)
        if attention == "mask":
            predicted += plan.mask_score_bytes(arch, b, 1, s) / s
        print(json.dumps({"dtype": str(dtype).split(".")[1], "attention": attention, "tokens": s,
                          "measured_per_token_layer": measured, "predicted_per_token_layer": predicted}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="256x1024,512x2048,1024x4096")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--attention", default="varlen", choices=("varlen", "mask"))
    ap.add_argument("--workdir", default=None, help="where the random models are saved (default: a temp dir)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every case (e.g. train.recompute_granularity=full)")
    ap.add_argument("--saved", action="store_true", help="saved-for-backward bytes per layer vs the model")
    ap.add_argument("--worker", nargs=3, metavar=("MODEL", "TOKENS", "ATTENTION"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2], args.set)
    elif args.saved:
        saved_worker(args.attention)
    else:
        run_cases(args)


if __name__ == "__main__":
    main()
