"""`deterministic: true` (areal_hpc/determinism.py): every setting it names exists in the pinned
stack (read from the installed sources, so an upgrade that drops one fails here), the ranks'
environment carries them on CUDA only, the key turns per-request seeds on, and the NCCL weight
group is made under vLLM's unpinned NCCL environment when batch invariance is on."""
import contextlib
import dataclasses
import importlib.util
import inspect
import logging
import sys
from pathlib import Path

import pytest
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
    assert callable(torch.use_deterministic_algorithms)
    # the settings table names each of these
    names = {k for s in determinism.SETTINGS for k in s.env}
    assert names == {"VLLM_BATCH_INVARIANT", "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO"}


def test_no_transformer_engine_switch():
    """Megatron reads NVTE_ALLOW_NONDETERMINISTIC_ALGO in TransformerEngine's attention only;
    the trainer builds the local layer spec, so the mode does not set it."""
    te = _source("megatron", "core/extensions/transformer_engine.py")
    assert '"NVTE_ALLOW_NONDETERMINISTIC_ALGO"' in te and "class TEDotProductAttention" in te
    spec = _source("areal_hpc", "train/attention.py")
    assert "get_gpt_layer_local_spec(" in spec and "transformer_engine" not in spec
    assert not any("NVTE" in k for s in determinism.SETTINGS for k in s.env)
    assert "NVTE" not in determinism.summary("cuda")
    assert "NVTE" not in _source("areal_hpc", "determinism.py").split('"""')[2]   # past the docstring


def test_vllm_pins_nccl_and_has_the_unpinned_context():
    """What broadcast.unpinned_nccl_env relies on, in the installed vLLM: batch invariance pins
    NCCL through `pin_nccl_env`, and `vllm.utils.nccl.unpinned_nccl_env()` (no arguments, a
    context manager) makes communicators without the pins."""
    invariant = _source("vllm", "model_executor/determinism/batch_invariant.py")
    assert "from vllm.utils.nccl import pin_nccl_env" in invariant and "pin_nccl_env(" in invariant
    from vllm.utils import nccl
    assert inspect.signature(nccl.unpinned_nccl_env).parameters == {}
    with nccl.unpinned_nccl_env():          # nothing pinned in this process: changes nothing
        pass


def test_the_ranks_environment_carries_the_settings_on_cuda_only():
    gpu = load("configs/qwen2_5_1_5b_math.yaml", [*BASE, "deterministic=true"])
    env = rank_env(gpu)
    assert env["VLLM_BATCH_INVARIANT"] == "1" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert env["NCCL_ALGO"] == "Ring" and env["NCCL_PROTO"] == "Simple"
    assert "VLLM_BATCH_INVARIANT" not in rank_env(load("configs/qwen2_5_1_5b_math.yaml", BASE))
    cpu = load("configs/tiny_cpu.yaml", [*BASE, "deterministic=true"])
    assert "VLLM_BATCH_INVARIANT" not in rank_env(cpu)
    assert "CUBLAS" in determinism.summary("cuda") and "CPU" in determinism.summary("cpu")


def test_the_key_turns_per_request_seeds_on():
    assert not determinism.seeded(load("configs/tiny_cpu.yaml", BASE))
    assert determinism.seeded(load("configs/tiny_cpu.yaml", [*BASE, "deterministic=true"]))
    assert determinism.seeded(load("configs/tiny_cpu.yaml", [*BASE, "rollout.per_request_seeds=true"]))


class _FakeUnpinned:
    """Stands in for vLLM's `unpinned_nccl_env`: records whether it is entered."""

    def __init__(self):
        self.active = False
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self):
        self.active, self.entered = True, self.entered + 1
        try:
            yield
        finally:
            self.active = False


@pytest.fixture
def fake_unpinned(monkeypatch):
    from vllm.utils import nccl
    fake = _FakeUnpinned()
    monkeypatch.setattr(nccl, "unpinned_nccl_env", fake)
    return fake


def _invariance(monkeypatch, on: bool) -> None:
    import vllm.envs
    monkeypatch.setattr(vllm.envs, "VLLM_BATCH_INVARIANT", on, raising=False)


class _FakeGroup:
    """Stands in for the NCCL group vLLM's platform makes: records, for each broadcast, whether
    the unpinned context was active."""

    def __init__(self, fake):
        self.fake, self.broadcasts = fake, []

    def broadcast(self, tensor, root):
        self.broadcasts.append((self.fake.active, root, tensor.numel()))
        return self

    def wait(self):
        return True


@pytest.mark.filterwarnings("ignore:Attempted to get default timeout")
@pytest.mark.parametrize("on", [True, False])
def test_the_nccl_weight_group_is_made_under_the_unpinned_env(monkeypatch, fake_unpinned, on):
    """With batch invariance on, the NCCL group is made, and its communicator with it (one
    broadcast at join, since torch makes it at the first collective), inside vLLM's context;
    off, outside it; a gloo group never enters it. The CUDA parts are faked on CPU."""
    from vllm.platforms import current_platform

    from areal_hpc.transport.rendezvous import free_port
    from areal_hpc.transport.weights import WeightGroupAddress, init_weight_group

    _invariance(monkeypatch, on)
    made = []

    def stateless_pg(**kw):
        made.append(fake_unpinned.active)
        return _FakeGroup(fake_unpinned)

    monkeypatch.setattr(current_platform, "stateless_init_device_torch_dist_pg", stateless_pg,
                        raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **kw: zeros(*a, **kw))
    group = init_weight_group(WeightGroupAddress("127.0.0.1", free_port(), 1, "nccl", 60), 0)
    assert made == [on] and group.broadcasts == [(on, 0, 1)]
    assert fake_unpinned.entered == int(on) and not fake_unpinned.active
    init_weight_group(WeightGroupAddress("127.0.0.1", free_port(), 1, "gloo", 60), 0)
    assert fake_unpinned.entered == int(on)


def test_a_vllm_without_the_context_is_named(monkeypatch, caplog):
    from areal_hpc.transport.weights import broadcast

    _invariance(monkeypatch, True)
    monkeypatch.setitem(sys.modules, "vllm.utils.nccl", None)      # the import fails
    with caplog.at_level(logging.WARNING, logger=broadcast.__name__):
        with broadcast.unpinned_nccl_env():
            pass
    assert "no vllm.utils.nccl.unpinned_nccl_env" in caplog.text and "may hang" in caplog.text
