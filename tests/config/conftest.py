"""A small, complete model directory and datasets for the input checks (no weights: check_inputs
only looks for the safetensors files, it does not read them)."""
import json
from pathlib import Path

import pytest

# The tiny model's config.json (tools/make_tiny_model.py), as the checks see it.
TINY_HF = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 64,
    "eos_token_id": 1, "pad_token_id": 0,
}
ALPHABET = "0123456789+=,\\boxed{}"


def write_model_dir(out: Path, hf: dict = TINY_HF) -> Path:
    from transformers import Qwen2Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", *ALPHABET])}
    Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, pad_token="<pad>", eos_token="<eos>",
                   model_max_length=512).save_pretrained(out)
    (out / "model.safetensors").write_bytes(b"")
    return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def datasets(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("data")
    math_rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    code_rows = [{"prompt": "echo", "tests": [{"input": "1\n", "output": "1\n"}]} for _ in range(3)]
    out = {"math": d / "math.jsonl", "code": d / "code.jsonl"}
    out["math"].write_text("".join(json.dumps(r) + "\n" for r in math_rows))
    out["code"].write_text("".join(json.dumps(r) + "\n" for r in code_rows))
    return out
