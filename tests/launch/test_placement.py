"""launch.placement's pure logic: which GPUs a rank takes from what Slurm shows it, the interface
spec, and the job-wide check (disjoint GPUs and cores per node, cores asked for, rendezvous
address). The same code runs on the simulated GPU cluster in tests/launch/test_slurm_gpu.py."""
import os

import pytest

from areal_hpc.config import load
from areal_hpc.launch.placement import (GENERATOR, TRAINER, PlacementError, RankPlacement, check, choose_gpus,
                                        interface_matches, local_index, p2p_hidden, place_rank)

EIGHT = [str(i) for i in range(8)]


def test_local_index_by_node_name():
    nodes = ["node1", "node1", "node2", "node1", "node2"]
    assert [local_index(nodes, r) for r in range(5)] == [(0, 3), (1, 3), (0, 2), (2, 3), (1, 2)]


def test_a_rank_bound_by_slurm_keeps_its_gpus():
    assert choose_gpus(["5"], 1, local_rank=5, local_size=8) == ["5"]
    assert choose_gpus(["4", "5", "6", "7"], 4, local_rank=1, local_size=2) == ["4", "5", "6", "7"]


def test_the_nodes_whole_list_is_sliced_by_local_rank():
    """A plain srun (or submitit, or mpiexec) shows every rank all 8 GPUs: each takes its own."""
    assert [choose_gpus(EIGHT, 1, r, 8) for r in range(8)] == [[g] for g in EIGHT]
    assert [choose_gpus(EIGHT, 2, r, 4) for r in range(4)] == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    assert choose_gpus(EIGHT, 8, 0, 1) == EIGHT


def _given(rank, node, offered, role=TRAINER, local=None, size=8, need=1):
    lr = rank % size if local is None else local
    return RankPlacement(rank=rank, role=role, node=node, host="h", local_rank=lr, local_size=size,
                         gpus=choose_gpus(offered, need, lr, size), offered=list(offered))


def test_trainer_ranks_each_given_their_own_gpu_only_are_flagged_for_p2p():
    """Bound per task (srun --gpus-per-task=1), a trainer's device cgroup under ConstrainDevices
    holds its GPU alone: its node-mates' GPUs, which NCCL's P2P needs, are hidden. Given the
    node's list, each takes its own and sees the others'. Generators (an engine's TP workers in
    one task) and a node with one trainer rank are not flagged."""
    bound = [_given(r, "n1", [str(r)]) for r in range(8)] + [_given(8, "n2", ["0"], size=1)]
    lines = p2p_hidden(bound)
    assert len(lines) == 1 and lines[0].startswith(
        "n1: trainer rank 0 was given GPU 0 only, while its 7 node-mate(s) use 1,2,3,4,5,6,7 "
        "(8 trainer rank(s) alike): under ConstrainDevices=yes NCCL cannot reach them over P2P/NVLink")
    shared = [_given(r, "n1", EIGHT) for r in range(8)]
    assert [p.gpus for p in shared] == [[g] for g in EIGHT] and p2p_hidden(shared) == []
    assert check(shared) == []
    engines = [_given(r, "n1", EIGHT[4 * r:4 * r + 4], role=GENERATOR, size=2, need=4) for r in range(2)]
    assert p2p_hidden(engines) == []


def test_too_few_gpus_is_one_line():
    with pytest.raises(PlacementError, match="3 rank.* need 4 GPU.* see 8"):
        choose_gpus(EIGHT, 4, 1, 3)
    # Two ranks that each see the node's 8 GPUs and need 8 take the same ones (it may be per-task
    # binding on a 16-GPU node): the job-wide check refuses the overlap.
    both = [RankPlacement(rank=r, role=GENERATOR, node="n1", host="h", local_rank=r, local_size=2,
                          gpus=choose_gpus(EIGHT, 8, r, 2), address="10.0.0.1") for r in range(2)]
    assert check(both)[0] == "n1: GPU 0 is given to rank 0 and rank 1"
    with pytest.raises(PlacementError, match="--gpus-per-node"):
        choose_gpus([], 1, 0, 1)
    assert choose_gpus(None, 0, 0, 1) == []     # CPU ranks need none


