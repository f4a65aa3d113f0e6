"""Code-reward sandbox: run one untrusted Python program, isolated, with bubblewrap.

Model-written code is hostile: it reads reference answers wherever it can, leaves daemons behind,
signals its host, patches the grader. Every code test therefore runs in a fresh sandbox built by
``bwrap`` (bubblewrap) for that test alone:

- namespaces: its own PID namespace (a fresh ``/proc`` shows the sandbox's processes only; no host
  pid can be named, so no host process can be signalled or traced; when the program exits, or is
  killed, bwrap's pid 1 exits and the kernel kills everything left in the namespace: a
  double-forked, ``setsid`` daemon dies with its test), network namespace (loopback only, no
  route out, nothing of the host's reachable), IPC and UTS namespaces, a new cgroup namespace
  where possible, and ``--new-session`` (no TIOCSTI into the host's terminal, no signals to the
  host's session);
- a user the program cannot turn into anyone else: as root, bwrap runs privileged (no user
  namespace, every capability dropped but CAP_SETUID/CAP_SETGID, which the bootstrap below uses at
  once to become an unprivileged uid of its own, ``SANDBOX_UID_BASE + caller pid``, with no caps
  left); as any other user (a Slurm job), in a user namespace as uid/gid 65534 (``nobody``) with
  further user namespaces disabled;
- no new namespaces in either mode: a seccomp filter (reward/seccomp.py, bwrap's ``--seccomp``)
  refuses unshare, setns and a clone with a CLONE_NEW* flag (x86_64, aarch64), and also
  CLONE_PARENT, ``memfd_create``/``memfd_secret`` (memory no process maps) and the keyring
  calls (``keyctl``, ``add_key``, ``request_key``: keyrings are per uid and outlive a test);
- file system: an empty tmpfs root with read-only binds of ``/usr`` (and the ``/lib*``, ``/bin``
  symlinks or directories of a merged or unmerged ``/usr``) and of the Python installation that
  runs the tests (``sys.base_prefix``: the interpreter, its standard library and the libraries it
  links); a minimal ``/dev``, a fresh ``/proc``, and a small private tmpfs as the working
  directory, the only writable place (``/`` and ``/dev`` are remounted read-only). Not there: the project (grader code included), datasets, the run directory, ``/etc``,
  ``/root``, ``/home``, the host's ``/tmp``. The program gets its source read-only and its stdin;
  the expected output never leaves the parent, which compares it;
- environment: cleared, ``PATH`` and ``LANG`` only;
- limits, set by a small bootstrap inside the sandbox before the program starts (``python -I``):
  processes ``RLIMIT_NPROC`` (it binds: the program's uid is never root, and in a user namespace
  the count is per namespace, so one sandbox's fork flood cannot starve another), address space
  ``RLIMIT_AS`` (per process), CPU time ``RLIMIT_CPU``, file size ``RLIMIT_FSIZE`` (stdout
  included), open files ``RLIMIT_NOFILE`` (soft and hard: pipes and sockets hold kernel memory),
  no core files; the scratch tmpfs has a fixed size, and ``/`` and ``/dev`` are read-only; the wall clock is the parent's,
  counted from the program's start (set-up excluded): past ``timeout_s`` it kills the sandbox's
  pid 1 (then bwrap itself), ``--die-with-parent`` covers the parent dying. Whatever the ending,
  the parent then kills the sandbox's pid 1 through a pidfd taken at start and waits until it
  has gone, which the kernel allows only once the whole PID namespace is empty: bwrap itself
  exits as soon as the program does, while its pid 1 still waits for what the program left, so
  without this a fork flood could outlive ``run`` by a moment on a loaded node;
- I/O: stdin, stdout and stderr are unlinked files the parent opened; it reads stdout back through
  the descriptor it holds (never re-opened by path), at most ``MAX_OUTPUT_BYTES``.

A sandbox that cannot be set up is reported as such (``SandboxResult.sandbox_error``), never as a
failing program: the bootstrap writes ``ok`` to a pipe once inside, limits set; no ``ok``, no
verdict on the program.

Why bubblewrap: it is a maintained Debian package (``apt-get install bubblewrap``), runs
unprivileged with no daemon and no setuid helper, and does exactly this (namespaces, binds,
tmpfs, a pid-1 reaper, die-with-parent) in one exec per test (~20 ms). nsjail does more (seccomp
policies, cgroups) but is not packaged in Debian 12; firejail is setuid root with a large
profile language; docker/podman need a daemon or an image store and are heavy per test; plain
``unshare(1)`` gives namespaces but no bind layout, no read-only root and no pid-1 reaper.
Memory: where the host lets this process make one, each test runs in a memory cgroup of its own
limited to ``memory_mb`` (reward/contain.py: v2 ``memory.max``, or v1 ``memory.limit_in_bytes``
with ``memsw``), which counts all its memory, tmpfs and kernel buffers included; a kill for that
limit ends the test as ``over_memory``. In every case ``RLIMIT_AS`` bounds each process and the
parent sums the memory of all the test's processes every ``MEMORY_POLL_S`` and kills the sandbox
past ``memory_mb`` (a user-space stand-in where no cgroup can be made, as in many Slurm jobs);
the memory no process maps is then bounded by the filter (no memfd), the open-file cap and the
sized tmpfs.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ..reaper import MPI_ENV_PREFIXES
from . import contain, seccomp

MAX_OUTPUT_BYTES = 32 << 20        # stdout (and any file) the program may write
MAX_ERROR_CHARS = 200
CPU_LIMIT_SLACK_S = 1              # RLIMIT_CPU = ceil(timeout_s) + this; the wall clock fires first
DEFAULT_MAX_PROCESSES = 32         # RLIMIT_NPROC inside: the program and its children
MAX_OPEN_FILES = 64                # RLIMIT_NOFILE inside, soft and hard: pipes and sockets
                                   # hold kernel memory no process maps
SCRATCH_BYTES = 64 << 20           # the tmpfs working directory
SANDBOX_UID_BASE = 0x70000000      # as root: the program runs as this + caller pid (one test at
                                   # a time per process: a pool worker each)
UID_OFFSET_ENV = "AREAL_SANDBOX_UID_OFFSET"
USERNS_UID = 65534                 # as another user: uid/gid inside the user namespace
KILL_GRACE_S = 5.0                 # after a kill, how long bwrap gets to go
MEMORY_POLL_S = 0.25               # how often the memory of a test's processes is summed
START_TIMEOUT_S = 30.0             # setting a sandbox up (not counted in timeout_s)
CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"
WORKDIR = "/tmp"                   # the tmpfs scratch, the program's cwd
SOURCE = "/sandbox/solution.py"

def child_env(uid_base: int, n: int) -> dict[str, str]:
    """The environment of a contained child that runs project code (a reward worker, a user's
    environment): the caller's import path (as multiprocessing's spawn hands it on), a range of
    sandbox uids of its own (`uid_base` + this process's pid and `n`; inside its PID namespace
    the child's own pid is 1), and not the MPI job's variables (an import of mpi4py.MPI would
    join the job as a duplicate rank)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(MPI_ENV_PREFIXES)},
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            UID_OFFSET_ENV: str(uid_base + (((os.getpid() & 0x3FFFFF) << 6) | (n & 63)))}

