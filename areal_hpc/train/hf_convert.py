"""Qwen2 (Hugging Face) <-> Megatron-core GPTModel (local spec): config and weight layouts.

Full, unsharded tensors on both sides; TP sharding and gathering live in `megatron_model.py`.
Layer indices are global (`decoder.layers.{i}` with i in [0, num_layers)). `conversion_rules`
is the one table both directions use; a rank can apply it tensor by tensor to what it owns.

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


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
    q, k, v = torch.split(qkv.reshape(ng, (nh // ng + 2) * hn, *tail), [nh // ng * hn, hn, hn], dim=1)
    return tuple(_own(t.reshape(-1, *tail), qkv) for t in (q, k, v))


def _own(t: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """`t` with storage of its own: views sharing one storage cannot be saved by safetensors.
    A reshape that had to copy (ng > 1 in `_split_qkv`) already made one; copying again would
    only cost time on every weight update."""
    return t.clone() if t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() else t


def _fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def _split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.clone(), up.clone()


@dataclass(frozen=True)
class Rule:
    """How one Megatron tensor is made from HF tensors, and back."""

    hf_names: tuple[str, ...]
    to_megatron: Callable[..., torch.Tensor]  # (*hf tensors) -> megatron tensor
    to_hf: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # megatron tensor -> hf tensors


def _rename(hf_name: str) -> Rule:
    return Rule((hf_name,), lambda t: t, lambda t: (t,))


def conversion_rules(hf_config: Any) -> dict[str, Rule]:
    """Megatron global parameter name -> `Rule`, for every parameter of the full model.

    Driving conversions from this table lets a pipeline stage or a TP rank convert only the
    tensors it owns, one at a time, without materialising the whole model.
    """
    nh, ng, hn, _ = _dims(hf_config)
    fuse = lambda q, k, v: _fuse_qkv(q, k, v, nh, ng, hn)  # noqa: E731
    split = lambda qkv: _split_qkv(qkv, nh, ng, hn)  # noqa: E731

    rules = {"embedding.word_embeddings.weight": _rename("model.embed_tokens.weight")}
    for i in range(_cfg(hf_config, "num_hidden_layers")):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        rules[mc + "input_layernorm.weight"] = _rename(hf + "input_layernorm.weight")
        rules[mc + "pre_mlp_layernorm.weight"] = _rename(hf + "post_attention_layernorm.weight")
        rules[mc + "self_attention.linear_proj.weight"] = _rename(hf + "self_attn.o_proj.weight")
        for kind in ("weight", "bias"):
            names = tuple(f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv")
            rules[mc + f"self_attention.linear_qkv.{kind}"] = Rule(names, fuse, split)
        rules[mc + "mlp.linear_fc1.weight"] = Rule(
            (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), _fuse_gate_up, _split_gate_up
        )
        rules[mc + "mlp.linear_fc2.weight"] = _rename(hf + "mlp.down_proj.weight")
    rules["decoder.final_layernorm.weight"] = _rename("model.norm.weight")
    if not tied_embeddings(hf_config):
        rules["output_layer.weight"] = _rename("lm_head.weight")
    return rules


def hf_to_megatron(hf_state_dict: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """HF Qwen2 names/layouts -> full Megatron GPTModel state dict (global layer indices).

    With tied embeddings a `lm_head.weight` in the input is ignored.
    """
    return {
        mc: rule.to_megatron(*(hf_state_dict[n] for n in rule.hf_names))
        for mc, rule in conversion_rules(hf_config).items()
    }


def megatron_to_hf(mcore_full_state_dict: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Full Megatron GPTModel state dict (global layer indices) -> HF Qwen2 names/layouts.

    Megatron's `_extra_state` entries are ignored. Split tensors are copies, so no two outputs
    share storage (safetensors refuses that). With tied embeddings `lm_head.weight` is left out,
    as in HF's own checkpoint files; transformers and vLLM tie it on load.
    """
    out = {}
    for mc, rule in conversion_rules(hf_config).items():
        for name, tensor in zip(rule.hf_names, rule.to_hf(mcore_full_state_dict[mc]), strict=True):
            out[name] = tensor
    return out
