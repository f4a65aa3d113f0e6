"""The configuration schema: one dataclass per section, each key with its default and what it
means (areal_hpc/config/__init__.py loads it; rules.py checks its values)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from omegaconf import MISSING


# The enumerations: a key whose value is one of a few names is typed with one of these, and the
# schema (OmegaConf's merge in `load`) refuses any other value, naming the key and the choices.
Dtype = Literal["float32", "bfloat16", "float16"]
DataKind = Literal["math", "code"]
Device = Literal["cpu", "cuda"]
Backend = Literal["gloo", "nccl"]
RolloutMode = Literal["async", "sync"]
StalePolicy = Literal["reissue", "drop", "keep"]
Prox = Literal["recompute", "loglinear", "behaviour"]
OffPolicy = Literal["decoupled", "trust_region", "token_mask", "seq_mask", "naive"]  # algo/ppo.py
Overlong = Literal["keep", "filter", "shape"]
Attention = Literal["auto", "varlen", "mask"]
Recompute = Literal["selective", "full"]
RecomputeMethod = Literal["uniform", "block"]
DecayStyle = Literal["constant", "linear", "cosine"]
RewardNorm = Literal["group", "none"]
AdvNorm = Literal["batch", "none"]
WeightMode = Literal["broadcast", "disk"]
Resume = Literal["auto", "never"]
OnError = Literal["drop_episode", "drop_group", "score_zero"]



class ConfigError(ValueError):
    """A bad configuration: the message names the key and what is wrong."""


@dataclass
class ModelConfig:
    path: str = MISSING                 # HF directory: config.json, *.safetensors, tokenizer.json
    dtype: Dtype = "float32"            # params / vLLM dtype


@dataclass
class DataConfig:
    # jsonl ({"question", "answer"} per line), parquet, arrow, or an HF datasets save_to_disk
    # directory (one split's); the keys below may be dotted (reward_model.ground_truth)
    train_path: str = MISSING
    eval_path: Optional[str] = None     # held-out set, same formats; evaluated at step 0 and at the end
    kind: DataKind = "math"             # math: {"question","answer"}; code: prompt + stdin/stdout tests
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
    trainer_backend: Backend = "gloo"
    weight_backend: Backend = "gloo"
    device: Device = "cpu"
    # Memory of one GPU, for the preflight (`python -m areal_hpc.plan memory`): every launcher
    # refuses a config whose per-GPU estimate exceeds it before any rank starts. 0 = no check.
    gpu_mem_gib: float = 80.0
    # Memory (RAM) of one node, for the host-memory preflight (`python -m areal_hpc.plan memory`
    # prints each node's terms and the `#SBATCH --mem` they need: areal_hpc/plan/host_memory.py):
    # every launcher refuses a config whose trainer or generator node needs more before any rank
    # starts. 0 = unknown, not checked.
    host_mem_gib: float = 0.0
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
    mode: RolloutMode = "async"
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
    stale_policy: StalePolicy = "reissue"
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
    generator_timeout_s: float = 1200.0
    # The other way round: the controller sends each generator a heartbeat at least every
    # heartbeat_s; a generator that hears nothing from it for generator_timeout_s (before the
    # first message: from trainer rank 0's beacon, or weights.join_timeout_s without a beat)
    # ends itself, naming the controller, and its reaper kills its vLLM engine and reward
    # workers. The same silence bounds every rank's wait for trainer rank 0's work.
    # Bounds every MPI collective (bcast, gather, barrier) among the trainer ranks and over the
    # whole job (start-up); past it the rank fails naming the operation and communicator instead
    # of hanging on a rank that is gone. It must exceed the longest skew between live peers: a
    # checkpoint save or load with its CRC pass, a weight update with its acknowledgements (up
    # to weights.timeout_s). Waits for trainer rank 0's own work (the first batch after the
    # initial evaluation, a batch's generation, the final evaluation before the last
    # checkpoint, the end-of-job barrier) are not bounded by it but by rank 0's liveness: its
    # beacon, silent for generator_timeout_s = gone (transport/beacon.py). `python -m
    # areal_hpc.plan time CONFIG` lists every wait beside its estimated work; the launchers'
    # preflight refuses a fixed bound shorter than its estimate.
    collective_timeout_s: float = 1800.0
    # A generator's vLLM engine that dies (its EngineCore or a TP worker gone, an engine error)
    # or stalls (a step, or a weight load, with no result for engine_stall_s) is killed
    # and started again in its rank with the current weights (weights.mode disk: the published
    # files; broadcast: sent again over the weight group re-formed with the new engine), its
    # in-flight samples continued from their tokens. More than
    # engine_restarts faults of one generator within engine_restart_window_s end the job, one
    # line naming it and the causes (0: the first fault ends it). Keep engine_stall_s well
    # above the longest single engine step and weight load. Under broadcast a generator's receive
    # is bounded by weights.timeout_s + engine_stall_s, and generator_timeout_s must exceed that
    # by 30 s (config/rules.py: rank 0 gives up on a silent generator there).
    engine_restarts: int = 3
    engine_restart_window_s: float = 3600.0
    engine_stall_s: float = 300.0
    # Before a restarted engine starts, its rank waits (at most this long) until each of its
    # GPUs has gpu_memory_utilization of its memory free again: the driver frees a killed
    # engine's memory as it tears its processes down, and vLLM refuses to start below its
    # budget. Past it the job ends naming the device and the processes holding its memory.
    # A restart's memory wait and engine start must fit in weights.join_timeout_s (rank 0's
    # allowance for a generator whose engine is down; `plan time` checks it).
    engine_memory_wait_s: float = 300.0
    # A rank alive but stuck (areal_hpc/stuck.py): its main thread without progress for this long
    # (a micro-batch, an engine step, a polling wait on a peer are progress; a call with a bound
    # of its own, a join, a weight update, a checkpoint, an engine restart, gets that bound on top)
    # writes its threads' stacks and every other rank's into the attempt's log, naming it, and
    # ends the attempt (exit 4; the batch script requeues it). 0 = off. `plan time` lists it.
    progress_timeout_s: float = 900.0
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
    lr_decay_style: DecayStyle = "constant"
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
    prox: Prox = "recompute"
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
    # The default, trust_region (BENCHMARKS.md "Paired, on the current code"): on the tiny task
    # at η = 2 and 8 decoupled is behind it with 95% intervals that exclude 0; naive PPO is not
    # told apart from it (intervals contain 0, trust_region ahead on every point estimate).
    off_policy: OffPolicy = "trust_region"
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
    overlong: Overlong = "keep"
    overlong_buffer: int = 64
    # Advantages: r <- clip((r + reward_bias) * reward_scaling, ±reward_clip); reward_norm
    # "group" (GRPO z-score per prompt) | "none"; adv_norm "batch" (z-score over all output
    # tokens of the batch) | "none".
    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: float = 20.0
    reward_norm: RewardNorm = "group"
    adv_norm: AdvNorm = "none"
    max_tokens_per_mb: int = 4096       # tokens (prompt + output) per packed micro-batch
    # Core attention over a packed micro-batch. varlen: each sequence attends only within itself
    # (cumulative sequence lengths; cost sum(len_i^2), memory linear in the pack): TransformerEngine
    # THD where installed, else PyTorch's fused kernels. mask: one dense [S, S] block-diagonal
    # mask through Megatron's local attention (the exact reference; cost S^2). auto = varlen.
    attention: Attention = "auto"
    # Log-probs are computed from the last hidden states in chunks of this many tokens, the
    # output projection and the [chunk, vocab / tp] float32 softmax recomputed in backward, so
    # no [tokens, vocab] tensor exists.
    logprob_chunk_tokens: int = 2048
    # Megatron activation recompute: granularity null | selective (core attention) | full
    # (whole layers); with full, method uniform | block and num_layers (per chunk / per stage).
    recompute_granularity: Optional[Recompute] = None
    recompute_method: Optional[RecomputeMethod] = None
    recompute_num_layers: Optional[int] = None
    sequence_parallel: bool = False     # Megatron sequence parallelism (needs topology.tp > 1)
    # Megatron's distributed optimizer: Adam state and fp32 main weights sharded over the
    # data-parallel ranks (ZeRO-1).
    distributed_optimizer: bool = False
    seed: int = 1

    @property
    def prox_pass_share(self) -> float:
        """The share of a step's sequences that a forward pass for π_prox covers (the step-time
        and memory planners ask here; `Actor.train_share` makes the pass): (k - 1) / k for
        prox recompute with k minibatches. The first minibatch's training forward runs with
        π_prox's weights (the step's initial ones), so its log-probs, detached, are π_prox's and
        need no pass; with one minibatch there is none. 0 for loglinear, behaviour and naive PPO."""
        if self.prox != "recompute" or self.off_policy == "naive":
            return 0.0
        return (self.ppo_minibatches - 1) / self.ppo_minibatches


@dataclass
class WeightSyncConfig:
    # broadcast: buckets over the weight group (NCCL on GPU, gloo on CPU) straight into the
    # running engines. disk: versioned safetensors directories under `disk_dir`, loaded by the
    # generators, for clusters where generator nodes cannot join a NCCL group with the trainers.
    mode: WeightMode = "broadcast"
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
    resume: Resume = "auto"
    # Signals that ask the job to checkpoint at the next step boundary and exit with code 3
    # (EXIT_PREEMPTED) for the batch script to requeue. Slurm: --signal=B:USR1@<seconds>.
    signals: list = field(default_factory=lambda: ["USR1", "TERM"])
    signal_lead_s: float = 0.0          # seconds from the signal to the time limit (Slurm --signal=B:USR1@N) for the step-time preflight; 0 = read from the batch script
    time_limit_s: float = 0.0           # the attempt's time limit in seconds for the step-time preflight; 0 = from Slurm (SLURM_JOB_END_TIME, squeue)
    # A preemption signal during a step that cannot finish (and checkpoint) before the job's end
    # stops it between minibatches: the step's start state, kept in host memory (model and
    # optimizer shard per rank), is restored and its batch kept for the rerun. False: finish it.
    mid_step_stop: bool = True
    # The periodic checkpoints' shards written by a writer process (Megatron's asynchronous
    # dist-checkpoint save) while the next steps train: the step stalls only to stage them; the
    # checkpoint is complete (manifest written) at the first step boundary or mid-step decision
    # point after the write ended on every rank. The final and preemption checkpoints are
    # complete before the job goes on.
    async_save: bool = False
    # The most host memory (GiB) a trainer rank may hold for an asynchronous save: what it writes
    # (its model shard on data-parallel rank 0, its optimizer shard; 14 B per parameter with
    # bf16 and Adam) is staged there until written, beside the next step; a save above it is
    # synchronous. 0 = no bound.
    async_max_host_gb: float = 32.0
    export_chunk_mb: int = 2048         # policy/: shard size, the most a rank holds of the export
    # Free space (storage/disk.py): at the launch and before each save the run directory's file
    # system must hold what is about to be written (the checkpoints written before the oldest is
    # deleted, keep + 1 at most; the rollout log's growth until the next save) plus this many GiB;
    # else the start, or the save before its first byte, is refused with one line (exit 2, the
    # newest checkpoint kept). null: no check.
    disk_margin_gb: Optional[float] = 1.0


@dataclass
class EnvConfig:
    """Multi-turn episodes (areal_hpc/env/, docs/environments.md): which environment, and the
    bounds of its episodes. fn unset: single-turn (one prompt, one completion)."""
    fn: Optional[str] = None            # "path/to/file.py:Class", "package.module:Class", or a built-in
    args: dict[str, Any] = field(default_factory=dict)   # keyword arguments of the class
    max_turns: int = 4                  # model turns per episode; an episode not done by then is cut
    # prompt + turns + observations; past it the episode is cut (None: rollout.max_model_len)
    max_episode_tokens: Optional[int] = None
    # what ends a model's turn: strings (a closing code fence, "</calc>") or token ids
    turn_stop: list[Any] = field(default_factory=list)
    observation_template: str = "{observation}"   # how an observation's text is wrapped
    call_timeout_s: float = 10.0        # per reset or step call; past it: the episode's error
    start_timeout_s: float = 60.0       # starting the environment's process (its imports)
    memory_mb: int = 4096               # address space of the environment's process
    output_bytes: int = 1 << 20         # what the environment's process may print, in all
    max_episodes: int = 32              # episodes running at once on a generator rank (a process
    #                                     each); more wait for a place
    # An episode its environment failed (raised, hung, died, answered garbage) or discarded
    # (Step.discard) is not the model's doing: drop_episode trains the group's other episodes,
    # with its baseline (GRPO's mean and std) over them only; drop_group trains none of the
    # group; score_zero trains it as an outcome with reward 0 (the model learns to avoid what
    # preceded a tool's failure).
    on_error: OnError = "drop_episode"
    # Native tool calling (docs/environments.md): the tools as JSON schemas (OpenAI's function
    # format; a built-in environment declares its own), rendered into the first prompt by the
    # tokenizer's chat template (data.chat); each model turn parsed by the vLLM tool parser
    # named here (hermes for Qwen2.5), the calls answered by the environment's `call` and their
    # results appended as the template's tool messages. None: turns go to `step` as text.
    tool_parser: Optional[str] = None
    tools: list[Any] = field(default_factory=list)
    reasoning_parser: Optional[str] = None  # vLLM's: calls inside the reasoning are not calls


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
    env: EnvConfig = field(default_factory=EnvConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name