# Runs inside the sandbox as pid 2, before the untrusted program: drops to the unprivileged uid
# (privileged mode), sets the limits, says "ok" on the status fd, closes every other fd, execs.
_BOOTSTRAP = r"""
import os, resource, sys
uid, nproc, mem, cpu, fsize, status, nofile = map(int, sys.argv[1:8])
if os.getuid() == 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() == 0 or os.geteuid() == 0:
        raise SystemExit("still root")
for lim, val in ((resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_AS, mem),
                 (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                 (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, nofile)):
    resource.setrlimit(lim, (val, val))
env = {k: os.environ[k] for k in ("PATH", "LANG") if k in os.environ}
os.write(status, b"ok")
os.closerange(3, 65536)
os.execve(sys.executable, [sys.executable, "-I", sys.argv[8]], env)
"""


@dataclass
class SandboxResult:
    stdout: bytes = b""                # at most MAX_OUTPUT_BYTES
    stderr_tail: str = ""              # last non-empty stderr line, shortened
    returncode: int | None = None      # the program's exit code; -N: killed by signal N
    timed_out: bool = False
    over_memory: bool = False          # its processes together passed memory_mb: killed
    sandbox_error: str | None = None   # the sandbox itself failed: no verdict on the program
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (self.sandbox_error is None and not self.timed_out and not self.over_memory
                and self.returncode == 0)


