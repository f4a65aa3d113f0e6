"""areal_hpc.reaper on real processes: a rank killed hard takes its children (running, stopped,
re-parented grandchildren, a forked child holding the watcher's pipe open) with it."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from areal_hpc import reaper

pytestmark = pytest.mark.slow     # starts MPI / torch.distributed worlds or processes (tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What the stand-in ranks below wait for, instead of sleeping an interval: the watcher's own
# record (reaper.SNAPSHOT_HOOK_ENV) holds every child's pid, or every segment the rank maps.
NOTED = textwrap.dedent("""
    import os, time
    from areal_hpc import reaper

    def wait_noted(pids=(), segments=(), timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(os.environ[reaper.SNAPSHOT_HOOK_ENV]) as f:
                    noted_pids, noted_segments = (f.readline().split() for _ in range(2))
                if set(map(str, pids)) <= set(noted_pids) and set(segments) <= set(noted_segments):
                    return
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.05)
        raise SystemExit("the watcher noted nothing within the bound")
""")

# A stand-in for a rank: starts the reaper, then children like vLLM's (a child with its own
# child, one of them stopped), prints their pids, and waits to be killed.
RANK = NOTED + textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from areal_hpc import reaper
    watcher = reaper.start("rank 7 (test)", interval=0.2)
    tree = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys, time; c = subprocess.Popen(['sleep', '300']); "
        "print(c.pid, flush=True); time.sleep(300)"], stdout=subprocess.PIPE, text=True)
    grandchild = int(tree.stdout.readline())
    stopped = subprocess.Popen(["sleep", "300"])
    os.kill(stopped.pid, signal.SIGSTOP)
    pids = [tree.pid, grandchild, stopped.pid]
    if sys.argv[1] == "fork":           # a forked child inherits the watcher pipe's write end
        pid = os.fork()
        if pid == 0:
            time.sleep(300)
            os._exit(0)
        pids.append(pid)
    wait_noted(pids=pids)                # the watcher has noted every one of them
    print(watcher.pid, *pids, flush=True)
    if sys.argv[1] == "exit":
        for p in pids:
            os.kill(p, signal.SIGKILL)
        sys.exit(0)
    time.sleep(300)
""")


def _hooked(tmp_path) -> dict:
    return {**os.environ, reaper.SNAPSHOT_HOOK_ENV: str(tmp_path / "noted")}


