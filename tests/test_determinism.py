"""`deterministic: true` (areal_hpc/determinism.py): every setting it names exists in the pinned
stack (read from the installed sources, so an upgrade that drops one fails here), the ranks'
environment carries them on CUDA only, and the key turns per-request seeds on."""
import dataclasses
import importlib.util
from pathlib import Path

import torch

from areal_hpc import determinism
from areal_hpc.config import load
from areal_hpc.launch.env import rank_env

BASE = ["model.path=x", "data.train_path=x"]


def _source(module: str, relative: str) -> str:
    """The text of a file of an installed package, without importing it."""
    root = Path(next(iter(importlib.util.find_spec(module).submodule_search_locations)))
    return (root / relative).read_text()


def test_every_setting_exists_in_the_pinned_stack():
    envs = _source("vllm", "envs.py")
    assert '"VLLM_BATCH_INVARIANT"' in envs
    invariant = _source("vllm", "model_executor/determinism/batch_invariant.py")
    assert "def init_batch_invariance" in invariant and "envs.VLLM_BATCH_INVARIANT" in invariant
    assert "init_batch_invariance()" in _source("vllm", "v1/worker/gpu_worker.py")
    from megatron.core.model_parallel_config import ModelParallelConfig
    assert "deterministic_mode" in {f.name for f in dataclasses.fields(ModelParallelConfig)}
    te = _source("megatron", "core/extensions/transformer_engine.py")
    assert '"NVTE_ALLOW_NONDETERMINISTIC_ALGO"' in te
    assert callable(torch.use_deterministic_algorithms)
    # the settings table names each of these
    names = {k for s in determinism.SETTINGS for k in s.env}
    assert names == {"VLLM_BATCH_INVARIANT", "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
                     "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO"}


def test_the_ranks_environment_carries_the_settings_on_cuda_only():
    gpu = load("configs/qwen2_5_1_5b_math.yaml", [*BASE, "deterministic=true"])
    env = rank_env(gpu)
    assert env["VLLM_BATCH_INVARIANT"] == "1" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert env["NCCL_ALGO"] == "Ring" and env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert "VLLM_BATCH_INVARIANT" not in rank_env(load("configs/qwen2_5_1_5b_math.yaml", BASE))
    cpu = load("configs/tiny_cpu.yaml", [*BASE, "deterministic=true"])
    assert "VLLM_BATCH_INVARIANT" not in rank_env(cpu)
    assert "CUBLAS" in determinism.summary("cuda") and "CPU" in determinism.summary("cpu")


def test_the_key_turns_per_request_seeds_on():
    assert not determinism.seeded(load("configs/tiny_cpu.yaml", BASE))
    assert determinism.seeded(load("configs/tiny_cpu.yaml", [*BASE, "deterministic=true"]))
    assert determinism.seeded(load("configs/tiny_cpu.yaml", [*BASE, "rollout.per_request_seeds=true"]))
