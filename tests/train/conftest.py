import pytest
import torch
import torch.distributed as dist

from areal_hpc.topology import free_port


@pytest.fixture(scope="session")
def megatron_ws1():
    """Megatron's parallel state is process-global: initialise it once (tp = pp = 1)."""
    from megatron.core import parallel_state

    from areal_hpc.train.megatron_model import init_megatron_parallel

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert dist.get_world_size() == 1, "these tests expect a single-process default group"
    if not parallel_state.model_parallel_is_initialized():
        init_megatron_parallel(tp=1, pp=1, seed=0, backend="gloo")


def _tiny_qwen2_dir(path, tie: bool, **shape) -> str:
    """A random 2-layer Qwen2 (vocab 128, GQA, informative biases) saved as a HF directory;
    `shape` overrides Qwen2Config fields (a bigger model)."""
    import json

    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**{
        **dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
        **shape, "tie_word_embeddings": tie})
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return str(path)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return _tiny_qwen2_dir(tmp_path_factory.mktemp("tiny_qwen2"), tie=False)


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory):
    return _tiny_qwen2_dir(tmp_path_factory.mktemp("tiny_qwen2_tied"), tie=True)
