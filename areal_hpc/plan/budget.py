"""Time economics of a run: a training step's seconds on a named GPU, and the preflight that
checks them against the job's time limit and its preemption signal's lead, and what a hard
preemption loses with each way to checkpoint (`hard_preemption`).

    python -m areal_hpc.plan time CONFIG.yaml [key=value ...] --gpu h100 [--mfu 0.35]
        [--gen-tok-s X] [--out-len N] [--ckpt-gb-s X] [--time-limit 24h] [--signal-lead 1200]

prints the FLOPs of one step, the seconds they take at the stated MFU, the weight update, the
checkpoint, the generation of a batch at the stated throughput, and every assumption. The same
numbers feed `check_time(cfg)`, which every launcher runs before any rank starts
(`areal_hpc.preflight.launcher`): it refuses, with one line naming the keys, a config whose
single step plus its checkpoint cannot finish between the preemption signal and the time limit
(a preempted job stops at the next step boundary, areal_hpc/preemption.py, so the step in
progress and the checkpoint must fit in the lead), and warns when `checkpoint.every_steps` steps
take longer than the time limit (no timed checkpoint within an attempt: a kill loses it all).
Skipped on CPU and when `topology.gpu` is "".

A hard preemption (SIGTERM, then SIGKILL after the partition's GraceTime) lands at a random time
and loses the work since the last complete checkpoint's step: on average half a checkpoint
period plus the time from a period's start until its checkpoint is complete (a kill before that
goes back one period more), and the restart. `hard_preemption` states it for the config's
cadence, for a synchronous checkpoint after every step, and for an asynchronous one
(checkpoint.async_save: the step stalls only to stage the shards, the write and the CRC read
overlap the next step, and the checkpoint is complete at the first step boundary or mid-step
decision point after them), with the GraceTime that lets a SIGTERM between steps lose nothing
but the restart.

FLOPs of one training step (the whole trainer), n = B x group_size sequences of s tokens each,
s = prompt + output tokens, T = n s tokens, N = n x output tokens:
- layers, forward: 2 x (layer matmul parameters) x T, plus causal attention 2 s^2 heads
  head_dim per sequence and layer (QK^T and AV at 2 s^2 head_dim each, half of them masked);
- the output layer, forward: 2 V h N (log-probs are computed at the output positions only,
  train/logprobs.py);
- training (forward + backward = 3 forwards) of the layers, plus the output layer's 4 forwards
  (its chunk is recomputed in backward);
- activation recompute: full = one more forward of the recomputed layers (uniform: all; block:
  recompute_num_layers of each stage's layers), selective = one more forward of core attention;
- π_prox (prox recompute, k minibatches, not naive PPO): one more forward of the layers and the
  output layer over all minibatches but the first (`TrainConfig.prox_pass_share`, (k - 1) / k).
Seconds = FLOPs / (n_trainers x the GPU's dense bf16 peak x MFU); MFU = FLOPs / (seconds x
n_trainers x peak) is `mfu`, what tools/gpu_check.py measures (`pack_flops` over its pack).
Every sequence has the same length (mean output `--out-len`, default max_new_tokens / 2, after a
prompt of max_model_len - max_new_tokens tokens, the room the config leaves for it): with
long-tailed lengths the attention term is larger (sum of squares). ASSUMPTIONS, not
measurements: MFU, the output length, the checkpoint filesystem's bandwidth, the weight
broadcast's (throughput.py's constants) and the generation throughput (throughput.py's decode
roofline scaled to the GPU's bandwidth, or `--gen-tok-s`).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from ..config import ConfigError, RunConfig, TrainConfig, load
from ..slurm_job import job_clock, parse_slurm_time
from .bounds import bound_problems, render_waits, waits
from .bounds import fmt_s as _fmt_s
from .calibration import assumed_rates
from .memory import Arch, read_arch
from .throughput import GPU_HBM_BYTES_S, UPDATE_FIXED_S, WEIGHT_BCAST_BYTES_S


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float           # dense (no sparsity) bf16 tensor-core FLOP/s
    hbm_bytes_s: float          # HBM bandwidth, bytes/s
    mem_gib: float              # memory, for reference


# Vendor datasheet values (dense bf16: NVIDIA quotes "with sparsity" figures, twice these).
GPUS: dict[str, Gpu] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity, HBM3 3.35 TB/s, 80 GB
    "h100": Gpu("H100 SXM", 989e12, 3.35e12, 80),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity, HBM3e 4.8 TB/s, 141 GB
    "h200": Gpu("H200 SXM", 989e12, 4.8e12, 141),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: BF16 312 TFLOPS dense, HBM2e 2,039 GB/s
    "a100": Gpu("A100-80G SXM", 312e12, 2.039e12, 80),
    # NVIDIA HGX B200 datasheet, per GPU: FP16/BF16 4.5 PFLOPS with sparsity, HBM3e 8 TB/s, 180 GB
    "b200": Gpu("B200", 2.25e15, 8.0e12, 180),
}
ALIASES = {"h100-sxm": "h100", "h100_sxm": "h100", "a100-80g": "a100", "a100-80gb": "a100",
           "a100_80g": "a100", "h200-sxm": "h200"}

# ASSUMPTIONS: the checkpoint's writes and the manifest's CRC-32 read-back go through a shared
# parallel filesystem at this aggregate rate (one step's checkpoint = every parameter's bf16
# weight, fp32 main weight and two Adam moments: 14 B per parameter in half precision).
CKPT_BYTES_S = 5e9
# The stop's margin beyond the checkpoint (generators, rollout log, exit): preemption.py's
# MID_STEP_MARGIN_S, which imports this package (tests/plan/test_preemption_loss.py pins them equal).
STOP_MARGIN_S = 60.0
CKPT_PASSES = 2                 # written once, read once for the CRC-32 of the manifest


def gpu_spec(name: str, key: str = "topology.gpu") -> Gpu:
    g = ALIASES.get(name.strip().lower(), name.strip().lower())
    if g not in GPUS:
        raise ConfigError(f"config key '{key}': unknown GPU {name!r}; one of {', '.join(GPUS)} "
                          f"(or \"\" for no time check)")
    return GPUS[g]


@dataclass
class StepFlops:
    """One training step's FLOPs, by part (the whole trainer)."""
    train: float                # forward + backward of the layers and the output layer
    recompute: float            # activation recompute's extra forward
    prox: float                 # π_prox's forward (train.prox = recompute)
    attention: float            # of which: core attention, all passes
    tokens: float               # T: tokens trained
    out_tokens: float           # N: output tokens

    @property
    def total(self) -> float:
        return self.train + self.recompute + self.prox


