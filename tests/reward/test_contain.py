import os
import signal
import subprocess
import sys

import pytest

from areal_hpc.reward import contain


@pytest.mark.skipif(contain.memory_base() is None,
                    reason="no writable memory cgroup on this host (the sandbox then relies on "
                           "its other bounds, tested in test_sandbox.py)")
def test_a_memory_cgroup_counts_memory_no_process_maps():
    """A memfd of 200 MiB under a 64 MiB group: RLIMIT_AS would never see it, the group does."""
    group = contain.MemoryGroup(64 << 20)
    try:
        assert group.prefix
        hog = ("import os\nfd = os.memfd_create('hog')\n"
               "for _ in range(200):\n    os.write(fd, b'x' * (1 << 20))\nprint('held')\n")
        res = subprocess.run([*group.prefix, sys.executable, "-c", hog], capture_output=True,
                             timeout=120)
        assert res.returncode == -signal.SIGKILL and b"held" not in res.stdout, res
        assert group.oom_killed()
    finally:
        group.remove()
    assert group.path is None


def test_the_bound_is_said_in_one_line():
    line = contain.bound()
    assert "\n" not in line and line.startswith("sandbox: ") and "reward workers: " in line


@pytest.mark.skipif(not contain.namespace_prefix()[0], reason=contain.namespace_prefix()[1])
def test_a_wrapped_process_is_pid_1_and_ending_it_ends_a_respawning_chain(tmp_path):
    """A chain that re-spawns itself as fast as it can (each generation forks, then exits),
    holding a lock: once `end` returns, the lock is free, with no retry."""
    import fcntl

    lock = tmp_path / "chain.lock"
    ready = tmp_path / "chain.ready"
    chain = (f"import fcntl, os, time\nif os.fork() == 0:\n    f = open({str(lock)!r}, 'w')\n"
             "    fcntl.flock(f, fcntl.LOCK_EX)\n"
             f"    open({str(ready)!r}, 'w').close()\n"
             "    while True:\n        if os.fork():\n            os._exit(0)\n"
             "time.sleep(600)\n")               # pid 1 lives on, as a reward worker does
    proc = subprocess.Popen(contain.wrap([sys.executable, "-c", chain]),
                            start_new_session=True)
    fd = contain.pidfd(contain.init_pid(proc))
    assert fd is not None
    try:
        _wait_for(ready)
    finally:
        contain.end(proc, fd)
        os.close(fd)
    assert proc.returncode is not None
    with open(lock) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)    # raises if any generation lives


def _wait_for(path, timeout_s: float = 60.0) -> None:
    import time
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.skipif(contain.memory_base() is None or not contain.namespace_prefix()[0],
                    reason="needs a writable memory cgroup and PID namespaces")
def test_workers_that_are_each_pid_1_make_their_own_memory_cgroups():
    """Two wrapped workers (each pid 1 of its namespace, as the reward pool's are) make a memory
    cgroup each, the second while the first's is still empty: both exist, apart. (Named from the
    pid, the second's mkdir failed and its clean-up removed the first's before its test joined
    it: CI's "sandbox failed: ... cannot create .../cgroup.procs".)"""
    make = ("import os, sys\nfrom areal_hpc.reward import contain\n"
            "g = contain.MemoryGroup(64 << 20)\nprint(os.getpid(), g.path, flush=True)\n"
            "sys.stdin.readline()\nprint(os.path.isdir(g.path or ''), flush=True)\ng.remove()\n")
    procs, lines = [], []
    try:
        for _ in range(2):      # the second starts once the first's cgroup is made
            p = subprocess.Popen(contain.wrap([sys.executable, "-c", make]), text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            procs.append(p)
            lines.append(p.stdout.readline().split())
        assert [pid for pid, _ in lines] == ["1", "1"]
        paths = [path for _, path in lines]
        assert "None" not in paths and paths[0] != paths[1], paths
        alive = []
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            alive.append(p.stdout.readline().strip())
        assert alive == ["True", "True"]
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
