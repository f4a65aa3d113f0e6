import pytest



@pytest.fixture(scope="session")
def megatron_ws1():
    """Megatron's parallel state is process-global: initialise it once (tp = pp = 1)."""
    from areal_hpc.train.megatron_model import single_process

    single_process()


def _tiny_qwen2_dir(path, tie: bool, **shape) -> str:
    """A random 2-layer Qwen2 (vocab 128, GQA, informative biases) saved as a HF directory;
    `shape` overrides Qwen2Config fields (a bigger model)."""
    import json

    from areal_hpc.random_models import save_random_qwen2

    save_random_qwen2(path, bias_std=0.1, **{**shape, "tie_word_embeddings": tie})
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return str(path)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return _tiny_qwen2_dir(tmp_path_factory.mktemp("tiny_qwen2"), tie=False)


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory):
    return _tiny_qwen2_dir(tmp_path_factory.mktemp("tiny_qwen2_tied"), tie=True)
