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


# ---- the reward-function import check: nothing it starts outlives it ---------------------------

DAEMON_AT_IMPORT = '''
import fcntl, os, sys, time
if os.fork() == 0:                       # a double-forked daemon holding stdout and stderr
    os.setsid()
    if os.fork() == 0:
        lock = open(LOCK, "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        open(LOCK + ".ready", "w").close()
        while True:
            print("still here", flush=True)
            time.sleep(0.2)
    os._exit(0)
BLOCK
def f(completion, reference, row):
    return 1.0
'''


def _module(tmp_path, block: bool):
    lock = tmp_path / "daemon.lock"
    mod = tmp_path / "at_import.py"
    mod.write_text(DAEMON_AT_IMPORT.replace("LOCK", repr(str(lock)), 1).replace(
        "LOCK + ", repr(str(lock)) + " + ").replace(
        "BLOCK", "while not os.path.exists(" + repr(str(lock) + ".ready") + "):\n"
                 "    time.sleep(0.05)\n" + ("time.sleep(600)\n" if block else "")))
    return mod, lock


def _launch_env(tmp_path, mod, model) -> list[str]:
    """The tiny CPU config on the session's tiny model (configs/tiny_cpu.yaml's own models/tiny
    would be built first in a fresh clone: minutes of this test spent on something else)."""
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    return [sys.executable, "-m", "areal_hpc.launch.env", str(root / "configs/tiny_cpu.yaml"),
            f"model.path={model}", f"reward.fn={mod}:f", f"output_dir={tmp_path / 'out'}"]


def _lock_free(lock, timeout_s: float = 0.0) -> bool:
    import fcntl
    import time
    deadline = time.monotonic() + timeout_s
    with open(lock) as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)


def test_eval_of_launch_env_is_not_held_open_by_a_daemon_the_check_started(tmp_path, tiny_model):
    """`eval "$(python -m areal_hpc.launch.env ...)"` reads the command's stdout to its end: a
    daemon the user's module starts at import (holding what it inherited) must not keep it open."""
    import shlex
    import subprocess
    mod, lock = _module(tmp_path, block=False)
    cmd = " ".join(map(shlex.quote, _launch_env(tmp_path, mod, tiny_model)))
    res = subprocess.run(["bash", "-c", f'eval "$({cmd})" && echo "run=$AREAL_RUN_DIR"'],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "run=" in res.stdout, res.stderr[-2000:]
    assert _lock_free(lock)           # the check's namespace is gone: no retry needed


def test_killing_launch_env_kills_its_check_child_and_what_that_started(tmp_path, tiny_model):
    import os
    import signal
    import subprocess
    import time
    mod, lock = _module(tmp_path, block=True)
    proc = subprocess.Popen(_launch_env(tmp_path, mod, tiny_model), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(f"{lock}.ready"):
            assert proc.poll() is None and time.monotonic() < deadline, "no check started"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    # the parent-death signal travels asynchronously: wait for the event, bounded
    assert _lock_free(lock, timeout_s=30.0)
