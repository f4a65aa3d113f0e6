"""Per-GPU memory model of a run, and the preflight that refuses configs that cannot fit.

    python -m areal_hpc.plan memory CONFIG.yaml [key=value ...] [--gpu-mem 80GiB]

prints, per rank kind, each memory term in GiB and the total against the GPU memory: the trainer
(one column per pipeline stage, the worst one marked) and the generator (one vLLM engine worker).
Exit 0 when everything fits, 2 with one line `error: ...` naming the largest term of the rank that
does not fit and the config keys that shrink it. `check_fits(cfg)` raises that line as a
`ConfigError`; every launcher calls it (`areal_hpc.preflight.launcher`) before any rank starts.
It is skipped for `topology.device=cpu` and for `topology.gpu_mem_gib=0`.

Architecture: `<model.path>/config.json`, else `configs/models/<basename of model.path>/
config.json` in this repository (the recipes' models, for planning on a login node).

Trainer rank (Megatron-core GPTModel, local layer spec, no TransformerEngine), per stage
-------------------------------------------------------------------------------------
Parameters: layers split evenly over `topology.pp` stages (Megatron requires `layers % pp == 0`);
the embedding on the first stage, final norm and untied output layer on the last; with tied
embeddings and pp > 1 the last stage holds a copy of the embedding. Matmul weights and the
vocabulary are split over tp, norms replicated. The vocabulary is NOT padded: the trainer passes
config.json's `vocab_size` to GPTModel as it is (`hf_convert.gpt_model_kwargs`; it must divide by
tp), so the model uses it unpadded.
Bytes per parameter: bf16/fp16 -> 2 (weights) + 4 (fp32 grad buffer, grad_reduce_in_fp32) + 4
(fp32 main weights) + 8 (Adam m, v); fp32 -> 4 + 4 + 8. With `train.distributed_optimizer` the
main weights and Adam state (12 B resp. 8 B) are divided by dp; the grad buffer stays whole.

Activations kept for backward, per token and layer, b = bytes of the parameter dtype, T = tp,
P = T with sequence parallelism else 1 (shapes measured with autograd saved-tensor hooks on the
real layer, fp32 and bf16, tools/bench_memory.py --saved):
- 2 RMSNorms (torch.nn.RMSNorm computes in fp32: keeps its fp32 input, the fp32 normalised x
  and the output in b): 2 * (8 + b) * h / P, plus 2 fp32 rstd: 8 / P
- varlen attention: fused qkv output (kept alive by the v view) (nh + 2 ng) hd, rotated q nh hd,
  rotated k ng hd, the attention output nh hd (twice on the per-sequence SDPA path: the
  sequences' outputs and their concatenation), all * b / T; log-sum-exp 4 nh / T; RoPE cos/sin
  4 hd b.
- mask attention: q and k, v repeated to nh heads 3 nh hd b / T, output nh hd b / T, and per
  layer the `[nh/T, S, S]` softmax (fp32, 4 B) plus, in half precision, its b-byte copy: term
  "attention scores"; one `[S, S]` bool mask per packed micro-batch of the step (all are packed
  before the first forward pass): term "attention masks".
- MLP (swiglu): fc1 output 2 ffn, silu output, up + 0, product: 5 ffn * b / T.
Recompute (Megatron): full+uniform keeps the `[S/P, h]` input of each chunk of
`recompute_num_layers` layers and recomputes one chunk during backward; full+block keeps the
inputs of the first `recompute_num_layers` layers of the stage and full activations of the
others; selective recomputes core attention (keeps its q, k, v inputs only).
Pipeline (1F1B): stage r keeps the activations of pp - r in-flight micro-batches of at most
`train.max_tokens_per_mb` tokens, plus the input and output tensors the schedule holds (S h b / P
each). The last stage also keeps the final norm's fp32 tensors and the gathered hidden states
of the output positions.
The step's packed batch: every trainer rank packs its data-parallel share of the whole step
(all minibatches) onto the device before the first forward (`Actor.plan_step`): per token the
ids and positions (int64, 16 B), per output token the output positions and targets (int64) and
the behaviour log-probs and advantages (fp32): 24 B, + 8 B of versions (prox loglinear), + 4 B
of π_prox log-probs on the last stage for (k-1)/k of them (`TrainConfig.prox_pass_share`); at
full length (B x group_size sequences of rollout.max_model_len tokens, max_new_tokens of them
output, over dp): term "step batch (packed)".
Working set on top of that (the largest of, at different times): the backward of one layer
(`BWD_FFN * ffn / T + BWD_H * h / P` values of b bytes per token, the largest weight gradient,
the chunk recomputed under full recompute); the chunked log-probs (last stage,
`train/logprobs.py`: `chunk * V/T * (4 + b)` B in half precision, `4` B in fp32: the fp32
logits reused in place for the softmax and its gradient, and one copy in b; plus the fp32
`[V/T, h]` gradient buffer of the output layer and, in half precision, its cast); the
optimizer step (torch's foreach Adam on CUDA: one fp32 temporary of all local main weights; on
CPU: two of the largest); a weight update (two `weights.bucket_mb` buckets and the TP-gathered
copy of the largest tensor, 3x); with tp > 1 the sender's TP peers in the weight gather
(term "weight gather, TP peers": each runs the stage's gathering iterator and drops every tensor;
a gather's output stays reserved until the sender joins it, and `weight_publisher.join_gather`
waits for the device every weights.bucket_mb, so a peer runs ahead by at most a bucket plus one
gathered tensor; without that wait it would be the whole stage's full tensors); the final HF
export (`export_bytes`). Only the
largest of these counts (rows marked "(alt)").

Generator rank (one vLLM worker; `rollout.engine_tp` workers per engine)
----------------------------------------------------------------------
Weights `params * b / engine_tp`; KV cache `2 * layers * max(1, kv_heads / engine_tp) * hd * b`
per token. vLLM's budget is `rollout.gpu_memory_utilization * GPU memory` (or weights +
activations + `rollout.kv_cache_gib` when that is set): weights + profile activations + the KV
cache. The KV cache the config asks for is `min(max_concurrent_prompts * group_size /
n_generators, max_num_seqs)` sequences of `rollout.max_model_len` tokens; the table reports
how many the budget holds. Refused when it cannot hold one sequence (vLLM would not start) or
when the budget plus what lies outside it (CUDA context, NCCL, CUDA graphs, two weight buckets)
exceeds the GPU; fewer sequences than asked is a note (vLLM queues the rest).

Constants (per GPU), stated here and used below
----------------------------------------------
CUDA_CONTEXT_GIB = 0.75   CUDA context, cuBLAS workspaces, kernels of one process
NCCL_COMM_GIB = 0.6       per NCCL communicator a rank uses: NCCL's buffers per connection, SIMPLE
                          (NCCL_BUFFSIZE, 4 MiB) + LL128 (4.7 MiB) + LL (0.5 MiB) = 9.2 MiB, a send
                          and a receive peer on each of up to 32 channels (NVLink): 0.57 GiB;
                          measured 544-688 MB per group on A100 NVLink (NVIDIA/nccl issue #964)
NVLS_COMM_GIB = 0.25      NVLink SHARP buffers (NVSwitch nodes: H100/H200/B200; not A100) per
                          communicator of more than 2 ranks, an upper bound: 16 channels x 2 x 1 MiB
                          (128 KiB chunks x 8 steps) x 8 local heads = 256 MiB, NCCL's
                          "NVLS comm ... nvlsTotalSize" INFO line; NCCL_NVLS_ENABLE=0 removes it
                          Communicators (`nccl_communicators`): trainer, with trainer_backend nccl:
                          the trainer world (checkpoint collectives), Megatron's TP, PP, DP and
                          model-parallel (TP x PP) groups, the embedding group (tied, pp > 1); the
                          weight group (weight_backend nccl, broadcast) on each stage's sender;
                          generator: vLLM's TP group twice (torch.distributed + its PyNccl) with
                          engine_tp > 1, the weight group. Each counted with more than one rank.
FRAGMENTATION = 0.10      caching-allocator fragmentation, on the dynamic part (activations and
                          working sets; parameter/gradient buffers are contiguous)
CUDA_GRAPHS_GIB = 1.5     vLLM CUDA graphs (rollout.enforce_eager=false), outside its budget
VLLM_MAX_NUM_SEQS = 128, VLLM_MAX_BATCHED_TOKENS = 2048: vLLM's defaults (unless
                          rollout.max_num_seqs / max_num_batched_tokens set them) for
                          `LLMEngine.from_engine_args` (which the generator uses, no override)
On CPU (tools/bench_memory.py) there is no CUDA context or NCCL and the fragmentation constant is
`CPU_FRAGMENTATION`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError, RunConfig

GiB = 2**30
MiB = 2**20
REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO / "configs" / "models"

CUDA_CONTEXT_GIB = 0.75
NCCL_COMM_GIB = 0.6
NVLS_COMM_GIB = 0.25
NO_NVLS_GPUS = ("a100",)          # topology.gpu without NVLink SHARP
FRAGMENTATION = 0.10
CPU_FRAGMENTATION = 0.10
CUDA_GRAPHS_GIB = 1.5
VLLM_MAX_NUM_SEQS = 128
VLLM_MAX_BATCHED_TOKENS = 2048
# Backward of one layer: gradient values per token alive at its peak (the MLP: grads of the
# product, of silu's output and of up, and the fc1-shaped one; hidden-sized ones around it).
BWD_FFN = 4.0
BWD_H = 4.0

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}     # model.dtype: bytes a value
_REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")


# ------------------------------------------------------------------------------ architecture

@dataclass(frozen=True)
class Arch:
    """What the memory model needs from a Qwen2 config.json (same conventions as hf_convert)."""

    source: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> "Arch":
        for key in _REQUIRED:
            value = hf.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                what = "missing" if value is None else f"must be a positive integer, got {value!r}"
                raise ConfigError(f"{source}: key '{key}' {what}")
        nh = hf["num_attention_heads"]
        ng = hf.get("num_key_value_heads") or nh
        hd = hf.get("head_dim") or hf["hidden_size"] // nh
        for key, value in (("num_key_value_heads", ng), ("head_dim", hd)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{source}: key '{key}' must be a positive integer, got {value!r}")
        if nh % ng:
            raise ConfigError(f"{source}: key 'num_key_value_heads' ({ng}) must divide "
                              f"num_attention_heads ({nh})")
        return cls(source=source, hidden=hf["hidden_size"], ffn=hf["intermediate_size"],
                   layers=hf["num_hidden_layers"], heads=nh, kv_heads=ng, head_dim=hd,
                   vocab=hf["vocab_size"], tied=bool(hf.get("tie_word_embeddings", False)))

    # parameters, full (unsharded)
    @property
    def layer_matmul_params(self) -> int:
        h, hd = self.hidden, self.head_dim
        qkv = (self.heads + 2 * self.kv_heads) * hd
        return qkv * h + qkv + self.heads * hd * h + 3 * self.ffn * h   # qkv (+bias), proj, fc1, fc2

    @property
    def layer_params(self) -> int:
        return self.layer_matmul_params + 2 * self.hidden               # + 2 norms

    @property
    def total_params(self) -> int:
        emb = self.vocab * self.hidden
        return emb * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden


def model_config_path(model_path: str) -> Path:
    """`<model.path>/config.json`, else the copy shipped under configs/models/<basename>."""
    own = Path(model_path) / "config.json"
    if own.is_file():
        return own
    shipped = MODELS_DIR / Path(model_path.rstrip("/")).name / "config.json"
    if shipped.is_file():
        return shipped
    raise ConfigError(f"config key 'model.path': no config.json at {own} nor at "
                      f"{shipped.relative_to(REPO)} (the memory model needs the architecture)")


def read_arch(cfg: RunConfig) -> Arch:
    path = model_config_path(cfg.model.path)
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable JSON file ({str(exc).splitlines()[0]})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return Arch.from_hf(hf, str(path))


# ------------------------------------------------------------------------------ the estimate

@dataclass
class Term:
    name: str
    bytes: float
    shrink: tuple[str, ...] = ()
    concurrent: bool = True         # False: one of the alternative peaks (only the max counts)


@dataclass
class RankEstimate:
    label: str                      # "trainer stage 0", "generator"
    terms: list[Term]
    notes: list[str] = field(default_factory=list)
    failure: str | None = None      # a reason that is not the total (generator KV budget)

    @property
    def total(self) -> float:
        alt = [t.bytes for t in self.terms if not t.concurrent]
        return sum(t.bytes for t in self.terms if t.concurrent) + max(alt, default=0.0)

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)

    def largest(self) -> Term:
        counted = [t for t in self.terms if t.concurrent]
        alt = [t for t in self.terms if not t.concurrent]
        if alt:
            counted.append(max(alt, key=lambda t: t.bytes))
        return max(counted, key=lambda t: t.bytes)


@dataclass
class Plan:
    cfg: RunConfig
    arch: Arch
    gpu_mem_gib: float | None       # None: no comparison (CPU config without --gpu-mem)
    trainer: list[RankEstimate]     # per pipeline stage
    generator: RankEstimate

    def worst_stage(self) -> RankEstimate:
        return max(self.trainer, key=lambda r: r.total)

    def problems(self) -> list[tuple[float, str]]:
        """(how far over, one-line reason) per rank kind that does not fit."""
        if not self.gpu_mem_gib:
            return []
        mem = self.gpu_mem_gib * GiB
        out = []
        for rank in (self.worst_stage(), self.generator):
            if rank.failure:
                out.append((float("inf"), rank.failure))
            elif rank.total > mem:
                big = rank.largest()
                out.append((rank.total / mem, f"{rank.label} needs {rank.total / GiB:.1f} GiB of "
                                              f"{fmt_num(self.gpu_mem_gib)} GiB: {big.name} "
                                              f"{big.bytes / GiB:.1f} GiB{_hint(big)}"))
        return sorted(out, key=lambda p: -p[0])

    def error(self) -> str | None:
        p = self.problems()
        return p[0][1] if p else None


def fmt_num(x: float) -> str:                      # GiB and the like, 4 significant digits
    return f"{x:.4g}"


def _hint(term: Term) -> str:
    return f" (shrink with {', '.join(term.shrink)})" if term.shrink else ""


def _layers_per_stage(cfg: RunConfig, arch: Arch) -> int:
    pp = cfg.topology.pp
    if arch.layers % pp:
        raise ConfigError(f"config key 'topology.pp': {arch.layers} layers ({arch.source}) do not "
                          f"split evenly over {pp} pipeline stages")
    return arch.layers // pp


def varlen_kernel(device: str, dtype: str) -> str:
    """The kernel `train/attention.py` picks: FlashAttention varlen for half precision on CUDA,
    else one SDPA call per sequence (whose outputs are kept besides their concatenation)."""
    return "flash_varlen" if device == "cuda" and dtype in ("bfloat16", "float16") else "sdpa_per_sequence"


def layer_activation_bytes(arch: Arch, b: int, tp: int, sp: bool, attention: str, kernel: str,
                           selective: bool = False) -> float:
    """Bytes per token one transformer layer keeps for backward (no full recompute), except
    the mask path's [S, S] scores (`mask_score_bytes`)."""
    h, hd, nh, ng, ffn = arch.hidden, arch.head_dim, arch.heads, arch.kv_heads, arch.ffn
    p = tp if sp else 1
    norms = 2 * (8 + b) * h / p + 8 / p
    rope = 4 * hd * b
    mlp = 5 * ffn * b / tp
    mixed, q, k = (nh + 2 * ng) * hd, nh * hd, ng * hd
    if selective:            # core attention's inputs (q, k, v view of the fused output) + output
        attn = (mixed + q + k + nh * hd) * b / tp
    elif attention == "mask":
        qkv = 3 * nh * hd if ng < nh else mixed + q + k    # GQA: k, v repeated to nh heads
        attn = (qkv + nh * hd) * b / tp
    else:
        outs = 2 if kernel == "sdpa_per_sequence" else 1
        attn = (mixed + q + k + outs * nh * hd) * b / tp + 4 * nh / tp
    return norms + rope + attn + mlp