def lengths(cfg: RunConfig, out_len: float | None = None) -> tuple[float, float]:
    """(prompt tokens, output tokens) per sequence: the output `out_len` (default half of
    rollout.max_new_tokens), the prompt the room max_model_len leaves besides max_new_tokens."""
    r = cfg.rollout
    prompt = max(1, r.max_model_len - r.max_new_tokens)
    out = r.max_new_tokens / 2 if out_len is None else out_len
    return float(prompt), float(min(out, r.max_new_tokens))


def step_flops(cfg: RunConfig, arch: Arch, out_len: float | None = None) -> StepFlops:
    """One step of `cfg`: B x group_size sequences of the same length (`lengths`)."""
    prompt, out = lengths(cfg, out_len)
    n = cfg.train.batch_prompts * cfg.rollout.group_size
    return pack_flops(arch, [prompt + out] * n, n * out, cfg.train, cfg.topology.pp)


def pack_flops(arch: Arch, seq_lens: list[float], out_tokens: float, train: TrainConfig,
               pp: int = 1) -> StepFlops:
    """The FLOPs of one training step over sequences of `seq_lens` tokens (prompt + output),
    `out_tokens` output tokens in all, trained as `train` says (recompute, π_prox): the
    project's one FLOP model (the module docstring), for the planner's step and for a measured
    pack (tools/gpu_check.py's MFU, `mfu`)."""
    tokens = float(sum(seq_lens))
    attn_fwd = 2.0 * arch.heads * arch.head_dim * arch.layers * float(sum(s * s for s in seq_lens))
    layers_fwd = 2.0 * arch.layers * arch.layer_matmul_params * tokens + attn_fwd
    head_fwd = 2.0 * arch.vocab * arch.hidden * out_tokens
    if train.recompute_granularity == "full":
        per_stage = arch.layers // pp
        share = 1.0 if train.recompute_method == "uniform" else \
            min(train.recompute_num_layers or 0, per_stage) / per_stage
        recompute, recompute_attn = share * layers_fwd, share * attn_fwd
    elif train.recompute_granularity == "selective":
        recompute = recompute_attn = attn_fwd
    else:
        recompute = recompute_attn = 0.0
    prox = (layers_fwd + head_fwd) * train.prox_pass_share
    attention = 3 * attn_fwd + recompute_attn + attn_fwd * train.prox_pass_share
    return StepFlops(train=3 * layers_fwd + 4 * head_fwd, recompute=recompute, prox=prox,
                     attention=attention, tokens=tokens, out_tokens=float(out_tokens))


