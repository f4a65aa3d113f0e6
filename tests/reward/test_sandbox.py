"""The launcher check (sandbox.check_available, preflight.generator_node) and the sandbox's own
API."""
import os

import pytest

import areal_hpc.reward.sandbox as sb
from areal_hpc.config import ConfigError, RunConfig, load
from areal_hpc.preflight import generator_node
from areal_hpc.reward.sandbox import Sandbox, SandboxUnavailable, check_available

PATH = os.environ["PATH"]


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
    with pytest.raises(SandboxUnavailable, match="bwrap not found: apt-get install bubblewrap") as e:
        check_available(cfg("code"))
    assert "reward.unsafe_no_sandbox=true" in str(e.value)
    with pytest.raises(ConfigError) as line:       # the preflight's line names the key
        generator_node(cfg("code"))
    assert str(line.value) == f"config key 'data.kind': {e.value}" and "\n" not in str(line.value)


def test_a_math_job_does_not_need_the_sandbox(no_bwrap):
    check_available(cfg("math"))
    generator_node(cfg("math"))


def test_the_python_tool_needs_the_sandbox_at_start_too(no_bwrap, tmp_path, monkeypatch):
    """A math job whose episodes use the Python tool (env.fn=python) is refused on the generator's
    node in one line, as a code job is (else every episode's reset would fail in its child);
    the unsafe opt-out is the code reward's, not the tool's; another environment needs nothing."""
    for unsafe in (False, True):
        tool = load(None, ["model.path=m", "data.train_path=t", "env.fn=python",
                           f"reward.unsafe_no_sandbox={str(unsafe).lower()}"])
        with pytest.raises(ConfigError) as line:
            generator_node(tool)
        assert str(line.value) == ("config key 'env.fn': the Python tool runs model-written code in "
                                   "the code sandbox, which cannot be set up on this node: bwrap "
                                   "not found: apt-get install bubblewrap"), str(line.value)
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n')
    monkeypatch.setenv("PATH", PATH)    # (still no sandbox: the environment's child needs none)
    generator_node(load(None, ["model.path=m", f"data.train_path={data}", "env.fn=calculator"]))


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


# ---- memory no process owns, keyrings, open files, CLONE_PARENT (the seccomp filter) ----------

needs_sandbox = pytest.mark.skipif(not Sandbox.available()[0],
                                   reason=f"no code sandbox here: {Sandbox.available()[1]}")

MEMFD_HOG = """
import os
fds = []
for _ in range(32):                      # 1 GiB that no process maps: RLIMIT_AS never sees it
    fd = os.memfd_create("hog")
    os.ftruncate(fd, 32 << 20)
    os.write(fd, b"x" * (32 << 20))
    fds.append(fd)
print("held", len(fds))
"""


@needs_sandbox
def test_a_memfd_hog_gets_reward_0_with_a_reason():
    from areal_hpc.reward.code import run_tests

    res = run_tests(MEMFD_HOG, [{"input": "", "output": "held 32"}], timeout_s=20, memory_mb=256)
    assert res["reward"] == 0.0 and res["error"] is None, res
    assert "PermissionError" in res["errors"][0], res   # memfd_create refused by the filter


@needs_sandbox
def test_keyrings_carry_nothing_from_one_test_to_the_next():
    store = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
nr = {"x86_64": 248, "aarch64": 217}[__import__("platform").machine()]   # add_key
print(libc.syscall(nr, b"user", b"areal-secret", b"answer=42", 9, -4), ctypes.get_errno())
"""
    read = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
nr = {"x86_64": 249, "aarch64": 218}[__import__("platform").machine()]   # request_key
print(libc.syscall(nr, b"user", b"areal-secret", None, 0), ctypes.get_errno())
"""
    first = Sandbox().run(store, timeout_s=10, memory_mb=256)
    second = Sandbox().run(read, timeout_s=10, memory_mb=256)
    assert first.stdout.split() == [b"-1", b"1"], first          # EPERM: nothing stored
    assert second.stdout.split() == [b"-1", b"1"], second        # EPERM: nothing found


@needs_sandbox
def test_open_files_are_capped_and_the_cap_cannot_be_raised():
    res = Sandbox().run("""
import os, resource
print(resource.getrlimit(resource.RLIMIT_NOFILE))
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 16, 1 << 16))
except ValueError:
    print("refused")
n = 0
try:
    while True:
        os.pipe()
        n += 2
except OSError:
    print(n < sb.MAX_OPEN_FILES)
""".replace("sb.MAX_OPEN_FILES", str(sb.MAX_OPEN_FILES)), timeout_s=10, memory_mb=256)
    assert res.stdout.decode().split("\n")[:3] == [
        f"({sb.MAX_OPEN_FILES}, {sb.MAX_OPEN_FILES})", "refused", "True"], res


@needs_sandbox
def test_a_child_made_with_clone_parent_is_refused():
    """CLONE_PARENT would make the child a sibling of its maker: outside the tree of the test."""
    res = Sandbox().run("""
import ctypes, os, platform
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 56, "aarch64": 220}[platform.machine()]
rc = libc.syscall(nr, 17 | 0x8000, 0, 0, 0, 0)    # SIGCHLD | CLONE_PARENT
if rc == 0:
    os._exit(0)
print(rc, os.strerror(ctypes.get_errno()))
""", timeout_s=10, memory_mb=256)
    assert res.stdout.decode().strip() == "-1 Operation not permitted", res