def mask_score_bytes(arch: Arch, b: int, tp: int, s: int) -> float:
    """Per layer and micro-batch of s tokens on the mask path: the fp32 softmax kept for
    backward, plus its half-precision copy (the bmm's input) in bf16/fp16."""
    return arch.heads / tp * s * s * (4 + (b if b != 4 else 0))


def nccl_communicators(cfg: RunConfig, role: str, tied: bool = False,
                       sender: bool = True) -> list[tuple[str, int]]:
    """(name, ranks) of every NCCL communicator with more than one rank that a rank of `role`
    ("trainer": a stage's weight sender when `sender`; "generator": one vLLM worker) uses;
    `tied`: the model ties its embeddings."""
    t, w = cfg.topology, cfg.weights
    group = t.pp + t.n_generators * cfg.rollout.engine_tp
    weights = [("weight group", group)] if w.mode == "broadcast" and t.weight_backend == "nccl" else []
    if role == "generator":
        etp = cfg.rollout.engine_tp
        return [c for c in [("vLLM TP (torch)", etp), ("vLLM TP (PyNccl)", etp), *weights] if c[1] > 1]
    if t.trainer_backend != "nccl":
        comms = []
    else:
        dp = t.n_trainers // (t.tp * t.pp)
        comms = [("trainer world", t.n_trainers), ("TP", t.tp), ("PP", t.pp), ("DP", dp),
                 ("TP x PP", t.tp * t.pp), ("embedding", 2 if tied and t.pp > 1 else 1)]
    return [c for c in [*comms, *(weights if sender else [])] if c[1] > 1]