def mfu(flops: StepFlops, seconds: float, gpu: Gpu, n_gpus: int = 1) -> float:
    """Model-FLOPs utilisation, the one definition (topology.mfu, `estimate_time`'s divisor):
    every FLOP of the step (`StepFlops.total`: recompute and π_prox passes included) over
    `seconds` x `n_gpus` x the GPU's dense bf16 peak."""
    return flops.total / (seconds * n_gpus * gpu.bf16_flops)


@dataclass
class StepTime:
    cfg: RunConfig
    gpu: Gpu
    mfu: float
    flops: StepFlops
    train_s: float              # the training step
    update_s: float             # the weight update after it
    ckpt_s: float               # one checkpoint
    gen_s: float                # generating one batch over all engines
    gen_tok_s: float            # per engine
    gen_source: str
    ckpt_bytes: float
    ckpt_bytes_s: float

    @property
    def step_s(self) -> float:
        """The trainer's side of a step: training, then the weight update."""
        return self.train_s + self.update_s

    @property
    def interval_s(self) -> float:
        """Async steady state: a step every max(trainer, generation of a batch)."""
        return max(self.step_s, self.gen_s)


def estimate_time(cfg: RunConfig, gpu: str | None = None, mfu: float | None = None,
                  gen_tok_s: float | None = None, out_len: float | None = None,
                  ckpt_bytes_s: float | None = None, arch: Arch | None = None) -> StepTime:
    """The step-time estimate of `cfg` on `gpu` (default topology.gpu) at `mfu` (default
    topology.mfu)."""
    spec = gpu_spec(gpu if gpu is not None else cfg.topology.gpu, "--gpu" if gpu is not None else "topology.gpu")
    mfu = cfg.topology.mfu if mfu is None else mfu
    if not (0 < mfu <= 1):
        raise ConfigError(f"--mfu: must be in (0, 1], got {mfu:g}")
    arch = arch or read_arch(cfg)
    fl = step_flops(cfg, arch, out_len)
    train_s = fl.total / (cfg.topology.n_trainers * spec.bf16_flops * mfu)
    p = float(arch.total_params)
    b = 2 if cfg.model.dtype != "float32" else 4
    update_s = b * p / WEIGHT_BCAST_BYTES_S + UPDATE_FIXED_S
    ckpt_bytes = p * (14 if b == 2 else 12)
    rate = CKPT_BYTES_S if ckpt_bytes_s is None else ckpt_bytes_s
    ckpt_s = CKPT_PASSES * ckpt_bytes / rate
    if gen_tok_s is None:
        gen_tok_s = assumed_rates(cfg)[0] * spec.hbm_bytes_s / GPU_HBM_BYTES_S
        source = (f"ASSUMED decode roofline (throughput.py) at {spec.name} bandwidth, "
                  f"output {int(cfg.rollout.max_new_tokens / 2)} tokens mean")
    else:
        source = "--gen-tok-s"
    gen_s = fl.out_tokens / (cfg.topology.n_generators * gen_tok_s)
    return StepTime(cfg, spec, mfu, fl, train_s, update_s, ckpt_s, gen_s, gen_tok_s, source,
                    ckpt_bytes, rate)


