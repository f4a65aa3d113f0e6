"""The random Qwen2 factory (areal_hpc/random_models.py): one seed, one model; overrides and the
informative biases and norms."""
import torch

from areal_hpc.random_models import SMALL, qwen_byte_tokenizer, random_qwen2


def test_a_seed_gives_one_model_and_fields_override_the_small_shape():
    a, b, c = random_qwen2(3), random_qwen2(3), random_qwen2(4)
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(x, y), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.config.hidden_size == SMALL["hidden_size"] and a.config.num_key_value_heads == 2
    big = random_qwen2(hidden_size=96, num_hidden_layers=3, tie_word_embeddings=True)
    assert big.config.hidden_size == 96 and len(big.model.layers) == 3
    assert big.config.tie_word_embeddings


def test_biases_and_norms_are_made_informative_only_when_asked():
    plain = random_qwen2()
    informative = random_qwen2(bias_std=0.5, norm=(1.0, 0.2))
    biases = [n for n, _ in plain.named_parameters() if n.endswith("bias")]
    norms = [n for n, _ in plain.named_parameters() if "norm" in n]
    assert biases and norms
    params = dict(plain.named_parameters())
    assert all(not params[n].any() for n in biases) and all((params[n] == 1).all() for n in norms)
    params = dict(informative.named_parameters())
    assert all(0.2 < params[n].std() < 1.0 for n in biases if params[n].numel() > 8)
    assert all(params[n].std() > 0.05 and abs(params[n].mean() - 1) < 0.2 for n in norms)


def test_the_byte_tokenizer_puts_the_specials_at_qwens_ids(tmp_path):
    tok = qwen_byte_tokenizer(tmp_path, eos=300, max_len=64)
    assert tok.eos_token_id == tok.pad_token_id == 300
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [301, 302]
    assert tok.decode(tok("hi 7")["input_ids"]) == "hi 7"
    assert (tmp_path / "tokenizer_config.json").exists()