def nccl_bytes(cfg: RunConfig, role: str, tied: bool = False) -> float:
    """NCCL's device memory on a rank of `role` (0 on CPU): NCCL_COMM_GIB per communicator, plus
    NVLS_COMM_GIB per communicator of more than 2 ranks on NVSwitch GPUs."""
    if cfg.topology.device != "cuda":
        return 0.0
    nvls = cfg.topology.gpu.strip().lower() not in NO_NVLS_GPUS
    return sum(NCCL_COMM_GIB + (NVLS_COMM_GIB if nvls and n > 2 else 0.0)
               for _, n in nccl_communicators(cfg, role, tied)) * GiB


def batch_bytes(cfg: RunConfig, last_stage: bool) -> float:
    """The step's packed tensors on one trainer rank: its data-parallel share of B x group_size
    sequences at full length (see the module docstring)."""
    t, r, tr = cfg.topology, cfg.rollout, cfg.train
    dp = t.n_trainers // (t.tp * t.pp)
    seqs = tr.batch_prompts * r.group_size / dp
    per_out = 24 + (8 if tr.prox == "loglinear" else 0) + (4 * tr.prox_pass_share if last_stage else 0)
    return seqs * (16 * r.max_model_len + per_out * min(r.max_new_tokens, r.max_model_len))


