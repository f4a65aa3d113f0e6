"""Run configuration: a tree of dataclasses, loaded from YAML with `key=value` overrides.

Every field has a simple type so the whole tree serialises (into the rollout HDF5 attributes and
checkpoint manifests) and back. Unknown keys and wrong types are errors that name the key; they
are raised by `load()` before any rank starts work. Every numeric key has a range (`RANGES`),
checked by `validate()`. No file but the YAML is read here: the model directory, the datasets
and every other start-up check are preflight.py's. Every
refusal is one `ConfigError` line naming the key, file or row.
"""
from __future__ import annotations

import io
import logging
import math
import re
import os
import signal as _signal
import string
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Optional

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .cpus import parse_cpus


class ConfigError(ValueError):
    """A bad configuration: the message names the key and what is wrong."""


@dataclass
class ModelConfig:
    path: str = MISSING                 # HF directory: config.json, *.safetensors, tokenizer.json
    dtype: str = "float32"              # params / vLLM dtype: float32 | bfloat16 | float16


@dataclass
class DataConfig:
    # jsonl ({"question", "answer"} per line), parquet, arrow, or an HF datasets save_to_disk
    # directory (one split's); the keys below may be dotted (reward_model.ground_truth)
    train_path: str = MISSING
    eval_path: Optional[str] = None     # held-out set, same formats; evaluated at step 0 and at the end
    kind: str = "math"                  # math: {"question","answer"}; code: prompt + stdin/stdout tests
    question_key: str = "question"
    answer_key: str = "answer"
    prompt_template: str = "{question}"  # how a question becomes the prompt text
    # Chat models: the prompt text above is the user message of the tokenizer's chat template
    # (with the generation prompt), after system_prompt when set, followed by assistant_prefix
    # (a reasoning model's "<think>\n"). chat_template: a Jinja template or a file holding one,
    # for a tokenizer without its own (or to replace it). Rendered for one row at start-up.
    chat: bool = False
    system_prompt: Optional[str] = None
    chat_template: Optional[str] = None
    assistant_prefix: str = ""
    eval_limit: int = 200               # held-out problems evaluated (0 = all)
    eval_samples: int = 4               # samples per held-out problem (accuracy = mean over them)
    eval_every_steps: int = 0           # also evaluate every this many steps (0 = start and end)
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
    gpu: str = ""                       # GPU model for the step-time preflight (h100, h200, a100, b200: areal_hpc/plan/budget.py); "" = no time check
    mfu: float = 0.35                   # model-FLOPs utilisation the step-time estimate assumes (python -m areal_hpc.plan time)
    # CPU placement on each node (areal_hpc.cpus), as taskset writes a list: "0", "0-3",
    # "0,2-5". A role's ranks on one node share its cores in equal parts; each rank runs as many
    # compute threads as it has cores. Disjoint lists: the roles compute side by side (async);
    # the same list: each phase gets every core in turn (the synchronous baseline). "" or null =
    # not bound: the launcher's placement (GPU nodes: leave both so).
    trainer_cpus: Optional[str] = None
    generator_cpus: Optional[str] = None


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
    # Every sample runs to max_new_tokens: an EOS is sampled like any token and generation goes
    # on past it, so sampling stays the policy's and only the stopping rule changes. For
    # fixed-length rollouts in throughput benchmarks and tests, not for training a model.
    # Held-out evaluation always stops at EOS.
    ignore_eos: bool = False
    # Each sample draws from its own seed (train.seed, prompt id, sample index; in the rollout
    # log): its tokens do not depend on the batch around it, and a sync run repeats bit for bit.
    # Off by default: ~10% of the tiny model's generation throughput on CPU, where vLLM then
    # also runs without chunked prefill (BENCHMARKS.md, per-request seeds).
    per_request_seeds: bool = False
    max_staleness: int = 1              # η: trajectories at most η versions behind the policy
    max_concurrent_prompts: int = 16    # prompts (groups) in flight over all generators
    # A group that finishes more than η versions behind the policy (long-tailed lengths: the
    # long, hard prompts) is, by `stale_policy`: "reissue" dropped and its prompt issued again
    # first, at most `max_reissues` times, then dropped for good (counted); "drop" dropped at
    # once; "keep" trained anyway (η then bounds submission only). Dropped groups stay in the
    # rollout log, marked dropped-stale.
    stale_policy: str = "reissue"
    max_reissues: int = 2
    # Under "reissue" and "drop": a group still being generated whose oldest token is already too
    # old for the next batch is stopped where it is (its tokens would only be dropped) and its
    # generator's engine moves on; the group is logged as dropped-stale as it got, with
    # finish_reason "abort" on its unfinished samples. Off by default: on the long-tailed
    # benchmark it gave up more prompts after max_reissues (the long ones, reissued sooner and
    # doomed again) and did not shorten the run (BENCHMARKS.md).
    abort_stale: bool = False
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
    # The other way round: the controller sends each generator a heartbeat at least every
    # heartbeat_s; a generator that hears nothing from it for generator_timeout_s (before the
    # first message: weights.join_timeout_s, the trainer's start-up and checkpoint load) ends
    # itself, naming the controller, and its reaper kills its vLLM engine and reward workers.
    # Bounds every MPI collective (bcast, gather, barrier) among the trainer ranks and over the
    # whole job (start-up, the end-of-job barrier); past it the rank fails naming the operation
    # and communicator instead of hanging on a rank that is gone. A collective waits for its
    # slowest rank, so this must exceed the longest legitimate skew between ranks: a batch wait
    # (sync mode: a whole batch generated), a training step, a weight update with its
    # acknowledgements (up to weights.timeout_s), a checkpoint save or load and its CRC pass
    # (the end-of-job barrier waits for the final checkpoint; minutes for a 32B model).
    collective_timeout_s: float = 1800.0
    # vLLM tensor parallelism inside one generator rank: workers per engine (GPUs on a GPU node;
    # on CPU, this rank's allowed CPUs split among them). Each worker joins the weight group, so
    # it has pp + n_generators * engine_tp members.
    engine_tp: int = 1
    max_num_seqs: Optional[int] = None  # vLLM max_num_seqs: sequences one engine decodes at once; None = vLLM's default
    max_num_batched_tokens: Optional[int] = None  # vLLM max_num_batched_tokens: tokens per engine step (chunked prefill); None = vLLM's default


