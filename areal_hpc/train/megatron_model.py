"""Build a Megatron-core GPTModel for a HF Qwen2 checkpoint, load it, and export it back.

Sharding conventions (megatron-core tags every TP-sharded parameter with
`tensor_model_parallel=True` and `partition_dim`):
- column-parallel (`linear_qkv`, `linear_fc1`, vocab-parallel embedding and output layer): dim 0;
  a contiguous dim-0 split of the fused QKV is a split by query groups (needs ng % tp == 0).
- swiglu `linear_fc1` is special: each rank holds `[gate_r; up_r]`, not a slice of `[gate; up]`.
- row-parallel (`linear_proj`, `linear_fc2`): dim 1. Norms are replicated.
- pipeline stages hold `decoder.layers.{local}`; `layer.layer_number` (1-based) is the global index.

Names handed to and from `hf_convert` are always global and unsharded.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from glob import glob

import torch
import torch.distributed as dist
from areal_hpc.train import mcore as _mcore  # noqa: F401 - first: Megatron imported with compiles deferred
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from safetensors import safe_open

from areal_hpc.train import cpu_compat
from areal_hpc.transport import mpi as coll
from areal_hpc.train.attention import gpt_block_spec
from areal_hpc.train.hf_convert import (
    conversion_rules,
    gpt_model_kwargs,
    megatron_config_kwargs,
    tied_embeddings,
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_FC1 = "mlp.linear_fc1.weight"
_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT = "output_layer.weight"


def init_megatron_parallel(tp: int, pp: int, seed: int, backend: str | None = None) -> None:
    """Create Megatron's model-parallel groups and RNG states over the default process group.

    The caller has already run `torch.distributed.init_process_group` over the trainer ranks only
    (and on GPU, `torch.cuda.set_device(0)`: launch.placement left it one GPU). World size = tp * pp * dp.
    `backend`, when given, is checked against the default group's ("nccl" on GPU, "gloo" on CPU).
    """
    if not dist.is_initialized():
        raise RuntimeError("init torch.distributed (trainer ranks) before Megatron")
    if backend is not None and dist.get_backend() != backend:
        raise RuntimeError(f"default process group uses {dist.get_backend()}, expected {backend}")
    cpu_compat.apply()
    parallel_state.initialize_model_parallel(       # its groups bounded as the default group
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        distributed_timeout_minutes=max(1, math.ceil(coll.DEFAULT_TIMEOUT_S / 60)),
    )
    torch.manual_seed(seed)  # CPU initialisation (use_cpu_initialization) draws from here
    model_parallel_cuda_manual_seed(seed)


def single_process(seed: int = 0, threads: int | None = 1, backend: str = "gloo") -> None:
    """A trainer of one rank in this process (the tests' and tools' Actor): a world of one over
    `backend` ("gloo"; "nccl" on the current CUDA device, set to 0) and Megatron's groups at
    tp = pp = 1, each made only if this process has none yet; torch's compute threads set to
    `threads` (None: left as they are). The world's store is in this process (no port to pick,
    none to lose to another process)."""
    if threads:
        torch.set_num_threads(threads)
    if not dist.is_initialized():
        device = None
        if backend == "nccl":
            torch.cuda.set_device(0)
            device = torch.device("cuda", 0)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    if dist.get_world_size() != 1:
        raise RuntimeError(f"a single-process trainer in a world of {dist.get_world_size()} ranks")
    if not parallel_state.model_parallel_is_initialized():
        init_megatron_parallel(1, 1, seed, backend=backend)


def read_hf_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def build_gpt_model(
    hf_config,
    params_dtype: torch.dtype = torch.float32,
    tp: int = 1,
    pp: int = 1,
    device: torch.device | str | None = None,
    attention: str = "mask",
    **config_overrides,
) -> GPTModel:
    """This rank's part of a GPTModel (local spec, RMSNorm, swiglu, GQA, RoPE) for `hf_config`.

    Args:
        params_dtype: parameter dtype; `torch.bfloat16` / `torch.float16` turn on Megatron's
            bf16 / fp16 mode.
        tp, pp: must match `init_megatron_parallel`.
        device: where the parameters live; default the current CUDA device, else CPU.
        attention: "varlen" (packed per-sequence attention, the model then takes
            `packed_seq_params`; see `areal_hpc.train.attention`) or "mask" (Megatron's local
            attention with a dense mask, the reference). "auto" = "varlen".
        config_overrides: extra `TransformerConfig` fields (e.g. `calculate_per_token_loss`,
            `recompute_granularity`, `sequence_parallel`).
    The output layer can hand back the last hidden states instead of logits (`return_hidden`,
    see `output_hidden_states`).
    """
    attention = "varlen" if attention == "auto" else attention
    if parallel_state.get_tensor_model_parallel_world_size() != tp:
        raise ValueError(f"tp={tp} but Megatron was initialised with a different TP size")
    if parallel_state.get_pipeline_model_parallel_world_size() != pp:
        raise ValueError(f"pp={pp} but Megatron was initialised with a different PP size")
    model_kwargs = gpt_model_kwargs(hf_config)
    if model_kwargs["vocab_size"] % tp:
        raise ValueError(f"vocab size {model_kwargs['vocab_size']} is not divisible by tp={tp}")
    on_gpu = torch.cuda.is_available()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    config = TransformerConfig(
        **megatron_config_kwargs(hf_config),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Without a GPU, Megatron's default GPU-side init runs under the CUDA RNG tracker.
        use_cpu_initialization=not on_gpu,
        # Random init stays on even when weights are loaded next: with perform_initialization=False
        # megatron-core 0.16 also skips tagging weights `tensor_model_parallel`/`partition_dim`.
        perform_initialization=True,
        # Packed micro-batches differ in length; PP must then exchange shapes first.
        variable_seq_lengths=pp > 1,
        # No MoE here, but 0.16 rejects variable_seq_lengths with the default "allgather".
        moe_token_dispatcher_type="alltoall",
        **config_overrides,
    )
    # With tied embeddings and pp > 1 the last stage's copy of the embedding is moved with
    # `.cuda()` before its all-reduce with the first stage.
    with cpu_compat.CudaToCpuMode():
        model = GPTModel(
            config=config,
            transformer_layer_spec=gpt_block_spec(config, attention),
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
            **model_kwargs,
        )
    model = model.to(device)
    if model.post_process:
        _hidden_state_output(model.output_layer)
    return model


def _hidden_state_output(layer) -> None:
    """Let the output layer return its (TP-prepared) input instead of logits while
    `layer.return_hidden` is True: `[S, b, H]` hidden states, all-gathered along the sequence
    with sequence parallelism. The TP region's backward (all-reduce, or reduce-scatter with
    sequence parallelism) sums the per-vocabulary-slice input gradients, as the layer's own
    matmul would. Parameter names and the state dict are unchanged."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    logits_forward = layer.forward
    layer.return_hidden = False

    def forward(input_, weight=None, runtime_gather_output=None):
        if not layer.return_hidden:
            return logits_forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                        group=layer.tp_group), None
        if layer.tp_group is not None and layer.tp_group.size() > 1:
            return copy_to_tensor_model_parallel_region(input_, group=layer.tp_group), None
        return input_, None

    layer.forward = forward


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The `[V/tp, H]` output projection of the last stage (the embedding when tied)."""
    gpt = _unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def output_hidden_states(model: torch.nn.Module, on: bool = True) -> None:
    """Make the last stage's forward return hidden states `[b, S, H]` instead of logits."""
    gpt = _unwrap(model)
    if gpt.post_process:
        gpt.output_layer.return_hidden = on


