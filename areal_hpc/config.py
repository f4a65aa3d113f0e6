"""Run configuration: a tree of dataclasses, loaded from YAML with `key=value` overrides.

Every field has a simple type so the whole tree serialises (into the rollout HDF5 attributes and
checkpoint manifests) and back. Unknown keys and wrong types are errors that name the key; they
are raised by `load()` before any rank starts work.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A bad configuration: the message names the key and what is wrong."""


@dataclass
class ModelConfig:
    path: str = MISSING                 # HF directory: config.json, *.safetensors, tokenizer.json
    dtype: str = "float32"              # params / vLLM dtype: float32 | bfloat16 | float16


@dataclass
class DataConfig:
    train_path: str = MISSING           # jsonl, {"question", "answer"} per line
    eval_path: Optional[str] = None     # held-out jsonl; evaluated at step 0 and at the end
    kind: str = "math"                  # math: {"question","answer"}; code: prompt + stdin/stdout tests
    question_key: str = "question"
    answer_key: str = "answer"
    prompt_template: str = "{question}"  # how a question becomes the prompt text
    eval_limit: int = 200               # held-out problems evaluated (0 = all)
    eval_samples: int = 4               # samples per held-out problem (accuracy = mean over them)
    seed: int = 0


@dataclass
class TopologyConfig:
    n_trainers: int = 1                 # trainer ranks = tp * pp * dp
    n_generators: int = 1               # generator ranks, one vLLM engine each
    tp: int = 1
    pp: int = 1
    # torch.distributed backends: "gloo" on CPU, "nccl" on GPUs.
    trainer_backend: str = "gloo"
    weight_backend: str = "gloo"
    device: str = "cpu"                 # "cpu" | "cuda"
    # Memory of one GPU, for the preflight (`python -m areal_hpc.plan memory`): every launcher
    # refuses a config whose per-GPU estimate exceeds it before any rank starts. 0 = no check.
    gpu_mem_gib: float = 80.0


@dataclass
class RolloutConfig:
    # "async": generators run ahead of the trainer by up to η versions (AReaL).
    # "sync": the baseline the paper compares against: generate a batch with the current weights,
    # wait for its longest sample, train, update; the same code with η forced to 0.
    mode: str = "async"
    group_size: int = 4                 # n samples per prompt (GRPO group)
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    max_staleness: int = 1              # η: trajectories at most η versions behind the policy
    max_concurrent_prompts: int = 16    # prompts (groups) in flight over all generators
    max_model_len: int = 512
    kv_cache_gib: Optional[int] = None  # fixed KV cache size (CPU: VLLM_CPU_KVCACHE_SPACE);
                                        # None = vLLM's default / gpu_memory_utilization
    gpu_memory_utilization: float = 0.8
    enforce_eager: bool = True
    # Liveness: each generator reports to the controller at least every `heartbeat_s` while its
    # loop runs; one silent for `generator_timeout_s` while the trainer waits on rollouts fails the
    # job with a message naming it (rank, host) instead of waiting forever. The allowance before a
    # generator's first report (starting vLLM) is weights.join_timeout_s. Weight updates are
    # bounded by weights.timeout_s instead. Keep it above the longest single engine step.
    heartbeat_s: float = 5.0
    generator_timeout_s: float = 600.0
    # vLLM tensor parallelism inside one generator rank: workers per engine (GPUs on a GPU node;
    # on CPU, this rank's allowed CPUs split among them). Each worker joins the weight group, so
    # it has pp + n_generators * engine_tp members.
    engine_tp: int = 1


@dataclass
class RewardConfig:
    workers: int = 1                    # reward processes beside each generator
    math_timeout_s: float = 10.0        # per call; a timeout or crash scores 0 and is counted