def test_interface_spec_as_nccl_reads_it():
    names = ["lo", "eth0", "ib0", "ib1"]
    assert interface_matches("ib", names) == ["ib0", "ib1"]
    assert interface_matches("=ib0", names) == ["ib0"]
    assert interface_matches("^lo,ib", names) == ["eth0"]
    assert interface_matches("hsn", names) == []


def _cuda_topology(**kw):
    return load("configs/tiny_cpu.yaml", ["topology.device=cuda", "topology.trainer_backend=nccl",
                                          "topology.weight_backend=nccl", *[f"{k}={v}" for k, v in kw.items()]]).topology


def test_place_rank_narrows_cuda_visible_devices(monkeypatch):
    topo = _cuda_topology()
    env = {"CUDA_VISIBLE_DEVICES": ",".join(EIGHT), "SLURMD_NODENAME": "node2"}
    p = place_rank(topo, 4, rank=3, role=GENERATOR, nodes=["node1", "node2", "node2", "node2"],
                   address="10.0.0.1", env=env)
    assert (p.local_rank, p.local_size, p.gpus) == (2, 3, [])
    assert p.problems == ["3 rank(s) on this node need 4 GPU(s) each but see 8 (CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7)"]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(EIGHT)}
    p = place_rank(topo, 4, rank=2, role=GENERATOR, nodes=["node1", "node2", "node2"], address="10.0.0.1", env=env)
    assert p.gpus == ["4", "5", "6", "7"] and env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and not p.problems


def test_place_rank_refuses_fewer_cores_than_the_component_asked():
    """The Slurm >= 22.05 pitfall: a step started without -c binds each task to one core."""
    topo = _cuda_topology()
    mine = sorted(os.sched_getaffinity(0))
    env = {"CUDA_VISIBLE_DEVICES": "0", "SLURM_HET_SIZE": "2", "SLURM_CPUS_PER_TASK_HET_GROUP_0": "12",
           "SLURM_STEP_ID": "0", "SLURM_CPUS_ON_NODE": "8"}
    p = place_rank(topo, 1, rank=0, role=TRAINER, nodes=["node1"] * 8, address="10.0.0.1", env=env)
    assert p.cpus == mine and p.cpus_asked == 12 and p.cpus_allocated == 1
    assert any("gave it 1 CPU(s) but its het component asked --cpus-per-task=12" in m for m in p.problems)
    env["SLURM_CPUS_ON_NODE"] = "96"
    p = place_rank(topo, 1, rank=0, role=TRAINER, nodes=["node1"] * 8, address="10.0.0.1", env=env)
    assert p.cpus_allocated == 12 and not p.problems


def test_place_rank_refuses_an_interface_that_is_not_there():
    topo = _cuda_topology()
    p = place_rank(topo, 1, 0, TRAINER, ["n"], "10.0.0.1",
                   env={"CUDA_VISIBLE_DEVICES": "0", "NCCL_SOCKET_IFNAME": "=nosuchif9"})
    assert p.problems and "NCCL_SOCKET_IFNAME==nosuchif9 matches no interface" in p.problems[0]
    p = place_rank(topo, 1, 0, TRAINER, ["n"], "10.0.0.1", env={"CUDA_VISIBLE_DEVICES": "0", "NCCL_SOCKET_IFNAME": "lo"})
    assert p.interfaces == ["lo"] and not p.problems


def test_place_rank_refuses_an_mpi_tcp_interface_that_is_not_there():
    topo = _cuda_topology()
    env = {"CUDA_VISIBLE_DEVICES": "0", "NCCL_SOCKET_IFNAME": "lo", "FI_PROVIDER": "tcp"}
    p = place_rank(topo, 1, 0, TRAINER, ["n"], "10.0.0.1", env={**env, "FI_TCP_IFACE": "nosuchif9"})
    assert p.problems == [f"FI_TCP_IFACE=nosuchif9 (MPI's interface under FI_PROVIDER=tcp) is not an "
                          f"interface with an address here (have {p.problems[0].rsplit('have ', 1)[1]}"]
    assert not place_rank(topo, 1, 0, TRAINER, ["n"], "10.0.0.1",
                          env={**env, "FI_TCP_IFACE": "lo"}).problems
    assert not place_rank(topo, 1, 0, TRAINER, ["n"], "10.0.0.1",      # not read by efa
                          env={**env, "FI_PROVIDER": "efa", "FI_TCP_IFACE": "nosuchif9"}).problems


