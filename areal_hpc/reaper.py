"""Kill a rank's child processes when the rank dies, however it dies.

A rank's children (vLLM's EngineCore and workers, reward workers, Megatron's checkpoint writer)
are separate processes. When the rank exits normally it stops them itself; when it is killed
(MPI_Abort after another rank's error, mpiexec tearing the job down, the OOM killer) they are
re-parented and keep running: a stopped or spinning vLLM engine then holds its cores, memory
and GPU after the job has ended. Slurm kills a step's whole cgroup, but `mpiexec` and other
launchers only kill the ranks.

`start()` launches a small watcher (`python -m areal_hpc.reaper PID`) in its own session. It
notes the rank's descendants every `interval` seconds until end-of-file on a pipe whose write
end the rank holds (the kernel closes it when the rank exits for any reason) or until the rank's
process is gone (checked at the same interval; a forked child may hold the pipe open). Then it
kills every noted process that is still the same process (pid and start time), with its
descendants, and what was forked after the last note (`inheritors`: the processes with the
rank's own initial environment, which a fork keeps), and exits. It ignores the usual
termination signals so that a signal sent to the whole job does not remove it before the
engine; SIGKILL still does.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

_watcher: subprocess.Popen | None = None


# Environment a process launched by an MPI process manager (MPICH hydra, Intel MPI, Open MPI,
# Slurm's PMI-2/PMIx plugins) uses to join the MPI job. Children that must not join it (the
# rank's watcher, vLLM's engine processes) are started without it: an `import mpi4py.MPI` in a
# child (e.g. via the re-imported `__main__` under spawn) would try to join the job as a
# duplicate of the parent's rank.
MPI_ENV_PREFIXES = ("PMI_", "PMIX_", "MPI", "HYDRA", "HYDI_", "OMPI_", "I_MPI_")


def start(label: str = "", interval: float = 1.0) -> subprocess.Popen:
    """Watch this process's descendants from a separate process; idempotent. The watcher ends
    (killing what is left) when this process exits; nothing needs to be called at exit.
    `label` (e.g. "rank 1 (generator, host n042)") names this process in the watcher's report
    when it ends without a clean exit."""
    global _watcher
    if _watcher is None:
        import atexit
        env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_ENV_PREFIXES)}
        _watcher = subprocess.Popen(
            [sys.executable, "-m", "areal_hpc.reaper", str(os.getpid()), str(interval),
             label or f"process {os.getpid()}"],
            stdin=subprocess.PIPE, env=env, start_new_session=True, close_fds=True)
        atexit.register(_clean_exit, _watcher)
    return _watcher


_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux prctl): a daemon that a
    child starts by forking twice is re-parented here, not to init, so `kill_descendants` still
    finds it. False where the call is not available."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def kill_descendants(pid: int | None = None) -> int:
    """SIGKILL every descendant of `pid` (default: this process) and reap them (zombies too: a
    subreaper must, or what it adopted stays a zombie); returns how many were killed. Found
    before any is killed (afterwards their children would belong to the nearest subreaper)."""
    import psutil
    try:
        victims = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return 0
    kill_and_wait(victims)
    return len(victims)


def kill_and_wait(procs: list, timeout: float = 5.0) -> None:
    """SIGKILL each of `procs` (psutil handles; one already gone is skipped) and reap them,
    waiting at most `timeout` seconds."""
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def _clean_exit(watcher: subprocess.Popen) -> None:
    """Tell the watcher this exit is a normal one (no report; leftovers are still killed)."""
    try:
        watcher.stdin.write(CLEAN)
        watcher.stdin.close()
    except OSError:
        pass


CLEAN = b"clean exit\n"


def _snapshot(parent, me: int) -> dict:
    import psutil

    found = {}
    try:
        for p in parent.children(recursive=True):
            if p.pid != me:
                found[p.pid] = p
    except psutil.Error:
        pass
    return found


def _identity(p) -> tuple | None:
    """(initial environment, start time) of process `p`: what its forks inherit."""
    import psutil
    try:
        return p.environ(), p.create_time()
    except psutil.Error:
        return None


def inheritors(identity: tuple, before: float, exclude: tuple[int, ...] = ()) -> list:
    """The live processes started, between the process of `identity` (`_identity`) and `before`,
    with its exact initial environment: its forks that did not exec (Megatron's checkpoint
    writers fork from the trainer rank as a save begins), their forks, and children it started
    with its environment as it was. A rank's environment is its own (the MPI process manager's
    rank and job variables), so nothing of another rank or job matches, nor a later attempt's
    rank (started after `before`). This finds the children forked after the watcher's last
    snapshot, which are no longer the rank's descendants once it is gone. Not the processes
    in `exclude` (the rank itself, which may still be on its way out), nor this one."""
    import psutil
    environ, created = identity
    exclude = {os.getpid(), *exclude}
    found = []
    for p in psutil.process_iter(["create_time"]):
        try:
            if p.pid not in exclude and created <= p.info["create_time"] <= before and p.environ() == environ:
                found.append(p)
        except psutil.Error:
            pass
    return found


def _kill(procs) -> list[int]:
    """SIGKILL each process still alive as the same process, and its descendants."""
    import psutil

    victims = {}
    for p in procs:
        try:
            if _alive(p):     # pid and start time: never a recycled pid; a zombie is dead
                victims.update((c.pid, c) for c in p.children(recursive=True) if c.pid != os.getpid())
                victims[p.pid] = p
        except psutil.Error:
            pass
    killed = []
    for p in victims.values():
        try:
            p.kill()
            killed.append(p.pid)
        except psutil.Error:
            pass
    psutil.wait_procs(list(victims.values()), timeout=10)
    return killed


# Test hook, read in `main` only: a file the watcher rewrites after each snapshot with the pids
# and the segments it has noted so far (tests/launch/test_reaper.py waits for its children
# there instead of sleeping an interval and hoping).
SNAPSHOT_HOOK_ENV = "AREAL_TEST_REAPER_SNAPSHOTS"


def watch(parent_pid: int, interval: float, stream=None, grace_s: float = 5.0,
          noted=None) -> tuple[list[int], bool]:
    """Note `parent_pid`'s descendants until `stream` (default: stdin) reaches end-of-file or the
    parent is gone, then kill those still running (after a clean exit, those still running
    `grace_s` later). `noted(pids, segments)` after each snapshot. Returns (pids killed,
    whether the parent announced a clean exit)."""
    import psutil

    stream = sys.stdin.buffer if stream is None else stream
    closed = threading.Event()
    said = bytearray()

    def wait_eof() -> None:
        while chunk := stream.read(1 << 12):
            said.extend(chunk)
        closed.set()

    try:
        parent = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        return [], False
    identity = _identity(parent)
    threading.Thread(target=wait_eof, daemon=True).start()
    seen: dict = {}
    segments: set[str] = set()
    # End-of-file is the prompt signal; polling the parent covers a forked child that inherited
    # the pipe's write end and so keeps the pipe open after the rank is gone.
    while not closed.wait(interval) and parent.is_running():
        seen = {pid: p for pid, p in seen.items() if p.is_running()}   # exited on their own
        seen.update(_snapshot(parent, os.getpid()))
        segments |= shm_mapped(parent_pid)
        if noted is not None:
            noted(set(seen), segments)
    closed.wait(1.0)        # a clean exit's announcement may trail the parent's end slightly
    clean = CLEAN in said
    if identity is not None:        # forked since the last snapshot: no longer its descendants
        seen.update((p.pid, p) for p in inheritors(identity, time.time() + 1.0, (parent_pid,)))
    if clean:               # children on their way out (resource tracker, engine) may finish
        psutil.wait_procs([p for p in seen.values() if _alive(p)], timeout=grace_s)
    killed = _kill(seen.values())
    remove_unmapped(segments)
    return killed, clean


# MPICH's shared-memory segments (mpich_shm_<world id>_<node>, mpich_vci_...): a rank that is
# killed never unlinks them. Their names come from the PMI job name, which a requeued Slurm job
# repeats (same job and step ids): MPICH creates a segment with O_EXCL, so when a stale one of
# that name is there no rank becomes its root, and MPI_Init fails (a size that differs:
# "MPIDI_POSIX_comm_bootstrap: Out of memory") or runs on the stale segment's contents, where a
# rank can wait for ever. Killed jobs also leave a few MiB each in /dev/shm (a tmpfs: memory).
SHM_PREFIX = "/dev/shm/mpich_"


def shm_mapped(pid: int | str, prefix: str = SHM_PREFIX) -> set[str]:
    """The files under `prefix` that process `pid` maps (empty if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(None, 5)[5].strip().removesuffix(" (deleted)")
                    for line in f if prefix in line and len(line.split(None, 5)) == 6}
    except (OSError, ValueError):
        return set()