def budget_problems(est: StepTime, limit: float | None, lead: float | None,
                    limit_src: str = "", lead_src: str = "") -> tuple[str | None, str | None]:
    """(refusal, warning): one line each, or None."""
    cfg = est.cfg
    need = est.step_s + est.ckpt_s
    keys = (f"topology.gpu={cfg.topology.gpu or est.gpu.name}, topology.mfu={est.mfu:g}, "
            f"train.batch_prompts, rollout.group_size")
    refuse = warn = None
    if lead is not None and need > lead:
        refuse = (f"checkpoint.signal_lead_s: a step ({_fmt_s(est.step_s)}) and its checkpoint "
                  f"({_fmt_s(est.ckpt_s)}) need {need:.0f} s but the preemption signal comes "
                  f"{lead:.0f} s before the time limit ({lead_src or 'lead'}): the job would be "
                  f"killed mid-step (raise --signal=B:USR1@ to >= {math.ceil(need)} and "
                  f"checkpoint.signal_lead_s, or shrink the step: {keys}; estimate: python -m "
                  f"areal_hpc.plan time CONFIG)")
    every = cfg.checkpoint.every_steps
    if limit is not None and every > 0 and every * est.interval_s > limit / 2:
        line = (f"checkpoint.every_steps={every}: {every} steps take {_fmt_s(every * est.interval_s)} "
                f"(estimated, {_fmt_s(est.interval_s)} each), "
                + ("more than" if every * est.interval_s > limit else "over half of")
                + f" the time limit {_fmt_s(limit)} ({limit_src or 'limit'}): ")
        if every * est.interval_s > limit:
            # No timed checkpoint in any attempt: a crash or a kill loses the attempt, every time.
            refuse = refuse or (line + f"no timed checkpoint within an attempt, a kill loses all its "
                                f"steps (lower checkpoint.every_steps to <= {max(1, int(limit // est.interval_s))})")
        else:
            warn = line + (f"a kill loses up to that much (lower checkpoint.every_steps to "
                           f"<= {max(1, int(limit / 2 // est.interval_s))})")
    return refuse, warn


def check_time(cfg: RunConfig, env=None, warn=None) -> StepTime | None:
    """The launchers' step-time preflight: ConfigError (one line) when a step and its checkpoint
    cannot finish within the preemption signal's lead, when checkpoint.every_steps steps
    outlast the time limit (no timed checkpoint in any attempt), or when a fixed wait is
    shorter than the work it bounds (`bounds.bound_problems`); a warning line (to `warn`,
    default stderr) when they outlast half of it. Skipped on CPU and for topology.gpu=""."""
    if cfg.topology.device == "cpu" or not cfg.topology.gpu.strip():
        return None
    est = estimate_time(cfg)
    limit, limit_src, lead, lead_src = job_clock(cfg, env)
    refuse, warning = budget_problems(est, limit, lead, limit_src, lead_src)
    refuse = refuse or bound_problems(waits(est))      # every fixed wait covers its work
    if refuse:
        raise ConfigError(refuse)
    if warning:
        (warn or (lambda line: print(f"[launch] warning: {line}", file=sys.stderr, flush=True)))(warning)
    return est


# ------------------------------------------------------------------------------ CLI

def add_time_parser(sub) -> None:
    tp = sub.add_parser("time", help="estimated seconds per training step on a named GPU")
    tp.add_argument("config")
    tp.add_argument("overrides", nargs="*", help="key=value")
    tp.add_argument("--gpu", default=None, help=f"one of {', '.join(GPUS)} (default topology.gpu)")
    tp.add_argument("--mfu", type=float, default=None, help="model-FLOPs utilisation (default topology.mfu)")
    tp.add_argument("--gen-tok-s", type=float, default=None, help="one engine's generation tokens/s")
    tp.add_argument("--out-len", type=float, default=None, help="mean output tokens (default max_new_tokens/2)")
    tp.add_argument("--ckpt-gb-s", type=float, default=None,
                    help=f"checkpoint filesystem GB/s, aggregate (default {CKPT_BYTES_S / 1e9:g})")
    tp.add_argument("--time-limit", default=None, help="the job's --time (e.g. 24:00:00)")
    tp.add_argument("--signal-lead", type=float, default=None, help="seconds of --signal=B:USR1@N")


