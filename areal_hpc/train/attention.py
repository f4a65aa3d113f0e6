"""Packed ("varlen") core attention for Megatron's local layer spec, and the layer spec using it.

A packed micro-batch is one row of several sequences. Megatron's local `DotProductAttention`
attends over it with a dense `[S, S]` block-diagonal mask: `[heads, S, S]` scores and their
softmax are materialised (and kept for backward), so memory and work grow with S². This module
attends within each sequence only, from the cumulative sequence lengths that Megatron's
`PackedSeqParams` (qkv_format "thd") carries: work grows with Σ lenᵢ², memory with S.

Kernels, chosen per device at call time:
- CUDA: PyTorch's `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 varlen, one launch
  for the whole pack, GQA without repeating k/v, forward and backward), when this torch has it
  and the dtype is half precision. Otherwise (fp32 on a GPU, an older torch) one fused
  `scaled_dot_product_attention` call per sequence (flash / memory-efficient backends).
- CPU: one `scaled_dot_product_attention(is_causal=True)` per sequence (PyTorch's CPU flash
  kernel: no `[L, L]` scores are kept).
TransformerEngine is not used: it does not install on the CPU test platform, so no path through
it could be tested here, and PyTorch's varlen kernel is the same FlashAttention-2 algorithm.
Megatron's `TEDotProductAttention` takes the same `PackedSeqParams`, should a site want it.

Positions: with THD, Megatron applies RoPE per sequence (positions restart at each one, as in the
inference engine); the mask path runs RoPE over the whole row instead. Both are exact (RoPE is
relative); they differ by float rounding only.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

try:  # torch >= 2.10 on CUDA
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None


def packed_seq_params(seq_lens: list[int], device) -> PackedSeqParams:
    """THD parameters for one packed row holding sequences of `seq_lens` tokens, in order."""
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
    cu = cu.to(device)
    longest = max(seq_lens)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel `PackedAttention` uses for tensors on `device` of `dtype`."""
    if device.type == "cuda" and _varlen_attn is not None and dtype in (torch.float16, torch.bfloat16):
        return "flash_varlen"
    return "sdpa_per_sequence"


class PackedAttention(MegatronModule):
    """Causal self-attention within each packed sequence (drop-in for `DotProductAttention`).

    Takes Megatron's THD layout: query `[T, heads/tp, d]`, key and value `[T, groups/tp, d]`,
    `packed_seq_params.cu_seqlens_q` `[n + 1]` int32. Returns `[T, 1, heads/tp * d]`.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("packed attention does not support context parallelism")
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params: PackedSeqParams | None = None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("PackedAttention needs PackedSeqParams(qkv_format='thd')")
        if attention_bias is not None:
            raise ValueError("PackedAttention does not take an attention bias")
        dropout = self.dropout if self.training else 0.0
        cu = packed_seq_params.cu_seqlens_q
        if varlen_kernel(query.device, query.dtype) == "flash_varlen" and dropout == 0.0:
            m = int(packed_seq_params.max_seqlen_q)
            out = _varlen_attn(query, key, value, cu, cu, m, m, scale=self.scale,
                               window_size=(-1, 0), enable_gqa=key.shape[1] != query.shape[1])
        else:
            out = _sdpa_per_sequence(query, key, value, cu, self.scale, dropout)
        return out.reshape(out.shape[0], 1, -1)


def _sdpa_per_sequence(q, k, v, cu, scale: float, dropout: float) -> torch.Tensor:
    """`[T, h, d]` out: one causal SDPA per sequence (`[1, h, L, d]` views, no copies of k/v)."""
    bounds = cu.tolist()
    gqa = k.shape[1] != q.shape[1]
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qi, ki, vi = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))  # [1, h, L, d]
        oi = F.scaled_dot_product_attention(qi, ki, vi, dropout_p=dropout, is_causal=True,
                                            scale=scale, enable_gqa=gqa)
        parts.append(oi[0].transpose(0, 1))
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0].contiguous()


class _SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` for Megatron with sequence parallelism: its weight is marked so that
    `finalize_model_grads` all-reduces its gradient over the TP group (each rank saw S/tp
    tokens). Megatron's own torch fallback refuses sequence parallelism outright."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)  # fp32 weight, as Megatron's torch fallback
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)


def gpt_block_spec(config, attention: str):
    """The decoder spec for `GPTModel`: Megatron's local layer spec (RMSNorm) with the chosen
    core attention, for this pipeline stage's layers.

    attention: "mask" keeps Megatron's `DotProductAttention` (dense mask, the reference);
    "varlen" uses `PackedAttention`. With
    `config.sequence_parallel` every norm (the final one included) is `_SequenceParallelRMSNorm`.
    Parameter names are those of the plain local spec either way.
    """
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    layer = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    sub = layer.submodules
    if attention == "varlen":
        sub.self_attention.submodules.core_attention = PackedAttention
    elif attention != "mask":
        raise ValueError(f"attention must be varlen or mask, got {attention!r}")
    norm = WrappedTorchNorm
    if config.sequence_parallel:
        norm = sub.input_layernorm = sub.pre_mlp_layernorm = _SequenceParallelRMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                      layer_norm=norm)