def export_bytes(largest_full: float, b: int, chunk_mb: int, on_cuda: bool) -> float:
    """The final HF export (train/hf_export.py) on a rank of a stage: streamed, it never gathers
    the model, only one parameter at a time (its TP-gathered tensor and the HF tensors split from
    it: twice the largest full tensor) on the device, moved to a host bucket of at most
    `checkpoint.export_chunk_mb`; on CPU that bucket is in the same memory."""
    return 2 * largest_full * b + (0.0 if on_cuda else chunk_mb * MiB)


def trainer_estimates(cfg: RunConfig, arch: Arch, weight_sync: bool = True) -> list[RankEstimate]:
    """One estimate per pipeline stage; `weight_sync=False` leaves out the weight update's buffers
    and the final export (a training step alone, as tools/bench_memory.py measures)."""
    t, tr = cfg.topology, cfg.train
    tp, pp = t.tp, t.pp
    dp = t.n_trainers // (tp * pp)
    b = DTYPE_BYTES[cfg.model.dtype]
    half = b == 2
    sp = tr.sequence_parallel and tp > 1
    p = tp if sp else 1
    attention = "mask" if tr.attention == "mask" else "varlen"
    kernel = varlen_kernel(t.device, cfg.model.dtype)
    on_cuda = t.device == "cuda"
    s = tr.max_tokens_per_mb
    h, v_local = arch.hidden, arch.vocab / tp
    n_layers = _layers_per_stage(cfg, arch)
    full = tr.recompute_granularity == "full"
    selective = tr.recompute_granularity == "selective"
    layer_act = layer_activation_bytes(arch, b, tp, sp, attention, kernel, selective) * s
    scores = mask_score_bytes(arch, b, tp, s) if attention == "mask" else 0.0
    layer_local = arch.layer_matmul_params / tp + 2 * h
    fc1_local = 2 * arch.ffn * h / tp
    bwd_transient = (BWD_FFN * arch.ffn / tp + BWD_H * h / p) * s * b + fc1_local * b
    # the step's masks: all micro-batches of one dp rank are packed before the first forward;
    # sum of S_i^2 over packs of at most s tokens is at most (tokens per dp rank) * s
    step_tokens = cfg.train.batch_prompts * cfg.rollout.group_size * cfg.rollout.max_model_len / dp
    masks = step_tokens * min(s, step_tokens) if attention == "mask" else 0.0

    act_keys = ["train.max_tokens_per_mb"]
    if not full:
        act_keys.append("train.recompute_granularity=full")
    elif tr.recompute_method == "block" or (tr.recompute_num_layers or 1) > 1:
        act_keys.append("train.recompute_method=uniform, train.recompute_num_layers=1")
    if tp > 1 and not sp:
        act_keys.append("train.sequence_parallel=true")
    act_keys.append("topology.tp")
    opt_keys = ([] if tr.distributed_optimizer else ["train.distributed_optimizer=true"]) + \
        ["topology.tp", "topology.pp"]

    stages = []
    for r in range(pp):
        first, last = r == 0, r == pp - 1
        n_params = n_layers * layer_local + (last * h)
        if first:
            n_params += v_local * h
        if last and (not arch.tied or pp > 1):
            n_params += v_local * h
        largest = max(fc1_local, v_local * h if (first or last) else 0)
        main_b = 12 if half else 8
        opt_shard = dp if tr.distributed_optimizer else 1
        params = n_params * b
        grads = n_params * 4
        optim = n_params * main_b / opt_shard
        in_flight = pp - r

        # kept activations per micro-batch
        if full and tr.recompute_method == "uniform":
            kept_layers = math.ceil(n_layers / tr.recompute_num_layers) * s * h * b / p
            recompute_chunk = min(tr.recompute_num_layers, n_layers) * layer_act
            kept_scores = 0.0
        elif full:          # block
            n_rc = min(tr.recompute_num_layers, n_layers)
            kept_layers = n_rc * s * h * b / p + (n_layers - n_rc) * layer_act
            recompute_chunk = layer_act if n_rc else 0.0
            kept_scores = (n_layers - n_rc) * scores
        else:
            kept_layers = n_layers * layer_act
            recompute_chunk = 0.0
            kept_scores = 0.0 if selective else n_layers * scores
        pipe_io = ((not first) + (not last)) * s * h * b / p
        head = (8 * h * s + s * h * b) if last else 0.0   # final norm (fp32 x, y) + gathered hidden
        activations = in_flight * (kept_layers + pipe_io) + head
        # one layer's backward of the scores: the fp32 gradient of the softmax and of its input
        # (+ the half-precision gradient of the probabilities), and Megatron's reused
        # [nh/T, S, S] baddbmm buffer (never written, so not resident on CPU)
        score_transient = (arch.heads / tp * s * s * (8 + (b if half else 0) + (b if on_cuda else 0))
                           if attention == "mask" else 0.0)
        attn_scores = in_flight * kept_scores + score_transient

        working = recompute_chunk + bwd_transient + (v_local * h * b if first else 0.0)
        chunk = min(tr.logprob_chunk_tokens, s)
        logprob = 0.0
        if last:
            # float32 logits (the softmax and its gradient in place) + one copy in the parameter
            # dtype; the float32 [V/tp, H] gradient buffer, cast to the parameter dtype at the end
            extra = b if half else 0
            logprob = chunk * v_local * (4 + extra) + v_local * h * (4 + extra)
        opt_temp = (n_params / opt_shard * 4) if on_cuda else 2 * largest * 4
        sync = (2 * cfg.weights.bucket_mb * MiB + 3 * largest * tp * b) if weight_sync else 0.0
        # a TP peer's gathers not yet joined by the sender: join_gather waits every bucket
        gather_ahead = (cfg.weights.bucket_mb * MiB + largest * tp * b) if weight_sync and tp > 1 else 0.0
        batch = batch_bytes(cfg, last)
        dynamic = activations + attn_scores + masks + batch + max(working, logprob, opt_temp, sync, gather_ahead)
        frag = (FRAGMENTATION if on_cuda else CPU_FRAGMENTATION) * dynamic
        reserve = CUDA_CONTEXT_GIB * GiB if on_cuda else 0.0

        terms = [
            Term("params", params, ("topology.tp", "topology.pp")),
            Term("grads", grads, ("topology.tp", "topology.pp")),
            Term("optimizer state", optim, tuple(opt_keys)),
            Term("activations", activations, tuple(act_keys)),
            Term("step batch (packed)", batch, ("train.batch_prompts", "rollout.group_size",
                                                "rollout.max_model_len", "topology.n_trainers")),
        ]
        if attention == "mask":
            terms += [
                Term("attention scores", attn_scores,
                     ("train.attention=varlen", "train.max_tokens_per_mb",
                      "train.recompute_granularity=full", "topology.tp")),
                Term("attention masks", masks, ("train.attention=varlen", "train.max_tokens_per_mb")),
            ]
        terms += [
            Term("backward working set", working, ("train.max_tokens_per_mb", "topology.tp"), False),
            Term("log-prob chunk", logprob, ("train.logprob_chunk_tokens", "topology.tp"), False),
            Term("optimizer step temp", opt_temp, tuple(opt_keys), False),
            Term("weight gather, TP peers", gather_ahead, ("topology.pp",), False),
            Term("weight sync buffers", sync, ("weights.bucket_mb",), False),
            Term("final HF export", export_bytes(largest * tp, b, cfg.checkpoint.export_chunk_mb,
                                                 on_cuda) if weight_sync else 0.0,
                 ("checkpoint.export_chunk_mb",), False),
            Term("CUDA context", reserve),
            Term("NCCL + NVLS buffers", nccl_bytes(cfg, "trainer", arch.tied), ("NCCL_NVLS_ENABLE=0",)),
            Term("fragmentation", frag, tuple(act_keys)),
        ]
        est = RankEstimate(f"trainer stage {r}", terms)
        est.notes.append(f"{n_layers} layers, {n_params / 1e9:.2f} B params, {in_flight} micro-batch(es) "
                         f"of {s} tokens in flight")
        stages.append(est)
    return stages


