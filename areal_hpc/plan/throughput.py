"""Throughput model of a run: a discrete-event simulation of the asynchronous RL pipeline.

    python -m areal_hpc.plan throughput CONFIG [key=value ...] [--from-run RUN_DIR]
        [--gen-tok-s X] [--train-tok-s X] [--update-s X] [--lengths RUN_DIR|rollouts.h5]
        [--median-len N --p99-len N] [--steps S] [--search] [--devices D]

Pure Python + numpy; it drives the controller's own bookkeeping, `rollout.ledger.Ledger` (issue,
arrived, drop_stale, take, trained), so submission, dropping and reissuing follow the running
code exactly: the simulation adds only the engines, the trainer and the clock.

Model
-----
- G generator engines (topology.n_generators). The controller hands each prompt (a group of
  n = rollout.group_size samples) to the engine with the fewest prompts in flight, whenever

      capacity = min(max_concurrent_prompts - running,
                     min(η + v + 1, steps) B - (accepted + running)) > 0

  (`StalenessManager.get_capacity`; B = train.batch_prompts, v = the policy version, η =
  rollout.max_staleness, forced to 0 by rollout.mode=sync; nothing is issued for a step past
  the simulated ones).
- An engine runs at most C sequences at once, C = min(max_concurrent_prompts n / G,
  max_num_seqs, kv_tokens / (prompt_len + mean output len)) (the KV budget, when the
  memory model can tell it); the rest wait in its queue (vLLM's scheduler).
- Decode with c running sequences: engine tokens/s T(c) = peak c / (c + c_half), every running
  sequence advancing at T(c) / c = peak / (c + c_half). `Rates.gen_tok_s` is T(C), the rate of
  a full engine (what a run measures), so peak = gen_tok_s (C + c_half) / C. c_half = 0: the
  engine's rate does not depend on how many sequences it runs (a CPU engine is close to that).
- Output lengths: drawn once per prompt (n samples; a reissued prompt keeps its lengths: long,
  hard prompts stay long), from an empirical list (a rollout log) or a lognormal of given median
  and p99 (sigma = ln(p99 / median) / 2.326), clipped to [1, rollout.max_new_tokens].
- A sample's oldest token carries the version its engine ran when it started decoding (tokens
  after a weight update carry later versions: interruptible generation); a group's is the
  minimum over its samples; scoring takes no time.
- Groups more than η versions behind the earliest version they can be trained at (the current
  one while the trainer waits, the next while it trains) are dropped as they arrive and when the
  trainer looks for a batch (`Ledger.drop_stale`, unless stale_policy=keep; their prompts
  reissued first), as the controller does. With abort_stale, once a batch is taken the groups
  still in flight that are already too old stop where they are (their tokens so far count as
  generated), are sent as they are and dropped, as the generators do on StaleBefore.
- Trainer: waits for B groups,
  takes the oldest B, trains for train_overhead_s + tokens / train_tok_s (tokens = output
  tokens of the batch, as metrics.jsonl's n_tokens), then updates the weights for update_s:
  every engine pauses (in-flight sequences keep their progress) and at its end the version
  increments on every side.
- Schedules: `async` runs generators and trainer on disjoint devices at once; `sync` is the
  colocated baseline: η = 0, and each phase gets every device in turn (generation rates and the
  KV budget scaled by `sync_gen_scale`, training by `sync_train_scale`; by default the ratio of
  all devices to the phase's own, i.e. linear scaling, an assumption).
- Ideal bound (async, full overlap) for S steps: with train = S (step + update_s) and gen =
  gen_tokens / (G T(C)) + S update_s, wall >= max(train, gen) + min(train, gen) / S: the trainer
  is sequential, no engine generates faster than T(C) nor during an update, and the pipeline's
  fill (the first batch, before any step) or drain (the last step, after the last batch) does
  not overlap. `SimResult.ideal_wall_s` uses the run's own generated tokens,
  so a simulated (or measured) run never beats it.

Rates (plan/calibration.py): measured ones come from a finished run (`calibrate`:
metrics.jsonl, generators.json, rollouts.h5, config.yaml) or from flags. Without either,
`assumed_rates` derives them from a roofline of the model on H100-class GPUs (datasheet peaks
times assumed efficiencies): these are ASSUMPTIONS, to be replaced by measured numbers. The
command line is plan/throughput_cli.py.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from ..config import ConfigError, RunConfig
from ..cpus import parse_cpus
from ..rollout.ledger import Ledger
from ..rollout.staleness import staleness_of
from .memory import DTYPE_BYTES, generator_estimate, kv_bytes_per_token, read_arch, vllm_limits

Z99 = 2.3263478740408408            # standard normal quantile of 0.99
ETAS = (0, 1, 2, 4, 8)
DEFAULT_C_HALF = 8.0                # assumed: an engine reaches half its peak at 8 sequences

# Without measured rates: a roofline on H100-class GPUs. ASSUMPTIONS, to be replaced by measured
# numbers (--from-run, or the flags). Peaks from NVIDIA's H100 SXM datasheet: 989 TFLOP/s dense
# bf16, 3.35 TB/s HBM3; the efficiencies are guesses of the usual order, not measurements.
GPU_BF16_FLOPS = 989e12
GPU_HBM_BYTES_S = 3.35e12
TRAIN_MFU = 0.35                    # Megatron model-FLOPs utilisation
DECODE_BW_EFFICIENCY = 0.5          # share of HBM bandwidth a decode step achieves
WEIGHT_BCAST_BYTES_S = 20e9         # NCCL broadcast trainer → engines, per byte of bf16 weights
UPDATE_FIXED_S = 2.0                # per update: pause, load into vLLM, resume


# ------------------------------------------------------------------------------ inputs

@dataclass
class Lengths:
    """Output-length distribution: `values` (empirical) or a lognormal of `median` and `p99`."""

    values: np.ndarray | None = None
    median: float | None = None
    p99: float | None = None
    prompt_len: float = 0.0
    source: str = ""

    def __post_init__(self):
        if self.values is not None:
            self.values = np.asarray(self.values, dtype=np.float64)
            if self.values.size == 0 or not np.all(self.values > 0):
                raise ValueError(f"{self.source or 'lengths'}: need positive output lengths")
        elif not (self.median and self.p99 and 0 < self.median <= self.p99):
            raise ValueError(f"need 0 < median ({self.median}) <= p99 ({self.p99})")

    @classmethod
    def constant(cls, n: int, prompt_len: float = 0.0) -> "Lengths":
        return cls(values=np.array([float(n)]), prompt_len=prompt_len, source=f"constant {n}")

    def sample(self, rng: np.random.Generator, k: int, cap: int) -> np.ndarray:
        if self.values is not None:
            out = rng.choice(self.values, size=k)
        else:
            sigma = math.log(self.p99 / self.median) / Z99
            out = rng.lognormal(math.log(self.median), sigma, size=k)
        return np.clip(np.rint(out), 1, cap)

    def mean(self, cap: int = 10**9) -> float:
        if self.values is not None:
            return float(np.clip(self.values, 1, cap).mean())
        sigma = math.log(self.p99 / self.median) / Z99
        return min(float(self.median * math.exp(sigma * sigma / 2)), cap)

    def describe(self) -> str:
        if self.values is not None:
            v = self.values
            return (f"{self.source}: {v.size} lengths, mean {v.mean():.1f}, median "
                    f"{np.median(v):.0f}, p99 {np.percentile(v, 99):.0f}")
        return f"{self.source or 'lognormal'}: median {self.median:g}, p99 {self.p99:g}"


@dataclass
class Rates:
    """What the simulation needs to know about the hardware (see the module docstring)."""

    gen_tok_s: float                # one engine, decode tokens/s while busy and full
    train_tok_s: float              # the whole trainer, trained (output) tokens/s
    update_s: float                 # one weight update (generators paused)
    lengths: Lengths
    train_overhead_s: float = 0.0   # per training step, on top of tokens / train_tok_s
    c_half: float = DEFAULT_C_HALF
    source: str = "flags"

    def check(self) -> None:
        for name, flag in (("gen_tok_s", "--gen-tok-s"), ("train_tok_s", "--train-tok-s")):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{flag}: must be a positive rate, got {v!r}")
        for name, flag in (("update_s", "--update-s"), ("train_overhead_s", "--train-overhead-s"),
                           ("c_half", "--c-half")):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{flag}: must be >= 0, got {v!r}")


@dataclass
class Setup:
    """The schedule's shape: what the config says, plus the per-engine concurrency limit."""

    n_generators: int
    batch_prompts: int
    group_size: int
    max_staleness: int
    max_concurrent_prompts: int
    seq_limit: int                  # C: sequences one engine runs at once
    max_new_tokens: int
    stale_policy: str = "reissue"
    max_reissues: int = 2
    abort_stale: bool = False       # doomed groups stopped mid-generation (rollout.abort_stale)
    colocated: bool = False         # generation pauses while the trainer trains (sync baseline)

    @classmethod
    def from_config(cls, cfg: RunConfig, lengths: Lengths, kv_tokens: float | None = None,
                    n_generators: int | None = None, kv_scale: float = 1.0) -> "Setup":
        r, t = cfg.rollout, cfg.topology
        g = n_generators or t.n_generators
        limit = min(math.ceil(r.max_concurrent_prompts * r.group_size / g), vllm_limits(cfg)[0])
        if kv_tokens is None:
            kv_tokens = kv_budget_tokens(cfg)
        if kv_tokens:
            per_seq = lengths.prompt_len + lengths.mean(r.max_new_tokens)
            limit = min(limit, max(1, int(kv_tokens * kv_scale // per_seq)))
        return cls(n_generators=g, batch_prompts=cfg.train.batch_prompts, group_size=r.group_size,
                   max_staleness=0 if r.mode == "sync" else r.max_staleness,
                   max_concurrent_prompts=r.max_concurrent_prompts, seq_limit=max(1, limit),
                   max_new_tokens=r.max_new_tokens, stale_policy=r.stale_policy,
                   max_reissues=r.max_reissues, abort_stale=r.abort_stale)


def kv_budget_tokens(cfg: RunConfig) -> float | None:
    """Tokens the KV cache of one engine holds, from the memory model; None when unknown (no
    architecture to read, or no GPU memory to size vLLM's budget from)."""
    try:
        arch = read_arch(cfg)
    except ConfigError:
        return None
    gpu = cfg.topology.gpu_mem_gib if cfg.topology.device == "cuda" else None
    if cfg.rollout.kv_cache_gib is None and not gpu:
        return None
    kv = generator_estimate(cfg, arch, gpu or None).term("KV cache").bytes
    per_token = kv_bytes_per_token(arch, DTYPE_BYTES[cfg.model.dtype], cfg.rollout.engine_tp)
    return kv / per_token if kv > 0 else None


# ------------------------------------------------------------------------------ the simulation

def pipelined_bound(steps: int, gen_s: float, train_s: float) -> float:
    """The least wall time of `steps` steps when generating a batch takes `gen_s` (weight loads
    included) and training it `train_s` (update included), fully overlapped but for one step of
    the shorter side: the first batch is generated before any step trains, and the last step
    trains after the last batch."""
    return steps * max(gen_s, train_s) + min(gen_s, train_s)


@dataclass
class SimResult:
    steps: int
    wall_s: float
    gen_busy_frac: float            # mean over engines of generating time / their span (until
                                    # the last batch is taken)
    trainer_idle_frac: float        # trainer waiting for a batch / wall
    staleness_mean: float           # over trained samples
    staleness_p95: float
    staleness_max: int
    dropped_share: float            # dropped groups / (trained + dropped)
    lost: int                       # prompts given up (StaleGroups.lost)
    gen_tokens: float               # generated, trained or not (finished samples)
    trained_tokens: float
    ideal_wall_s: float             # the bound of the module docstring, for this run's tokens
    step_s: list[float] = field(default_factory=list)   # each step's end time

    @property
    def steps_per_hour(self) -> float:
        return 3600.0 * self.steps / self.wall_s if self.wall_s > 0 else float("inf")

    @property
    def ideal_steps_per_hour(self) -> float:
        return 3600.0 * self.steps / self.ideal_wall_s if self.ideal_wall_s > 0 else float("inf")


class _Engine:
    """All running sequences advance alike: `progress` counts the tokens each has emitted since
    the engine started; a sequence started at progress p with L tokens ends at p + L."""

    __slots__ = ("progress", "t_last", "running", "queue", "busy_s", "stamp", "version_of")

    def __init__(self):
        self.progress, self.t_last, self.busy_s, self.stamp = 0.0, 0.0, 0.0, 0
        self.running: list = []         # heap of (end progress, seq key)
        self.queue: deque = deque()     # (seq key, length) waiting for a slot


def simulate(setup: Setup, rates: Rates, steps: int, seed: int = 0) -> SimResult:
    """Run the pipeline of `setup` at `rates` for `steps` training steps (see the module)."""
    rates.check()
    if steps < 1:
        raise ValueError("steps must be >= 1")
    rng = np.random.default_rng(seed)
    G, B, n, C = setup.n_generators, setup.batch_prompts, setup.group_size, setup.seq_limit
    eta = setup.max_staleness
    peak = rates.gen_tok_s * (C + rates.c_half) / C
    # The controller's own bookkeeping: what to issue, to whom, which groups wait, which are too
    # stale and come back (the prompt ids are the cursor's; the dataset is one row, never read).
    ledger = Ledger(num_prompts=1, data_seed=0, generators=list(range(G)), batch_prompts=B,
                    max_staleness=eta, max_concurrent=setup.max_concurrent_prompts,
                    stale_policy=setup.stale_policy, max_reissues=setup.max_reissues,
                    total_steps=steps)
    engines = [_Engine() for _ in range(G)]
    lengths_of: dict[int, np.ndarray] = {}
    pending: dict[int, list] = {}        # prompt id -> [samples left, oldest version, engine]
    version = 0
    paused = False                       # engines stopped (weight update; colocated training)
    events: list = []                    # (time, kind, engine, stamp)
    now = 0.0
    gen_tokens = 0.0
    trained_tokens = 0.0
    stal: list[int] = []
    dropped = trained_groups = 0
    trainer = "wait"                     # wait | train | update
    wait_since, wait_s = 0.0, 0.0
    step_end: list[float] = []
    span_s = span_busy_s = 0.0           # when the last batch was taken, engine busy seconds then

    def seq_rate(e: _Engine) -> float:
        return peak / (len(e.running) + rates.c_half) if e.running else 0.0

    def advance(e: _Engine) -> None:
        dt = now - e.t_last
        if dt > 0 and e.running and not paused:
            e.progress += seq_rate(e) * dt
            e.busy_s += dt
        e.t_last = now

    def schedule(i: int) -> None:
        e = engines[i]
        e.stamp += 1
        if e.running and not paused:
            end = e.running[0][0]
            heapq.heappush(events, (now + max(end - e.progress, 0.0) / seq_rate(e), 1, i, e.stamp))

    def fill(i: int) -> None:
        e = engines[i]
        while e.queue and len(e.running) < C and not paused:
            key, length = e.queue.popleft()
            pending[key[0]][1] = min(pending[key[0]][1], version)   # first token's version
            heapq.heappush(e.running, (e.progress + length, key))

    def submit() -> None:
        touched = set()
        for iss in ledger.issue():
            i, pid = iss.rank, iss.prompt_id
            if pid not in lengths_of:    # a new prompt (a reissued one keeps its lengths)
                lengths_of[pid] = rates.lengths.sample(rng, n, setup.max_new_tokens)
            pending[pid] = [n, 10**9, i]
            for k, length in enumerate(lengths_of[pid]):
                engines[i].queue.append(((pid, k), float(length)))
            touched.add(i)
        for i in touched:
            advance(engines[i])
            fill(i)
            schedule(i)

    def arrive(pid: int, i: int, oldest: int) -> None:
        """Engine i's group of prompt `pid` reaches the controller."""
        ledger.arrived(i, [{"prompt_id": pid, "versions": [oldest], "output_tokens": ()}] * n, [])

    def drop_stale() -> None:
        nonlocal dropped
        for g in ledger.drop_stale():
            pid = g.trajectories[0]["prompt_id"]
            dropped += 1
            if all(p != pid for p, _ in ledger.reissue):
                lengths_of.pop(pid, None)   # given up

    def abort_stale() -> None:
        """After a batch is taken, as the generators on StaleBefore: a group in flight with a
        token older than the next trainable version - η stops; its tokens so far are generated
        (and wasted), its prompt is dropped as stale."""
        nonlocal gen_tokens
        if not (setup.abort_stale and ledger.stale_groups.drops and not setup.colocated):
            return
        limit = ledger.stale_before
        doomed = {pid for pid, p in pending.items() if p[1] < limit}
        if not doomed:
            return
        for e in engines:
            advance(e)
            kept = []
            for end, key in e.running:
                if key[0] in doomed:
                    gen_tokens += e.progress - (end - lengths_of[key[0]][key[1]])
                else:
                    kept.append((end, key))
            heapq.heapify(kept)
            e.running = kept
            e.queue = deque(q for q in e.queue if q[0][0] not in doomed)
        for pid in sorted(doomed):      # as the generators: each sent, then dropped as stale
            _, oldest, i = pending.pop(pid)
            arrive(pid, i, oldest)
        drop_stale()
        for i in range(G):
            fill(i)
            schedule(i)
        submit()

    def try_train() -> None:
        nonlocal trainer, wait_s, trained_tokens, trained_groups, span_s, span_busy_s
        drop_stale()
        if len(ledger.buffer) < B:
            return
        groups = ledger.take(B)
        wait_s += now - wait_since
        tokens = 0.0
        for g in groups:
            pid = g.trajectories[0]["prompt_id"]
            tokens += float(lengths_of.pop(pid).sum())
            stal.extend(staleness_of(version, t["versions"]) for t in g.trajectories)
        trained_tokens += tokens
        trained_groups += B
        if trained_groups == steps * B:  # the last batch: the generators' span ends (as theirs)
            for e in engines:
                advance(e)
            span_s, span_busy_s = now, sum(e.busy_s for e in engines)
        trainer = "train"
        if setup.colocated:
            set_paused(True)
        heapq.heappush(events, (now + rates.train_overhead_s + tokens / rates.train_tok_s, 0, -1, 0))
        abort_stale()

    def set_paused(value: bool) -> None:
        nonlocal paused
        for e in engines:
            advance(e)
        paused = value
        for i in range(G):
            if not paused:
                fill(i)
            schedule(i)

    def finish(i: int) -> None:
        nonlocal gen_tokens
        e = engines[i]
        while e.running and e.running[0][0] <= e.progress + 1e-9:
            end, (pid, k) = heapq.heappop(e.running)
            gen_tokens += lengths_of[pid][k]
            p = pending[pid]
            p[0] -= 1
            if p[0] == 0:                # the group is complete: to the controller
                del pending[pid]
                arrive(pid, i, p[1])

    submit()
    try_train()
    while len(step_end) < steps:
        if not events:
            raise RuntimeError("simulation stalled (no events): check the setup")
        t, kind, i, stamp = heapq.heappop(events)
        if kind == 1 and stamp != engines[i].stamp:
            continue
        now = t
        if kind == 1:                    # a sequence (or several) ended on engine i
            e = engines[i]
            advance(e)
            finish(i)
            fill(i)
            schedule(i)
            drop_stale()
            submit()
            if trainer == "wait":
                try_train()
        elif trainer == "train":         # training step done: weight update, engines pause
            trainer = "update"
            if not setup.colocated:
                set_paused(True)
            heapq.heappush(events, (now + rates.update_s, 0, -1, 0))
        else:                            # update done: next version everywhere
            version += 1
            ledger.trained(version)
            step_end.append(now)
            trainer, wait_since = "wait", now
            if len(step_end) == steps:  # done: no step beyond the last is counted
                break
            set_paused(False)
            submit()
            try_train()
    wall = step_end[-1]
    for e in engines:
        advance(e)
    # generating over the generators' span, from the start until the last batch is taken (their
    # generators.json accounting): the last step's training is the pipeline's drain
    busy = span_busy_s / (G * span_s) if span_s > 0 else 0.0
    total_train = steps * rates.update_s + rates.train_overhead_s * steps + trained_tokens / rates.train_tok_s
    total_gen = gen_tokens / (G * rates.gen_tok_s) + steps * rates.update_s
    ideal = pipelined_bound(steps, total_gen / steps, total_train / steps)
    arr = np.asarray(stal, dtype=np.float64)
    return SimResult(steps=steps, wall_s=wall, gen_busy_frac=busy, trainer_idle_frac=wait_s / wall,
                     staleness_mean=float(arr.mean()), staleness_p95=float(np.percentile(arr, 95)),
                     staleness_max=int(arr.max()), dropped_share=dropped / max(dropped + trained_groups, 1),
                     lost=ledger.stale_groups.lost, gen_tokens=gen_tokens, trained_tokens=trained_tokens,
                     ideal_wall_s=ideal, step_s=step_end)


# ------------------------------------------------------------------------------ schedules

@dataclass
class Prediction:
    async_: SimResult
    sync: SimResult
    setup: Setup
    sync_setup: Setup

    @property
    def speedup(self) -> float:
        return self.async_.steps_per_hour / self.sync.steps_per_hour


def device_units(cfg: RunConfig) -> tuple[int, int]:
    """(generator, trainer) devices: GPUs on CUDA; on CPU the cores of generator_cpus and
    trainer_cpus when set (`areal_hpc.cpus` lists), else one per rank."""
    t = cfg.topology
    if t.device == "cuda":
        return t.n_generators * cfg.rollout.engine_tp, t.n_trainers
    return (len(parse_cpus(t.generator_cpus)) or t.n_generators,
            len(parse_cpus(t.trainer_cpus)) or t.n_trainers)


def sync_variant(setup: Setup, rates: Rates, gen_scale: float, train_scale: float) -> tuple[Setup, Rates]:
    """The colocated synchronous baseline: η = 0, each phase on every device (rates and the
    engines' concurrency limit scaled)."""
    s = replace(setup, max_staleness=0, colocated=True,
                seq_limit=max(1, int(setup.seq_limit * gen_scale)))
    return s, replace(rates, gen_tok_s=rates.gen_tok_s * gen_scale,
                      train_tok_s=rates.train_tok_s * train_scale)


def predict(cfg: RunConfig, rates: Rates, steps: int | None = None, seed: int = 0,
            sync_gen_scale: float | None = None, sync_train_scale: float | None = None,
            kv_tokens: float | None = None) -> Prediction:
    """Async (the config as it is; rollout.mode=sync gives η = 0) and the colocated sync baseline
    for `steps` (default train.total_steps) at `rates`."""
    steps = steps or cfg.train.total_steps
    gu, tu = device_units(cfg)
    setup = Setup.from_config(cfg, rates.lengths, kv_tokens)
    sg = sync_gen_scale if sync_gen_scale is not None else (gu + tu) / gu
    st = sync_train_scale if sync_train_scale is not None else (gu + tu) / tu
    s_setup, s_rates = sync_variant(setup, rates, sg, st)
    return Prediction(simulate(setup, rates, steps, seed), simulate(s_setup, s_rates, steps, seed),
                      setup, s_setup)


@dataclass
class SearchRow:
    gen_devices: int
    train_devices: int
    eta: int
    result: SimResult
    schedule: str = "async"


def search(cfg: RunConfig, rates: Rates, devices: int | None = None, etas=ETAS, steps: int = 8,
           seed: int = 0, max_splits: int = 7) -> list[SearchRow]:
    """Every split of `devices` (default: the config's) between generators and trainer (at most
    `max_splits` of them, evenly spaced), times every η, plus the sync baseline on all devices;
    sorted by predicted steps/hour. Rates scale linearly with devices (an assumption): an
    engine's rate stays (GPU; more engines) or grows with its cores (CPU; n_generators kept)."""
    gu, tu = device_units(cfg)
    D = devices or gu + tu
    gpu = cfg.topology.device == "cuda"
    etp = cfg.rollout.engine_tp if gpu else 1
    tmult = cfg.topology.tp * cfg.topology.pp if gpu else 1
    splits = [g for g in range(etp, D, etp) if (D - g) % tmult == 0 and D - g >= tmult]
    if gpu:
        splits = [g for g in splits if g // etp >= 1]
    if len(splits) > max_splits:
        idx = np.linspace(0, len(splits) - 1, max_splits).round().astype(int)
        splits = [splits[k] for k in sorted(set(idx))]
    rows = []
    for g in splits:
        r = replace(rates, train_tok_s=rates.train_tok_s * (D - g) / tu)
        if gpu:
            n_gen = g // etp
        else:
            n_gen = cfg.topology.n_generators
            r = replace(r, gen_tok_s=rates.gen_tok_s * g / gu)
        base = Setup.from_config(cfg, rates.lengths, n_generators=n_gen,
                                 kv_scale=1.0 if gpu else g / gu)
        for eta in etas:
            rows.append(SearchRow(g, D - g, eta, simulate(replace(base, max_staleness=eta), r, steps, seed)))
    base = Setup.from_config(cfg, rates.lengths)
    s_setup, s_rates = sync_variant(base, rates, D / gu, D / tu)
    rows.append(SearchRow(D, D, 0, simulate(s_setup, s_rates, steps, seed), "sync"))
    rows.sort(key=lambda row: -row.result.steps_per_hour)
    return rows
