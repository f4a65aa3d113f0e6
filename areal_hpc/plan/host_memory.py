"""Host memory (RAM) per node of a GPU run, the `#SBATCH --mem` the recipes ask for, and the
preflight that refuses a config whose node cannot hold it.

    python -m areal_hpc.plan memory CONFIG.yaml [key=value ...]

prints, after the per-GPU tables (plan/memory.py), one table per role: each term summed over the
ranks of a node, in GiB, pinned (page-locked: never swapped, never reclaimed) or pageable, the
node's total with HEADROOM, and the `--mem` value of the role's het component (the largest
node's total, whole GiB up). `check_host_fits(cfg)` raises one line naming the node's largest
term and the keys that shrink it when a node's total exceeds `topology.host_mem_gib`; the
launchers call it beside `check_fits`. Skipped for `topology.device=cpu` (there the model itself
lives in host memory: the per-GPU tables are the host's) and for `topology.host_mem_gib=0`.

Nodes: GPUS_PER_NODE GPUs each, filled whole as launch/submit.py `hetjob_layout` packs them (and
the slurm/ recipes are written): trainer ranks in order, one GPU each; generator ranks of
`rollout.engine_tp` GPUs each. A trainer rank's place is Megatron's default order (tp fastest,
then dp, then pp: megatron.core.parallel_state.initialize_model_parallel, order "tp-cp-ep-dp-pp",
as train/megatron_model.py calls it), so a node holds whole TP groups of one or more stages.

Trainer rank, per rank (its stage's parameter and optimizer byte counts are the GPU model's
"params" and "optimizer state" terms, `memory.trainer_estimates`)
-------------------------------------------------------------------------------------------
- step snapshot (pinned; with checkpoint.mid_step_stop): train/step_snapshot.py keeps a host copy
  of the rank's model shard and of its optimizer's main parameters and state where they are not
  the model's, in buffers allocated at the first step and kept for the run: "params" +
  "optimizer state" (bf16 + Adam: 2 + 12 / dp-shards bytes a parameter).
- checkpoint staging (pinned): Megatron's dist-checkpoint save copies what the rank writes to host
  memory before writing it (FileSystemWriterAsync.preload_tensors, `.to("cpu",
  non_blocking=True)`: pinned), for a synchronous save as for an asynchronous one
  (checkpoint.async_max_host_gb only chooses which; train/checkpoint.py `staged_bytes`). What a
  rank writes: its model shard on data-parallel rank 0 (the replicas write nothing), its
  optimizer shard (every rank with the distributed optimizer, else data-parallel rank 0). torch
  caches freed pinned blocks for reuse (its CUDA host allocator), so after the first checkpoint
  this stays resident beside the snapshot. Every run writes at least its final checkpoint.
- host buckets (weight senders: dp = tp = 0 of each stage, pageable): the final HF export's chunk
  (checkpoint.export_chunk_mb) plus one HF tensor (train/hf_export.py), or with weights.mode=disk
  a bucket (weights.bucket_mb) plus one tensor (transport/weights/disk.py), whichever is larger;
  broadcast goes device to device (none).
- step share (pageable): its data-parallel share of B x group_size samples at full length, as
  received (the pickled message and the arrays unpickled from it: 2 x the sample's bytes) plus the
  per-output-token arrays `Actor.train_share` builds (advantages float32, loss mask float64).
  A sample's bytes (`sample_bytes`): int32 prompt tokens, and per output token an int32 token,
  a float32 behaviour log-prob and an int32 version (rollout/vllm_engine.FinishedSample), at
  rollout.max_model_len tokens of which min(max_new_tokens, max_model_len - 1) are output.
- controller (trainer rank 0 only, pageable): the groups buffered and the batch in training,
  at most (η + 1) x B groups (the staleness window, rollout/staleness.StalenessManager; η = 0
  under rollout.mode=sync), plus the batch once more as the shares pickled for sending; and the
  rollout log: h5py's chunk caches and one group concatenated for its append (HDF5_CACHE_MIB +
  one group).
- process baseline (pageable): TRAINER_PROCESS_GIB + CUDA_HOST_GIB.

Generator rank, per rank (one vLLM engine of rollout.engine_tp GPUs)
--------------------------------------------------------------------
- process baseline (pageable): the rank's process (GENERATOR_PROCESS_GIB: Python, MPI, the
  tokenizer, vLLM's client side), vLLM's engine-core process when engine_tp > 1 (with one GPU
  the worker runs in it: rollout/vllm_engine.py) and each worker (VLLM_PROCESS_GIB +
  CUDA_HOST_GIB each).
- samples in flight (pageable): min(max_concurrent_prompts, (η + 1) x B) x group_size /
  n_generators samples at rollout.max_model_len tokens, INFLIGHT_TOKEN_BYTES a token.
- vLLM host buffers (pageable): each worker's CPU token table of its input batch, max_num_seqs x
  max_model_len int32 (vLLM V1's InputBatch; memory.vllm_limits).
- vLLM swap / CPU offload: none. VLLMEngine passes neither swap_space nor cpu_offload_gb nor a
  KV offload to `EngineArgs`, and vLLM V1 recomputes preempted sequences instead of swapping.
- weight load (weights.mode=disk, pageable): each worker reads one tensor at a time from the
  memory-mapped safetensors files (vllm_ext `load_weights_from_path`): the largest HF tensor.
  Broadcast receives into device buffers (none on the host).
- reward workers (pageable): reward.workers processes, REWARD_WORKER_GIB each, plus the code
  sandbox's bound (CODE_TEST_MIB: reward/pool.py's code_memory_mb) for data.kind=code.
- environment processes (with env.fn, pageable): env.max_episodes x env.memory_mb, their
  address-space limit (an upper bound).

Constants (ESTIMATES, stated here: this project's test box has no GPU to measure them on)
------------------------------------------------------------------------------------------
GPUS_PER_NODE = 8          the recipes' nodes (slurm/areal_*.sh: --gpus-per-node=8)
TRAINER_PROCESS_GIB = 3.0  Python, torch, Megatron-core, mpi4py, h5py, transformers: resident
                           library pages and heap (torch's CPU build alone: 0.3 GiB after import,
                           measured here), on the high side
CUDA_HOST_GIB = 2.0        host side of one CUDA process: driver and runtime, the resident pages of
                           libtorch_cuda, cuBLAS, cuDNN and NCCL, the context's host allocations,
                           NCCL's host-side proxy buffers for inter-node peers
GENERATOR_PROCESS_GIB = 2.0, VLLM_PROCESS_GIB = 1.5  a vLLM process beyond the model's device
                           terms: 1.4 GiB for the engine core and its worker on CPU, measured
                           (BENCHMARKS.md, "A Qwen2.5-0.5B-shaped model"), rounded up per process
INFLIGHT_TOKEN_BYTES = 256 a token of a sample in flight: the Python lists of its tokens,
                           log-probs and versions in VLLMEngine, vLLM's request and output
                           state (int and float objects, 24-36 B each, several copies)
REWARD_WORKER_GIB = 0.5    one reward process (Python, sympy / math_verify)
HEADROOM = 0.10            on a node's sum: allocator slack, what the terms leave out
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import ConfigError, RunConfig
from .memory import DTYPE_BYTES, GiB, MiB, Arch, Term, fmt_num, read_arch, trainer_estimates, vllm_limits

GPUS_PER_NODE = 8
TRAINER_PROCESS_GIB = 3.0
CUDA_HOST_GIB = 2.0
GENERATOR_PROCESS_GIB = 2.0
VLLM_PROCESS_GIB = 1.5
INFLIGHT_TOKEN_BYTES = 256
REWARD_WORKER_GIB = 0.5
CODE_TEST_MIB = 512
HDF5_CACHE_MIB = 32
HEADROOM = 0.10

TRAINER, GENERATOR = "trainer", "generator"


@dataclass
class HostTerm(Term):
    pinned: bool = False


@dataclass
class NodeEstimate:
    """One node's terms, each summed over its ranks."""
    label: str                      # "trainer node 0 (ranks 0-7)"
    role: str                       # TRAINER or GENERATOR
    ranks: int
    terms: list[HostTerm] = field(default_factory=list)

    def add(self, term: HostTerm) -> None:
        """Add `term` to the node's term of that name (a new row the first time)."""
        for t in self.terms:
            if t.name == term.name:
                t.bytes += term.bytes
                return
        self.terms.append(HostTerm(term.name, term.bytes, term.shrink, pinned=term.pinned))

    def term(self, name: str) -> HostTerm:
        return next(t for t in self.terms if t.name == name)

    @property
    def pinned(self) -> float:
        return sum(t.bytes for t in self.terms if t.pinned)

    @property
    def ranks_bytes(self) -> float:
        return sum(t.bytes for t in self.terms)

    @property
    def headroom(self) -> float:
        return HEADROOM * self.ranks_bytes

    @property
    def total(self) -> float:
        return self.ranks_bytes + self.headroom

    def largest(self) -> HostTerm:
        return max(self.terms, key=lambda t: t.bytes)