def _unwrap(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside Megatron's DDP (or other `.module` wrappers)."""
    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module
    return model


def _global_name(model: GPTModel, local_name: str) -> str:
    m = _LAYER.match(local_name)
    if m is None:
        return local_name
    layer = model.decoder.layers[int(m.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}." + local_name[m.end():]


def _named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """(local name, global name, parameter) for this rank's part of the model."""
    gpt = _unwrap(model)
    for name, param in gpt.named_parameters():
        yield name, _global_name(gpt, name), param


class HFCheckpoint(Mapping):
    """Lazy read-only view of a HF safetensors checkpoint: tensors are read on access."""

    def __init__(self, model_dir: str):
        files = sorted(glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        self._handles = [safe_open(f, framework="pt", device="cpu") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def _tp_shard(full: torch.Tensor, param: torch.nn.Parameter, global_name: str) -> torch.Tensor:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    rank = parallel_state.get_tensor_model_parallel_rank()
    if global_name.endswith(_FC1):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp, dim=0)[rank], torch.chunk(up, tp, dim=0)[rank]])
    return torch.chunk(full, tp, dim=param.partition_dim)[rank]


def _tp_gather(local: torch.Tensor, param: torch.nn.Parameter, global_name: str) -> torch.Tensor:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return local
    shards = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    if global_name.endswith(_FC1):
        gates, ups = zip(*(torch.chunk(s, 2, dim=0) for s in shards))
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(shards, dim=param.partition_dim)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_weights: Mapping[str, torch.Tensor], hf_config) -> None:
    """Copy HF-named full weights into this rank's (TP-sharded, PP-staged) parameters.

    `hf_weights` may be lazy (`HFCheckpoint`): each rank reads only the tensors it owns.
    """
    rules = conversion_rules(hf_config)
    for _, global_name, param in _named_parameters(model):
        # A tied output layer on a later pipeline stage is a copy of the input embedding.
        source = _EMBEDDING if global_name == _OUTPUT and tied_embeddings(hf_config) else global_name
        rule = rules[source]
        full = rule.to_megatron(*(hf_weights[n] for n in rule.hf_names))
        shard = _tp_shard(full, param, global_name)
        if shard.shape != param.shape:
            raise ValueError(f"{global_name}: checkpoint {tuple(shard.shape)} vs model {tuple(param.shape)}")
        param.copy_(shard)


