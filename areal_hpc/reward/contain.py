"""Bounds that hold for everything a process starts: a memory cgroup per sandboxed test, a PID
namespace per reward worker (and per import-check child), and a race-free way to end either.

Listing a process's descendants and then killing them loses to anything born in between (a
chain that re-spawns itself faster than the list is read wins on purpose). So nothing here kills
by list:

- **Reward workers and the import-check child** (``wrap``): started as ``setpriv --pdeathsig
  KILL unshare --pid --fork --kill-child --mount-proc CMD``: CMD is pid 1 of a PID namespace of
  its own, with its own ``/proc``. Killing that pid 1 (``end``: SIGKILL through a pidfd, which
  always names the same process) makes the kernel kill every process of the namespace and refuse
  new ones, and pid 1 is not reaped before its namespace is empty, so once the pidfd reads as
  exited nothing CMD started is left, whatever it did (double fork, ``setsid``, a child made
  with CLONE_PARENT: from pid 1 the kernel refuses that flag, below pid 1 it makes a sibling
  inside the namespace). ``--kill-child`` and ``--pdeathsig KILL`` chain the same end to the
  starting thread's death, a SIGKILL of the parent included. As another user ``unshare`` also
  makes a user namespace in which the process keeps its uid (``--map-current-user``); where neither works (no ``unshare``, user
  namespaces disabled) the fallback is said: the child is its descendants' subreaper and they
  are killed by list (``reaper.kill_descendants``), which a determined chain can outrun.
- **Sandboxed tests** (``MemoryGroup``): the test's whole memory (page cache, tmpfs and shared
  memory included, which no process's ``RLIMIT_AS`` counts) in a memory cgroup of its own where
  the host lets this process make one (cgroup v2 ``memory.max``, or v1
  ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` where swap is accounted). Where it
  does not, the sandbox's other bounds stand alone (reward/sandbox.py: ``memfd_create`` refused,
  open files and file sizes capped, the scratch tmpfs sized, the parent summing the memory of the
  test's processes). ``bound()`` says which holds, in one line.
"""
from __future__ import annotations

import functools
import os
import secrets
import select
import shutil
import signal
import subprocess
import time

from ..reaper import kill_descendants

END_TIMEOUT_S = 10.0          # how long a killed namespace gets to empty


def _unique() -> str:
    """A cgroup name part no other process picks: reward workers each run as pid 1 of their own
    PID namespace, where names from the pid repeated across workers (one worker's failed mkdir
    then removed another's fresh cgroup before its test joined it: CI, a test's "sandbox failed")."""
    return secrets.token_hex(8)


# ---- PID namespaces for workers ---------------------------------------------------------------

def _ns_prefix(as_root: bool) -> list[str]:
    # as another user, a user namespace of its own in which it keeps its uid (not root: the
    # sandbox then runs as a user too, in a nested user namespace)
    user = [] if as_root else ["--map-current-user"]
    return ["setpriv", "--pdeathsig", "KILL", "unshare", *user, "--pid", "--fork",
            "--kill-child", "--mount-proc"]


@functools.lru_cache(maxsize=1)
def namespace_prefix() -> tuple[list[str], str]:
    """(the command prefix that starts a process as pid 1 of its own PID namespace, a line
    saying so), or ([], why not). Probed once per process: one short run."""
    if shutil.which("setpriv") is None or shutil.which("unshare") is None:
        return [], "no PID namespace (setpriv or unshare missing)"
    prefix = _ns_prefix(os.getuid() == 0)
    try:
        out = subprocess.run([*prefix, "sh", "-c", "echo $$"], capture_output=True,
                             timeout=30, stdin=subprocess.DEVNULL)
        if out.returncode == 0 and out.stdout.strip() == b"1":
            return prefix, "PID namespace per worker (unshare --pid, killed whole)"
        why = (out.stderr.decode("utf-8", "replace").strip().splitlines() or ["no output"])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        why = f"{type(e).__name__}: {e}"
    return [], f"no PID namespace ({why[:120]})"


# As root, what a wrapped child may not hold: with CAP_SYS_ADMIN it can unmount its own /proc and
# see the host's beneath, and CAP_SYS_PTRACE would then let it write its parent's memory
# (/proc/PID/mem, process_vm_writev) whatever Yama says; raw I/O and module loading are the same
# door. The code sandbox's bwrap (reward/sandbox.py), run from such a child, needs none of these.
ROOT_DROPPED_CAPS = ("sys_ptrace", "sys_rawio", "sys_module")


def wrap(cmd: list[str]) -> list[str]:
    """`cmd` as pid 1 of a PID namespace of its own where one can be made, else as it is; as
    root, without ROOT_DROPPED_CAPS (its bounding set: nothing it starts gets them back)."""
    prefix = namespace_prefix()[0]
    if prefix and os.geteuid() == 0:
        drop = ",".join(f"-{c}" for c in ROOT_DROPPED_CAPS)
        cmd = ["setpriv", "--bounding-set", drop, "--inh-caps", drop, *cmd]
    return [*prefix, *cmd]


