"""The launcher check (sandbox.check_available) and the sandbox's own API."""
import pytest

import areal_hpc.reward.sandbox as sb
from areal_hpc.config import ConfigError, RunConfig, load
from areal_hpc.reward.sandbox import Sandbox, check_available


def cfg(kind: str, unsafe: bool = False) -> RunConfig:
    return load(None, ["model.path=m", "data.train_path=t", f"data.kind={kind}",
                       f"reward.unsafe_no_sandbox={str(unsafe).lower()}"])


@pytest.fixture
def no_bwrap(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    sb.Sandbox.available.cache_clear()
    yield
    sb.Sandbox.available.cache_clear()


def test_unsafe_no_sandbox_defaults_to_false():
    assert RunConfig().reward.unsafe_no_sandbox is False


def test_a_code_job_refuses_to_start_without_the_sandbox(no_bwrap):
    assert Sandbox.available() == (False, "bwrap not found: apt-get install bubblewrap")
    with pytest.raises(ConfigError, match="bwrap not found: apt-get install bubblewrap") as e:
        check_available(cfg("code"))
    assert "reward.unsafe_no_sandbox=true" in str(e.value)


def test_a_math_job_does_not_need_the_sandbox(no_bwrap):
    check_available(cfg("math"))


def test_unsafe_no_sandbox_starts_and_warns_loudly(no_bwrap, capsys, caplog):
    check_available(cfg("code", unsafe=True))
    assert "UNSAFE" in capsys.readouterr().err
    assert any("UNSAFE" in r.getMessage() for r in caplog.records)


def test_user_namespaces_disabled_is_named(monkeypatch):
    monkeypatch.setattr(sb.os, "getuid", lambda: 1000)
    real_open = open

    def fake_open(path, *a, **k):
        if path == "/proc/sys/user/max_user_namespaces":
            import io
            return io.StringIO("0\n")
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(sb.shutil, "which", lambda name: f"/usr/bin/{name}")  # bwrap "found"
    assert sb._unavailable_reason() == (
        "user namespaces disabled (sysctl user.max_user_namespaces = 0)")


@pytest.mark.skipif(not Sandbox.available()[0], reason="no code sandbox here")
def test_available_here_and_a_plain_run():
    sb.Sandbox.available.cache_clear()
    assert Sandbox.available() == (True, "")
    res = Sandbox().run("import sys\nprint(sys.stdin.read().upper())", "abc")
    assert (res.ok, res.stdout, res.returncode, res.sandbox_error) == (True, b"ABC\n", 0, None)