def _p(rank, node, gpus=(), cpus=(), bound=False, host="h", address="10.0.0.1"):
    return RankPlacement(rank=rank, role=TRAINER, node=node, host=host, local_rank=0, local_size=1,
                         gpus=list(gpus), cpus=list(cpus), bound=bound, address=address)


def test_check_refuses_shared_gpus_and_cores_per_node_only():
    ok = [_p(0, "n1", ["0"]), _p(1, "n1", ["1"]), _p(2, "n2", ["0"])]
    assert check(ok) == []
    assert check([_p(0, "n1", ["0"]), _p(1, "n1", ["0"])]) == ["n1: GPU 0 is given to rank 0 and rank 1"]
    assert check([_p(0, "n1", cpus=[0, 1], bound=True), _p(1, "n1", cpus=[1, 2], bound=True)]) \
        == ["n1: core 1 is given to rank 0 and rank 1"]
    assert check([_p(0, "n1", cpus=[0, 1]), _p(1, "n1", cpus=[0, 1])]) == []   # unbound: the OS shares
    # one pool for the step's tasks (task/cgroup's cpuset, taskset around mpiexec): not an overlap
    assert check([_p(0, "n1", cpus=[0, 1], bound=True), _p(1, "n1", cpus=[0, 1], bound=True)]) == []


def test_check_refuses_a_loopback_rendezvous_across_hosts():
    one_host = [_p(0, "n1", address="127.0.0.1"), _p(1, "n2", address="127.0.0.1")]
    assert check(one_host) == []        # fake nodes of one machine: loopback reaches every rank
    two = [_p(0, "n1", address="127.0.1.1", host="a"), _p(1, "n2", address="127.0.1.1", host="b")]
    assert "loopback" in check(two)[0] and "AREAL_HOST_ADDR" in check(two)[0]


RECIPE_SCRIPTS = {"configs/qwen2_5_1_5b_math.yaml": "slurm/areal_1_5b.sh",
                  "configs/qwen2_5_7b_math.yaml": "slurm/areal_7b.sh",
                  "configs/qwen2_5_7b_tool.yaml": "slurm/areal_7b.sh",
                  "configs/qwen2_5_32b_math.yaml": "slurm/areal_32b.sh"}


def _recipe(config):
    from pathlib import Path
    return load(config, ["model.path=x", "data.train_path=x"]), Path(RECIPE_SCRIPTS[config]).read_text()


@pytest.mark.parametrize("config", sorted(RECIPE_SCRIPTS))
def test_plan_placement_of_each_recipe(config):
    """`python -m areal_hpc.plan placement`: every recipe's layout gives each rank its own GPUs
    (1 per trainer, rollout.engine_tp per generator) and fits a 128-core node."""
    from areal_hpc.launch.placement import plan_layout, sbatch_components
    cfg, script = _recipe(config)
    placements, problems = plan_layout(cfg, sbatch_components(script), cores_per_node=128)
    assert problems == []
    assert len(placements) == cfg.topology.n_trainers + cfg.topology.n_generators
    for p in placements:
        assert len(p.gpus) == (1 if p.role == TRAINER else cfg.rollout.engine_tp)