def time_command(args, console) -> int:
    """`python -m areal_hpc.plan time`: the estimate and its assumptions; exit 2 with one line
    `error: ...` on bad input or when the step cannot fit the signal lead."""
    try:
        cfg = load(args.config, args.overrides)
        for flag in ("gen_tok_s", "out_len", "ckpt_gb_s", "signal_lead"):
            v = getattr(args, flag)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ConfigError(f"--{flag.replace('_', '-')}: must be positive, got {v:g}")
        gpu = args.gpu if args.gpu is not None else (cfg.topology.gpu or None)
        if gpu is None:
            raise ConfigError("no GPU: pass --gpu (one of " + ", ".join(GPUS) + ") or set topology.gpu")
        est = estimate_time(cfg, gpu, args.mfu, args.gen_tok_s, args.out_len,
                            None if args.ckpt_gb_s is None else args.ckpt_gb_s * 1e9)
        limit = None
        if args.time_limit is not None:
            limit = parse_slurm_time(args.time_limit)
            if limit is None:
                raise ConfigError(f"--time-limit: expected a Slurm time like 24:00:00, got {args.time_limit!r}")
        limit = limit or (cfg.checkpoint.time_limit_s or None)
        lead = args.signal_lead or (cfg.checkpoint.signal_lead_s or None)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    render_time(est, console)
    render_preemption(hard_preemption(est), console)
    rows = waits(est)
    render_waits(rows, console)
    refuse, warning = budget_problems(est, limit, lead, "--time-limit", "--signal-lead")
    refuse = refuse or bound_problems(rows)
    if warning:
        console.print(f"[yellow]warning[/]: {warning}")
    if refuse:
        print(f"error: {refuse}", file=sys.stderr)
        return 2
    return 0


# ------------------------------------------------------------------------------ hard preemption

# ASSUMPTIONS: an asynchronous save stages each rank's shards in host memory at this rate (a
# device-to-host copy into pageable memory); a requeued job spends this long before its first
# step besides reading the checkpoint and generating the first batch (ranks, Megatron, vLLM
# engines; the wait in the queue is the site's and not counted).
HOST_COPY_BYTES_S = 10e9
RESTART_FIXED_S = 300.0


@dataclass(frozen=True)
class Cadence:
    """A way to checkpoint, and what it costs: the trainer's stall per checkpoint, the time from
    a checkpoint's start until it is complete, the checkpoint period (`every` steps and the
    stall), and the mean work a kill at a random time loses (the restart aside)."""
    every: int
    asynchronous: bool
    stall_s: float
    complete_s: float
    period_s: float

    @property
    def loss_s(self) -> float:
        # a kill at u in [0, period): lost u once the checkpoint is complete, else u + period
        return self.period_s / 2 + self.complete_s

    @property
    def name(self) -> str:
        return (f"{'async' if self.asynchronous else 'sync'}, every "
                + ("step" if self.every == 1 else f"{self.every} steps"))


@dataclass(frozen=True)
class HardPreemption:
    """What a hard preemption costs a config: by cadence, the restart, the GraceTime."""
    cadences: list[Cadence]         # the config's first
    staged_bytes: float             # per rank, the largest, for an asynchronous save
    restart_parts: dict[str, float]
    ckpt_s: float                   # a checkpoint's write and CRC read

    @property
    def restart_s(self) -> float:
        return sum(self.restart_parts.values())

    @property
    def grace_s(self) -> float:
        """The GraceTime that lets a SIGTERM between steps lose only the restart: the
        preemption's checkpoint (or the completion of the asynchronous one in flight, whose
        shards it then links), plus the stop's margin (generators, rollout log, exit)."""
        return self.ckpt_s + STOP_MARGIN_S


