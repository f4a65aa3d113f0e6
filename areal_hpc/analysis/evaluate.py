"""Held-out pass@k of a model with vLLM, scored by the generators' own reward service.

    python tools/evaluate.py models/tiny models/tiny/heldout.jsonl --config runs/tiny/config.yaml
    python tools/evaluate.py runs/tiny/policy models/tiny/heldout.jsonl     # finds ../config.yaml

The model is any HF directory: the initial model or a run's trained `policy/`. With a run's config
(--config, or the config.yaml beside a run's policy/) every setting is the training job's own
held-out evaluation: the first data.eval_limit problems, the prompt template, data.eval_samples
samples per problem, rollout.temperature/top_p/max_new_tokens, one vLLM request per sample through
the generator's engine wrapper, and the reward pool. Its accuracy (the share of samples with
reward > 0.5) is pass@1 here; when the run's eval.json holds a result for the same model (the
initial one, or the final policy), the two are printed side by side with the sampling tolerance.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..config import ConfigError, load
from ..data.prompts import load_prompts, prompt_ids
from ..reward import custom
from ..reward.custom import RewardFnError, check
from ..reward.pool import RewardPool
from ..storage import run_dir as run_files

EXIT_BAD_INPUT = 2
# Two independent pass@1 estimates with standard error SE each differ by less than
# TOLERANCE_SIGMAS·√2·SE but about once in 16,000 times (normal approximation).
TOLERANCE_SIGMAS = 4


@dataclass
class EvalSettings:
    """How to sample and score; `from_config` takes them from a run's config."""

    samples: int = 1                # samples per problem (n of pass@k)
    limit: int = 0                  # first `limit` problems (0 = all)
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    prompt_template: str = "{question}"
    chat: bool = False              # the data.chat settings (data/prompts.py: prompt_ids)
    system_prompt: str | None = None
    chat_template: str | None = None
    assistant_prefix: str = ""
    kind: str = "math"              # dataset kind (data/prompts.py)
    question_key: str = "question"
    answer_key: str = "answer"
    dtype: str = "float32"
    max_model_len: int = 512
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.8
    engine_tp: int = 1                  # vLLM tensor parallelism (rollout.engine_tp)
    enforce_eager: bool = True
    seed: int = 0
    reward_workers: int = 1
    math_timeout_s: float = 10.0
    unsafe_no_sandbox: bool = False
    extractor: str = "boxed"        # reward.extractor
    reward_fns: tuple = ()          # reward.fn / reward.functions (reward/custom.py Spec)
    fn_timeout_s: float = 10.0

    @classmethod
    def from_config(cls, cfg) -> EvalSettings:
        """The training job's held-out evaluation settings (a config.RunConfig)."""
        d, r = cfg.data, cfg.rollout
        return cls(samples=d.eval_samples, limit=d.eval_limit, max_new_tokens=r.max_new_tokens,
                   temperature=r.temperature, top_p=r.top_p, prompt_template=d.prompt_template,
                   chat=d.chat, system_prompt=d.system_prompt, chat_template=d.chat_template,
                   assistant_prefix=d.assistant_prefix,
                   kind=d.kind, question_key=d.question_key, answer_key=d.answer_key,
                   dtype=cfg.model.dtype, max_model_len=r.max_model_len,
                   kv_cache_gib=r.kv_cache_gib,
                   gpu_memory_utilization=r.gpu_memory_utilization, engine_tp=r.engine_tp,
                   enforce_eager=r.enforce_eager, seed=cfg.train.seed,
                   reward_workers=cfg.reward.workers, math_timeout_s=cfg.reward.math_timeout_s,
                   unsafe_no_sandbox=cfg.reward.unsafe_no_sandbox, extractor=cfg.reward.extractor,
                   reward_fns=tuple(custom.specs_of(cfg)), fn_timeout_s=cfg.reward.fn_timeout_s)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples of which c are correct:
    1 − C(n−c, k) / C(n, k), the chance that k of the n samples drawn without replacement
    contain a correct one (Chen et al., 2021)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarise(correct: list[int], n: int, ks: list[int]) -> dict:
    """pass@k over problems (mean of the per-problem estimates) and the standard error of
    pass@1 over problems (the sampling noise of this evaluation: problems differ, and samples
    of one problem are not independent, so the per-problem spread is the honest measure)."""
    rates = np.array(correct, dtype=np.float64) / n
    out = {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in ks}
    out["pass@1_se"] = float(rates.std(ddof=1) / math.sqrt(len(rates))) if len(rates) > 1 else math.nan
    return out