def remove_stale_segments(min_age_s: float = 10.0, prefix: str = SHM_PREFIX) -> list[str]:
    """Before this rank starts MPI: unlink this node's MPICH segments (ours: others' cannot be
    unlinked in the sticky /dev/shm) that no live process maps and that are older than
    `min_age_s`, i.e. left by a killed job. A segment of this job's start-up is safe: its root
    rank maps it at once after creating it, and it is seconds old, not `min_age_s`."""
    folder, _, stem = prefix.rpartition("/")
    try:
        names = [n for n in os.listdir(folder) if n.startswith(stem)]
    except OSError:
        return []
    now, old = time.time(), set()
    for name in names:
        path = f"{folder}/{name}"
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid == os.getuid() and now - st.st_mtime >= min_age_s:
            old.add(path)
    return remove_unmapped(old, prefix)


def remove_unmapped(paths: set[str], prefix: str = SHM_PREFIX) -> list[str]:
    """Unlink each of `paths` (segments the dead rank mapped) that no live process maps any
    more: the job's other ranks on this node keep theirs until the last one's watcher ends."""
    left = {p for p in paths if os.path.exists(p)}
    if not left:
        return []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            left -= shm_mapped(pid, prefix)
            if not left:
                return []
    removed = []
    for path in sorted(left):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: list[str]) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    label = argv[2] if len(argv) > 2 else f"process {argv[0]}"
    hook = os.environ.get(SNAPSHOT_HOOK_ENV)

    def noted(pids, segments) -> None:
        tmp = f"{hook}.tmp"
        with open(tmp, "w") as f:
            f.write(" ".join(map(str, sorted(pids))) + "\n" + " ".join(sorted(segments)) + "\n")
        os.replace(tmp, hook)       # whole, never half written

    killed, clean = watch(int(argv[0]), float(argv[1]) if len(argv) > 1 else 1.0,
                          noted=noted if hook else None)
    try:
        if not clean:
            print(f"[areal_hpc.reaper] {label} ended without a clean exit (killed by a signal, "
                  f"its node lost, or aborted after another rank's error); killed "
                  f"{len(killed)} leftover child process(es)", file=sys.stderr, flush=True)
        elif killed:
            print(f"[areal_hpc.reaper] {label} exited leaving {len(killed)} child process(es); "
                  f"killed them: {killed}", file=sys.stderr, flush=True)
    except OSError:         # the launcher that collected our output may be gone already
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
