"""`deterministic: true` (areal_hpc/determinism.py): every setting it names exists in the pinned
stack (read from the installed sources, so an upgrade that drops one fails here), the ranks'
environment carries them on CUDA only, the key turns per-request seeds on, the NCCL weight
group is made under vLLM's unpinned NCCL environment when batch invariance is on, and an NCCL
below the floor of that environment is refused on CUDA with one line."""
import contextlib
import dataclasses
import importlib.util
import inspect
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from areal_hpc import determinism, preflight
from areal_hpc.config import ConfigError, load
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


@pytest.fixture
def nccl_at_floor(monkeypatch):
    """This machine's NCCL (none on a CPU torch, any release on a GPU box) out of the way: the
    summary's refusal is tested on its own below."""
    monkeypatch.setattr(determinism, "installed_nccl", lambda: (determinism.NCCL_FLOOR, "a test"))


def test_no_transformer_engine_switch(nccl_at_floor):
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


def test_the_ranks_environment_carries_the_settings_on_cuda_only(nccl_at_floor):
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

    def is_completed(self):     # polled by transport/weights/broadcast.py's `finish`
        return True

    def wait(self):
        return True


@pytest.mark.filterwarnings("ignore:Attempted to get default timeout")
@pytest.mark.parametrize("on", [True, False])
def test_the_nccl_weight_group_is_made_under_the_unpinned_env(monkeypatch, fake_unpinned, on):
    """With batch invariance on, the NCCL group is made, and its communicator with it (one
    broadcast at join, since torch makes it at the first collective), inside vLLM's context;
    off, outside it; a gloo group never enters it. The CUDA parts are faked on CPU."""
    from areal_hpc.transport.rendezvous import free_port
    from areal_hpc.transport.weights import WeightGroupAddress, init_weight_group
    from areal_hpc.transport.weights import broadcast as bc

    _invariance(monkeypatch, on)
    made, real = [], bc.stateless_group

    def stateless_pg(store, rank, size, timeout, backend):
        if backend != "nccl":
            return real(store, rank, size, timeout, backend)
        # made inside vLLM's context (when on), with timeouts an error, not the process ended
        made.append((fake_unpinned.active, os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")))
        return _FakeGroup(fake_unpinned)

    monkeypatch.setattr(bc, "stateless_group", stateless_pg)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **kw: zeros(*a, **kw))
    group = init_weight_group(WeightGroupAddress("127.0.0.1", free_port(), 1, "nccl", 60), 0)
    assert made == [(on, "2")] and group.broadcasts == [(on, 0, 1)]
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


FLOOR_LINE = ("config key 'deterministic': true on CUDA needs NCCL >= 2.29.7, found NCCL {} (a "
              "test's NCCL): vLLM's batch invariance pins NCCL settings in its engine and makes "
              "the weight group without them only through NCCL_NO_CACHE (NCCL 2.29.7), else the "
              "weight update may hang; install NCCL >= 2.29.7 (the nvidia-nccl wheel torch loads) "
              "or set deterministic: false")


@pytest.mark.parametrize("found", [(2, 29, 6), (2, 28, 9), (2, 19, 3), (1, 99, 99), (2, 27, 5, "")])
def test_an_nccl_below_the_floor_is_named_with_the_floor_and_the_key(found):
    assert determinism.nccl_problem(found, "a test's NCCL") == FLOOR_LINE.format(
        ".".join(map(str, found[:3])))


@pytest.mark.parametrize("found", [(2, 29, 7), (2, 29, 7, "+cuda13.0"), (2, 29, 8), (2, 30, 0),
                                   (2, 32, 3), (3, 0, 0)])
def test_an_nccl_at_or_above_the_floor_passes(found):
    assert determinism.nccl_problem(found, "a test's NCCL") is None


def test_no_nccl_passes():
    """A CPU torch has no NCCL: nothing to check (and this CPU box's torch reads as none)."""
    assert determinism.nccl_problem(None) is None
    if torch.version.cuda is None:
        assert determinism.installed_nccl() is None
        determinism.check_nccl("cuda")          # a CUDA config checked on a CPU torch: skipped
        assert "CUBLAS" in determinism.summary("cuda")


def test_nccls_version_number_is_read_as_nccl_writes_it():
    """ncclGetVersion's integer: major*10000 + minor*100 + patch since 2.9, *1000 before."""
    assert determinism._decode(22907) == (2, 29, 7)
    assert determinism._decode(23203) == (2, 32, 3)
    assert determinism._decode(21805) == (2, 18, 5)
    assert determinism._decode(2708) == (2, 7, 8)


@pytest.mark.parametrize("found", [(2, 28, 9), (2, 29, 7), None])
def test_the_preflight_summary_refuses_an_nccl_below_the_floor_on_cuda(monkeypatch, found):
    """`summary` (the launchers' preflight, for `deterministic: true`, before any rank starts)
    raises the one line on CUDA below the floor; at it, or without NCCL, it says the settings;
    on CPU NCCL is not read."""
    monkeypatch.setattr(determinism, "installed_nccl",
                        lambda: None if found is None else (found, "a test's NCCL"))
    if found == (2, 28, 9):
        with pytest.raises(ConfigError) as err:
            determinism.summary("cuda")
        assert str(err.value) == FLOOR_LINE.format("2.28.9")
    else:
        assert "NCCL_PROTO=Simple" in determinism.summary("cuda")

    def unread():
        raise AssertionError("NCCL read for a CPU run")

    monkeypatch.setattr(determinism, "installed_nccl", unread)
    assert "on CPU" in determinism.summary("cpu")
    determinism.check_nccl("cpu")


def test_every_launcher_refuses_through_the_summary():
    """Every launcher (launch/env.py, launch/local.py, launch/submit.py) runs preflight.launcher
    and turns its ConfigError into `error: <line>` and exit 2: the summary is called there for
    `deterministic: true`."""
    src = inspect.getsource(preflight.launcher)
    assert "if cfg.deterministic:" in src and "determinism.summary(cfg.topology.device)" in src
