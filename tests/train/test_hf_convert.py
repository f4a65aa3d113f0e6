"""Qwen2 HF <-> Megatron conversion: exact round trip and equal logits (world size 1, gloo)."""

import pytest
import torch
from transformers import Qwen2ForCausalLM

from areal_hpc.random_models import random_qwen2
from areal_hpc.train.hf_convert import (
    gpt_model_kwargs,
    hf_to_megatron,
    megatron_config_kwargs,
    megatron_to_hf,
)


def tiny_qwen2(tie: bool, seed: int = 0) -> Qwen2ForCausalLM:
    return random_qwen2(seed, bias_std=0.5, norm=(0.5, 0.5), tie_word_embeddings=tie,
                        rope_theta=10000.0).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_is_exact(tie):
    model = tiny_qwen2(tie)
    sd = model.state_dict()
    mcore = hf_to_megatron(sd, model.config)
    assert ("output_layer.weight" in mcore) is not tie
    assert mcore["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (4 * 16 + 2 * 2 * 16, 64)
    assert mcore["decoder.layers.0.mlp.linear_fc1.weight"].shape == (256, 64)
    back = megatron_to_hf(mcore, model.config)
    expected = set(sd) - ({"lm_head.weight"} if tie else set())
    assert set(back) == expected
    for name in expected:
        assert torch.equal(back[name], sd[name]), name


def test_qkv_layout_is_per_query_group():
    # nh=4, ng=2, hn=1, h=1: q heads 0..3, k heads 0..1, v heads 0..1 tagged by value.
    cfg = {"hidden_size": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 1,
           "num_hidden_layers": 1, "intermediate_size": 2, "tie_word_embeddings": True}
    hf = {"model.embed_tokens.weight": torch.zeros(3, 4), "model.norm.weight": torch.ones(4)}
    p = "model.layers.0."
    hf[p + "self_attn.q_proj.bias"] = torch.tensor([10.0, 11.0, 12.0, 13.0])
    hf[p + "self_attn.k_proj.bias"] = torch.tensor([20.0, 21.0])
    hf[p + "self_attn.v_proj.bias"] = torch.tensor([30.0, 31.0])
    for n in "qkv":
        hf[p + f"self_attn.{n}_proj.weight"] = hf[p + f"self_attn.{n}_proj.bias"][:, None].clone()
    hf[p + "mlp.gate_proj.weight"] = torch.full((2, 4), 1.0)
    hf[p + "mlp.up_proj.weight"] = torch.full((2, 4), 2.0)
    for n in ["input_layernorm.weight", "post_attention_layernorm.weight"]:
        hf[p + n] = torch.ones(4)
    hf[p + "self_attn.o_proj.weight"] = torch.eye(4)
    hf[p + "mlp.down_proj.weight"] = torch.ones(4, 2)
    mc = hf_to_megatron(hf, cfg)
    qkv = mc["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert qkv.tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert mc["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [1, 1, 2, 2]


@pytest.mark.parametrize("ng", [1, 2, 4])
def test_split_tensors_own_their_storage(ng):
    """Every HF tensor made from a fused one has storage of its own (safetensors refuses shared
    storage), whether the split needed a copy (ng > 1) or was a view (ng = 1)."""
    from areal_hpc.train.hf_convert import conversion_rules

    cfg = {"hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": ng, "head_dim": 2,
           "num_hidden_layers": 1, "intermediate_size": 6, "tie_word_embeddings": True}
    rules = conversion_rules(cfg)
    for mc, fused in [("self_attention.linear_qkv.weight", torch.randn((4 + 2 * ng) * 2, 8)),
                      ("self_attention.linear_qkv.bias", torch.randn((4 + 2 * ng) * 2)),
                      ("mlp.linear_fc1.weight", torch.randn(12, 8))]:
        rule = rules["decoder.layers.0." + mc]
        parts = rule.to_hf(fused)
        ptrs = {t.untyped_storage().data_ptr() for t in parts} | {fused.untyped_storage().data_ptr()}
        assert len(ptrs) == len(parts) + 1, mc
        assert torch.equal(rule.to_megatron(*parts), fused), mc


def test_config_kwargs_from_object_and_config_json_dict():
    model = tiny_qwen2(tie=True)
    kw = megatron_config_kwargs(model.config)
    assert (kw["num_layers"], kw["hidden_size"], kw["num_attention_heads"]) == (2, 64, 4)
    assert (kw["num_query_groups"], kw["kv_channels"], kw["ffn_hidden_size"]) == (2, 16, 128)
    assert kw["normalization"] == "RMSNorm" and kw["add_qkv_bias"] and not kw["add_bias_linear"]
    assert kw["layernorm_epsilon"] == model.config.rms_norm_eps
    gk = gpt_model_kwargs(model.config)
    assert gk["rotary_base"] == 10000.0 and gk["share_embeddings_and_output_weights"]
    # A transformers-4.x style config.json (Qwen2.5): rope_theta at top level, rope_scaling null.
    legacy = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 128,
              "max_position_embeddings": 256, "rope_theta": 1000000.0, "rope_scaling": None,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "use_sliding_window": False}
    assert gpt_model_kwargs(legacy)["rotary_base"] == 1000000.0
    with pytest.raises(NotImplementedError):
        gpt_model_kwargs({**legacy, "rope_scaling": {"type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("tie", [False, True])
def test_megatron_logits_equal_hf_logits(megatron_ws1, tie):
    from areal_hpc.train.megatron_model import build_gpt_model, hf_state_dict, load_hf_weights

    hf = tiny_qwen2(tie, seed=1)
    gpt = build_gpt_model(hf.config, params_dtype=torch.float32, tp=1, pp=1).eval()
    load_hf_weights(gpt, hf.state_dict(), hf.config)
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(0))
    # Megatron's own default causal mask is built on "cuda": always pass one.
    causal = torch.ones(37, 37, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        ref = hf(ids).logits
        out = gpt(ids, torch.arange(37).expand(2, 37), causal)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-4
    # ... and the export gives back exactly the HF weights.
    exported = hf_state_dict(gpt, hf.config)
    sd = hf.state_dict()
    assert set(exported) == set(sd) - ({"lm_head.weight"} if tie else set())
    for name, tensor in exported.items():
        assert torch.equal(tensor, sd[name]), name
