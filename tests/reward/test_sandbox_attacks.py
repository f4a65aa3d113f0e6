"""Attacks on the code-reward sandbox: each is a small program run through the real sandbox
(reward/sandbox.py), some end to end through run_tests and RewardPool; each test asserts the
attack was contained. Bounded: every attack caps itself (forks, bytes, seconds) so that a
regression fails the test instead of taking the machine down.
"""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

import areal_hpc.reward.code as code_mod
from areal_hpc.reward.code import run_tests
from areal_hpc.reward.pool import RewardPool, RewardResult
from areal_hpc.reward.sandbox import (DEFAULT_MAX_PROCESSES, MAX_OUTPUT_BYTES, SANDBOX_UID_BASE,
                                      Sandbox)

OK, WHY = Sandbox.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"no code sandbox here: {WHY}")

GRADER = Path(code_mod.__file__).resolve()
PROJECT = GRADER.parents[2]


def run(program: str, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 256):
    return Sandbox().run(textwrap.dedent(program), stdin, timeout_s=timeout_s,
                         memory_mb=memory_mb)


def out(res) -> str:
    assert res.sandbox_error is None, res.sandbox_error
    assert not res.timed_out, res
    return res.stdout.decode()


def sandbox_processes() -> list[psutil.Process]:
    """As root, sandboxed programs run as SANDBOX_UID_BASE + the caller's pid (this process)."""
    uid = SANDBOX_UID_BASE + os.getpid()
    found = []
    for p in psutil.process_iter(["uids", "status"]):
        try:
            if p.info["uids"].real == uid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, TypeError, AttributeError):
            pass
    return found


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    if os.getuid() == 0:  # elsewhere the sandbox's uid is ours: no way to tell them apart
        assert sandbox_processes() == []


@pytest.fixture
def usr1_counter():
    """Counts SIGUSR1 (the job's preemption flag) received by this, the host process."""
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
    yield got
    signal.signal(signal.SIGUSR1, old)


# ---- reading what it must not read -------------------------------------------------------------

FIND_TOKEN = """
    import os, sys
    token = sys.stdin.readline().strip()   # only its first half: the test knows the rest
    hits = []
    for d in os.listdir("/proc"):
        for name in ("cmdline", "environ"):
            try:
                if token.encode() in open(f"/proc/{d}/{name}", "rb").read():
                    hits.append(f"/proc/{d}/{name}")
            except OSError:
                pass
    for root, dirs, files in os.walk("/"):
        if root.startswith(("/proc", "/sys", "/dev", "/usr", sys.base_prefix)):  # the read-only
            # interpreter tree: /usr and the Python installation
            dirs[:] = []
            continue
        for f in files:
            try:
                if token.encode() in open(os.path.join(root, f), "rb").read(1 << 20):
                    hits.append(os.path.join(root, f))
            except OSError:
                pass
    print(hits)
"""


def test_reference_answer_dataset_and_rank_command_lines_are_unreachable(tmp_path):
    token = "SECRET-" + uuid.uuid4().hex
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.jsonl").write_text(f'{{"question": "q", "answer": "{token}"}}\n')
    # A "rank" whose command line holds the reference answer, as the ranks' did.
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", token])
    try:
        res = run(FIND_TOKEN, stdin=token[:20] + "\n")
        assert out(res) == "[]\n"
        # End to end: the expected output stays in the parent; a cheater prints what it finds.
        cheat = FIND_TOKEN.replace("print(hits)", "print(hits[0] if hits else 'nothing')")
        result = run_tests(textwrap.dedent(cheat), [{"input": token[:20], "output": token}])
        assert result == {"passed": [False], "errors": ["wrong answer"], "reward": 0.0,
                          "error": None}
    finally:
        rank.kill()
        rank.wait()


def test_parent_environment_secret_is_not_inherited(monkeypatch):
    monkeypatch.setenv("AREAL_TEST_SECRET", "hunter2")
    res = run("""
        import os
        print(sorted(os.environ))
        print(open("/proc/self/environ", "rb").read().count(b"hunter2"))
        print(open("/proc/1/environ", "rb").read().count(b"hunter2")
              if os.access("/proc/1/environ", os.R_OK) else 0)
    """)
    assert out(res) == "['LANG', 'PATH']\n0\n0\n"


