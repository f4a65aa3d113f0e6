"""CPU placement of the ranks (areal_hpc.cpus): parsing, shares, binding, the launcher's
line; the binding itself on this process (affinity and torch's thread count), restored after."""
import os

import pytest
import torch

from areal_hpc.config import load
from areal_hpc import cpus

CONFIG = "configs/tiny_cpu.yaml"


@pytest.mark.parametrize("text, want", [
    ("", []), ("0", [0]), ("0-3", [0, 1, 2, 3]), ("3,1,2-2", [1, 2, 3]), (" 0 , 4-5 ", [0, 4, 5]),
])
def test_parse_and_format_round_trip(text, want):
    assert cpus.parse_cpus(text) == want
    assert cpus.parse_cpus(cpus.format_cpus(want)) == want


def test_format_merges_runs():
    assert cpus.format_cpus([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize("bad", ["a", "1-", "-1", "2-1", "0-1-2", "1.5"])
def test_bad_lists_name_the_key(bad):
    with pytest.raises(ValueError, match=r"^topology\.trainer_cpus: "):
        cpus.parse_cpus(bad, "topology.trainer_cpus")


@pytest.mark.parametrize("ids, n, want", [
    ([0, 1], 2, [[0], [1]]),
    ([3, 0, 2, 1], 2, [[0, 1], [2, 3]]),           # sorted first
    ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
    ([0, 1, 2], 2, [[0, 1], [2]]),
    (range(5), 2, [[0, 1, 2], [3, 4]]),             # the longer lists first
    (range(10), 4, [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]),
    ([4, 5, 6, 7], 1, [[4, 5, 6, 7]]),
    ([2, 9], 3, [[2], [9], [2]]),                   # fewer CPUs than workers: shared
    ([0], 2, [[0], [0]]),
    ([5], 3, [[5], [5], [5]]),
])
def test_split(ids, n, want):
    assert cpus.split_cpus(ids, n) == want


def test_split_needs_cpus_and_a_positive_count():
    with pytest.raises(ValueError):
        cpus.split_cpus([], 2)
    with pytest.raises(ValueError):
        cpus.split_cpus([0, 1], 0)


def test_check_refuses_cpus_not_available():
    topo = load(CONFIG, ["topology.trainer_cpus=0", "topology.generator_cpus=0,9999"]).topology
    with pytest.raises(ValueError, match=r"topology\.generator_cpus: CPU\(s\) 9999 are not available"):
        cpus.check_cpus(topo)
    cpus.check_cpus(topo, allowed=[0, 9999])


def test_describe_says_where_each_role_runs():
    topo = load(CONFIG, ["topology.trainer_cpus=0", "topology.generator_cpus=0-1"]).topology
    line = cpus.describe(topo, {})
    assert "1 trainer rank(s) on CPUs 0, 1 thread(s) each" in line
    assert "1 generator rank(s) on CPUs 0-1, 2 thread(s) each" in line
    assert "CPUs 0 shared by both roles (generators at nice 10)" in line
    plain = cpus.describe(load(CONFIG).topology, {"OMP_NUM_THREADS": "1"})
    assert plain == ("1 trainer rank(s) unbound, OMP_NUM_THREADS=1; "
                     "1 generator rank(s) unbound, OMP_NUM_THREADS=1")


def test_bind_sets_affinity_and_threads_then_restore():
    before, threads, omp = os.sched_getaffinity(0), torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    first = min(before)
    topo = load(CONFIG, [f"topology.trainer_cpus={first}"]).topology
    try:
        assert cpus.bind_rank(topo, "generator", 0, 1) is None          # not bound: untouched
        assert os.sched_getaffinity(0) == before
        assert cpus.bind_rank(topo, "trainer", 0, 1) == [first]
        assert os.sched_getaffinity(0) == {first}
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp


def test_a_generator_sharing_the_trainers_cores_yields_to_it():
    """In a child process (a nice value cannot be taken back): shared cores → nice raised by
    SHARED_GENERATOR_NICE; disjoint cores → unchanged."""
    import subprocess
    import sys
    first = min(os.sched_getaffinity(0))
    code = ("import os, sys; from areal_hpc.config import load; from areal_hpc import cpus; "
            "t = load('configs/tiny_cpu.yaml', sys.argv[1:]).topology; before = os.nice(0); "
            "cpus.bind_rank(t, 'generator', 0, 1); print(os.nice(0) - before)")
    for gen, want in ((str(first), cpus.SHARED_GENERATOR_NICE), ("", 0)):
        r = subprocess.run([sys.executable, "-c", code, f"topology.trainer_cpus={first}",
                            f"topology.generator_cpus={gen}"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert int(r.stdout.split()[-1]) == want
