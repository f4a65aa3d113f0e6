"""Fixtures of the tests that start a real vLLM engine on the tiny random Qwen2
(test_vllm_engine.py's `make_tiny_model`)."""
import pytest

from tests.rollout.test_vllm_engine import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 and its character tokenizer, written once per test module."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    make_tiny_model(path)
    return str(path)
