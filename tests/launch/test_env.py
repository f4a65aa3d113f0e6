"""areal_hpc.launch.env's rank environment: the user's exported values win over its defaults,
except over the `deterministic` key's settings, which win with one warning line each on stderr."""
import pytest

from areal_hpc.config import load
from areal_hpc.launch.env import export_lines, forced_env, merged_env

BASE = ["model.path=x", "data.train_path=x"]
GPU = "configs/qwen2_5_1_5b_math.yaml"


@pytest.fixture
def site(monkeypatch):
    """A site's environment: its own NCCL protocol and cuBLAS workspace, the mode's own NCCL
    algorithm already, and a thread count of its choice."""
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.setenv("NCCL_PROTO", "LL128")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")


def _warnings(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_the_deterministic_settings_win_over_the_environment_with_a_warning(site, capsys):
    cfg = load(GPU, [*BASE, "deterministic=true"])
    env = merged_env(cfg)
    assert env["NCCL_PROTO"] == "Simple" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert env["NCCL_ALGO"] == "Ring" and env["VLLM_BATCH_INVARIANT"] == "1"
    assert env["OMP_NUM_THREADS"] == "4"            # not the mode's: the user's value still wins
    lines = _warnings(capsys)
    assert sorted(lines) == [
        "[launch] warning: deterministic: true overrides CUBLAS_WORKSPACE_CONFIG from the "
        "environment: :16:8 -> :4096:8",
        "[launch] warning: deterministic: true overrides NCCL_PROTO from the environment: "
        "LL128 -> Simple"], lines                   # NCCL_ALGO had the mode's value: no line

    exports = export_lines(cfg)
    assert "export NCCL_PROTO=Simple" in exports and "export CUBLAS_WORKSPACE_CONFIG=:4096:8" in exports
    assert "export NCCL_ALGO=Ring" in exports and "export VLLM_BATCH_INVARIANT=1" in exports
    assert not any(ln.startswith("export OMP_NUM_THREADS=") for ln in exports)
    assert len(_warnings(capsys)) == 2


def test_without_the_key_the_environment_wins_silently(site, capsys):
    cfg = load(GPU, BASE)
    assert forced_env(cfg) == {}
    env = merged_env(cfg)
    assert env["NCCL_PROTO"] == "LL128" and env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert "VLLM_BATCH_INVARIANT" not in env
    assert not any("NCCL" in ln or "CUBLAS" in ln for ln in export_lines(cfg))
    assert _warnings(capsys) == []


def test_on_cpu_the_key_sets_no_variable(site, capsys):
    cfg = load("configs/tiny_cpu.yaml", [*BASE, "deterministic=true"])
    assert forced_env(cfg) == {}
    assert merged_env(cfg)["NCCL_PROTO"] == "LL128"
    assert _warnings(capsys) == []
