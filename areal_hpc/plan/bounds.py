"""Every wait of the job beside the work it waits for, on a named GPU.

A bounded wait shorter than the work it bounds kills a healthy job; the 32B recipe's trainer
ranks once waited for the first batch (the initial evaluation, then a batch's generation: about
an hour by the step-time estimate) under rollout.collective_timeout_s (30 min). So the waits are
of two kinds:

- **for trainer rank 0's work** (it evaluates, gathers a batch from the generators, finishes the
  run): bounded by its liveness, its beacon (transport/beacon.py), not by a number of seconds.
  Listed with the estimated work for information; nothing to refuse.
- **for a peer that may be dead**: a fixed bound (a config key), which must exceed the longest
  legitimate wait for a live peer. `bound_problems` refuses, in one line naming the key, a bound
  shorter than its estimate; `check_time` (the launchers' step-time preflight) calls it.

The estimates come from the step-time estimate (`budget.estimate_time`: MFU, the GPU's peak,
the checkpoint and weight-broadcast bandwidths, the decode roofline) and two ASSUMPTIONS below
for starting a vLLM engine. `python -m areal_hpc.plan time CONFIG --gpu h100` prints the table.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import RunConfig
from .memory import read_arch

# ASSUMPTIONS: a vLLM engine reads its weights from the shared filesystem at this rate per node,
# and then spends this long on start-up work that does not scale with the model (profiling the
# KV cache, capturing CUDA graphs unless rollout.enforce_eager).
ENGINE_READ_BYTES_S = 2e9
ENGINE_INIT_S = 60.0
ENGINE_GRAPHS_S = 120.0
# ASSUMPTION: the driver frees a killed engine's GPU memory within this long.
ENGINE_MEMORY_FREE_S = 30.0


def fmt_s(s: float) -> str:
    """Seconds as a person reads them: 45 s, 3.5 min, 2.13 h."""
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    return f"{s / 60:.1f} min" if s >= 120 else f"{s:.0f} s"


@dataclass(frozen=True)
class Wait:
    """One wait of the job: who waits for what, bounded by `key` (None: by rank 0's liveness)."""
    who: str
    work: str
    estimate_s: float
    key: str | None = None
    bound_s: float | None = None

    @property
    def margin(self) -> float | None:
        """The bound over the estimate (None for a liveness-bounded wait)."""
        if self.bound_s is None:
            return None
        return self.bound_s / self.estimate_s if self.estimate_s > 0 else float("inf")


def eval_seconds(est) -> float:
    """One held-out evaluation: eval_limit problems (all of them: taken as 200) x eval_samples,
    each a mean output (as for training) at the estimated generation throughput."""
    cfg = est.cfg
    if not cfg.data.eval_path:
        return 0.0
    problems = cfg.data.eval_limit or 200
    per_sample = est.flops.out_tokens / (cfg.train.batch_prompts * cfg.rollout.group_size)
    return problems * cfg.data.eval_samples * per_sample / (cfg.topology.n_generators * est.gen_tok_s)


def engine_start_seconds(cfg: RunConfig, params: float) -> float:
    """A vLLM engine's start: its weights read from disk, then the fixed start-up work."""
    b = 2 if cfg.model.dtype != "float32" else 4
    fixed = ENGINE_INIT_S + (0.0 if cfg.rollout.enforce_eager else ENGINE_GRAPHS_S)
    return b * params / ENGINE_READ_BYTES_S + fixed


def engine_step_seconds(est, params: float) -> float:
    """The longest single engine step: a prefill of max_num_batched_tokens (vLLM's default
    2048) over the engine's GPUs at the stated MFU."""
    r = est.cfg.rollout
    tokens = r.max_num_batched_tokens or 2048
    return 2.0 * params * tokens / (r.engine_tp * est.gpu.bf16_flops * est.mfu)


def micro_batch_seconds(est) -> float:
    """One micro-batch's forward and backward on a data-parallel rank (taken as every trainer
    rank: the longest) at the estimated training speed."""
    cfg = est.cfg
    share = cfg.train.max_tokens_per_mb * cfg.topology.n_trainers / max(est.flops.tokens, 1.0)
    return est.train_s * min(1.0, share)


def waits(est) -> list[Wait]:
    """Every wait of `est.cfg`'s job with its estimated work."""
    cfg = est.cfg
    r, w, ck = cfg.rollout, cfg.weights, cfg.checkpoint
    params = float(read_arch(cfg).total_params)
    ev = eval_seconds(est)
    load_s = est.ckpt_s                 # a resume reads the checkpoint and checks its CRC-32s
    every = cfg.data.eval_every_steps
    export_s = est.ckpt_bytes / 7 / est.ckpt_bytes_s    # policy/: the bf16 weights, 2 of 14 B
    return [
        Wait("trainer 1..N", "the first batch: initial eval + a batch's generation", ev + est.gen_s),
        Wait("trainer 1..N", "a later batch: generation beyond the step"
             + (" + periodic eval" if every else ""),
             max(0.0, est.gen_s - est.step_s) + (ev if every else 0.0)),
        Wait("trainer 1..N", "the final checkpoint: after the final eval", ev),
        Wait("all but rank 0", "end of job: final eval, checkpoint, export",
             ev + est.ckpt_s + export_s),
        Wait("generators", "first message: trainer start-up + resume", load_s),
        Wait("trainer 1..N", "an update's outcome: rank 0's broadcast and acknowledgements "
             "(a generator restarting: its engine start too)", est.update_s),
        Wait("trainer", "a live peer (MPI, torch and Megatron groups): checkpoint save/load + "
             "CRC; weights.timeout_s",
             max(est.ckpt_s, load_s, w.timeout_s), "rollout.collective_timeout_s",
             r.collective_timeout_s),
        Wait("all", "a weight update: broadcast + engine load", est.update_s,
             "weights.timeout_s", w.timeout_s),
        Wait("all", "joining the weight group: vLLM start, trainer resume",
             max(engine_start_seconds(cfg, params), load_s), "weights.join_timeout_s",
             w.join_timeout_s),
        Wait("rank 0", "a generator restarting its engine: the memory wait's bound + vLLM start",
             r.engine_memory_wait_s + engine_start_seconds(cfg, params), "weights.join_timeout_s",
             w.join_timeout_s),
        Wait("generator", "its restarted engine's GPUs: the killed engine's memory freed",
             ENGINE_MEMORY_FREE_S, "rollout.engine_memory_wait_s", r.engine_memory_wait_s),
        Wait("rank 0, generators", "a live rank's silence: an engine step + 2 heartbeats",
             engine_step_seconds(est, params) + 2 * r.heartbeat_s,
             "rollout.generator_timeout_s", r.generator_timeout_s),
        Wait("generator", "its engine's step or weight load (the engine watch: a stall)",
             max(engine_step_seconds(est, params), est.update_s), "rollout.engine_stall_s",
             r.engine_stall_s),
    ] + ([Wait("every rank", "its main thread between signs of progress: a micro-batch's "
               "forward and backward, an engine step",
               max(micro_batch_seconds(est), engine_step_seconds(est, params)),
               "rollout.progress_timeout_s", r.progress_timeout_s)]
         if r.progress_timeout_s else []) + ([Wait("batch script", "the signal's lead: a step + its checkpoint",
               est.step_s + est.ckpt_s, "checkpoint.signal_lead_s", ck.signal_lead_s)]
         if ck.signal_lead_s else [])


def bound_problems(rows: list[Wait]) -> str | None:
    """One line naming the first key whose bound is shorter than the work it bounds, or None."""
    for x in rows:
        if x.bound_s is not None and x.bound_s < x.estimate_s:
            return (f"{x.key} = {x.bound_s:g} s is shorter than what it bounds ({x.work}: "
                    f"~{fmt_s(x.estimate_s)} estimated, python -m areal_hpc.plan time CONFIG): "
                    f"a healthy job would fail there; raise it to >= {x.estimate_s * 1.5:.0f}")
    return None


def render_waits(rows: list[Wait], console) -> None:
    from rich.table import Table

    tab = Table(title="every wait of the job beside the work it waits for")
    for c in ("who waits", "for", "estimate", "bounded by", "bound", "margin"):
        tab.add_column(c, justify="right" if c in ("estimate", "bound", "margin") else "left")
    for x in rows:
        if x.key is None:
            tab.add_row(x.who, x.work, fmt_s(x.estimate_s), "rank 0's liveness", "-", "-")
        else:
            m = x.margin
            mark = "[red]" if m < 1 else "[yellow]" if m < 2 else ""
            tab.add_row(x.who, x.work, fmt_s(x.estimate_s), x.key, fmt_s(x.bound_s),
                        f"{mark}{m:.1f}x")
    console.print(tab)