def load_hf_checkpoint(model: torch.nn.Module, model_dir: str, hf_config=None) -> None:
    """`load_hf_weights` from a HF directory (config.json + *.safetensors)."""
    load_hf_weights(model, HFCheckpoint(model_dir), hf_config or read_hf_config(model_dir))


@torch.no_grad()
def full_megatron_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This pipeline stage's parameters, TP-gathered, under global Megatron names.

    Collective over the TP group: every TP rank must call it. Tensors stay on the model's device
    and dtype.
    """
    return {
        global_name: _tp_gather(param.detach(), param, global_name)
        for _, global_name, param in _named_parameters(model)
    }


@torch.no_grad()
def iter_stage_hf(model: torch.nn.Module, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's weights as full HF-named tensors, one Megatron parameter at a time.

    Collective over the TP group: every TP rank of the stage must run the iterator to its end,
    in step (each parameter is TP-gathered when reached). Only the tensors of one parameter are
    alive at a time beyond the shards, so a consumer that sends and drops them (the weight
    broadcast) never holds the stage twice. Order: the conversion rules' (embedding, layers in
    order, final norm, lm_head), restricted to what this stage holds; a tied lm_head is not
    produced (it is the embedding).
    """
    params = {global_name: param for _, global_name, param in _named_parameters(model)}
    for mc_name, rule in conversion_rules(hf_config).items():
        param = params.get(mc_name)
        if param is None:
            continue
        full = _tp_gather(param.detach(), param, mc_name)
        yield from zip(rule.hf_names, rule.to_hf(full), strict=True)


@torch.no_grad()
def _stage_hf_state_dict(model: torch.nn.Module, hf_config) -> dict[str, torch.Tensor]:
    """This pipeline stage's weights as full HF-named tensors (the whole model when pp == 1).

    Collective over the TP group. Each stage has its own layers (and the embedding / final
    norm / lm_head where it holds them).
    """
    mcore = full_megatron_state_dict(model)
    out = {}
    for mc_name, rule in conversion_rules(hf_config).items():
        if mc_name in mcore:
            out.update(zip(rule.hf_names, rule.to_hf(mcore[mc_name]), strict=True))
    return out


@torch.no_grad()
def hf_state_dict(model: torch.nn.Module, hf_config) -> dict[str, torch.Tensor]:
    """The whole model as full HF-named tensors on the first pipeline stage; {} on later stages.

    Collective over the TP and PP groups. Stage by stage, each later stage sends its tensors
    (TP-gathered) to the first stage of its pipeline, names and shapes first; tensors keep their
    device and dtype. A tied lm_head on the last stage is the embedding's copy: not sent.
    """
    local = _stage_hf_state_dict(model, hf_config)
    group = parallel_state.get_pipeline_model_parallel_group()
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return local
    ranks = dist.get_process_group_ranks(group)  # global ranks, by stage
    stage = parallel_state.get_pipeline_model_parallel_rank()
    device = next(iter(local.values())).device
    if stage > 0:
        meta = [[(k, tuple(v.shape), v.dtype) for k, v in local.items()]]
        dist.send_object_list(meta, dst=ranks[0], device=device)
        for tensor in local.values():
            dist.send(tensor.contiguous(), dst=ranks[0])
        return {}
    for src in ranks[1:]:
        meta = [None]
        dist.recv_object_list(meta, src=src, device=device)
        for name, shape, dtype in meta[0]:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(tensor, src=src)
            local[name] = tensor
    return local