def test_plan_placement_refuses_overlap_oversubscription_and_a_wrong_count(capsys):
    import argparse

    from areal_hpc.launch.placement import plan_command, plan_layout, sbatch_components
    cfg, script = _recipe("configs/qwen2_5_32b_math.yaml")
    comps = sbatch_components(script)
    comps[1].update({"nodes": "6", "ntasks-per-node": "2"})      # two 8-GPU engines per 8-GPU node
    _, problems = plan_layout(cfg, comps)
    assert problems[0] == "generator-node0: GPU 0 is given to rank 32 and rank 33"
    comps = sbatch_components(script)
    _, problems = plan_layout(cfg, comps, cores_per_node=64)
    assert problems == ["het component 0: 8 task(s) x 12 CPU(s) oversubscribe a 64-core node",
                        "het component 1: 1 task(s) x 96 CPU(s) oversubscribe a 64-core node"]
    comps[0]["nodes"] = "3"
    assert plan_layout(cfg, comps)[1][0] == "het component 0 has 3 x 8 task(s) but the config has 32 trainer rank(s)"
    args = argparse.Namespace(config="configs/qwen2_5_32b_math.yaml", overrides=["model.path=x", "data.train_path=x"],
                              script="slurm/areal_32b.sh", cores_per_node=64)
    assert plan_command(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: placement: het component 0: 8 task(s) x 12 CPU(s) oversubscribe a 64-core node",
                   "error: placement: het component 1: 1 task(s) x 96 CPU(s) oversubscribe a 64-core node"]


# --- gloo: where torch's ProcessGroupGloo binds (the trainers' Megatron groups, on GPUs too) ----

def test_gloo_socket_ifname_is_exact_names_with_an_address():
    """gloo takes GLOO_SOCKET_IFNAME as exact names (no NCCL prefixes or '^'), each an interface
    with an address; a GPU trainer rank is checked beside NCCL_SOCKET_IFNAME, a GPU generator
    (NCCL weight group) joins no gloo group."""
    topo = _cuda_topology()
    env = {"CUDA_VISIBLE_DEVICES": "0", "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    p = place_rank(topo, 1, 0, TRAINER, ["n"], "10.0.0.1", env=env)
    assert (p.interfaces, p.gloo, p.problems) == (["lo"], "lo", [])
    for bad in ("^lo", "lo,nosuchif9"):
        p = place_rank(topo, 1, 0, TRAINER, ["n"], "10.0.0.1", env={**env, "GLOO_SOCKET_IFNAME": bad})
        assert len(p.problems) == 1 and p.problems[0].startswith(f"GLOO_SOCKET_IFNAME={bad}: ") \
            and "is not an interface with an address here (gloo takes exact names" in p.problems[0], p.problems
    p = place_rank(topo, 1, 1, GENERATOR, ["n", "n"], "10.0.0.1", env={"CUDA_VISIBLE_DEVICES": "1"})
    assert p.gloo == "" and not p.problems


def _resolver(*addresses):
    import socket

    def resolve(host, port, family, kind):
        if not addresses:
            raise socket.gaierror("no such host")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, kind, 6, "", (a, 0)) for a in addresses]
    return resolve


def test_gloo_binds_the_first_bindable_address_of_the_host_name():
    from areal_hpc.launch.placement import gloo_default_address
    here = lambda family, sockaddr: sockaddr[0] != "10.9.9.9"      # noqa: E731 - a host without 10.9.9.9
    assert gloo_default_address("n1", _resolver("127.0.1.1", "10.0.0.5"), here) == "127.0.1.1"   # Debian
    assert gloo_default_address("n1", _resolver("10.9.9.9", "10.0.0.5"), here) == "10.0.0.5"
    assert gloo_default_address("n1", _resolver("10.9.9.9"), here) == "127.0.0.1"   # torch's fallback
    assert gloo_default_address("n1", _resolver(), here) == "127.0.0.1"            # unresolvable


def test_trainers_on_several_hosts_with_gloo_on_loopback_are_refused(monkeypatch):
    """Host names that resolve to 127.0.1.1 and GLOO_SOCKET_IFNAME unset: each trainer's gloo
    binds loopback. On one host that works (every fake node of the local cluster); across hosts
    the job is refused in one line that names the fix; with GLOO_SOCKET_IFNAME set it passes."""
    import socket
    monkeypatch.setattr(socket, "getaddrinfo", _resolver("127.0.1.1"))
    topo = _cuda_topology()
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    ps = [place_rank(topo, 1, r, TRAINER, ["n1", "n2", "n3"], "10.0.0.1", env=dict(env)) for r in (0, 1)]
    assert [p.gloo for p in ps] == ["127.0.1.1", "127.0.1.1"]
    assert check(ps) == []                          # one host
    ps[1].host = "other-host"
    problems = check(ps)
    assert len(problems) == 1 and problems[0].startswith(
        "rank 0 (trainer) on n1: gloo would bind loopback 127.0.1.1") and "span 2 hosts" in problems[0] \
        and "(1 more rank(s) alike): set GLOO_SOCKET_IFNAME" in problems[0], problems
    ps = [place_rank(topo, 1, r, TRAINER, ["n1", "n2", "n3"], "10.0.0.1", env={**env, "GLOO_SOCKET_IFNAME": "lo"})
          for r in (0, 1)]
    ps[1].host = "other-host"
    assert [p.gloo for p in ps] == ["lo", "lo"] and check(ps) == []