@dataclass
class RewardFnConfig:
    fn: str = MISSING                   # "package.module:function" or "path/to/file.py:function"
    weight: float = 1.0


@dataclass
class RewardConfig:
    workers: int = 1                    # reward processes beside each generator
    math_timeout_s: float = 10.0        # per call; a timeout or crash scores 0 and is counted
    # Code rewards run every test in a bubblewrap sandbox (reward/sandbox.py); a data.kind=code
    # job refuses to start where it cannot be set up. true: run model-written code WITHOUT
    # isolation (it can read answers, files, the environment, signal the job); warns at start.
    unsafe_no_sandbox: bool = False
    # The built-in math reward: how the answer is read from a completion: boxed (the last
    # \boxed{}), gsm8k ("#### N"), answer ("Answer: N"), last_number.
    extractor: str = "boxed"
    # Reward functions of your own, in place of the built-in reward of data.kind
    # (areal_hpc/reward/custom.py: fn(completion, reference, row) -> float or {"reward": ...}).
    # fn: one function; functions: several, [{fn: ..., weight: ...}], the reward their weighted
    # sum. Checked (imported) before any rank starts.
    fn: Optional[str] = None
    functions: list[RewardFnConfig] = field(default_factory=list)
    fn_timeout_s: float = 10.0          # per call of the functions; past it: 0 and counted


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
    # Off-policy correction (algo/ppo.py OffPolicy): decoupled (the above) | trust_region (plus
    # a clip against π_behav: r = π_θ/π_behav kept in 1 ± behav_clip where the advantage pushes
    # it out) | token_mask (w also dropped below behav_imp_weight_floor) | seq_mask (a sequence
    # dropped when its geometric-mean w leaves [seq_imp_weight_low, seq_imp_weight_high]) |
    # naive (PPO-clip against π_behav; no π_prox pass). behav_kl_coef: β·KL(π_behav‖π_θ), k3.
    # The default, trust_region: on the tiny task (4 minibatches, lr 3e-4, η 2 and 8, 3 seeds;
    # BENCHMARKS.md "Off-policy corrections") decoupled collapsed towards the initial accuracy
    # at η = 8 while trust_region was the best cell there and within 0.5 sd of naive PPO at η 2.
    off_policy: str = "trust_region"
    behav_clip: float = 0.2
    behav_imp_weight_floor: float = 0.5
    seq_imp_weight_low: float = 0.5
    seq_imp_weight_high: float = 2.0
    behav_kl_coef: float = 0.0
    # Collapse guards. filter_zero_variance: groups whose rewards are all equal (no learning
    # signal) are left out of the loss, counted per step (their rows are consumed, as trained).
    # overlong: samples cut at rollout.max_new_tokens are kept | filter (left out of the loss)
    # | shape (DAPO's soft penalty: reward minus up to 1 over the last overlong_buffer tokens
    # before the limit, and the cut ones -1). A step with no learning signal left never moves
    # the weights.
    filter_zero_variance: bool = False
    overlong: str = "keep"
    overlong_buffer: int = 64
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
    signal_lead_s: float = 0.0          # seconds from the signal to the time limit (Slurm --signal=B:USR1@N) for the step-time preflight; 0 = read from the batch script
    time_limit_s: float = 0.0           # the attempt's time limit in seconds for the step-time preflight; 0 = from Slurm (SLURM_JOB_END_TIME, squeue)
    # A preemption signal during a step that cannot finish (and checkpoint) before the job's end
    # stops it between minibatches: the step's start state, kept in host memory (model and
    # optimizer shard per rank), is restored and its batch kept for the rerun. False: finish it.
    mid_step_stop: bool = True
    export_chunk_mb: int = 2048         # policy/: shard size, the most a rank holds of the export


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: str = "runs"            # the run lives in <output_dir>/<name>
    # TensorBoard event files in <run_dir>/tensorboard, rebuilt from metrics.jsonl at each start
    # (storage/tensorboard.py): `tensorboard --logdir <run_dir>/tensorboard`
    tensorboard: bool = True
    # Every setting that makes a run repeat bit for bit on GPUs, behind one key (determinism.py):
    # per-request sampling seeds, vLLM's batch-invariant kernels, Megatron's deterministic mode,
    # torch's deterministic algorithms, cuBLAS's workspace and a fixed NCCL algorithm. Off by
    # default: it costs generation and step time.
    deterministic: bool = False
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
    lines = str(exc).splitlines()
    msg = lines[0] if lines else type(exc).__name__
    return f"config key '{key}': {msg}" if key else msg