def _start(mode, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", RANK, mode], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_hooked(tmp_path))
    watcher, *children = map(int, proc.stdout.readline().split())
    return proc, _process(watcher), [c for c in map(_process, children) if c is not None]


def _process(pid):
    """psutil's handle on pid; None when it has already ended (a rank that exits at once)."""
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _cleanup(proc, watcher, children):
    for p in [*children, watcher]:
        try:
            p.kill()
        except psutil.Error:
            pass
    if proc.poll() is None:
        proc.kill()


def _alive(procs):
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("mode", ["plain", "fork"])
def test_children_die_with_a_killed_rank(mode, tmp_path):
    proc, watcher, children = _start(mode, tmp_path)
    try:
        assert len(_alive(children)) == len(children)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while _alive(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(children), [p.cmdline() for p in _alive(children)]
        watcher.wait(timeout=20)         # and the watcher itself is gone
        report = proc.stderr.read()
        assert "rank 7 (test) ended without a clean exit" in report, report
        assert f"killed {len(children)} leftover" in report, report
    finally:
        _cleanup(proc, watcher, children)


# A stand-in for a rank that forks once told to (a line on stdin), as the trainer forks Megatron's
# checkpoint writers when a save begins; the fork starts a child of its own.
FORKS = textwrap.dedent("""
    import os, subprocess, sys, time
    sys.stdin.readline()
    if os.fork() == 0:
        child = subprocess.Popen(["sleep", "300"])
        print(os.getpid(), child.pid, flush=True)
        time.sleep(300)
        os._exit(0)
    time.sleep(300)
""")


class _Reading:
    """A stream whose first read says that the watcher has begun (its rank's identity taken)."""

    def __init__(self, fd):
        self.fd, self.begun = fd, threading.Event()

    def read(self, n):
        self.begun.set()
        return os.read(self.fd, n)


def test_a_child_forked_after_the_last_snapshot_dies_with_the_rank():
    """A rank killed just after it forked (no snapshot since, here none at all: the interval is an
    hour) takes the fork and the fork's child with it: they carry the rank's own environment.
    Another rank's fork (its environment differs in its PMI rank) is left alone."""
    ranks = [subprocess.Popen([sys.executable, "-c", FORKS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PMI_RANK": str(k)}) for k in (7, 8)]
    r, w = os.pipe()
    stream, result = _Reading(r), {}
    watcher = threading.Thread(target=lambda: result.update(out=reaper.watch(ranks[0].pid, 3600, stream)))
    watcher.start()
    forks = []
    try:
        assert stream.begun.wait(60)
        for rank in ranks:
            rank.stdin.write("fork\n")
            rank.stdin.flush()
            forks.append([psutil.Process(int(pid)) for pid in rank.stdout.readline().split()])
        ranks[0].kill()
        ranks[0].wait()
        os.close(w)
        watcher.join(60)
        killed, clean = result["out"]
        assert not clean and set(killed) == {p.pid for p in forks[0]}, (killed, forks)
        assert not _alive(forks[0]) and len(_alive([psutil.Process(ranks[1].pid), *forks[1]])) == 3
    finally:
        for p in (p for group in forks for p in group):
            try:
                p.kill()
            except psutil.Error:
                pass
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_watcher_ends_with_a_clean_exit_and_ignores_termination_signals(tmp_path):
    proc, watcher, children = _start("exit", tmp_path)
    assert proc.wait(timeout=30) == 0
    if watcher is not None:
        watcher.wait(timeout=20)
    assert "without a clean exit" not in proc.stderr.read()


def test_watcher_survives_sigterm_until_the_rank_ends(tmp_path):
    proc, watcher, children = _start("plain", tmp_path)
    try:
        noted = tmp_path / "noted"
        before = noted.stat().st_ino
        watcher.send_signal(signal.SIGTERM)     # a signal to the whole job
        deadline = time.monotonic() + 60        # it goes on noting: a snapshot after the signal
        while noted.stat().st_ino == before and time.monotonic() < deadline:
            assert watcher.is_running() and watcher.status() != psutil.STATUS_ZOMBIE
            time.sleep(0.05)
        assert noted.stat().st_ino != before
        assert watcher.is_running() and watcher.status() != psutil.STATUS_ZOMBIE
        proc.kill()
        proc.wait()
        watcher.wait(timeout=20)
        assert not _alive(children)
    finally:
        _cleanup(proc, watcher, children)


SHM_RANK = NOTED + textwrap.dedent("""
    import mmap, os, sys, time
    from areal_hpc import reaper
    watcher = reaper.start("rank 7 (test)", interval=0.2)
    maps = []
    for path in sys.argv[1:]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 1 << 16)
        maps.append(mmap.mmap(fd, 1 << 16))
    wait_noted(segments=sys.argv[1:])    # the watcher has noted what it maps
    print(watcher.pid, flush=True)
    time.sleep(300)
""")


def test_a_killed_ranks_mpich_segments_are_removed_unless_another_process_maps_them(tmp_path):
    """MPICH's /dev/shm segments outlive a killed rank; its watcher removes those it mapped, but
    not one that another rank of the job (here: this test) still maps."""
    import mmap
    import uuid

    tag = uuid.uuid4().hex[:12]
    own, shared = (f"/dev/shm/mpich_shm_test_{tag}_{k}" for k in ("own", "shared"))
    proc = subprocess.Popen([sys.executable, "-c", SHM_RANK, own, shared], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env=_hooked(tmp_path))
    try:
        watcher = psutil.Process(int(proc.stdout.readline()))
        with open(shared, "r+b") as f, mmap.mmap(f.fileno(), 1 << 16) as still_mapped:
            proc.kill()
            proc.wait(timeout=60)
            watcher.wait(timeout=120)
            assert not os.path.exists(own)
            assert os.path.exists(shared) and still_mapped[:1] == b"\0"
    finally:
        proc.kill()
        for path in (own, shared):
            if os.path.exists(path):
                os.unlink(path)


def test_stale_segments_go_before_mpi_starts_but_not_a_live_or_fresh_one():
    """What a requeued attempt's rank removes before MPI_Init (main.py): this user's MPICH segments
    older than the bound that no process maps (a killed job's, whose names the attempt's own
    would repeat). One that a process maps, and one made a moment ago, stay."""
    import mmap
    import uuid

    tag = uuid.uuid4().hex[:12]
    stale, mapped, fresh = (f"/dev/shm/mpich_shm_test_{tag}_{k}" for k in ("stale", "mapped", "fresh"))
    for path in (stale, mapped, fresh):
        with open(path, "wb") as f:
            f.truncate(1 << 16)
    hour_ago = time.time() - 3600
    for path in (stale, mapped):
        os.utime(path, (hour_ago, hour_ago))
    try:
        with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 1 << 16):
            # this process maps `mapped`; remove_unmapped skips its own maps, so a child holds it
            holder = subprocess.Popen([sys.executable, "-c", (
                "import mmap, sys, time\n"
                f"f = open({mapped!r}, 'r+b'); m = mmap.mmap(f.fileno(), 1 << 16)\n"
                "print('mapped', flush=True); time.sleep(300)")], stdout=subprocess.PIPE, text=True)
            try:
                assert holder.stdout.readline().strip() == "mapped"
                removed = reaper.remove_stale_segments(min_age_s=60)
            finally:
                holder.kill()
                holder.wait(timeout=60)
        assert stale in removed and mapped not in removed and fresh not in removed
        assert not os.path.exists(stale) and os.path.exists(mapped) and os.path.exists(fresh)
    finally:
        for path in (stale, mapped, fresh):
            if os.path.exists(path):
                os.unlink(path)