# --- plan placement: the nodes' cores from sinfo ------------------------------------------------

FAKE_SINFO = """#!/usr/bin/env bash
echo "$*" >>{log}
printf '%s\\n' {lines}
"""


def _fake_sinfo(tmp_path, monkeypatch, nodes: dict[str, int]):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sinfo").write_text(FAKE_SINFO.format(log=tmp_path / "sinfo.args", lines=" ".join(
        f"'{n} {c}'" for n, c in nodes.items())))
    (bin_dir / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def _plan(*args):
    from areal_hpc.plan.__main__ import main
    return main(["placement", "configs/qwen2_5_7b_math.yaml", "model.path=x", "data.train_path=x",
                 "--script", "slurm/areal_7b.sh", *args])


def test_plan_placement_takes_the_nodes_cores_from_sinfo(tmp_path, monkeypatch, capsys):
    """The 7B recipe asks 8 tasks x 12 CPUs = 96 per node on 4 + 12 nodes: refused on 64-CPU
    nodes with one line per component naming those numbers, on a partition with too few 96-CPU
    nodes, passed on 128-CPU ones; --cores-per-node names the count instead of sinfo."""
    _fake_sinfo(tmp_path, monkeypatch, {f"gpu{i:02d}": 64 for i in range(16)})
    assert _plan() == 2
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [
        "error: placement: het component 0: 4 node(s) of 8 task(s) x 12 CPU(s) = 96 CPU(s) each, but sinfo "
        "lists 0 node(s) with that many (nodes x CPUs: 16 x 64)",
        "error: placement: het component 1: 12 node(s) of 8 task(s) x 12 CPU(s) = 96 CPU(s) each, but sinfo "
        "lists 0 node(s) with that many (nodes x CPUs: 16 x 64)"]
    assert (tmp_path / "sinfo.args").read_text().splitlines() == ["-h -N -o %N %c"] * 2
    _fake_sinfo(tmp_path, monkeypatch, {**{f"gpu{i:02d}": 64 for i in range(10)},
                                        **{f"big{i:02d}": 128 for i in range(6)}})
    assert _plan() == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: placement: het component 1: 12 node(s) of 8 task(s) x 12 CPU(s) = 96 CPU(s) each, but sinfo "
        "lists 6 node(s) with that many (nodes x CPUs: 10 x 64, 6 x 128)"]
    _fake_sinfo(tmp_path, monkeypatch, {f"gpu{i:02d}": 128 for i in range(16)})
    assert _plan() == 0
    assert "nodes x CPUs (sinfo): component 0: 16 x 128; component 1: 16 x 128" in capsys.readouterr().out
    assert _plan("--cores-per-node", "64") == 2         # named: sinfo is not asked
    assert capsys.readouterr().err.strip().splitlines()[0] == \
        "error: placement: het component 0: 8 task(s) x 12 CPU(s) oversubscribe a 64-core node"


def test_plan_placement_asks_sinfo_for_the_scripts_partition(tmp_path, monkeypatch, capsys):
    from areal_hpc.launch.placement import sinfo_cores
    _fake_sinfo(tmp_path, monkeypatch, {"gpu01": 96, "gpu02": 96})
    assert sinfo_cores("h100") == {"gpu01": 96, "gpu02": 96}
    assert (tmp_path / "sinfo.args").read_text() == "-h -N -o %N %c -p h100\n"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))         # no sinfo here
    assert sinfo_cores() is None
    assert _plan() == 0
    assert "CPUs per node: not checked (no sinfo here" in capsys.readouterr().out
