"""Packed ("varlen") core attention for Megatron's local layer spec, and the layer spec using it.

A packed micro-batch is one row of several sequences. Megatron's local `DotProductAttention`
attends over it with a dense `[S, S]` block-diagonal mask: `[heads, S, S]` scores and their
softmax are materialised (and kept for backward), so memory and work grow with S². This module
attends within each sequence only, from the cumulative sequence lengths that Megatron's
`PackedSeqParams` (qkv_format "thd") carries: work grows with Σ lenᵢ², memory with S.

Kernels, chosen per device at call time:
- CUDA: PyTorch's `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 varlen, one launch
  for the whole pack, forward and backward), when this torch has it and the dtype is half
  precision. Otherwise (fp32 on a GPU, an older torch) one fused `scaled_dot_product_attention`
  call per sequence (flash / memory-efficient backends).
  `varlen_attn`'s keywords differ between releases (torch 2.10: `is_causal`, no `scale`; 2.11:
  `scale`, `window_size`; 2.12 and later also `enable_gqa`), so `_flash_varlen` passes only
  what the installed function's signature names (read once, cached): causal masking as
  `window_size=(-1, 0)` or `is_causal=True`; GQA as `enable_gqa=True`, or, where that keyword is
  absent, k and v repeated to the query's heads (`repeat_interleave` over heads, the grouping
  SDPA's `enable_gqa` uses: query head i reads kv head i // (heads / groups)), which gives the
  same result at the cost of the repeated copies; a `scale` it does not take is folded into
  the query (`q * scale * sqrt(d)`; the kernel's default is 1 / sqrt(d)), skipped when equal.
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
import functools
import inspect
import math

import torch
import torch.nn.functional as F
from areal_hpc.train import mcore as _mcore  # noqa: F401 - first: Megatron imported with compiles deferred
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
    if (device.type == "cuda" and _varlen_attn is not None and dtype in (torch.float16, torch.bfloat16)
            and not varlen_keywords(_varlen_attn).isdisjoint({"window_size", "is_causal"})):
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
            out = _flash_varlen(query, key, value, cu, int(packed_seq_params.max_seqlen_q), self.scale)
        else:
            out = _sdpa_per_sequence(query, key, value, cu, self.scale, dropout)
        return out.reshape(out.shape[0], 1, -1)


@functools.lru_cache(maxsize=None)
def varlen_keywords(fn) -> frozenset[str]:
    """The parameter names of `fn` (a `varlen_attn`), read once per function."""
    return frozenset(inspect.signature(fn).parameters)


def varlen_call_plan(fn=None) -> str:
    """How `_flash_varlen` calls `fn` (default the installed `varlen_attn`), in words: for the
    GPU check's report, and to see on CPU what a torch release would get."""
    fn = fn or _varlen_attn
    if fn is None:
        return "varlen_attn absent"
    kw = varlen_keywords(fn)
    causal = "window_size=(-1, 0)" if "window_size" in kw else "is_causal=True" if "is_causal" in kw else None
    if causal is None:
        return "varlen_attn takes neither window_size nor is_causal: not used"
    return ", ".join([causal, "scale=" if "scale" in kw else "scale folded into q",
                      "enable_gqa=True" if "enable_gqa" in kw else "GQA: k/v repeat_interleave"])


def _flash_varlen(q, k, v, cu, max_len: int, scale: float, fn=None) -> torch.Tensor:
    """Causal `varlen_attn` over the pack (`[T, h, d]` q, `[T, g, d]` k and v), with only the
    keywords `fn`'s signature has (module docstring)."""
    fn = fn or _varlen_attn
    kw = varlen_keywords(fn)
    kwargs = {}
    if "window_size" in kw:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in kw:
        kwargs["is_causal"] = True
    else:
        raise TypeError(f"{getattr(fn, '__qualname__', fn)} takes neither window_size nor is_causal")
    if "scale" in kw:
        kwargs["scale"] = scale
    elif not math.isclose(scale * math.sqrt(q.shape[-1]), 1.0, rel_tol=1e-6):
        q = q * (scale * math.sqrt(q.shape[-1]))
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in kw:
            kwargs["enable_gqa"] = True
        else:
            if q.shape[1] % k.shape[1]:
                raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return fn(q, k, v, cu, cu, max_len, max_len, **kwargs)


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