def staged_bytes_per_rank(cfg: RunConfig, params: float) -> float:
    """What the largest trainer rank writes, which an asynchronous save stages in host memory
    (train/checkpoint.staged_bytes): its model shard (data-parallel rank 0 writes the
    replicated weights) and its optimizer shard (fp32 main weights and Adam moments, divided
    over dp by the distributed optimizer, else written by data-parallel rank 0), the layers
    taken as even over the pipeline stages."""
    t = cfg.topology
    shard = params / (t.tp * t.pp)
    half = cfg.model.dtype != "float32"
    dp = max(1, t.n_trainers // (t.tp * t.pp))
    opt = (12 if half else 8) * shard / (dp if cfg.train.distributed_optimizer else 1)
    return (2 if half else 4) * shard + opt


def _seal_points(est: StepTime, every: int) -> list[float]:
    """Seconds after a checkpoint began (at a step's end) at which the trainer ranks can seal
    it: each step boundary of the period and, with checkpoint.mid_step_stop, each mid-step
    decision point (before π_prox, after each minibatch but the last), a step taken as the wait
    for its batch, then π_prox, then the minibatches."""
    cfg, fl = est.cfg, est.flops
    m = cfg.train.ppo_minibatches
    prox = est.train_s * fl.prox / fl.total if fl.total else 0.0
    wait = est.interval_s - est.step_s
    points = []
    for k in range(every):
        start = k * est.interval_s + wait
        if cfg.checkpoint.mid_step_stop:
            points.append(start)
            points += [start + prox + j * (est.train_s - prox) / m for j in range(1, m)]
        points.append((k + 1) * est.interval_s)
    return points


def cadence(est: StepTime, every: int, asynchronous: bool, stage_s: float = 0.0) -> Cadence:
    """`every` steps per checkpoint, written synchronously (the trainer stalls for the write
    and the CRC read: `est.ckpt_s`) or asynchronously (it stalls `stage_s`; the checkpoint is
    complete at the first seal point after the write and read, or when the next save waits for
    them)."""
    if not asynchronous:
        return Cadence(every, False, est.ckpt_s, est.ckpt_s, every * est.interval_s + est.ckpt_s)
    late = [t for t in _seal_points(est, every) if t >= est.ckpt_s]
    complete = stage_s + (late[0] if late else est.ckpt_s)
    return Cadence(every, True, stage_s, complete,
                   stage_s + max(every * est.interval_s, est.ckpt_s))


def hard_preemption(est: StepTime) -> HardPreemption:
    """What a hard preemption costs `est.cfg` (see the module docstring): its own cadence,
    synchronous and asynchronous checkpoints after every step, the restart, the GraceTime."""
    cfg = est.cfg
    params = est.ckpt_bytes / (14 if cfg.model.dtype != "float32" else 12)
    staged = staged_bytes_per_rank(cfg, params)
    stage_s = staged / HOST_COPY_BYTES_S
    ck = cfg.checkpoint
    own = cadence(est, ck.every_steps or cfg.train.total_steps, ck.async_save, stage_s)
    rows = [own] + [c for c in (cadence(est, 1, False), cadence(est, 1, True, stage_s))
                    if (c.every, c.asynchronous) != (own.every, own.asynchronous)]
    parts = {"start": RESTART_FIXED_S,
             "checkpoint read (CRC check, load)": 2 * est.ckpt_bytes / est.ckpt_bytes_s,
             "the first batch generated": est.gen_s}
    return HardPreemption(rows, staged, parts, est.ckpt_s)


def render_preemption(hp: HardPreemption, console) -> None:
    from rich.table import Table

    tab = Table(title="a hard preemption (SIGTERM, SIGKILL after GraceTime) at a random time")
    for col in ("checkpoint", "stall per step", "complete after", "lost on average",
                "with the restart"):
        tab.add_column(col, justify="left" if col == "checkpoint" else "right")
    for i, c in enumerate(hp.cadences):
        per_step = c.stall_s / c.every
        tab.add_row(c.name + (" (this config)" if i == 0 else ""),
                    f"{per_step:,.0f} s ({per_step / (c.period_s / c.every):.1%})",
                    _fmt_s(c.complete_s), _fmt_s(c.loss_s), _fmt_s(c.loss_s + hp.restart_s))
    console.print(tab)
    console.print("  restart " + _fmt_s(hp.restart_s) + ": " + ", ".join(
        f"{k} {_fmt_s(v)}" for k, v in hp.restart_parts.items()) +
        f" (ASSUMED start {RESTART_FIXED_S:.0f} s; the queue wait not counted)")
    console.print(f"  an asynchronous save stages {hp.staged_bytes / 2**30:,.1f} GiB of host "
                  f"memory on the largest trainer rank (checkpoint.async_max_host_gb), copied at "
                  f"an ASSUMED {HOST_COPY_BYTES_S / 1e9:g} GB/s")
    console.print(f"  GraceTime >= {math.ceil(hp.grace_s)} s (a checkpoint, {hp.ckpt_s:,.0f} s, "
                  f"and the stop's margin) lets a SIGTERM between steps lose only the restart; "
                  f"one mid-step loses the table's work")


def render_time(est: StepTime, console) -> None:
    from rich.table import Table

    cfg, fl, g = est.cfg, est.flops, est.gpu
    t, r, tr = cfg.topology, cfg.rollout, cfg.train
    prompt, out = lengths(cfg, fl.out_tokens / (tr.batch_prompts * r.group_size))
    console.print(f"[bold]{cfg.name}[/]: {t.n_trainers} trainer GPU(s) {g.name} "
                  f"({g.bf16_flops / 1e12:.0f} TFLOP/s dense bf16, {g.hbm_bytes_s / 1e12:.2f} TB/s) at "
                  f"MFU {est.mfu:g}; {t.n_generators} generator engine(s) of {r.engine_tp} GPU(s)")
    console.print(f"step: B {tr.batch_prompts} x n {r.group_size} = {tr.batch_prompts * r.group_size} "
                  f"sequences of {prompt:.0f} prompt + {out:.0f} output tokens = {fl.tokens / 1e6:.1f} M "
                  f"tokens ({fl.out_tokens / 1e6:.1f} M output); recompute "
                  f"{tr.recompute_granularity or 'none'}, π_prox {tr.prox}")
    tab = Table(title="one training step, estimated")
    tab.add_column("part")
    tab.add_column("PFLOP", justify="right")
    tab.add_column("seconds", justify="right")
    per_s = t.n_trainers * g.bf16_flops * est.mfu
    for name, f in (("forward + backward", fl.train), ("activation recompute", fl.recompute),
                    ("π_prox forward", fl.prox)):
        tab.add_row(name, f"{f / 1e15:,.0f}", f"{f / per_s:,.0f}")
    tab.add_row("(of which core attention)", f"{fl.attention / 1e15:,.0f}", f"{fl.attention / per_s:,.0f}")
    tab.add_row("[bold]training[/]", f"[bold]{fl.total / 1e15:,.0f}[/]", f"[bold]{est.train_s:,.0f}[/]")
    tab.add_row("weight update", "", f"{est.update_s:,.0f}")
    tab.add_row("[bold]trainer step[/]", "", f"[bold]{est.step_s:,.0f}[/]")
    tab.add_row(f"generation of a batch ({est.gen_tok_s:,.0f} tok/s per engine)", "", f"{est.gen_s:,.0f}")
    tab.add_row("[bold]async step interval[/] (max of the two)", "", f"[bold]{est.interval_s:,.0f}[/]")
    tab.add_row(f"checkpoint ({est.ckpt_bytes / 1e9:,.0f} GB, written + CRC read at "
                f"{est.ckpt_bytes_s / 1e9:g} GB/s)", "", f"{est.ckpt_s:,.0f}")
    console.print(tab)
    console.print(f"  {_fmt_s(est.interval_s)} per step: {3600 / est.interval_s:.2f} steps/h, "
                  f"{tr.total_steps} steps in {_fmt_s(tr.total_steps * est.interval_s)}; a preemption "
                  f"needs a lead >= {est.step_s + est.ckpt_s:,.0f} s (step + checkpoint); "
                  f"checkpoint.every_steps={cfg.checkpoint.every_steps} = "
                  f"{_fmt_s(cfg.checkpoint.every_steps * est.interval_s)}")
    console.print(f"  assumptions: MFU {est.mfu:g} (topology.mfu / --mfu); every sequence "
                  f"{prompt:.0f} + {out:.0f} tokens (--out-len; long tails raise the attention term); "
                  f"generation {est.gen_source}; weight broadcast and checkpoint bandwidths as "
                  f"stated (--ckpt-gb-s)")