def _yaml_problem(exc: yaml.YAMLError, context_line: bool = True) -> tuple[int | None, str]:
    """(1-based line, one-line description) of a PyYAML error."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None)
    context = getattr(exc, "context", None)
    if problem:
        what = problem
        cmark = getattr(exc, "context_mark", None)
        if context:
            where = (f" at line {cmark.line + 1}" if context_line and cmark is not None
                     and cmark is not mark else "")
            what += f" ({context}{where})"
    else:
        lines = str(exc).splitlines()
        what = lines[0] if lines else type(exc).__name__
    return (mark.line + 1 if mark is not None else None), " ".join(what.split())


def _read_utf8(path: Path, what: str) -> str:
    """A file's text; unreadable or non-UTF-8 is one ConfigError line naming file and line."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what} ({exc.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}: "
                          f"{exc.reason})") from None


def _read_yaml(path: Path):
    """A YAML file as an OmegaConf node; syntax errors, duplicate keys (OmegaConf's loader refuses
    them), text that is not UTF-8 and a top level that is not a mapping are one ConfigError line
    naming the file and line."""
    text = _read_utf8(path, "the config file")
    try:
        node = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as exc:
        line, what = _yaml_problem(exc)
        raise ConfigError(f"{path}:{line}: bad YAML: {what}" if line else
                          f"{path}: bad YAML: {what}") from None
    if not OmegaConf.is_dict(node):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level, "
                          f"got a {type(OmegaConf.to_container(node)).__name__}")
    return node


def _read_overrides(overrides: list[str]):
    bad = [o for o in overrides if "=" not in o or not o.split("=", 1)[0].strip()]
    if bad:
        raise ConfigError(f"override must be key=value, got: {bad[0]!r}")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except yaml.YAMLError:
        for o in overrides:     # name the one that is bad
            try:
                OmegaConf.from_dotlist([o])
            except yaml.YAMLError as exc:
                key = o.split("=", 1)[0]
                raise ConfigError(f"config key '{key}': override {o!r} is not a valid YAML "
                                  f"value: {_yaml_problem(exc, False)[1]}") from None
        raise