@dataclass
class HostPlan:
    cfg: RunConfig
    host_mem_gib: float | None      # None: not compared
    trainers_per_node: int
    generators_per_node: int
    trainer_nodes: list[NodeEstimate]
    generator_node: NodeEstimate    # every generator node holds the same

    def nodes(self, role: str) -> list[NodeEstimate]:
        return self.trainer_nodes if role == TRAINER else [self.generator_node]

    def worst(self, role: str) -> NodeEstimate:
        return max(self.nodes(role), key=lambda n: n.total)

    def mem_gib(self, role: str) -> int:
        """The role's het component's `#SBATCH --mem` in GiB: its largest node's total, up."""
        return math.ceil(self.worst(role).total / GiB)

    def error(self) -> str | None:
        """One line for the node most over topology.host_mem_gib, or None."""
        if not self.host_mem_gib:
            return None
        mem = self.host_mem_gib * GiB
        over = [n for n in (self.worst(TRAINER), self.worst(GENERATOR)) if n.total > mem]
        if not over:
            return None
        node = max(over, key=lambda n: n.total)
        big = node.largest()
        hint = f" (shrink with {', '.join(big.shrink)})" if big.shrink else ""
        return (f"{node.label} needs {node.total / GiB:.1f} GiB of host memory, over "
                f"topology.host_mem_gib={fmt_num(self.host_mem_gib)}: {big.name} "
                f"{big.bytes / GiB:.1f} GiB{hint}")


