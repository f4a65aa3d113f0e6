"""The throughput planner's rates (plan/throughput.py): measured from a finished run
(`calibrate`), or assumed from the model and the GPU (`assumed_rates`)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..config import ConfigError, RunConfig
from ..storage import run_dir as run_files
from ..storage.rollout_log import RolloutReader
from .memory import kv_bytes_per_token, read_arch, vllm_limits
from .throughput import (
    DECODE_BW_EFFICIENCY,
    GPU_BF16_FLOPS,
    GPU_HBM_BYTES_S,
    TRAIN_MFU,
    UPDATE_FIXED_S,
    WEIGHT_BCAST_BYTES_S,
    Lengths,
    Rates,
)

# ------------------------------------------------------------------------------ calibration

def load_lengths(path: str | Path, metrics: list[dict] | None = None) -> Lengths:
    """Output lengths of a rollout log (a file, or a run directory's rollouts.h5). A run
    directory without one falls back to metrics.jsonl's per-step mean response_len."""
    p = Path(path)
    h5 = p / run_files.ROLLOUTS if p.is_dir() else p
    if h5.is_file():
        try:
            with RolloutReader(h5) as reader:
                out = np.diff(np.r_[0, reader.column("output_end")])
                prompt = np.diff(np.r_[0, reader.column("prompt_end")])
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{h5}: not a readable rollout log ({str(exc).splitlines()[0]})") from None
        if out.size == 0 or not np.any(out > 0):
            raise ConfigError(f"{h5}: no trajectories with output tokens")
        out = out[out > 0]
        return Lengths(values=out, prompt_len=float(prompt.mean()), source=str(h5))
    if p.is_dir():
        if metrics is None:
            metrics = read_metrics(p)
        lens = [m["response_len"] for m in metrics if m.get("response_len", 0) > 0]
        if lens:
            return Lengths(values=np.array(lens), source=f"{run_files.RunDir(p).metrics} (response_len)")
        raise ConfigError(f"{p}: no rollouts.h5 and no response_len in metrics.jsonl")
    raise ConfigError(f"{p}: no such run directory or rollout log")


def _records(read, path: Path, none: str) -> list:
    """What `read()` returns from the run file `path`; ConfigError when it is bad or empty."""
    try:
        recs = read()
    except run_files.RunFileError as exc:
        raise ConfigError(str(exc)) from None
    if not recs:
        raise ConfigError(f"{path}: {none}")
    return recs


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's step records; ConfigError without any."""
    rd = run_files.RunDir(run_dir)
    return _records(rd.read_metrics, rd.metrics, "no step records")


def calibrate(run_dir: str | Path, c_half: float = 0.0) -> Rates:
    """Rates measured by a finished run: generation tokens/s while busy (rollout-log output
    tokens, else generators.json tokens, over the generators' busy seconds, per engine),
    training tokens/s (sum n_tokens / sum seconds; with >= 4 steps and a positive intercept,
    a least-squares fit gives train_overhead_s too), update_s (mean weight_sync_s) and the
    output lengths. c_half is not measurable from the files (default 0)."""
    d = Path(run_dir)
    if not d.is_dir():
        raise ConfigError(f"--from-run: no run directory at {d}")
    rd = run_files.RunDir(d)
    metrics = read_metrics(d)
    try:
        secs = np.array([float(m["seconds"]) for m in metrics])
        toks = np.array([float(m["n_tokens"]) for m in metrics])
        upd = np.array([float(m.get("weight_sync_s", 0.0)) for m in metrics])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{rd.metrics}: a step lacks 'seconds' or 'n_tokens' ({exc})") from None
    gens = _records(rd.read_generators, rd.generators, "no such file")
    try:
        busy = sum(float(g.seconds["busy"]) for g in gens)
        gen_tokens = sum(float(g.tokens) for g in gens)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{rd.generators}: not a readable generators file ({exc})") from None
    lengths = load_lengths(d, metrics)
    if lengths.values is not None and lengths.source.endswith(run_files.ROLLOUTS):
        gen_tokens = float(lengths.values.sum())      # training samples only (no eval tokens)
    if busy <= 0 or gen_tokens <= 0 or secs.sum() <= 0 or toks.sum() <= 0:
        raise ConfigError(f"{d}: no generation or training time recorded")
    train_tok_s, overhead = toks.sum() / secs.sum(), 0.0
    if len(secs) >= 4 and np.ptp(toks) > 0:
        slope, icpt = np.polyfit(toks, secs, 1)
        if slope > 0 and icpt > 0:
            train_tok_s, overhead = 1.0 / slope, float(icpt)
    return Rates(gen_tok_s=gen_tokens / busy, train_tok_s=float(train_tok_s),
                 update_s=float(upd.mean()), lengths=lengths, train_overhead_s=overhead,
                 c_half=c_half, source=str(d))


def assumed_rates(cfg: RunConfig, lengths: "Lengths | None" = None) -> tuple[float, float, float, float]:
    """ASSUMED (gen_tok_s, train_tok_s, update_s, c_half) from a roofline of the model on
    H100-class GPUs (the constants above); ConfigError when the model's config.json is unknown.

    train: FLOPs per trained token = 6 P (forward + backward) + 2 P with full recompute + 2 P
    times the share of the tokens the π_prox forward covers (`TrainConfig.prox_pass_share`),
    at TRAIN_MFU of every trainer GPU's peak.
    decode: one step of C sequences reads the bf16 weights once (2 P bytes) and every sequence's
    KV cache (2 layers kv_heads head_dim 2 bytes per token, at the mean context prompt + L/2),
    at DECODE_BW_EFFICIENCY of the engine's GPUs' bandwidth; C as the simulation's seq_limit.
    That step time (2 P + c kv ctx) / bandwidth is the simulation's T(c) = peak c / (c + c_half)
    with c_half = 2 P / (kv ctx): a lone long sequence decodes at its latency bound, not at the
    full engine's rate (the sync baseline's long tail).
    update: 2 P bytes at WEIGHT_BCAST_BYTES_S plus UPDATE_FIXED_S."""
    try:
        arch = read_arch(cfg)
    except ConfigError:
        raise ConfigError("no rates: pass --from-run RUN_DIR or --gen-tok-s, --train-tok-s, "
                          "--update-s (the model's config.json is not readable for assumed "
                          "defaults)") from None
    p = float(arch.total_params)
    tr = cfg.train
    flops = (6 + 2 * (tr.recompute_granularity == "full") + 2 * tr.prox_pass_share) * p
    train_tok_s = cfg.topology.n_trainers * GPU_BF16_FLOPS * TRAIN_MFU / flops
    r = cfg.rollout
    c = max(1, min(math.ceil(r.max_concurrent_prompts * r.group_size / cfg.topology.n_generators),
                   vllm_limits(cfg)[0]))
    mean_len = lengths.mean(r.max_new_tokens) if lengths is not None else r.max_new_tokens / 2
    prompt = lengths.prompt_len if lengths is not None else 0.0
    kv_per_token = kv_bytes_per_token(arch, 2)      # bf16, the whole engine
    bytes_per_token = 2 * p / c + kv_per_token * (prompt + mean_len / 2)
    gen_tok_s = r.engine_tp * GPU_HBM_BYTES_S * DECODE_BW_EFFICIENCY / bytes_per_token
    update_s = 2 * p / WEIGHT_BCAST_BYTES_S + UPDATE_FIXED_S
    c_half = 2 * p / (kv_per_token * max(1.0, prompt + mean_len / 2))
    return gen_tok_s, train_tok_s, update_s, c_half