# Keys that configs of earlier releases may hold (a run's config.yaml, a checkpoint's): ignored
# with a warning, so that old runs still resume, export and evaluate.
REMOVED_KEYS = {"log_every": "every step is logged to metrics.jsonl"}


# Keys whose value may come from the environment (`${oc.env:SCRATCH}/runs`): paths. Anywhere else
# an environment value would be written, resolved, into config.yaml, the rollout log and every
# checkpoint (a token or password among them).
ENV_KEYS = ("output_dir", "model.path", "data.train_path", "data.eval_path", "data.chat_template",
            "reward.fn")


def _check_env_interpolations(tree, prefix: str = "") -> None:
    if isinstance(tree, dict):
        for k, v in tree.items():
            _check_env_interpolations(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            _check_env_interpolations(v, f"{prefix[:-1]}[{i}].")
    elif isinstance(tree, str) and "oc.env" in tree and prefix[:-1] not in ENV_KEYS \
            and not re.fullmatch(r"reward\.functions\[\d+\]\.fn", prefix[:-1]):
        raise ConfigError(f"config key '{prefix[:-1]}': an environment interpolation ({tree}) would "
                          "be written, resolved, into config.yaml, the rollout log and every "
                          f"checkpoint; only {', '.join(ENV_KEYS)} (and reward.functions[i].fn) "
                          "may use one")


def load(yaml_path: str | os.PathLike | None, overrides: list[str] = ()) -> RunConfig:
    """Schema ← YAML ← `key=value` overrides; validated; returns a RunConfig object."""
    schema = OmegaConf.structured(RunConfig)
    try:
        layers = [schema]
        if yaml_path is not None:
            path = Path(yaml_path)
            if not path.is_file():
                raise ConfigError(f"config file not found: {path}")
            layers.append(_read_yaml(path))
        layers.append(_read_overrides(list(overrides)))
        for layer in layers[1:]:
            for key, why in REMOVED_KEYS.items():
                if key in layer:
                    del layer[key]
                    logging.getLogger(__name__).warning(
                        "config key '%s' is no longer used (%s); ignored", key, why)
        for layer in layers[1:]:
            _check_env_interpolations(OmegaConf.to_container(layer, resolve=False))
        for layer in layers[1:]:    # OmegaConf's merge error for these names no key
            for key, value in OmegaConf.to_container(layer, resolve=False).items():
                if key in schema and OmegaConf.is_dict(schema[key]) and not isinstance(value, dict):
                    raise ConfigError(f"config key '{key}': must be a mapping of {key}.* keys, "
                                      f"got {value!r}")
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


INT_MAX = 2**31 - 1          # counts end up in int32 tensors, vLLM / torch arguments
MAX_RANKS = 65536            # ranks of one role (the launcher and Slurm bound the real number)
SEED_MAX = 2**31 - 1         # + rank offsets stays below numpy's 2**32
MAX_TIMEOUT_S = 30 * 86400.0  # torch.distributed / threading timeouts must be finite
MAX_REWARD_WORKERS = 512      # reward processes per generator: more is a typo, not a plan
MAX_REWARD_TIMEOUT_S = 3600.0  # one sample's scoring; the pool restarts a worker past it


@dataclass(frozen=True)
class Range:
    """Allowed values of one numeric key; None = unbounded on that side (floats must be finite)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def problem(self, value) -> str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return f"must be {'>' if self.lo_open else '>='} {_num(self.lo)}, got {_num(value)}" + self.why
        if self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi):
            return f"must be {'<' if self.hi_open else '<='} {_num(self.hi)}, got {_num(value)}" + self.why
        return None


def _num(x) -> str:
    if isinstance(x, int):
        return str(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else f"{x:g}"


_COUNT = Range(1, INT_MAX)
_NONNEG = Range(0, INT_MAX)
_TIMEOUT = Range(0.001, MAX_TIMEOUT_S, why=" (seconds)")
_RANKS = Range(1, MAX_RANKS)

# Every int / float key of the schema (reward.* is checked in `validate` itself); optional keys
# are checked when set. tests/config checks that no numeric key is missing here.
RANGES: dict[str, Range] = {
    "data.eval_limit": Range(0, INT_MAX, why=" (0 = all)"),
    "data.eval_samples": Range(1, 65536),
    "data.eval_every_steps": _NONNEG,
    "data.seed": Range(0, SEED_MAX),
    "topology.n_trainers": _RANKS,
    "topology.n_generators": _RANKS,
    "topology.tp": _RANKS,
    "topology.pp": _RANKS,
    "topology.gpu_mem_gib": Range(0, 65536, why=" (0 = no memory preflight)"),
    "topology.mfu": Range(0, 1, lo_open=True, why=" (model-FLOPs utilisation)"),
    "rollout.group_size": Range(1, 65536),
    "rollout.max_new_tokens": _COUNT,
    # vLLM refuses temperatures above 2 and raises those below 0.01 to 0.01, which would no
    # longer be the temperature the trainer scores the behaviour log-probs with.
    "rollout.temperature": Range(0.01, 2.0, why=" (vLLM samples at temperatures in [0.01, 2])"),
    "rollout.top_p": Range(0, 1, lo_open=True),
    "rollout.max_staleness": _NONNEG,
    "rollout.max_concurrent_prompts": _COUNT,
    "rollout.max_reissues": _NONNEG,
    "rollout.max_model_len": Range(2, INT_MAX),
    "rollout.kv_cache_gib": Range(1, 65536, why=" (or null: vLLM's default)"),
    "rollout.gpu_memory_utilization": Range(0, 1, lo_open=True),
    "rollout.heartbeat_s": _TIMEOUT,
    "rollout.generator_timeout_s": _TIMEOUT,
    "rollout.collective_timeout_s": _TIMEOUT,
    "rollout.engine_tp": _RANKS,
    "rollout.max_num_seqs": _COUNT,
    "rollout.max_num_batched_tokens": _COUNT,
    "train.total_steps": _COUNT,
    "train.batch_prompts": _COUNT,
    "train.lr": Range(0, 1, lo_open=True),
    "train.lr_warmup_steps": _NONNEG,
    "train.lr_decay_steps": _COUNT,
    "train.min_lr": Range(0, 1),
    "train.weight_decay": Range(0),
    "train.adam_beta1": Range(0, 1, hi_open=True),
    "train.adam_beta2": Range(0, 1, hi_open=True),
    "train.adam_eps": Range(0, 1, lo_open=True),
    "train.clip_grad": Range(0, why=" (0 = no clipping)"),
    "train.ppo_minibatches": _COUNT,
    "train.eps_clip": Range(0, 1, lo_open=True, hi_open=True),
    "train.eps_clip_high": Range(0, lo_open=True),
    "train.dual_clip": Range(1, lo_open=True, why=" (or null: off)"),
    "train.behav_imp_weight_cap": Range(1, why=" (or null: no cap)"),
    "train.behav_clip": Range(0, 1, lo_open=True, hi_open=True),
    "train.behav_imp_weight_floor": Range(0, 1, lo_open=True),
    "train.seq_imp_weight_low": Range(0, 1, lo_open=True),
    "train.seq_imp_weight_high": Range(1),
    "train.behav_kl_coef": Range(0, 10),
    "train.overlong_buffer": _COUNT,
    "train.reward_bias": Range(),
    "train.reward_scaling": Range(0, lo_open=True),
    "train.reward_clip": Range(0, lo_open=True),
    "train.max_tokens_per_mb": _COUNT,
    "train.logprob_chunk_tokens": _COUNT,
    "train.recompute_num_layers": _COUNT,
    "train.seed": Range(0, SEED_MAX),
    "weights.bucket_mb": Range(1, 65536),
    "weights.timeout_s": _TIMEOUT,
    "weights.join_timeout_s": _TIMEOUT,
    "checkpoint.every_steps": Range(0, INT_MAX, why=" (0 = none on a timer)"),
    "checkpoint.keep": _COUNT,
    "checkpoint.export_chunk_mb": Range(1, 65536),
    "checkpoint.signal_lead_s": Range(0, MAX_TIMEOUT_S, why=" (seconds; 0 = from the batch script)"),
    "checkpoint.time_limit_s": Range(0, MAX_TIMEOUT_S, why=" (seconds; 0 = from Slurm)"),
}

# train.off_policy's choices (algo/ppo.py OffPolicy says what each does).
OFF_POLICY_OBJECTIVES = ("decoupled", "trust_region", "token_mask", "seq_mask", "naive")

# Every key whose value is one of a few names (None: null), checked once by `check_choices`.
CHOICES: dict[str, tuple] = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "data.kind": ("math", "code"),
    "topology.device": ("cpu", "cuda"),
    "topology.trainer_backend": ("gloo", "nccl"),
    "topology.weight_backend": ("gloo", "nccl"),
    "rollout.mode": ("async", "sync"),
    "rollout.stale_policy": ("reissue", "drop", "keep"),
    "train.prox": ("recompute", "loglinear", "behaviour"),
    "train.off_policy": OFF_POLICY_OBJECTIVES,
    "train.overlong": ("keep", "filter", "shape"),
    "train.attention": ("auto", "varlen", "mask"),
    "train.recompute_granularity": (None, "selective", "full"),
    "train.lr_decay_style": ("constant", "linear", "cosine"),
    "train.reward_norm": ("group", "none"),
    "train.adv_norm": ("batch", "none"),
    "weights.mode": ("broadcast", "disk"),
    "checkpoint.resume": ("auto", "never"),
}


def _names(choices: tuple) -> str:
    """("a", "b", None) -> "a, b or null"."""
    words = ["null" if c is None else str(c) for c in choices]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"

# Preemption signals must be catchable (KILL, STOP are not), not synchronous faults (a handler
# that returns re-runs the faulting instruction) and not CHLD (every child process exit sends it).
UNUSABLE_SIGNALS = ("KILL", "STOP", "SEGV", "BUS", "FPE", "ILL", "CHLD")


def _get(cfg: RunConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def check_ranges(cfg: RunConfig) -> None:
    for key, rng in RANGES.items():
        value = _get(cfg, key)
        if value is None:
            continue
        problem = rng.problem(value)
        if problem:
            raise ConfigError(f"config key '{key}': {problem}")


def check_choices(cfg: RunConfig) -> None:
    for key, choices in CHOICES.items():
        value = _get(cfg, key)
        _check(value in choices, key, f"must be {_names(choices)}, got {value!r}")


def check_signals(names: list) -> None:
    for name in names:
        _check(isinstance(name, str) and f"SIG{name}" in _signal.Signals.__members__,
               "checkpoint.signals", f"unknown signal {name!r} (names without SIG, e.g. USR1, TERM)")
        why = "cannot be caught" if name in ("KILL", "STOP") else "not a notification signal"
        _check(name not in UNUSABLE_SIGNALS, "checkpoint.signals",
               f"SIG{name} cannot announce a preemption ({why}); use e.g. USR1 or TERM")


def check_template(template: str, kind: str, key: str = "data.prompt_template") -> None:
    """The fields of `template` (str.format syntax) must be ones the data kind fills in."""
    from .data.prompts import TEMPLATE_FIELDS
    fields = TEMPLATE_FIELDS.get(kind, ())
    names = ", ".join("{" + f + "}" for f in fields)
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:   # "Single '}' encountered", "expected '}' before end of string"
        raise ConfigError(f"config key '{key}': {exc} in {template!r} (write literal braces as "
                          f"{{{{ and }}}})") from None
    used = set()
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        _check(name in fields, key,
               f"unknown field {{{name}}} in {template!r}: data.kind={kind} fills in {names} "
               f"(write literal braces as {{{{ and }}}})" if name else
               f"positional field {{}} in {template!r}: name it, one of {names}")
        _check(conversion in (None, "s", "r", "a"), key, f"bad conversion !{conversion} in {{{name}}}")
        _check("{" not in (spec or ""), key, f"nested field in the format spec of {{{name}}}")
        try:
            format("x", spec or "")
        except ValueError as exc:
            raise ConfigError(f"config key '{key}': bad format spec {{{name}:{spec}}}: {exc}") from None
        used.add(name)
    _check(bool(used), key, f"{template!r} has no field: every prompt would be the same text "
           f"(use {names})")


def validate(cfg: RunConfig) -> None:
    """Semantic checks that types alone cannot express."""
    t, r, tr = cfg.topology, cfg.rollout, cfg.train
    check_ranges(cfg)       # first: the checks below may divide by these
    check_choices(cfg)
    _check(t.n_trainers % (t.tp * t.pp) == 0, "topology.n_trainers",
           f"{t.n_trainers} trainer ranks are not a multiple of tp*pp = {t.tp * t.pp}")
    for key in ("trainer_cpus", "generator_cpus"):
        try:
            parse_cpus(getattr(t, key), f"topology.{key}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    _check(r.max_new_tokens < r.max_model_len, "rollout.max_new_tokens",
           f"{r.max_new_tokens} leaves no room for a prompt in rollout.max_model_len = "
           f"{r.max_model_len}")
    name = PurePosixPath(cfg.name)
    _check(bool(cfg.name) and not name.is_absolute() and ".." not in name.parts
           and "\0" not in cfg.name, "name",
           f"must be a folder name inside output_dir (not absolute, no '..'), got {cfg.name!r}")
    _check(r.generator_timeout_s > 2 * r.heartbeat_s, "rollout.generator_timeout_s",
           f"must exceed two heartbeats (2 * rollout.heartbeat_s = {2 * r.heartbeat_s})")
    _check(1 <= cfg.reward.workers <= MAX_REWARD_WORKERS, "reward.workers",
           f"must be in [1, {MAX_REWARD_WORKERS}] (processes per generator), got {cfg.reward.workers}")
    for key in ("math_timeout_s", "fn_timeout_s"):
        value = getattr(cfg.reward, key)
        _check(math.isfinite(value) and 0 < value <= MAX_REWARD_TIMEOUT_S, f"reward.{key}",
               f"must be in (0, {MAX_REWARD_TIMEOUT_S:g}] seconds (one sample's scoring), got {value}")
    from .data.answers import EXTRACTORS
    _check(cfg.reward.extractor in EXTRACTORS, "reward.extractor",
           f"must be one of {', '.join(EXTRACTORS)}, got {cfg.reward.extractor!r}")
    from .reward.custom import RewardFnError, specs_of
    try:
        specs_of(cfg)
    except RewardFnError as exc:
        raise ConfigError(str(exc)) from None
    _check(tr.max_tokens_per_mb >= r.max_model_len, "train.max_tokens_per_mb",
           f"must hold one whole sequence: >= rollout.max_model_len = {r.max_model_len}")
    _check(tr.overlong != "shape" or tr.overlong_buffer < r.max_new_tokens, "train.overlong_buffer",
           f"must be below rollout.max_new_tokens = {r.max_new_tokens} (the ramp ends there)")
    if tr.recompute_granularity == "full":
        _check(tr.recompute_method in ("uniform", "block"), "train.recompute_method",
               f"full recompute needs uniform or block, got {tr.recompute_method!r}")
        _check(tr.recompute_num_layers is not None and tr.recompute_num_layers >= 1,
               "train.recompute_num_layers", "full recompute needs a layer count >= 1")
    else:
        _check(tr.recompute_method is None and tr.recompute_num_layers is None,
               "train.recompute_method", "only with train.recompute_granularity=full")
    _check(not tr.sequence_parallel or t.tp > 1, "train.sequence_parallel", "needs topology.tp > 1")
    dp = t.n_trainers // (t.tp * t.pp)
    _check(tr.batch_prompts * r.group_size >= tr.ppo_minibatches * dp, "train.ppo_minibatches",
           f"{tr.batch_prompts * r.group_size} sequences per step cannot fill {tr.ppo_minibatches} "
           f"minibatches on each of {dp} data-parallel ranks")
    _check(tr.min_lr <= tr.lr, "train.min_lr", f"must be <= train.lr = {tr.lr}, got {tr.min_lr}")
    decay = tr.lr_decay_steps if tr.lr_decay_steps is not None else tr.total_steps * tr.ppo_minibatches
    _check(decay > tr.lr_warmup_steps, "train.lr_decay_steps",
           f"must exceed lr_warmup_steps = {tr.lr_warmup_steps} (got {decay} optimizer steps)")
    check_signals(cfg.checkpoint.signals)
    check_template(cfg.data.prompt_template, cfg.data.kind)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