def test_etc_passwd_home_root_and_project_files_are_invisible():
    paths = ["/etc/passwd", "/etc/shadow", "/etc", "/home", str(PROJECT), str(GRADER),
             str(PROJECT / "setup.cfg"), str(Path.home() / ".bashrc"), "/run"]
    res = run(f"""
        import os
        for p in {paths!r}:
            print(p, os.path.exists(p))
        print(sorted(os.listdir("/")))
    """)
    lines = out(res).splitlines()
    assert lines[:-1] == [f"{p} False" for p in paths]
    # Only the interpreter's read-only tree, /dev, /proc, the scratch and the source.
    top = set(eval(lines[-1]))
    assert top <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "dev", "proc", "tmp",
                   "sandbox", Path(sys.base_prefix).resolve().parts[1]}


def test_proc_shows_no_host_process():
    res = run("""
        import os
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
        print(len(pids), max(pids))
        print(any(b"pytest" in open(f"/proc/{p}/cmdline", "rb").read() for p in pids))
        print(os.getppid())
    """)
    n, highest, pytest_seen, ppid = out(res).split()
    assert int(n) <= 3 and int(highest) <= 3  # bwrap's pid 1, the program (and a transient)
    assert pytest_seen == "False" and ppid == "1"


# ---- writing, signalling, tracing, connecting ----------------------------------------------------

def test_writes_outside_the_scratch_fail_and_nothing_appears_on_the_host(tmp_path):
    before = GRADER.read_bytes()
    targets = ["/evil", "/usr/evil", f"{sys.base_prefix}/evil", "/sandbox/solution.py",
               "/sandbox/evil", str(GRADER), str(tmp_path / "evil"), "/proc/sys/kernel/pid_max",
               "/dev/evil", "/dev/shm/evil"]
    res = run(f"""
        import os
        for t in {targets!r}:
            try:
                with open(t, "a") as f:
                    f.write("x")
                print(t, "written")
            except OSError as e:
                print(t, "refused")
        open("/tmp/mine", "w").write("fine")   # the scratch is writable
        open("/dev/null", "w").write("fine")   # and so is /dev/null
        print(open("/tmp/mine").read())
    """)
    assert out(res).splitlines() == [f"{t} refused" for t in targets] + ["fine"]
    assert GRADER.read_bytes() == before
    assert not (tmp_path / "evil").exists() and not Path("/evil").exists()
    assert not Path(sys.base_prefix, "evil").exists()


def test_grader_source_cannot_be_patched_through_run_tests():
    before = GRADER.read_bytes()
    patch = f"""
        import os
        import importlib.util, sys
        found = [importlib.util.find_spec("areal_hpc")]   # importable anywhere?
        for root, dirs, files in os.walk("/"):
            if root in ("/proc", "/sys", "/dev", "/usr", sys.base_prefix):
                dirs[:] = []   # (the interpreter's tree: find_spec above covers it)
            found += [os.path.join(root, f) for f in files
                      if f == "code.py" and "areal_hpc" in root]
        try:
            open({str(GRADER)!r}, "w").write("def run_tests(*a, **k): return {{'reward': 1.0}}")
            print("patched")
        except OSError:
            print("no grader", found)
    """
    res = run(patch, timeout_s=10.0)
    assert out(res) == "no grader [None]\n"
    result = run_tests(textwrap.dedent(patch), [{"input": "", "output": "patched"}],
                       timeout_s=10.0)
    assert result["reward"] == 0.0 and result["errors"] == ["wrong answer"]
    assert GRADER.read_bytes() == before


def test_signals_to_the_host_reach_nobody(usr1_counter):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        res = run(f"""
            import os, signal
            for pid in (os.getppid(), {os.getpid()}, {victim.pid}, 1):
                for sig in (signal.SIGUSR1, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                        print(pid, "sent")
                    except OSError as e:
                        print(pid, e.errno)
            try:
                os.kill(-1, signal.SIGUSR1)   # everything it may signal: its own sandbox only
                os.killpg(os.getpgid(0), signal.SIGUSR1)
            except OSError:
                pass
            print("alive")
        """)
        time.sleep(0.2)
        assert usr1_counter == []
        assert victim.poll() is None
        # Host pids do not exist in its PID namespace (ESRCH = 3); its parent, bwrap's pid 1,
        # is root's (EPERM = 1) or, as a user, its own sandbox's init.
        lines = out(res).splitlines()
        for pid in (os.getpid(), victim.pid):
            assert lines.count(f"{pid} 3") == 2, lines
        assert lines[-1] == "alive"
    finally:
        victim.kill()
        victim.wait()