def megatron_place(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of trainer rank `rank` in Megatron's default order."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def sample_bytes(cfg: RunConfig) -> int:
    """Host bytes of one sample at full length (see the module docstring)."""
    r = cfg.rollout
    out = min(r.max_new_tokens, r.max_model_len - 1)
    return 4 * (r.max_model_len - out) + 12 * out


def window_groups(cfg: RunConfig) -> int:
    """Groups the staleness window lets exist between submission and training: (η + 1) x B."""
    eta = 0 if cfg.rollout.mode == "sync" else cfg.rollout.max_staleness
    return (eta + 1) * cfg.train.batch_prompts


def largest_hf_tensor(arch: Arch) -> int:
    """Elements of the model's largest HF tensor (the embedding / output layer, or an MLP one)."""
    return max(arch.vocab, arch.ffn) * arch.hidden


def _rank_range(first: int, n: int) -> str:
    return f"rank {first}" if n == 1 else f"ranks {first}-{first + n - 1}"


def trainer_rank_terms(cfg: RunConfig, arch: Arch, stages: list, rank: int) -> list[HostTerm]:
    """The host terms of trainer rank `rank` (`stages`: memory.trainer_estimates of cfg)."""
    t, r, tr, ck = cfg.topology, cfg.rollout, cfg.train, cfg.checkpoint
    dp = t.n_trainers // (t.tp * t.pp)
    tp_rank, dp_rank, pp_rank = megatron_place(rank, t.tp, t.pp, dp)
    on_cuda = t.device == "cuda"
    b = DTYPE_BYTES[cfg.model.dtype]
    stage = stages[pp_rank]
    params, optim = stage.term("params").bytes, stage.term("optimizer state").bytes
    shard_keys = ("topology.tp", "topology.pp") + (
        () if tr.distributed_optimizer else ("train.distributed_optimizer=true",))
    snapshot = params + optim if ck.mid_step_stop else 0.0
    staged = (params if dp_rank == 0 else 0.0) + (optim if tr.distributed_optimizer or dp_rank == 0 else 0.0)
    buckets = 0.0
    if dp_rank == 0 and tp_rank == 0:
        tensor = largest_hf_tensor(arch) * b
        buckets = max(ck.export_chunk_mb * MiB + tensor,
                      cfg.weights.bucket_mb * MiB + tensor if cfg.weights.mode == "disk" else 0.0)
    out = min(r.max_new_tokens, r.max_model_len - 1)
    seqs = math.ceil(tr.batch_prompts * r.group_size / dp)
    batch_keys = ("train.batch_prompts", "rollout.group_size", "rollout.max_model_len")
    group = r.group_size * sample_bytes(cfg)
    controller = ((window_groups(cfg) + tr.batch_prompts) * group + HDF5_CACHE_MIB * MiB + group
                  if rank == 0 else 0.0)
    return [
        HostTerm("step snapshot", snapshot, ("checkpoint.mid_step_stop=false", *shard_keys), pinned=on_cuda),
        HostTerm("checkpoint staging", staged, shard_keys, pinned=on_cuda),
        HostTerm("host buckets (export, disk weights)", buckets,
                 ("checkpoint.export_chunk_mb", "weights.bucket_mb")),
        HostTerm("step share", seqs * (2 * sample_bytes(cfg) + 12 * out), (*batch_keys, "topology.n_trainers")),
        HostTerm("controller + rollout log", controller, ("rollout.max_staleness", *batch_keys)),
        HostTerm("process baseline", (TRAINER_PROCESS_GIB + (CUDA_HOST_GIB if on_cuda else 0.0)) * GiB),
    ]


def generator_rank_terms(cfg: RunConfig, arch: Arch) -> list[HostTerm]:
    """The host terms of one generator rank (every one holds the same)."""
    t, r, w = cfg.topology, cfg.rollout, cfg.reward
    etp = r.engine_tp
    on_cuda = t.device == "cuda"
    b = DTYPE_BYTES[cfg.model.dtype]
    worker = VLLM_PROCESS_GIB + (CUDA_HOST_GIB if on_cuda else 0.0)
    baseline = GENERATOR_PROCESS_GIB + (VLLM_PROCESS_GIB if etp > 1 else 0.0) + etp * worker
    in_flight = math.ceil(min(r.max_concurrent_prompts, window_groups(cfg)) * r.group_size / t.n_generators)
    max_seqs, _ = vllm_limits(cfg)
    rewards = w.workers * (REWARD_WORKER_GIB * GiB + (CODE_TEST_MIB * MiB if cfg.data.kind == "code" else 0.0))
    envs = cfg.env.max_episodes * cfg.env.memory_mb * MiB if cfg.env.fn else 0.0
    return [
        HostTerm("samples in flight", in_flight * r.max_model_len * INFLIGHT_TOKEN_BYTES,
                 ("rollout.max_concurrent_prompts", "rollout.max_model_len", "topology.n_generators")),
        HostTerm("vLLM host buffers", etp * max_seqs * r.max_model_len * 4,
                 ("rollout.max_num_seqs", "rollout.max_model_len")),
        HostTerm("vLLM swap / CPU offload", 0.0),
        HostTerm("weight load (disk mode)",
                 etp * largest_hf_tensor(arch) * b if cfg.weights.mode == "disk" else 0.0,
                 ("weights.mode=broadcast",)),
        HostTerm("reward workers", rewards, ("reward.workers",)),
        HostTerm("environment processes", envs, ("env.max_episodes", "env.memory_mb")),
        HostTerm("process baseline", baseline * GiB),
    ]


def host_estimate(cfg: RunConfig, trainers_per_node: int | None = None,
                  generators_per_node: int | None = None, host_mem_gib: float | None = None) -> HostPlan:
    """The host-memory plan of `cfg` with that many ranks a node (default: GPUS_PER_NODE GPUs a
    node, filled whole), against `host_mem_gib` (default topology.host_mem_gib; 0 = none; never
    on CPU)."""
    t = cfg.topology
    arch = read_arch(cfg)
    stages = trainer_estimates(cfg, arch)
    tpn = trainers_per_node or min(t.n_trainers, GPUS_PER_NODE)
    gpn = generators_per_node or min(t.n_generators, max(1, GPUS_PER_NODE // cfg.rollout.engine_tp))
    trainer_nodes = []
    for first in range(0, t.n_trainers, tpn):
        n = min(tpn, t.n_trainers - first)
        node = NodeEstimate(f"trainer node {first // tpn} ({_rank_range(first, n)})", TRAINER, n)
        for rank in range(first, first + n):
            for term in trainer_rank_terms(cfg, arch, stages, rank):
                node.add(term)
        trainer_nodes.append(node)
    gen = NodeEstimate(f"generator node ({gpn} rank{'s' if gpn > 1 else ''})", GENERATOR, gpn)
    for term in generator_rank_terms(cfg, arch):
        term.bytes *= gpn
        gen.add(term)
    mem = t.host_mem_gib if host_mem_gib is None else host_mem_gib
    return HostPlan(cfg, (mem or None) if t.device == "cuda" else None, tpn, gpn, trainer_nodes, gen)


def check_host_fits(cfg: RunConfig) -> None:
    """Raise ConfigError with one line when a node's host-memory total exceeds
    `topology.host_mem_gib`. Skipped on CPU and when host_mem_gib is 0."""
    if cfg.topology.device == "cpu" or not cfg.topology.host_mem_gib:
        return
    err = host_estimate(cfg).error()
    if err:
        raise ConfigError(err)


# ------------------------------------------------------------------------------ output

MAX_COLUMNS = 6


def render_host(hp: HostPlan, console) -> None:
    """The host tables (after the per-GPU ones in `plan memory`)."""
    from rich.table import Table

    if hp.cfg.topology.device != "cuda":
        console.print("host memory: planned for topology.device=cuda only (on CPU the tables "
                      "above are the host's)")
        return
    nodes = hp.trainer_nodes
    if len(nodes) > MAX_COLUMNS:
        worst = hp.worst(TRAINER)
        nodes = [n for i, n in enumerate(nodes) if i in (0, len(nodes) - 1) or n is worst]
    for role, shown in ((TRAINER, nodes), (GENERATOR, [hp.generator_node])):
        per = hp.trainers_per_node if role == TRAINER else hp.generators_per_node
        tab = Table(title=f"host memory, {role} node ({per} {role} rank(s) of {GPUS_PER_NODE} GPUs), GiB",
                    caption="pinned: page-locked (never swapped or reclaimed)")
        tab.add_column("term")
        tab.add_column("kind")
        for n in shown:
            tab.add_column(n.label.split(" (")[0].replace("trainer ", "") if role == TRAINER else "node",
                           justify="right")
        for i, term in enumerate(shown[0].terms):
            tab.add_row(term.name, "pinned" if term.pinned else "pageable",
                        *(f"{n.terms[i].bytes / GiB:.2f}" for n in shown))
        tab.add_row(f"headroom {HEADROOM:.0%}", "", *(f"{n.headroom / GiB:.2f}" for n in shown))
        tab.add_row("[bold]node total[/]", "", *(f"[bold]{n.total / GiB:.2f}[/]" for n in shown))
        tab.add_row("of which pinned", "", *(f"{n.pinned / GiB:.2f}" for n in shown))
        if hp.host_mem_gib:
            tab.add_row("host memory", "", *(fmt_num(hp.host_mem_gib) for _ in shown))
        console.print(tab)
    console.print(f"  #SBATCH --mem: het component 0 (trainer) --mem={hp.mem_gib(TRAINER)}G, "
                  f"component 1 (generator) --mem={hp.mem_gib(GENERATOR)}G")
