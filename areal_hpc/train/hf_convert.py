"""Qwen2 (Hugging Face) <-> Megatron-core GPTModel (local spec): config and weight layouts.

Full, unsharded tensors on both sides; TP sharding and gathering live in `megatron_model.py`.
Layer indices are global (`decoder.layers.{i}` with i in [0, num_layers)).

Layout differences:
- attention: HF has separate q/k/v projections (with bias). Megatron fuses them into `linear_qkv`
  as `[ng, (nh/ng + 2) * hn, h]` flattened to `[ng * (nh/ng + 2) * hn, h]`: per query group, its
  nh/ng query heads, then its key head, then its value head. The bias follows the same layout.
- MLP: Megatron's `linear_fc1` is `[gate; up]` stacked on dim 0 (swiglu); `linear_fc2` is down.
- norms: RMSNorm weights map one to one (both compute `weight * x / rms(x)`).
- tied embeddings (`tie_word_embeddings`, e.g. Qwen2.5-1.5B): Megatron has no `output_layer`;
  the HF dict gets no `lm_head.weight`, as in HF's own safetensors files.

`hf_config` is a `transformers.PretrainedConfig` or the plain dict of `config.json`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_ATTN_Q = "model.layers.{i}.self_attn.q_proj"
_ATTN_K = "model.layers.{i}.self_attn.k_proj"
_ATTN_V = "model.layers.{i}.self_attn.v_proj"

# Per-layer tensors that map one to one (HF suffix, Megatron suffix).
_LAYER_RENAMES = [
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
]


def _cfg(hf_config: Any, key: str, default: Any = None) -> Any:
    if isinstance(hf_config, dict):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def _rope_theta(hf_config: Any) -> float:
    """rope base; transformers 5 nests it in `rope_parameters`, config.json files of 4.x do not."""
    params = _cfg(hf_config, "rope_parameters") or _cfg(hf_config, "rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"rope scaling {rope_type!r} is not supported")
    theta = params.get("rope_theta", _cfg(hf_config, "rope_theta"))
    return float(theta if theta is not None else 10000.0)


def _dims(hf_config: Any) -> tuple[int, int, int, int]:
    """(num heads, num query groups, head dim, hidden size)."""
    h = _cfg(hf_config, "hidden_size")
    nh = _cfg(hf_config, "num_attention_heads")
    ng = _cfg(hf_config, "num_key_value_heads") or nh
    hn = _cfg(hf_config, "head_dim") or h // nh
    return nh, ng, hn, h


def tied_embeddings(hf_config: Any) -> bool:
    return bool(_cfg(hf_config, "tie_word_embeddings", False))


def megatron_config_kwargs(hf_config: Any) -> dict:
    """`TransformerConfig` kwargs describing the architecture (no parallelism, dtype or init)."""
    if _cfg(hf_config, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not supported")
    if _cfg(hf_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"activation {_cfg(hf_config, 'hidden_act')!r}")
    nh, ng, hn, h = _dims(hf_config)
    return dict(
        num_layers=_cfg(hf_config, "num_hidden_layers"),
        hidden_size=h,
        num_attention_heads=nh,
        num_query_groups=ng,
        kv_channels=hn,
        ffn_hidden_size=_cfg(hf_config, "intermediate_size"),
        normalization="RMSNorm",
        layernorm_epsilon=_cfg(hf_config, "rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        # RL recomputes log-probs that must match the sampler: no dropout anywhere.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Kernel fusions default to off in 0.16; set explicitly, they need TE/Apex or CUDA.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def gpt_model_kwargs(hf_config: Any) -> dict:
    """`GPTModel` kwargs besides `config` and `transformer_layer_spec`."""
    return dict(
        vocab_size=_cfg(hf_config, "vocab_size"),
        max_sequence_length=_cfg(hf_config, "max_position_embeddings"),
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf_config),
        rotary_percent=1.0,
        share_embeddings_and_output_weights=tied_embeddings(hf_config),
    )


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nh: int, ng: int, hn: int):
    """HF q `[nh*hn, ...]`, k/v `[ng*hn, ...]` -> Megatron `[ng*(nh/ng+2)*hn, ...]`."""
    tail = q.shape[1:]
    q = q.reshape(ng, nh // ng * hn, *tail)
    k = k.reshape(ng, hn, *tail)
    v = v.reshape(ng, hn, *tail)
    return torch.cat([q, k, v], dim=1).reshape(ng * (nh // ng + 2) * hn, *tail)


def _split_qkv(qkv: torch.Tensor, nh: int, ng: int, hn: int):
    """Inverse of `_fuse_qkv`."""
    tail = qkv.shape[1:]
    grouped = qkv.reshape(ng, (nh // ng + 2) * hn, *tail)
    q, k, v = torch.split(grouped, [nh // ng * hn, hn, hn], dim=1)
    return (
        q.reshape(nh * hn, *tail).clone(),
        k.reshape(ng * hn, *tail).clone(),
        v.reshape(ng * hn, *tail).clone(),
    )


def hf_to_megatron(hf_state_dict: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """HF Qwen2 names/layouts -> full Megatron GPTModel state dict (global layer indices)."""
    nh, ng, hn, _ = _dims(hf_config)
    sd = hf_state_dict
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"]}
    for i in range(_cfg(hf_config, "num_hidden_layers")):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mc_name in _LAYER_RENAMES:
            out[mc + mc_name] = sd[hf + hf_name]
        for kind in ("weight", "bias"):
            q, k, v = (sd[f"{n.format(i=i)}.{kind}"] for n in (_ATTN_Q, _ATTN_K, _ATTN_V))
            out[mc + f"self_attention.linear_qkv.{kind}"] = _fuse_qkv(q, k, v, nh, ng, hn)
        out[mc + "mlp.linear_fc1.weight"] = torch.cat(
            [sd[hf + "mlp.gate_proj.weight"], sd[hf + "mlp.up_proj.weight"]], dim=0
        )
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
    if not tied_embeddings(hf_config):
        out["output_layer.weight"] = sd["lm_head.weight"]
    return out


def megatron_to_hf(mcore_full_state_dict: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Full Megatron GPTModel state dict (global layer indices) -> HF Qwen2 names/layouts.

    Megatron's `_extra_state` entries are ignored. With tied embeddings `lm_head.weight` is left
    out (HF and vLLM tie it on load).
    """
    nh, ng, hn, _ = _dims(hf_config)
    sd = mcore_full_state_dict
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"]}
    for i in range(_cfg(hf_config, "num_hidden_layers")):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mc_name in _LAYER_RENAMES:
            out[hf + hf_name] = sd[mc + mc_name]
        for kind in ("weight", "bias"):
            q, k, v = _split_qkv(sd[mc + f"self_attention.linear_qkv.{kind}"], nh, ng, hn)
            out[f"{_ATTN_Q.format(i=i)}.{kind}"] = q
            out[f"{_ATTN_K.format(i=i)}.{kind}"] = k
            out[f"{_ATTN_V.format(i=i)}.{kind}"] = v
        gate, up = torch.chunk(sd[mc + "mlp.linear_fc1.weight"], 2, dim=0)
        out[hf + "mlp.gate_proj.weight"] = gate.clone()
        out[hf + "mlp.up_proj.weight"] = up.clone()
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    if not tied_embeddings(hf_config):
        out["lm_head.weight"] = sd["output_layer.weight"]
    return out