def _uid_offset() -> int:
    """This process's pid, or the offset a reward worker was given (reward/pool.py: a worker is
    pid 1 of its own PID namespace, so its pid names nothing)."""
    value = os.environ.get(UID_OFFSET_ENV, "")
    return int(value) if value.isdigit() and int(value) < (1 << 30) else os.getpid()


def _interpreter() -> tuple[str, str]:
    """(real path of the interpreter running us, its installation prefix)."""
    exe = os.path.realpath(sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _project_root() -> str:
    # areal_hpc/reward/sandbox.py -> the checkout (or site-packages) holding areal_hpc
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def _bind_args() -> list[str]:
    """The read-only file system: /usr, the /lib* and /bin links, the Python installation."""
    exe, prefix = _interpreter()
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if not _under(prefix, "/usr"):
        # Parents made explicitly 0755: bwrap would copy the host's modes (/root is 0700, which
        # the unprivileged uid could not cross). They are directories of the sandbox's own tmpfs.
        parts = prefix.strip("/").split("/")
        for i in range(1, len(parts)):
            args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
        args += ["--ro-bind", prefix, prefix]
    return args


def _unavailable_reason() -> str | None:
    """Why a sandbox cannot be built here (static checks), or None."""
    if not sys.platform.startswith("linux"):
        return f"the code sandbox needs Linux, this is {sys.platform}"
    if shutil.which("bwrap") is None:
        return "bwrap not found: apt-get install bubblewrap"
    exe, prefix = _interpreter()
    if not (_under(exe, prefix) or _under(exe, "/usr")):
        return f"the interpreter {exe} is outside its prefix {prefix}: cannot bind it alone"
    project = _project_root()
    for bound in (prefix, "/usr"):
        if _under(project, bound):
            return (f"the project ({project}: grader code, maybe data) is under {bound}, which "
                    f"the sandbox binds; run from a checkout or a virtualenv elsewhere")
    if os.getuid() != 0:
        try:
            with open("/proc/sys/user/max_user_namespaces") as f:
                if int(f.read().strip() or 0) == 0:
                    return "user namespaces disabled (sysctl user.max_user_namespaces = 0)"
        except OSError:
            pass
        try:
            with open("/proc/sys/kernel/unprivileged_userns_clone") as f:
                if f.read().strip() == "0":
                    return ("user namespaces disabled for unprivileged users "
                            "(sysctl kernel.unprivileged_userns_clone = 0)")
        except OSError:
            pass
    return None


def last_line(data: bytes) -> str:
    lines = [ln.strip() for ln in data[-4096:].decode("utf-8", "replace").splitlines()]
    lines = [ln for ln in lines if ln]
    return lines[-1][:MAX_ERROR_CHARS] if lines else ""


def _read_back(f, limit: int) -> bytes:
    f.seek(0)
    return f.read(limit)


class Sandbox:
    """``Sandbox.available()`` says whether code can be isolated on this node (and why not);
    ``Sandbox().run(program, stdin)`` runs one program in a fresh sandbox."""

    def __init__(self, max_processes: int = DEFAULT_MAX_PROCESSES,
                 scratch_bytes: int = SCRATCH_BYTES, tmp_dir: str | None = None):
        self.max_processes = max_processes
        self.scratch_bytes = scratch_bytes
        self.tmp_dir = tmp_dir  # where the parent's unlinked stdin/stdout/stderr files live

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def available() -> tuple[bool, str]:
        """(True, "") when a sandbox was built and ran a program here; else (False, why).
        Checked once per process (one real sandbox run, ~0.1 s)."""
        reason = _unavailable_reason()
        if reason is None:
            res = Sandbox().run("print('ok')", b"", timeout_s=30.0, memory_mb=256)
            if res.sandbox_error is not None:
                reason = res.sandbox_error
            elif not res.ok or res.stdout.strip() != b"ok":
                reason = (f"a probe program failed in the sandbox: exit {res.returncode}, "
                          f"{res.stderr_tail or 'no stderr'}")
        return (reason is None, reason or "")

    def command(self, timeout_s: float, memory_mb: int) -> list[str]:
        exe, _ = _interpreter()
        cpu_s = math.ceil(timeout_s) + CPU_LIMIT_SLACK_S
        if os.getuid() == 0:
            # Privileged bwrap: no user namespace (whose uid would map to host root, which
            # RLIMIT_NPROC does not bind); the bootstrap drops to a uid of its own at once.
            who = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
            uid = SANDBOX_UID_BASE + _uid_offset()
        else:
            who = ["--unshare-user", "--uid", str(USERNS_UID), "--gid", str(USERNS_UID),
                   "--disable-userns"]
            uid = USERNS_UID
        # no new namespaces, in both modes (reward/seccomp.py); fd set in run()
        filt = ["--seccomp", "SECCOMP_FD"] if seccomp.supported() else []
        return [
            "bwrap", *who, *filt,
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "sandbox",
            "--die-with-parent", "--new-session",
            *_bind_args(),
            "--dev", "/dev", "--proc", "/proc",
            "--size", str(self.scratch_bytes), "--perms", "1777", "--tmpfs", WORKDIR,
            "--perms", "0755", "--dir", os.path.dirname(SOURCE),
            "--perms", "0444", "--ro-bind-data", "SOURCE_FD", SOURCE,  # fd set in run()
            # The root tmpfs (the /sandbox, /usr... mount points) and /dev read-only: as a user
            # they belong to the sandbox's uid, and a tmpfs without a size is the node's RAM.
            "--remount-ro", "/dev", "--remount-ro", "/",
            "--chdir", WORKDIR,
            "--clearenv", "--setenv", "PATH", CHILD_PATH, "--setenv", "LANG", "C.UTF-8",
            exe, "-I", "-S", "-c", _BOOTSTRAP,
            str(uid), str(self.max_processes), str(memory_mb << 20), str(cpu_s),
            str(MAX_OUTPUT_BYTES), "STATUS_FD", str(MAX_OPEN_FILES), SOURCE,
        ]

    def spawn(self, program: bytes, stdin, stdout, stderr, timeout_s: float, memory_mb: int,
              group: contain.MemoryGroup) -> tuple[subprocess.Popen, int]:
        """bwrap started on ``program`` in ``group``, its limits from ``timeout_s`` (CPU) and
        ``memory_mb``, with these stdin, stdout and stderr (files or fds): (the process, the
        status pipe's read end, which says ``ok`` once the program is set up: `wait_started`).
        `run` and the long-running sandbox (reward/sandbox_live.py) share it: one containment."""
        status_r, status_w = os.pipe()
        try:
            with tempfile.TemporaryFile(dir=self.tmp_dir) as src, \
                    tempfile.TemporaryFile(dir=self.tmp_dir) as filt:
                src.write(program)
                src.seek(0)
                filt.write(seccomp.program() if seccomp.supported() else b"")
                filt.seek(0)
                os.set_blocking(status_r, False)
                cmd = self.command(timeout_s, memory_mb)
                cmd[cmd.index("SOURCE_FD")] = str(src.fileno())
                cmd[cmd.index("STATUS_FD")] = str(status_w)
                if "SECCOMP_FD" in cmd:
                    cmd[cmd.index("SECCOMP_FD")] = str(filt.fileno())
                # No preexec_fn: safe from threaded callers. The limits are set inside; the
                # cgroup is joined by a shell that then becomes bwrap (group.prefix).
                proc = subprocess.Popen(
                    group.prefix + cmd, stdin=stdin, stdout=stdout, stderr=stderr,
                    close_fds=True, pass_fds=(src.fileno(), status_w, filt.fileno()),
                    start_new_session=True, env={"PATH": CHILD_PATH, "LANG": "C.UTF-8"})
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        return proc, status_r

    def run(self, program: str | bytes, stdin: str | bytes = b"", timeout_s: float = 5.0,
            memory_mb: int = 512) -> SandboxResult:
        """Run ``program`` (Python source) with ``stdin``; never raises (a failure to set up is
        ``sandbox_error``). Blocks until everything the program started is gone."""
        start = time.monotonic()
        if isinstance(program, str):
            program = program.encode("utf-8", "surrogateescape")
        if isinstance(stdin, str):
            stdin = stdin.encode("utf-8", "surrogateescape")
        reason = _unavailable_reason()
        if reason is not None:
            return SandboxResult(sandbox_error=f"sandbox unavailable: {reason}")
        status_r = ns_fd = None
        files = []
        group = contain.MemoryGroup(memory_mb << 20)   # the test's whole memory, where we can
        try:
            fin, fout, ferr = files = [tempfile.TemporaryFile(dir=self.tmp_dir) for _ in range(3)]
            fin.write(stdin)
            fin.seek(0)
            proc, status_r = self.spawn(program, fin, fout, ferr, timeout_s, memory_mb, group)
            # The wall clock starts once the program does (the bootstrap's "ok"): setting up
            # the sandbox on a loaded node does not count against the test.
            state = wait_started(proc, status_r, START_TIMEOUT_S)
            started = state == "ok"
            if started:   # bwrap's only child, the sandbox's pid 1, as a pidfd (see end_namespace)
                ns_fd = next(map(contain.pidfd, child_pids(proc.pid)), None)
            timed_out = slow_setup = over_memory = False
            if started:     # the wall clock, and the memory of all its processes together
                ended = _wait_bounded(proc, timeout_s, memory_mb << 20, group.oom_killed)
                timed_out, over_memory = ended == "timeout", ended == "memory"
                if ended != "exited":
                    kill_sandbox(proc)
            else:
                try:
                    proc.wait(timeout={"ended": KILL_GRACE_S, "slow": 0}[state])
                except subprocess.TimeoutExpired:
                    slow_setup = True
                    kill_sandbox(proc)
            code = proc.wait()
            end_namespace(ns_fd)
            over_memory = over_memory or group.oom_killed()
            stderr = _read_back(ferr, 1 << 20)
            if not started:
                tail = last_line(stderr)
                if slow_setup:
                    why = f"not set up within {START_TIMEOUT_S:g} s"
                else:
                    why = tail or f"bwrap exit code {code}"
                return SandboxResult(sandbox_error=f"sandbox failed: {why}"[:MAX_ERROR_CHARS],
                                     seconds=time.monotonic() - start)
            if code < 0:  # bwrap itself killed (not by us): the program's fate is unknown
                if not timed_out and not over_memory:
                    return SandboxResult(
                        sandbox_error=f"sandbox killed by signal {-code}",
                        seconds=time.monotonic() - start)
            elif code > 128:  # bwrap reports a program killed by signal N as 128 + N
                code = -(code - 128)
            return SandboxResult(stdout=_read_back(fout, MAX_OUTPUT_BYTES),
                                 stderr_tail=last_line(stderr), returncode=code,
                                 timed_out=timed_out, over_memory=over_memory,
                                 seconds=time.monotonic() - start)
        except Exception as e:  # no scratch directory, no fds, no processes left...
            return SandboxResult(
                sandbox_error=f"sandbox error: {type(e).__name__}: {e}"[:MAX_ERROR_CHARS],
                seconds=time.monotonic() - start)
        finally:
            for f in files:
                f.close()
            end_namespace(ns_fd)
            for fd in (status_r, ns_fd):
                if fd is not None:
                    os.close(fd)
            group.remove()


def end_namespace(ns_fd: int | None) -> None:
    """Make sure the sandbox's PID namespace is empty. bwrap exits as soon as the program does,
    while its pid 1 still waits for what the program left (a setsid daemon, a fork flood) and
    dies only by --die-with-parent, a moment later: that moment is a race on a loaded node.
    SIGKILL to pid 1 through its pidfd (always the same process) makes the kernel kill the whole
    namespace, and the pidfd reads as exited only once the namespace is empty (bounded)."""
    if ns_fd is None:
        return
    try:
        signal.pidfd_send_signal(ns_fd, signal.SIGKILL)
    except (ProcessLookupError, OSError):
        pass
    select.select([ns_fd], [], [], KILL_GRACE_S)
    try:    # ours to reap where this process is a subreaper (a reward worker) and bwrap is gone
        os.waitid(os.P_PIDFD, ns_fd, os.WEXITED | os.WNOHANG)
    except (ChildProcessError, OSError):
        pass


def _wait_bounded(proc: subprocess.Popen, timeout_s: float, limit_bytes: int,
                  oom_killed=lambda: False) -> str:
    """Wait for the sandbox: ``"exited"``; ``"timeout"`` after ``timeout_s``; ``"memory"`` once
    its memory cgroup has had a process killed for the limit (``oom_killed``; the test is then
    over, not only that process), or once the memory of all its processes together (PSS)
    passes ``limit_bytes`` (checked every MEMORY_POLL_S: RLIMIT_AS bounds each process alone, so
    without this a test of 32 processes could hold 32 times its memory)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            proc.wait(timeout=max(0.0, min(MEMORY_POLL_S, deadline - time.monotonic())))
            return "exited"
        except subprocess.TimeoutExpired:
            pass
        if oom_killed():
            return "memory"
        if time.monotonic() >= deadline:
            return "timeout"
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            continue
        if total_memory(tree, "rss") > limit_bytes and total_memory(tree, "pss") > limit_bytes:
            # (RSS first, cheap; it counts the pages a fork shares with its parent in every
            # process, so the verdict is PSS's, each shared page split among its sharers)
            for p in tree:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(tree, timeout=KILL_GRACE_S)
            return "memory"


def total_memory(procs, field: str) -> int:
    """Sum of a memory field over `procs` (rss: /proc/PID/statm; pss: smaps_rollup, costlier)."""
    import psutil

    total = 0
    for p in procs:
        try:
            info = p.memory_info() if field == "rss" else p.memory_full_info()
            total += getattr(info, field)
        except (psutil.Error, AttributeError):
            pass
    return total


def wait_started(proc: subprocess.Popen, fd: int, timeout_s: float) -> str:
    """``"ok"`` once the bootstrap says so; ``"ended"`` if the status pipe closes or bwrap exits
    without it; ``"slow"`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        readable, _, _ = select.select([fd], [], [], 0.05)
        if readable:
            return "ok" if _read_status(fd) else "ended"
        if proc.poll() is not None:
            return "ended"
        if time.monotonic() >= deadline:
            return "slow"


def _read_status(fd: int) -> bool:
    try:
        return os.read(fd, 16).startswith(b"ok")
    except BlockingIOError:
        return False


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        pass
    try:
        import psutil
        return [c.pid for c in psutil.Process(pid).children()]
    except Exception:
        return []


def kill_sandbox(proc: subprocess.Popen) -> None:
    """Kill the sandbox's pid 1 (the kernel then kills its whole PID namespace, and bwrap exits
    once the namespace is empty), then, should that not do, bwrap's process group."""
    for child in child_pids(proc.pid):  # bwrap's only child: the sandbox's pid 1
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=KILL_GRACE_S)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class SandboxUnavailable(RuntimeError):
    """Code rewards cannot be sandboxed on this node (the preflight names the key: data.kind)."""


def check_available(cfg) -> None:
    """A ``data.kind == "code"`` job refuses to start where code cannot be sandboxed
    (`SandboxUnavailable` naming what is missing), unless ``reward.unsafe_no_sandbox``; then it
    warns, loudly, at every start. Call it on every node that scores code (the generators):
    preflight.py `generator_node`."""
    if getattr(cfg.data, "kind", "math") != "code":
        return
    if getattr(cfg.reward, "unsafe_no_sandbox", False):
        warn_unsafe()
        return
    ok, reason = Sandbox.available()
    if not ok:
        raise SandboxUnavailable(
            f"code rewards run model-written programs, which need the code sandbox, and it "
            f"cannot be set up on this node: {reason}. (Set reward.unsafe_no_sandbox=true to run "
            f"them without isolation: UNSAFE.)")


def warn_unsafe() -> None:
    msg = ("UNSAFE: reward.unsafe_no_sandbox=true: model-written code runs WITHOUT the sandbox; "
           "it can read the reference answers, the file system and the environment, use the "
           "network and signal this job")
    logging.getLogger(__name__).warning(msg)
    print(f"WARNING: {msg}", file=sys.stderr, flush=True)