def test_killing_its_parent_costs_only_its_own_test():
    res = run("""
        import os, signal
        try:
            os.kill(os.getppid(), signal.SIGKILL)
        except OSError as e:
            print("refused", e.errno)
        print("still here")
    """)
    # As root bwrap's pid 1 is root: refused; as a user it is the sandbox's own init.
    assert res.sandbox_error is None or "sandbox" in res.sandbox_error
    after = run("print(input())", "next test\n")
    assert out(after) == "next test\n"


def test_ptrace_of_parent_and_host_fails():
    res = run(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        for pid in (os.getppid(), {os.getpid()}):
            r = libc.ptrace(16, pid, 0, 0)   # PTRACE_ATTACH
            print(pid, r, ctypes.get_errno() != 0)
    """)
    lines = out(res).splitlines()
    assert all(line.split()[1:] == ["-1", "True"] for line in lines), lines


def test_network_is_unreachable_even_to_a_port_the_host_listens_on():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    abstract = b"\0areal-test-" + uuid.uuid4().hex.encode()
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(abstract)
    unix.listen(1)
    try:
        res = run(f"""
            import socket
            for family, addr in ((socket.AF_INET, ("127.0.0.1", {port})),
                                 (socket.AF_INET, ("1.1.1.1", 53)),
                                 (socket.AF_UNIX, {abstract!r})):
                s = socket.socket(family)
                s.settimeout(1)
                try:
                    s.connect(addr)
                    print("connected")
                except OSError as e:
                    print("refused")
        """)
        assert out(res) == "refused\nrefused\nrefused\n"
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
        unix.close()


def test_capabilities_and_uid_are_unprivileged():
    res = run("""
        import os
        caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith(("CapEff", "CapPrm"))]
        print(os.getuid() != 0, os.geteuid() != 0, caps)
        try:
            os.setuid(0)
            print("root")
        except OSError:
            print("no root")
    """)
    assert out(res) == "True True ['0000000000000000', '0000000000000000']\nno root\n"


def test_no_new_namespaces_in_either_mode():
    """unshare, setns and clone with CLONE_NEW* are refused by the seccomp filter (as root, where
    bwrap has no user namespace to disable them with); a thread and a fork still work."""
    res = run("""
        import ctypes, os, platform, threading
        libc = ctypes.CDLL(None, use_errno=True)
        for name, flag in (("user", 0x10000000), ("mount", 0x20000), ("net", 0x40000000),
                           ("pid", 0x20000000)):
            rc = libc.unshare(flag)
            print(name, rc, os.strerror(ctypes.get_errno()))
        fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        print("setns", libc.setns(fd, 0), os.strerror(ctypes.get_errno()))
        # clone(2) itself, through the C library's syscall(): SIGCHLD | CLONE_NEWUSER
        nr = {"x86_64": 56, "aarch64": 220}[platform.machine()]
        print("clone", libc.syscall(nr, 17 | 0x10000000, 0, 0, 0, 0), os.strerror(ctypes.get_errno()))
        t = threading.Thread(target=lambda: None); t.start(); t.join()
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        print("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    lines = out(res).splitlines()
    assert lines[:6] == ["user -1 Operation not permitted", "mount -1 Operation not permitted",
                         "net -1 Operation not permitted", "pid -1 Operation not permitted",
                         "setns -1 Operation not permitted", "clone -1 Operation not permitted"], lines
    assert lines[6] == "fork 7", lines


def test_the_filter_program_is_well_formed():
    """8 bytes an instruction, every jump inside the program, the last ones returns."""
    import struct

    from areal_hpc.reward import seccomp

    for machine in ("x86_64", "aarch64"):
        prog = seccomp.program(machine)
        ins = [struct.unpack("<HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
        assert len(prog) % 8 == 0 and all(op == 0x06 for op, *_ in ins[-4:])
        assert all(i + 1 + max(jt, jf) < len(ins) for i, (op, jt, jf, _) in enumerate(ins) if op != 0x06)


# ---- processes that outlive or swamp the test ----------------------------------------------------

def test_double_fork_setsid_daemon_dies_with_its_test_and_later_tests_are_unaffected():
    marker = "DAEMON-" + uuid.uuid4().hex
    daemon = f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                # The daemon: rewrite every stdout it can find, ours later, for 20 s.
                code = ("import glob, os, time\\n"
                        "open('/tmp/daemon-up', 'w').close()\\n"
                        "end = time.time() + 20\\n"
                        "while time.time() < end:\\n"
                        "    for p in glob.glob('/proc/*/fd/1') + glob.glob('/tmp/**', recursive=True):\\n"
                        "        try: open(p, 'w').write('HACKED')\\n"
                        "        except OSError: pass\\n"
                        "    os.write(1, b'HACKED')\\n"
                        "    time.sleep(0.01)\\n")
                os.execv(sys.executable, [sys.executable, "-c", code, {marker!r}])
            os._exit(0)
        end = time.time() + 30    # until the daemon runs (its mark), at most 30 s
        while not os.path.exists("/tmp/daemon-up") and time.time() < end:
            time.sleep(0.01)
        print("daemon up" if os.path.exists("/tmp/daemon-up") else "no daemon", flush=True)
    """
    first = run(daemon)
    assert first.sandbox_error is None
    assert b"daemon up" in first.stdout, first.stdout[-300:]
    # Gone when run() returns: bwrap's pid 1 exited, the kernel killed its PID namespace.
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if marker in " ".join(p.info["cmdline"] or [])
                 and p.status() != psutil.STATUS_ZOMBIE]
    assert leftovers == []
    for _ in range(3):
        later = run("import time\ntime.sleep(0.2)\nprint(input())", "untouched\n")
        assert out(later) == "untouched\n"


def test_daemon_through_the_pool_then_honest_code_scores():
    """A program that leaves a daemon behind answers right only once its daemon runs (the
    daemon's mark), so its 1.0 shows the daemon ran; the daemon then writes the answer into
    every stdout it can open for as long as it lives: the honest program after it, in the same
    worker, still prints exactly its own answer."""
    daemon = ("import glob, os, time\n"
              "if os.fork() == 0:\n"
              "    os.setsid()\n"
              "    if os.fork() == 0:\n"
              "        open('/tmp/daemon-up', 'w').close()\n"
              "        while True:\n"
              "            for p in glob.glob('/proc/*/fd/1'):\n"
              "                try: open(p, 'w').write('3')\n"
              "                except OSError: pass\n"
              "            time.sleep(0.01)\n"
              "    os._exit(0)\n"
              "end = time.time() + 30\n"
              "while not os.path.exists('/tmp/daemon-up') and time.time() < end:\n"
              "    time.sleep(0.01)\n"
              "a, b = map(int, input().split())\n"
              "print(a + b if os.path.exists('/tmp/daemon-up') else 'no daemon')\n")
    tests = [{"input": "1 2", "output": "3"}]
    with RewardPool(max_workers=1) as pool:
        pool.submit("daemon", "code", daemon, tests)
        pool.submit("honest", "code", "a, b = map(int, input().split())\nprint(a + b)", tests)
        passed = {"code_tests_run": 1.0, "code_tests_passed": 1.0}
        assert sorted(pool.drain(timeout=60)) == [RewardResult("daemon", 1.0, None, passed),
                                                  RewardResult("honest", 1.0, None, passed)]


def test_fork_flood_is_bounded_and_dies_with_the_test():
    start = time.monotonic()
    res = run("""
        import os, time
        n = 0
        for _ in range(2000):          # the attack caps itself
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                try:
                    os.setsid()
                    while True:
                        time.sleep(1)
                finally:
                    os._exit(0)
            n += 1
        print(n)
    """, timeout_s=10.0)
    n = int(out(res))
    assert n < DEFAULT_MAX_PROCESSES
    assert time.monotonic() - start < 10.0


def test_a_memory_hog_of_many_processes_is_stopped_at_the_tests_limit():
    """Six processes of 100 MiB each, under a 256 MiB test: each is within its own RLIMIT_AS,
    together they pass the limit, and the test is stopped (a failure of the program)."""
    res = run("""
        import os, time
        for _ in range(6):
            if os.fork() == 0:
                block = bytearray(100 << 20)
                time.sleep(30)
                os._exit(0)
        time.sleep(30)
    """, timeout_s=20, memory_mb=256)
    assert res.over_memory and not res.timed_out and res.seconds < 15, res
    from areal_hpc.reward.code import run_tests
    prog = "import os, time\nfor _ in range(6):\n    if os.fork() == 0:\n        b = bytearray(100 << 20)\n        time.sleep(30)\ntime.sleep(30)\n"
    out = run_tests(f"```python\n{prog}```", [{"input": "", "output": ""}], timeout_s=20,
                    memory_mb=256)
    assert out["reward"] == 0.0 and out["error"] is None
    assert out["errors"][0] == "memory limit exceeded (256 MiB, its processes together)"


def test_memory_hog_gets_memory_error():
    res = run("""
        blocks = []
        for _ in range(100):          # 10 GB at most, far above the 256 MB limit
            blocks.append(bytearray(100 << 20))
        print("allocated")
    """, memory_mb=256)
    assert res.returncode == 1 and res.stderr_tail == "MemoryError" and res.stdout == b""


def test_endless_output_is_cut():
    start = time.monotonic()
    res = run("""
        import sys
        chunk = "x" * (1 << 20)
        for _ in range(100):          # 100 MB at most
            sys.stdout.write(chunk)
    """, timeout_s=20.0)
    assert len(res.stdout) <= MAX_OUTPUT_BYTES
    assert res.returncode != 0 and "File too large" in res.stderr_tail
    assert time.monotonic() - start < 20.0


def test_filling_the_scratch_stops_at_its_size():
    res = run("""
        n = 0
        try:
            with open("/tmp/fill", "wb") as f:
                for _ in range(1000):   # 1 GB at most
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    n += 1
        except OSError as e:
            print(n, e.errno)
    """, timeout_s=20.0)
    n, errno_ = out(res).split()
    assert int(n) <= 64 and int(errno_) in (27, 28)  # EFBIG / ENOSPC


def test_infinite_loop_is_stopped_at_the_wall_clock_and_is_an_error():
    start = time.monotonic()
    res = run("""
        import signal
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGXCPU, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        while True:
            pass
    """, timeout_s=1.0)
    assert res.timed_out and time.monotonic() - start < 4.0
    result = run_tests("while True:\n    pass\n", [{"input": "", "output": ""}], timeout_s=0.5)
    assert result["reward"] == 0.0 and result["error"] == "test 0: timeout after 0.5 s"


# ---- a sandbox that fails is an error, never a silent 0.0 ------------------------------------------

def test_missing_scratch_is_an_error_not_a_wrong_answer(tmp_path):
    gone = str(tmp_path / "missing")
    result = run_tests("print(1)", [{"input": "", "output": "1"}], scratch_root=gone)
    assert result["reward"] == 0.0
    assert result["error"].startswith("test 0: sandbox error: FileNotFoundError")


def test_missing_bwrap_is_an_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    result = run_tests("print(1)", [{"input": "", "output": "1"}])
    assert result["error"] == ("test 0: sandbox unavailable: bwrap not found: "
                               "apt-get install bubblewrap")


def test_a_sandbox_that_fails_to_set_up_is_an_error(monkeypatch):
    import areal_hpc.reward.sandbox as sb
    real = sb._bind_args
    monkeypatch.setattr(sb, "_bind_args", lambda: real() + ["--ro-bind", "/nonexistent", "/x"])
    res = run("print(1)")
    assert res.sandbox_error is not None and res.sandbox_error.startswith("sandbox failed: ")
    assert "nonexistent" in res.sandbox_error
    result = run_tests("print(1)", [{"input": "", "output": "1"}])
    assert result["reward"] == 0.0 and result["error"].startswith("test 0: sandbox failed: ")


def test_pool_reports_sandbox_failures_and_timeouts_as_errors():
    import shutil
    tests = [{"input": "", "output": "1"}]
    with RewardPool(max_workers=1, code_test_timeout_s=0.5) as pool:
        pool.submit("loop", "code", "while True:\n    pass", tests)
        pool.submit("wrong", "code", "print(2)", tests)
        results = dict((r.key, r) for r in pool.drain(timeout=60))
        assert results["loop"] == RewardResult("loop", 0.0, "test 0: timeout after 0.5 s")
        assert results["wrong"] == RewardResult("wrong", 0.0, None, {"code_tests_run": 1.0,
                                                                     "code_tests_passed": 0.0})
        shutil.rmtree(pool._scratch_root)  # the sandbox cannot be set up any more
        pool.submit("broken", "code", "print(1)", tests)
        [broken] = pool.drain(timeout=60)
        assert broken.reward == 0.0
        assert broken.error.startswith("test 0: sandbox error: FileNotFoundError")
        assert pool.stats()["errors"] == 2