def protect_from_children() -> None:
    """As root, make this process not dumpable: then only a process with CAP_SYS_PTRACE can read
    or write its memory, which no `wrap`ped child holds (ROOT_DROPPED_CAPS). Without it, a child
    that has unmounted its own /proc could still write this process's memory as root where Yama
    allows it (ptrace_scope 0). Every rank calls it first (areal_hpc.main), before starting any child. (As another
    user the children run in a user namespace of their own and need none of this.)"""
    if os.geteuid() != 0:
        return
    import ctypes
    PR_SET_DUMPABLE = 4
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def init_pid(proc: subprocess.Popen, timeout_s: float = 5.0) -> int:
    """The host pid of the process `wrap` started: `proc` itself without a namespace, else
    unshare's only child (pid 1 inside)."""
    if not namespace_prefix()[0]:
        return proc.pid
    deadline = time.monotonic() + timeout_s
    while True:
        kids = _children(proc.pid)
        if kids:
            return kids[0]
        if proc.poll() is not None or time.monotonic() > deadline:
            return proc.pid
        time.sleep(0.01)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def end(proc: subprocess.Popen, fd: int | None, timeout_s: float = END_TIMEOUT_S) -> None:
    """Kill what `wrap` started and everything it started, and wait until it is gone (bounded).
    `fd`: a pidfd of `init_pid(proc)`; without a namespace (or a pidfd) the fallback kills by
    list."""
    if fd is not None and namespace_prefix()[0]:
        # unshare itself first: killed after its child it would print "sigprocmask unblock
        # failed" (util-linux re-raising SIGKILL) onto the job's output; its death kills pid 1
        # too (--kill-child), and the pidfd kill below is the bound that does not depend on it
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        select.select([fd], [], [], timeout_s)  # readable once pid 1 and its namespace are gone
    else:
        kill_descendants(proc.pid)
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass


# ---- memory cgroups for sandboxed tests -------------------------------------------------------

def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    found = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                    found.append((fields[4], rfields[0], rfields[2]))
    except OSError:
        pass
    return found


def _own_path(v2: bool) -> str | None:
    """This process's cgroup path in the v2 hierarchy, or in v1's memory hierarchy."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                if (v2 and ctrls == "") or (not v2 and "memory" in ctrls.split(",")):
                    return path
    except (OSError, ValueError):
        pass
    return None


def _probe(base: str, limit_file: str) -> bool:
    probe = os.path.join(base, f"areal_probe_{_unique()}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        return os.path.exists(os.path.join(probe, limit_file))
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass


@functools.lru_cache(maxsize=1)
def memory_base() -> tuple[str, str] | None:
    """("v2" or "v1", a directory in which a child cgroup with a memory limit can be made), or
    None. cgroup v2 first, then v1's memory controller."""
    for point, kind, opts in _mounts():
        if kind == "cgroup2":
            path = _own_path(v2=True)
            if path is not None and _probe(point + path, "memory.max"):
                return "v2", point + path
    for point, kind, opts in _mounts():
        if kind == "cgroup" and "memory" in opts.split(","):
            path = _own_path(v2=False)
            if path is not None and _probe(point + path, "memory.limit_in_bytes"):
                return "v1", point + path
    return None


def bound() -> str:
    """One line: which memory bound sandboxed tests get here, and how workers are contained."""
    base = memory_base()
    mem = (f"memory cgroup {base[0]} per test" if base else
           "no writable memory cgroup: memory bounded by RLIMIT_AS, the summed memory of a "
           "test's processes, memfd_create refused, open files and file sizes capped")
    return f"sandbox: {mem}; reward workers: {namespace_prefix()[1]}"


class MemoryGroup:
    """A memory cgroup for one sandboxed test (``None``-like when the host has none: ``prefix``
    is empty). ``prefix`` starts a command inside it before it runs anything."""

    def __init__(self, limit_bytes: int):
        self.path = None
        base = memory_base()
        if base is None:
            return
        self.kind, parent = base
        path = os.path.join(parent, f"areal_sandbox_{_unique()}")
        try:
            os.mkdir(path)
        except OSError:
            return                      # not made here: nothing to remove
        try:
            if self.kind == "v2":
                _write(path, "memory.max", limit_bytes)
                if os.path.exists(os.path.join(path, "memory.oom.group")):
                    _write(path, "memory.oom.group", 1)     # one OOM kill ends the test whole
                if os.path.exists(os.path.join(path, "memory.swap.max")):
                    _write(path, "memory.swap.max", 0)
            else:
                _write(path, "memory.limit_in_bytes", limit_bytes)
                if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                    _write(path, "memory.memsw.limit_in_bytes", limit_bytes)
        except OSError:
            _rmdir(path, 0)
            return
        self.path = path

    @property
    def prefix(self) -> list[str]:
        if self.path is None:
            return []
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', self.path]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the group for its memory limit."""
        if self.path is None:
            return False
        name = "memory.events" if self.kind == "v2" else "memory.oom_control"
        try:
            with open(os.path.join(self.path, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
        except (OSError, ValueError):
            pass
        if self.kind == "v1":     # kernels without the oom_kill count: the limit was hit
            try:
                with open(os.path.join(self.path, "memory.failcnt")) as f:
                    return int(f.read()) > 0 and not _has_oom_kill_count(self.path)
            except (OSError, ValueError):
                pass
        return False

    def remove(self) -> None:
        if self.path is not None:
            _rmdir(self.path, END_TIMEOUT_S)
            self.path = None


def _has_oom_kill_count(path: str) -> bool:
    try:
        with open(os.path.join(path, "memory.oom_control")) as f:
            return "oom_kill " in f.read()
    except OSError:
        return False


def _write(path: str, name: str, value: int) -> None:
    with open(os.path.join(path, name), "w") as f:
        f.write(str(value))


def _rmdir(path: str, timeout_s: float) -> None:
    """Remove an emptied cgroup; its last processes may still be being released (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