@dataclass
class TrainConfig:
    total_steps: int = 20
    batch_prompts: int = 8              # B: prompts (groups) per training step
    # Adam(W) through Megatron's optimizer; lr schedule by Megatron's OptimizerParamScheduler,
    # counted in optimizer steps (ppo_minibatches per training step): linear warm-up from 0 to
    # lr over lr_warmup_steps, then constant | linear | cosine decay to min_lr at lr_decay_steps
    # (null = the run's last optimizer step).
    lr: float = 1e-4
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    lr_decay_steps: Optional[int] = None
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # Decoupled PPO. π_prox: "recompute" (a forward pass with the weights at the start of the
    # step), "loglinear" (AReaL's approximation from per-token versions, no forward pass) or
    # "behaviour" (π_prox = π_behav: naive PPO against the sampling policy).
    prox: str = "recompute"
    ppo_minibatches: int = 1            # optimizer steps per training step (π_prox fixed for all)
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None   # DAPO clip-higher; None = eps_clip
    dual_clip: Optional[float] = None       # dual-clip PPO bound c > 1 for A < 0; None = off
    behav_imp_weight_cap: Optional[float] = 5.0
    # Advantages: r <- clip((r + reward_bias) * reward_scaling, ±reward_clip); reward_norm
    # "group" (GRPO z-score per prompt) | "none"; adv_norm "batch" (z-score over all output
    # tokens of the batch) | "none".
    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: float = 20.0
    reward_norm: str = "group"
    adv_norm: str = "none"
    max_tokens_per_mb: int = 4096       # tokens (prompt + output) per packed micro-batch
    # Core attention over a packed micro-batch. varlen: each sequence attends only within itself
    # (cumulative sequence lengths; cost sum(len_i^2), memory linear in the pack): TransformerEngine
    # THD where installed, else PyTorch's fused kernels. mask: one dense [S, S] block-diagonal
    # mask through Megatron's local attention (the exact reference; cost S^2). auto = varlen.
    attention: str = "auto"
    # Log-probs are computed from the last hidden states in chunks of this many tokens, the
    # output projection and the [chunk, vocab / tp] float32 softmax recomputed in backward, so
    # no [tokens, vocab] tensor exists.
    logprob_chunk_tokens: int = 2048
    # Megatron activation recompute: granularity null | selective (core attention) | full
    # (whole layers); with full, method uniform | block and num_layers (per chunk / per stage).
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    sequence_parallel: bool = False     # Megatron sequence parallelism (needs topology.tp > 1)
    # Megatron's distributed optimizer: Adam state and fp32 main weights sharded over the
    # data-parallel ranks (ZeRO-1).
    distributed_optimizer: bool = False
    seed: int = 1


@dataclass
class WeightSyncConfig:
    # broadcast: buckets over the weight group (NCCL on GPU, gloo on CPU) straight into the
    # running engines. disk: versioned safetensors directories under `disk_dir`, loaded by the
    # generators, for clusters where generator nodes cannot join a NCCL group with the trainers.
    mode: str = "broadcast"
    bucket_mb: int = 256                # bucket size (broadcast unit; file size on disk); two are
                                        # in flight per side (~2x this beside vLLM's KV budget)
    # Bounds every collective on the weight group and the wait for the generators'
    # acknowledgement of an update; past it the job fails naming the generators (rank, host).
    timeout_s: float = 600.0
    join_timeout_s: float = 1800.0      # joining the weight group (generators start vLLM first)
    disk_dir: str = ""                  # disk mode; "" = <run_dir>/weights (a shared filesystem)


@dataclass
class CheckpointConfig:
    # A checkpoint (model + optimizer shards, run state) every `every_steps` training steps (0 =
    # none on a timer), at the end, and when a preemption signal arrives.
    every_steps: int = 10
    keep: int = 2                       # newest valid checkpoints kept
    # auto: a rerun (requeue) in an existing run dir resumes from its newest valid checkpoint;
    # never: an existing run dir is an error.
    resume: str = "auto"
    # Signals that ask the job to checkpoint at the next step boundary and exit with code 3
    # (EXIT_PREEMPTED) for the batch script to requeue. Slurm: --signal=B:USR1@<seconds>.
    signals: list = field(default_factory=lambda: ["USR1", "TERM"])


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: str = "runs"            # the run lives in <output_dir>/<name>
    log_every: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


def _explain(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    msg = str(exc).splitlines()[0]
    return f"config key '{key}': {msg}" if key else msg


def load(yaml_path: str | os.PathLike | None, overrides: list[str] = ()) -> RunConfig:
    """Schema ← YAML ← `key=value` overrides; validated; returns a RunConfig object."""
    schema = OmegaConf.structured(RunConfig)
    try:
        layers = [schema]
        if yaml_path is not None:
            path = Path(yaml_path)
            if not path.is_file():
                raise ConfigError(f"config file not found: {path}")
            layers.append(OmegaConf.load(path))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"override must be key=value, got: {bad[0]!r}")
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"config key '{missing[0]}' is required but not set")
        cfg: RunConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc)) from None
    validate(cfg)
    return cfg


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}': {msg}")