def vllm_limits(cfg: RunConfig) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of one vLLM engine: the rollout keys, else vLLM's
    defaults for `LLMEngine.from_engine_args`."""
    r = cfg.rollout
    return r.max_num_seqs or VLLM_MAX_NUM_SEQS, r.max_num_batched_tokens or VLLM_MAX_BATCHED_TOKENS


def kv_bytes_per_token(arch: Arch, dtype_bytes: int, engine_tp: int = 1) -> int:
    """KV-cache bytes one token takes on one vLLM worker of an engine over `engine_tp` GPUs
    (K and V of every layer; kv heads split over the workers, at least one each)."""
    return 2 * arch.layers * max(1, arch.kv_heads // engine_tp) * arch.head_dim * dtype_bytes


def generator_estimate(cfg: RunConfig, arch: Arch, gpu_mem_gib: float | None) -> RankEstimate:
    t, r = cfg.topology, cfg.rollout
    etp = r.engine_tp
    b = DTYPE_BYTES[cfg.model.dtype]
    on_cuda = t.device == "cuda"
    weights = arch.total_params * b / etp
    kv_per_token = kv_bytes_per_token(arch, b, etp)
    h, hd, ffn = arch.hidden, arch.head_dim, arch.ffn
    qkv = (arch.heads + 2 * arch.kv_heads) * hd
    max_seqs, max_tokens = vllm_limits(cfg)
    act = max_tokens * b * (2 * qkv / etp + 6 * ffn / etp + 6 * h) + max_seqs * arch.vocab * 4 * 4
    asked = math.ceil(r.max_concurrent_prompts * r.group_size / t.n_generators)
    seqs = min(asked, max_seqs)
    per_seq = kv_per_token * r.max_model_len
    kv_need = seqs * per_seq
    buckets = 2 * cfg.weights.bucket_mb * MiB
    if r.kv_cache_gib is not None:
        kv = r.kv_cache_gib * GiB
        budget_txt = f"rollout.kv_cache_gib={r.kv_cache_gib}"
    elif gpu_mem_gib:
        kv = max(0.0, r.gpu_memory_utilization * gpu_mem_gib * GiB - weights - act)
        budget_txt = (f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} x "
                      f"{fmt_num(gpu_mem_gib)} GiB")
    else:
        kv = kv_need
        budget_txt = "no GPU memory given: the KV cache the config asks for"
    holds = int(kv // per_seq)
    terms = [
        Term("weights", weights, ("rollout.engine_tp",)),
        Term("vLLM activations", act, ("rollout.engine_tp",)),
        Term("KV cache", kv, ("rollout.gpu_memory_utilization", "rollout.engine_tp")),
        Term("CUDA graphs", CUDA_GRAPHS_GIB * GiB if on_cuda and not r.enforce_eager else 0.0,
             ("rollout.enforce_eager=true",)),
        Term("weight sync buffers", buckets, ("weights.bucket_mb",)),
        Term("CUDA context", CUDA_CONTEXT_GIB * GiB if on_cuda else 0.0),
        Term("NCCL + NVLS buffers", nccl_bytes(cfg, "generator"), ("NCCL_NVLS_ENABLE=0",)),
    ]
    est = RankEstimate("generator", terms)
    est.notes.append(f"KV budget ({budget_txt}) {kv / GiB:.1f} GiB holds {holds} sequence(s) of "
                     f"rollout.max_model_len={r.max_model_len} ({per_seq / GiB:.2f} GiB each); the config "
                     f"asks {asked} per engine (max_concurrent_prompts x group_size / n_generators)"
                     + (f", vLLM runs at most {max_seqs} (rollout.max_num_seqs)"
                        if asked > max_seqs else "")
                     + f": {kv_need / GiB:.1f} GiB at full length")
    if holds < seqs:
        est.notes.append(f"the KV cache holds {holds} of {seqs} sequences at full length: vLLM queues "
                         f"or preempts the rest (long sequences are the exception)")
    if holds < 1:
        est.failure = (f"generator: the vLLM budget ({budget_txt}) leaves {kv / GiB:.1f} GiB for the KV "
                       f"cache after weights {weights / GiB:.1f} GiB and activations {act / GiB:.1f} GiB; "
                       f"one sequence of rollout.max_model_len={r.max_model_len} needs {per_seq / GiB:.2f} "
                       f"GiB (shrink with rollout.engine_tp, rollout.max_model_len, raise "
                       f"rollout.gpu_memory_utilization)")
    return est


def estimate(cfg: RunConfig, gpu_mem_gib: float | None = None, weight_sync: bool = True) -> Plan:
    """The memory plan of `cfg` against `gpu_mem_gib` (default: topology.gpu_mem_gib on CUDA,
    no comparison on CPU)."""
    arch = read_arch(cfg)
    if gpu_mem_gib is None and cfg.topology.device == "cuda":
        gpu_mem_gib = cfg.topology.gpu_mem_gib or None
    tp = cfg.topology.tp
    if arch.vocab % tp:
        raise ConfigError(f"config key 'topology.tp': vocab_size {arch.vocab} ({arch.source}) is not "
                          f"divisible by tp={tp} (the trainer does not pad the vocabulary)")
    return Plan(cfg, arch, gpu_mem_gib, trainer_estimates(cfg, arch, weight_sync),
                generator_estimate(cfg, arch, gpu_mem_gib))


def check_fits(cfg: RunConfig) -> None:
    """Raise ConfigError with one line when a rank's estimate exceeds `topology.gpu_mem_gib`.
    Skipped on CPU and when gpu_mem_gib is 0."""
    if cfg.topology.device == "cpu" or not cfg.topology.gpu_mem_gib:
        return
    err = estimate(cfg).error()
    if err:
        raise ConfigError(err)