def evaluate(model: str | Path, rows: list[dict], s: EvalSettings, *, ks: list[int] | None = None,
             progress: bool = True) -> dict:
    """Sample `s.samples` answers to each prompt row (data/prompts.py rows) with vLLM and score
    them with the reward pool. Returns problems, samples, pass@k for k in `ks` (default 1 and
    s.samples), pass@1_se, accuracy (share of samples with reward > 0.5, = pass@1), reward_errors,
    correct (per problem), seconds."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from ..rollout.vllm_engine import VLLMEngine     # vLLM: only when generating

    t0 = time.monotonic()
    n = s.samples
    ks = sorted({k for k in (ks or [1, n]) if 1 <= k <= n})
    tok = AutoTokenizer.from_pretrained(str(model))
    prompts = [prompt_ids(tok, s, r["question"]) for r in rows]
    correct = [0] * len(rows)
    errors = 0
    # One bar for the whole pipeline: a sample counts once generated and scored.
    bar = tqdm(total=len(prompts) * n, desc="generating + scoring", unit="sample",
               disable=not progress, file=sys.stderr, delay=2.0)

    def collect(results) -> None:
        nonlocal errors
        for res in results:
            correct[res.key[0]] += res.reward > 0.5
            errors += res.error is not None
        bar.update(len(results))

    with RewardPool(s.reward_workers, math_timeout_s=s.math_timeout_s,
                    unsafe_no_sandbox=s.unsafe_no_sandbox, extractor=s.extractor,
                    functions=s.reward_fns, fn_timeout_s=s.fn_timeout_s) as pool, \
            VLLMEngine(str(model), dtype=s.dtype, max_model_len=s.max_model_len, seed=s.seed,
                       kv_cache_gib=s.kv_cache_gib, enforce_eager=s.enforce_eager,
                       gpu_memory_utilization=s.gpu_memory_utilization,
                       tensor_parallel_size=s.engine_tp) as engine:
        for i, p in enumerate(prompts):
            for j in range(n):
                engine.submit(f"eval:{i}:{j}", p, max_new_tokens=s.max_new_tokens,
                              temperature=s.temperature, top_p=s.top_p)
        while engine.has_unfinished():
            for smp in engine.step():
                _, i, j = smp.request_id.split(":")
                row = rows[int(i)]
                text = tok.decode(smp.output_tokens, skip_special_tokens=True)
                pool.submit((int(i), int(j)), row["reward_kind"], text, row["reference"], row.get("row"))
            collect(pool.done())
        while pool.unfinished:
            collect(pool.done(timeout=0.5))
        collect(pool.done())
    bar.close()
    total = len(prompts) * n
    return {"model": str(model), "problems": len(prompts), "samples_per_problem": n,
            "samples": total, **summarise(correct, n, ks),
            "accuracy": sum(correct) / total if total else math.nan,
            "reward_errors": errors, "correct": correct, "seconds": time.monotonic() - t0}


def claimed_result(model: Path, config_path: Path | None, cfg) -> dict | None:
    """What the training log (the run's eval.json) claims for this model: the "final" entry for
    the run's policy/, the "initial" one for the model the run started from; else None."""
    if config_path is None or not run_files.RunDir(config_path.parent).evals.is_file():
        return None
    run = run_files.RunDir(config_path.parent)
    evals = run.read_all_evals()
    if model.resolve() == run.policy.resolve():
        label = "final"
    elif model.resolve() == Path(cfg.model.path).resolve():
        label = "initial"
    else:
        return None
    return next((e for e in evals if e.get("label") == label), None)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("model", type=Path, help="HF model directory (initial model or <run>/policy)")
    ap.add_argument("dataset", type=Path, help="held-out jsonl")
    ap.add_argument("--config", type=Path, help="the run's config.yaml (default: the one beside "
                    "a run's policy/ directory, if any)")
    ap.add_argument("--samples", type=int, help="samples per problem (default: data.eval_samples, "
                    "or 1 without a config)")
    ap.add_argument("--k", type=int, nargs="+", help="report pass@k for these k "
                    "(default: 1 and --samples)")
    ap.add_argument("--limit", type=int, help="first N problems (0 = all; default: data.eval_limit)")
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--json", type=Path, help="also write the result here")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2: a missing or unreadable input, one line)."""
    args = _parser().parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")     # before vLLM is imported
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT

    if not (args.model / "config.json").is_file():
        return fail(f"{args.model}: not a Hugging Face model directory (no config.json)")
    config_path = args.config
    if config_path is None and (args.model.parent / run_files.CONFIG).is_file() \
            and args.model.name == run_files.POLICY:
        config_path = args.model.parent / run_files.CONFIG
    cfg = None
    settings = EvalSettings()
    if config_path is not None:
        try:
            cfg = load(config_path)
        except ConfigError as e:
            return fail(f"{config_path}: {e}")
        try:        # the run's own reward functions, imported here before any engine starts
            check(cfg)
        except RewardFnError as e:
            return fail(f"{config_path}: {e}")
        settings = EvalSettings.from_config(cfg)
    for key in ("samples", "limit", "temperature", "top_p", "max_new_tokens", "seed"):
        if getattr(args, key) is not None:
            setattr(settings, key, getattr(args, key))
    try:
        rows = load_prompts(str(args.dataset), settings.kind, settings.question_key,
                            settings.answer_key, custom=bool(settings.reward_fns))
    except (FileNotFoundError, ValueError) as e:
        return fail(str(e))
    if settings.limit:
        rows = rows[: settings.limit]
    if settings.samples < 1 or not rows:
        return fail("nothing to evaluate (no problems, or --samples < 1)")

    print(f"evaluating {args.model} on {len(rows)} problems × {settings.samples} samples "
          f"(T={settings.temperature:g}, top_p={settings.top_p:g}, max_new_tokens="
          f"{settings.max_new_tokens}{', settings from ' + str(config_path) if config_path else ''})",
          flush=True)
    res = evaluate(args.model, rows, settings, ks=args.k)
    for key in (k for k in res if k.startswith("pass@") and not k.endswith("_se")):
        print(f"{key}: {res[key]:.4f}" + (f"  (± {res['pass@1_se']:.4f} s.e. over problems)"
                                          if key == "pass@1" else ""))
    print(f"reward errors: {res['reward_errors']}; {res['seconds']:.1f} s")
    claimed = claimed_result(args.model, config_path, cfg) if cfg else None
    if claimed is not None:
        diff = res["accuracy"] - claimed["accuracy"]
        tol = TOLERANCE_SIGMAS * math.sqrt(2) * res["pass@1_se"]
        print(f"training log ({claimed['label']}, version {claimed['version']}): "
              f"{claimed['accuracy']:.4f} over {claimed['samples']} samples; difference "
              f"{diff:+.4f} ({'within' if abs(diff) <= tol else 'OUTSIDE'} the sampling "
              f"tolerance ±{tol:.4f} = {TOLERANCE_SIGMAS}·√2·s.e.)")
        res["claimed"] = claimed
    if args.json:
        args.json.write_text(json.dumps({**res, "settings": asdict(settings)}, indent=1))
    return 0