def validate(cfg: RunConfig) -> None:
    """Semantic checks that types alone cannot express."""
    t, r, tr = cfg.topology, cfg.rollout, cfg.train
    _check(t.n_generators >= 1, "topology.n_generators", "need at least one generator rank")
    _check(t.n_trainers >= 1, "topology.n_trainers", "need at least one trainer rank")
    _check(t.tp >= 1 and t.pp >= 1, "topology.tp", "tp and pp must be >= 1")
    _check(t.n_trainers % (t.tp * t.pp) == 0, "topology.n_trainers",
           f"{t.n_trainers} trainer ranks are not a multiple of tp*pp = {t.tp * t.pp}")
    _check(t.device in ("cpu", "cuda"), "topology.device", f"must be cpu or cuda, got {t.device!r}")
    for key in ("trainer_backend", "weight_backend"):
        _check(getattr(t, key) in ("gloo", "nccl"), f"topology.{key}",
               f"must be gloo or nccl, got {getattr(t, key)!r}")
    _check(cfg.model.dtype in ("float32", "bfloat16", "float16"), "model.dtype",
           f"must be float32, bfloat16 or float16, got {cfg.model.dtype!r}")
    _check(r.mode in ("async", "sync"), "rollout.mode", f"must be async or sync, got {r.mode!r}")
    _check(r.group_size >= 1, "rollout.group_size", "must be >= 1")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    _check(r.temperature > 0, "rollout.temperature", "must be > 0 (behaviour log-probs need sampling)")
    _check(r.max_staleness >= 0, "rollout.max_staleness", "η must be >= 0")
    _check(r.max_concurrent_prompts >= 1, "rollout.max_concurrent_prompts", "must be >= 1")
    _check(r.heartbeat_s > 0, "rollout.heartbeat_s", "must be > 0")
    _check(r.generator_timeout_s > 2 * r.heartbeat_s, "rollout.generator_timeout_s",
           f"must exceed two heartbeats (2 * rollout.heartbeat_s = {2 * r.heartbeat_s})")
    _check(r.engine_tp >= 1, "rollout.engine_tp",
           f"vLLM workers per generator engine must be >= 1, got {r.engine_tp}")
    _check(cfg.data.kind in ("math", "code"), "data.kind", f"must be math or code, got {cfg.data.kind!r}")
    _check(cfg.reward.workers >= 1, "reward.workers", "must be >= 1")
    _check(cfg.reward.math_timeout_s > 0, "reward.math_timeout_s", "must be > 0")
    _check(tr.total_steps >= 1, "train.total_steps", "must be >= 1")
    _check(tr.batch_prompts >= 1, "train.batch_prompts", "must be >= 1")
    _check(tr.dual_clip is None or tr.dual_clip > 1, "train.dual_clip", "must be > 1 (or null)")
    _check(tr.max_tokens_per_mb >= r.max_model_len, "train.max_tokens_per_mb",
           f"must hold one whole sequence: >= rollout.max_model_len = {r.max_model_len}")
    _check(tr.prox in ("recompute", "loglinear", "behaviour"), "train.prox",
           f"must be recompute, loglinear or behaviour, got {tr.prox!r}")
    _check(tr.attention in ("auto", "varlen", "mask"), "train.attention",
           f"must be auto, varlen or mask, got {tr.attention!r}")
    _check(tr.logprob_chunk_tokens >= 1, "train.logprob_chunk_tokens", "must be >= 1")
    _check(tr.recompute_granularity in (None, "selective", "full"), "train.recompute_granularity",
           f"must be null, selective or full, got {tr.recompute_granularity!r}")
    if tr.recompute_granularity == "full":
        _check(tr.recompute_method in ("uniform", "block"), "train.recompute_method",
               f"full recompute needs uniform or block, got {tr.recompute_method!r}")
        _check(tr.recompute_num_layers is not None and tr.recompute_num_layers >= 1,
               "train.recompute_num_layers", "full recompute needs a layer count >= 1")
    else:
        _check(tr.recompute_method is None and tr.recompute_num_layers is None,
               "train.recompute_method", "only with train.recompute_granularity=full")
    _check(not tr.sequence_parallel or t.tp > 1, "train.sequence_parallel", "needs topology.tp > 1")
    _check(t.gpu_mem_gib >= 0, "topology.gpu_mem_gib", "must be >= 0 (0 = no memory preflight)")
    dp = t.n_trainers // (t.tp * t.pp)
    _check(tr.ppo_minibatches >= 1, "train.ppo_minibatches", "must be >= 1")
    _check(tr.batch_prompts * r.group_size >= tr.ppo_minibatches * dp, "train.ppo_minibatches",
           f"{tr.batch_prompts * r.group_size} sequences per step cannot fill {tr.ppo_minibatches} "
           f"minibatches on each of {dp} data-parallel ranks")
    _check(tr.lr > 0 and 0 <= tr.min_lr <= tr.lr, "train.min_lr", "need 0 <= min_lr <= lr and lr > 0")
    _check(tr.lr_decay_style in ("constant", "linear", "cosine"), "train.lr_decay_style",
           f"must be constant, linear or cosine, got {tr.lr_decay_style!r}")
    _check(tr.lr_warmup_steps >= 0, "train.lr_warmup_steps", "must be >= 0")
    decay = tr.lr_decay_steps if tr.lr_decay_steps is not None else tr.total_steps * tr.ppo_minibatches
    _check(decay > tr.lr_warmup_steps, "train.lr_decay_steps",
           f"must exceed lr_warmup_steps = {tr.lr_warmup_steps} (got {decay} optimizer steps)")
    _check(tr.reward_scaling > 0 and tr.reward_clip > 0, "train.reward_scaling",
           "reward_scaling and reward_clip must be > 0")
    _check(tr.reward_norm in ("group", "none"), "train.reward_norm",
           f"must be group or none, got {tr.reward_norm!r}")
    _check(tr.adv_norm in ("batch", "none"), "train.adv_norm", f"must be batch or none, got {tr.adv_norm!r}")
    _check(cfg.weights.bucket_mb >= 1, "weights.bucket_mb", "must be >= 1")
    _check(cfg.weights.mode in ("broadcast", "disk"), "weights.mode",
           f"must be broadcast or disk, got {cfg.weights.mode!r}")
    _check(cfg.weights.timeout_s > 0 and cfg.weights.join_timeout_s > 0, "weights.timeout_s",
           "timeout_s and join_timeout_s must be > 0")
    ck = cfg.checkpoint
    _check(ck.every_steps >= 0, "checkpoint.every_steps", "must be >= 0")
    _check(ck.keep >= 1, "checkpoint.keep", "must be >= 1")
    _check(ck.resume in ("auto", "never"), "checkpoint.resume", f"must be auto or never, got {ck.resume!r}")
    import signal as _signal
    for name in ck.signals:
        _check(hasattr(_signal, f"SIG{name}"), "checkpoint.signals", f"unknown signal {name!r} (e.g. USR1, TERM)")


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def check_paths(cfg: RunConfig) -> None:
    """Inputs that must exist before any rank starts work (clear message, not a deep traceback)."""
    model = Path(cfg.model.path)
    if not (model / "config.json").is_file():
        hint = " (build the tiny one with: python tools/make_tiny_model.py --out models/tiny)"
        raise ConfigError(f"config key 'model.path': no HF model at {model} (config.json missing){hint}")
    log = cfg.run_dir / "rollouts.h5"
    if log.exists() and cfg.checkpoint.resume == "never":
        raise ConfigError(f"config key 'name': run {cfg.name!r} already has {log}; choose another "
                          f"name=..., remove {cfg.run_dir}, or resume it with checkpoint.resume=auto")
    from .data.prompts import load_prompts
    for key, value in (("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path)):
        if value is None:
            continue
        if not Path(value).is_file():
            raise ConfigError(f"config key '{key}': file not found: {value}")
        try:    # every row parsed now, so a bad line stops the job before any rank starts
            rows = load_prompts(value, cfg.data.kind, cfg.data.question_key, cfg.data.answer_key)
        except ValueError as exc:
            raise ConfigError(f"config key '{key}': {exc}") from None
        if not rows:
            raise ConfigError(f"config key '{key}': {value} holds no rows")
