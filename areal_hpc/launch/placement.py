"""Where each rank runs: its GPUs, its cores, its network interface, checked before any rank works.

A trainer rank owns one GPU; a generator rank owns `rollout.engine_tp` GPUs (one vLLM engine, its
TP workers one GPU each). Slurm tells a task its GPUs through CUDA_VISIBLE_DEVICES, in one of two
ways, and a rank must be right under both:
- the node's whole list (slurm/job.sh, a plain `srun`, submitit, `mpiexec` inside an allocation,
  or no Slurm at all): every rank on the node sees every GPU, and a TP = 1 engine or
  `torch.cuda.set_device(0)` would put every rank on GPU 0. The rank then takes the slice
  `local_rank * N ... + N` of it;
- bound per task (`srun --gpus-per-task=N`): the list holds exactly this rank's N GPUs. Under
  ConstrainDevices=yes (common on GPU sites) the task's device cgroup then holds those alone, so
  NCCL cannot use P2P/NVLink to its node-mates' GPUs, and Slurm numbers every task's GPUs from 0:
  the ranks of a node cannot tell theirs apart, and `check` refuses the overlap saying so.
  slurm/job.sh does not bind per task; `p2p_hidden` warns where a step did (without device
  cgroups it runs).
Either way the rank narrows CUDA_VISIBLE_DEVICES to its own GPUs before CUDA starts, so device 0
is its first GPU for torch and vLLM alike.

Cores: since Slurm 22.05 `srun` does not inherit `--cpus-per-task`; a step started without `-c`
binds every task to one core (at 32B a generator's loop, vLLM's EngineCore, its TP workers and
the reward pool on one core). slurm/job.sh passes each het component's `-c`. A rank reads what its
component asked (SLURM_CPUS_PER_TASK_HET_GROUP_k, in the batch environment srun passes on), what
the step allocated on its node (SLURM_CPUS_ON_NODE over the ranks there) and, where a task plugin
binds, its affinity; fewer than asked is refused.

Network: NCCL_SOCKET_IFNAME (GPU jobs) must match an interface of the node, in NCCL's syntax.
gloo, which the trainer ranks use on GPUs too (megatron-core 0.16 creates its data-parallel gloo
groups eagerly, `initialize_model_parallel(create_gloo_process_groups=True)`), and every rank of a
gloo weight group on CPU, binds as torch's ProcessGroupGloo does: GLOO_SOCKET_IFNAME, a comma list
of exact interface names that must each have an address (no prefixes); unset, the first address
the host name resolves to that it can bind, else loopback. A host name that resolves to 127.0.1.1
(Debian's /etc/hosts) binds loopback: peers on other hosts cannot connect.

`gather_and_check` collects every rank's `RankPlacement` on world rank 0, which refuses a GPU
held by two ranks of one node, a core given to two bound ranks, too few cores, an interface that
does not exist, a loopback rendezvous address with ranks on several hosts, or gloo bound to
loopback on ranks of several hosts — in one line, before the trainer or the engines start.
`python -m areal_hpc.launch.placement CONFIG` (what `slurm/job.sh --dry-run` runs on every rank
instead of the job) prints the table per node.
Torch-free: it runs before torch or vLLM look at a GPU.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import sys
from dataclasses import asdict, dataclass, field

from ..config import ConfigError, load
from ..cpus import format_cpus
from ..topology import GENERATOR, TRAINER, check_world, host_address, local_index, node_name
from ..transport.mpi import barrier, bcast, gather


class PlacementError(ValueError):
    """A rank's GPUs, cores or network are not what the job needs; the message is one line."""


def gpus_needed(topology, role: str, engine_tp: int) -> int:
    if topology.device != "cuda":
        return 0
    return 1 if role == TRAINER else engine_tp


def visible_gpus(env=None) -> list[str] | None:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them; without that variable
    the node's NVIDIA devices (/proc/driver/nvidia/gpus), or None when there is no driver."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return None


def choose_gpus(visible: list[str] | None, need: int, local_rank: int, local_size: int) -> list[str]:
    """This rank's GPUs out of what it sees (see the module docstring). PlacementError when the
    node has too few for its ranks."""
    if need == 0:
        return []
    if not visible:
        raise PlacementError(
            f"no GPU visible ({'CUDA_VISIBLE_DEVICES is empty' if visible == [] else 'no NVIDIA driver'})"
            f" but this rank needs {need}: ask for --gpus-per-node in the #SBATCH lines")
    if len(visible) == need:                 # bound per task by Slurm (or a single rank)
        return list(visible)
    if len(visible) >= need * local_size:    # the node's whole list: take this rank's slice
        return list(visible[local_rank * need:(local_rank + 1) * need])
    raise PlacementError(
        f"{local_size} rank(s) on this node need {need} GPU(s) each but see {len(visible)} "
        f"(CUDA_VISIBLE_DEVICES={','.join(visible)})")


def interface_matches(spec: str, names: list[str]) -> list[str]:
    """The interfaces NCCL / gloo would accept for `spec` (NCCL_SOCKET_IFNAME syntax: a comma
    list of prefixes; '=' before the list: exact names; '^' before it: every interface but
    those)."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    wanted = [w for w in spec.split(",") if w]

    def hit(name):
        return any(name == w if exact else name.startswith(w) for w in wanted)
    return [n for n in names if hit(n) != exclude]


def gloo_interfaces(spec: str) -> list[str]:
    """The interfaces torch's gloo binds for GLOO_SOCKET_IFNAME=`spec`: its comma list of exact
    names, one device each ([]: unset, or a single character, which torch ignores)."""
    return [n for n in spec.split(",") if n] if len(spec) > 1 else []


def interface_addresses() -> dict[str, list[str]]:
    """This host's interfaces and their IPv4/IPv6 addresses (gloo needs one on its interface)."""
    import psutil
    return {name: [a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addrs in psutil.net_if_addrs().items()}


def _can_bind(family: int, sockaddr) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind(sockaddr)
        return True
    except OSError:
        return False


def gloo_default_address(host: str, resolve=None, can_bind=_can_bind) -> str:
    """The address torch's gloo binds without GLOO_SOCKET_IFNAME: the first address `host`
    resolves to (`resolve`: socket.getaddrinfo) that this host can bind, else the loopback
    address it falls back to."""
    try:
        infos = (resolve or socket.getaddrinfo)(host, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError:
        infos = []
    for family, _, _, _, sockaddr in infos:
        if can_bind(family, sockaddr):
            return sockaddr[0]
    return "127.0.0.1"


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address in ("localhost",)


@dataclass
class RankPlacement:
    """Where one rank runs (what `gather_and_check` compares and the dry-run prints)."""
    rank: int
    role: str
    node: str                   # Slurm node name (fake nodes share a host)
    host: str                   # the machine's host name
    local_rank: int             # among the ranks on its node
    local_size: int
    gpus: list[str] = field(default_factory=list)      # CUDA_VISIBLE_DEVICES after narrowing
    offered: list[str] = field(default_factory=list)   # what the task was given, before it
    cpus: list[int] = field(default_factory=list)      # affinity
    bound: bool = False         # affinity narrower than the host: a task plugin placed it
    cpus_asked: int | None = None       # the het component's --cpus-per-task
    cpus_allocated: int | None = None   # the step's CPUs on this node over its ranks there
    ifname: str = "auto"        # NCCL_SOCKET_IFNAME (GPU) or GLOO_SOCKET_IFNAME (CPU) spec
    interfaces: list[str] = field(default_factory=list)   # what that spec matches here
    gloo: str = ""              # where its gloo groups bind: interfaces or address ("": no gloo)
    address: str = ""           # the rendezvous address (trainer rank 0's)
    problems: list[str] = field(default_factory=list)     # found by this rank itself


def place_rank(topology, engine_tp: int, rank: int, role: str, nodes: list[str], address: str,
               env=None, apply: bool = True) -> RankPlacement:
    """This rank's placement, from its node and every rank's node name (`nodes`, world order).
    With `apply`, CUDA_VISIBLE_DEVICES is narrowed to the rank's GPUs (before CUDA starts)."""
    env = os.environ if env is None else env
    local_rank, local_size = local_index(nodes, rank)
    p = RankPlacement(rank=rank, role=role, node=nodes[rank], host=socket.gethostname(),
                      local_rank=local_rank, local_size=local_size, address=address)
    visible = visible_gpus(env)
    p.offered = list(visible or []) if gpus_needed(topology, role, engine_tp) else []
    try:
        p.gpus = choose_gpus(visible, gpus_needed(topology, role, engine_tp), local_rank, local_size)
    except PlacementError as exc:
        p.problems.append(str(exc))
    if apply and p.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(p.gpus)
    p.cpus = sorted(os.sched_getaffinity(0))
    p.bound = len(p.cpus) < (os.cpu_count() or len(p.cpus))
    group = 0 if role == TRAINER else 1
    asked = env.get(f"SLURM_CPUS_PER_TASK_HET_GROUP_{group}")
    if asked is None and env.get("SLURM_HET_SIZE") is None:
        asked = env.get("SLURM_CPUS_PER_TASK")
    p.cpus_asked = int(asked) if asked and asked.isdigit() else None
    on_node = env.get("SLURM_CPUS_ON_NODE")
    if on_node and on_node.isdigit() and "SLURM_STEP_ID" in env:
        p.cpus_allocated = int(on_node) // local_size
    if p.cpus_asked:
        if p.bound and len(p.cpus) < p.cpus_asked:
            p.problems.append(f"runs on {len(p.cpus)} core(s) ({format_cpus(p.cpus)}) but its het "
                              f"component asked --cpus-per-task={p.cpus_asked}: start the step with "
                              f"srun -c (Slurm >= 22.05 does not pass it on)")
        elif p.cpus_allocated is not None and p.cpus_allocated < p.cpus_asked:
            p.problems.append(f"the step gave it {p.cpus_allocated} CPU(s) but its het component "
                              f"asked --cpus-per-task={p.cpus_asked}: start the step with srun -c")
    have = interface_addresses()
    names = list(have)
    gloo_spec = env.get("GLOO_SOCKET_IFNAME", "")
    if topology.device == "cuda":
        p.ifname = env.get("NCCL_SOCKET_IFNAME", "auto")
        p.interfaces = interface_matches(p.ifname, names) if p.ifname != "auto" else []
        if p.ifname != "auto" and not p.interfaces:
            p.problems.append(f"NCCL_SOCKET_IFNAME={p.ifname} matches no interface here (have {','.join(names)})")
    else:
        p.ifname = gloo_spec or "auto"
        p.interfaces = gloo_interfaces(gloo_spec)
    tcp_iface = env.get("FI_TCP_IFACE", "")
    if env.get("FI_PROVIDER") == "tcp" and tcp_iface and not have.get(tcp_iface):
        p.problems.append(f"FI_TCP_IFACE={tcp_iface} (MPI's interface under FI_PROVIDER=tcp) is not "
                          f"an interface with an address here (have {','.join(names)})")
    # gloo: Megatron's data-parallel groups on every trainer rank; the weight group on CPU.
    if role == TRAINER or topology.weight_backend == "gloo":
        bound = gloo_interfaces(gloo_spec)
        missing = [n for n in bound if not have.get(n)]
        if missing:
            p.problems.append(f"GLOO_SOCKET_IFNAME={gloo_spec}: {','.join(missing)} is not an interface with an "
                              f"address here (gloo takes exact names, comma-separated; have {','.join(names)})")
        p.gloo = ",".join(bound) if bound else gloo_default_address(p.host)
    return p


def check(placements: list[RankPlacement]) -> list[str]:
    """Every problem of the job's placement, one line each (empty: it is sound)."""
    out = [f"rank {p.rank} ({p.role}) on {p.node}: {msg}" for p in placements for msg in p.problems]
    by_node: dict[str, list[RankPlacement]] = {}
    for p in placements:
        by_node.setdefault(p.node, []).append(p)
    for node, ps in by_node.items():
        seen: dict[str, RankPlacement] = {}
        for p in ps:
            for g in p.gpus:
                if g in seen:
                    q = seen[g]
                    # Each given exactly its own GPUs (bound per task): under ConstrainDevices
                    # Slurm numbers every task's GPUs from 0, so "the same" GPU may be two.
                    why = (" (each was given only its own GPUs: under ConstrainDevices=yes Slurm "
                           "numbers every task's GPUs from 0, so the ranks cannot tell theirs "
                           "apart; start the step without per-task GPU binding, as slurm/job.sh "
                           "does)") if p.offered == p.gpus and q.offered == q.gpus else ""
                    out.append(f"{node}: GPU {g} is given to rank {q.rank} and rank {p.rank}{why}")
                seen.setdefault(g, p)
        # Cores: ranks with the same mask share a pool on purpose (task/cgroup confines a step's
        # tasks to one cpuset; mpiexec under taskset); masks that differ but intersect are a
        # binding gone wrong (two tasks pinned to one core).
        masks: dict[tuple, int] = {}
        for p in (q for q in ps if q.bound):
            masks.setdefault(tuple(p.cpus), p.rank)
        seen_masks = list(masks.items())
        for i, (a, ra) in enumerate(seen_masks):
            for b, rb in seen_masks[i + 1:]:
                common = sorted(set(a) & set(b))
                if common:
                    out.append(f"{node}: core {common[0]} is given to rank {ra} and rank {rb}")
    hosts = {p.host for p in placements}
    if placements and len(hosts) > 1 and is_loopback(placements[0].address):
        out.append(f"rank 0's rendezvous address {placements[0].address} is a loopback address "
                   f"but the ranks run on {len(hosts)} hosts: set AREAL_HOST_ADDR (or fix the "
                   f"host name's entry in /etc/hosts)")
    gloo = [p for p in placements if p.gloo]
    looped = [p for p in gloo if is_loopback(p.gloo)]
    gloo_hosts = {p.host for p in gloo}
    if looped and len(gloo_hosts) > 1:
        p = looped[0]
        out.append(f"rank {p.rank} ({p.role}) on {p.node}: gloo would bind loopback {p.gloo} (the address "
                   f"host name {p.host} resolves to) but the ranks' gloo groups span {len(gloo_hosts)} hosts"
                   + (f" ({len(looped) - 1} more rank(s) alike)" if len(looped) > 1 else "")
                   + ": set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on "
                     "(slurm/site_gpu.sh), or fix the host name's entry in /etc/hosts")
    return out


def p2p_hidden(placements: list[RankPlacement]) -> list[str]:
    """Nodes whose trainer ranks were each given only their own GPUs (`srun --gpus-per-task`),
    one line each. Where the site sets ConstrainDevices=yes, a task's device cgroup then holds
    only those: its TP/DP peers' GPUs cannot be opened, and NCCL falls back from P2P/NVLink to
    shared host memory between ranks of one node (at 32B, SP collectives on every layer: about
    an hour more per step). Trainer ranks given the node's whole list (slurm/job.sh) narrow it
    to their own GPU themselves and keep P2P. A warning, not a refusal: the job runs either way."""
    out = []
    for node in dict.fromkeys(p.node for p in placements if p.role == TRAINER):
        ranks = [p for p in placements if p.node == node and p.role == TRAINER and p.gpus]
        used = {g for p in ranks for g in p.gpus}
        short = [p for p in ranks if not used <= set(p.offered)]
        if len(ranks) > 1 and short:
            p = short[0]
            out.append(f"{node}: trainer rank {p.rank} was given GPU {','.join(p.offered)} only, while its "
                       f"{len(ranks) - 1} node-mate(s) use {','.join(sorted(used - set(p.gpus), key=str))} "
                       f"({len(short)} trainer rank(s) alike): under ConstrainDevices=yes NCCL cannot reach "
                       f"them over P2P/NVLink; start the trainers' step without per-task GPU binding "
                       f"(as slurm/job.sh does), each rank then takes its own GPU by local rank")
    return out


def table(placements: list[RankPlacement]) -> str:
    """Per node, which rank holds which GPUs and cores, and its interface."""
    lines = []
    for node in dict.fromkeys(p.node for p in placements):
        lines.append(f"{node}:")
        for p in (q for q in placements if q.node == node):
            cpus = (f"cores {format_cpus(p.cpus)}" if p.bound else "cores unbound" if p.cpus
                    else "cores planned") + (
                f", {p.cpus_allocated} allocated" if p.cpus_allocated is not None else "") + (
                f" (asked {p.cpus_asked})" if p.cpus_asked else "")
            gpus = (f"GPU {','.join(p.gpus)} of {len(p.offered)}" if p.gpus else "no GPU")
            net = p.ifname if p.ifname == "auto" else f"{p.ifname} -> {','.join(p.interfaces) or 'none'}"
            lines.append(f"  rank {p.rank:>4} {p.role:<9} local {p.local_rank}/{p.local_size}  {gpus:<18} "
                         f"{cpus}  iface {net}" + (f"  gloo {p.gloo}" if p.gloo else ""))
    if placements:
        lines.append(f"rendezvous: {placements[0].address} (trainer rank 0 on {placements[0].node})")
    return "\n".join(lines)


def gather_and_check(world, topology, engine_tp: int, rank: int, role: str, address: str,
                     apply: bool = True) -> tuple[RankPlacement, list[RankPlacement] | None, list[str]]:
    """Collective over `world`: place this rank, gather every placement on rank 0, check them
    there, and share the verdict. Returns (mine, all (rank 0) or None, problems (every rank))."""
    nodes = world.allgather(node_name())
    mine = place_rank(topology, engine_tp, rank, role, nodes, address, apply=apply)
    every = gather(world, asdict(mine), root=0, what="start-up: every rank's placement")
    placements = [RankPlacement(**d) for d in every] if every is not None else None
    problems = check(placements) if placements is not None else None
    problems = bcast(world, problems, root=0, what="start-up: the placement verdict")
    return mine, placements, problems


def main(argv: list[str] | None = None) -> int:
    """`python -m mpi4py -m areal_hpc.launch.placement CONFIG [key=value ...]` on every rank of
    the job's step: place, check, print the table on rank 0; exit 2 on a problem."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load(argv[0], argv[1:])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    try:
        check_world(cfg.topology, world.Get_size())
    except ConfigError as exc:
        if world.Get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    rank = world.Get_rank()
    role = TRAINER if rank < cfg.topology.n_trainers else GENERATOR
    address = world.bcast(host_address() if rank == 0 else None, root=0)
    _, placements, problems = gather_and_check(world, cfg.topology, cfg.rollout.engine_tp, rank,
                                               role, address, apply=False)
    if rank == 0:
        print(table(placements), flush=True)
        for line in problems:
            print(f"error: placement: {line}", file=sys.stderr, flush=True)
        for line in p2p_hidden(placements):
            print(f"warning: placement: {line}", file=sys.stderr, flush=True)
        if not problems:
            print(f"placement: {len(placements)} rank(s) on {len({p.node for p in placements})} "
                  f"node(s), GPUs disjoint on every node", flush=True)
    # `python -m mpi4py` aborts the world when a rank exits non-zero: not before rank 0 has said why.
    barrier(world, what="placement: rank 0's report")
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())


# --- the static plan: a recipe's #SBATCH layout, before any job --------------------------------

def sbatch_components(script_text: str) -> list[dict[str, str]]:
    """The het components' `--key=value` options from a batch script's #SBATCH lines."""
    comps, opts = [], {}
    for line in script_text.splitlines():
        if not line.startswith("#SBATCH"):
            continue
        words = line.split()[1:]
        if words == ["hetjob"]:
            comps.append(opts)
            opts = {}
        for w in words:
            if w.startswith("--") and "=" in w:
                k, v = w[2:].split("=", 1)
                opts[k] = v
    comps.append(opts)
    return comps


def sinfo_cores(partition: str | None = None) -> dict[str, int] | None:
    """Each node's CPU count as Slurm lists it (`sinfo -h -N -o "%N %c"`, in `partition` if one is
    named), or None where that cannot be asked (no sinfo here, no cluster it reaches)."""
    import subprocess
    cmd = ["sinfo", "-h", "-N", "-o", "%N %c", *(["-p", partition] if partition else [])]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    cores = {}
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        words = line.split()
        if len(words) == 2 and words[1].isdigit():
            cores[words[0]] = int(words[1])     # a node in two partitions is listed twice
    return cores or None


def core_counts(cores: dict[str, int]) -> str:
    """How many nodes have how many CPUs: "20 x 64, 2 x 128"."""
    sizes = sorted(set(cores.values()))
    return ", ".join(f"{sum(c == n for c in cores.values())} x {n}" for n in sizes)


def cores_problem(k: int, nodes: int, per_node: int, cpt: int, cores: int | dict[str, int] | None) -> str | None:
    """One line when het component `k` (`nodes` x `per_node` tasks x `cpt` CPUs) asks more CPUs
    per node than its nodes have: `cores` is every node's count (an int), or each node's count as
    sinfo lists them (then: fewer than `nodes` of them have enough); None or 0: nothing checked."""
    need = per_node * cpt
    if not cores:
        return None
    if isinstance(cores, int):
        return None if need <= cores else (f"het component {k}: {per_node} task(s) x {cpt} CPU(s) "
                                           f"oversubscribe a {cores}-core node")
    fit = sum(c >= need for c in cores.values())
    if fit >= nodes or fit == len(cores):     # enough, or too few nodes at all: not a matter of cores
        return None
    return (f"het component {k}: {nodes} node(s) of {per_node} task(s) x {cpt} CPU(s) = {need} CPU(s) "
            f"each, but sinfo lists {fit} node(s) with that many (nodes x CPUs: {core_counts(cores)})")


def plan_layout(cfg, comps: list[dict[str, str]], cores_per_node: int = 0,
                node_cores: list[dict[str, int] | None] | None = None) -> tuple[list[RankPlacement], list[str]]:
    """Every rank's placement as slurm/job.sh's step would make it from these components
    (component 0 = trainers, 1 = generators): GPUs bound per task in node order, the cores its
    component asks for. More cores asked per node than the nodes have is refused: every node has
    `cores_per_node`, or (when 0) component k's nodes have `node_cores[k]` (`sinfo_cores`)."""
    t = cfg.topology
    if len(comps) != 2:
        return [], [f"the script has {len(comps)} het component(s); the job needs 2 (trainers, generators)"]
    placements, problems, rank = [], [], 0
    for k, (role, opts) in enumerate(zip((TRAINER, GENERATOR), comps)):
        nodes, per_node = int(opts.get("nodes", 1)), int(opts.get("ntasks-per-node", 1))
        gpus = int(str(opts.get("gpus-per-node", "0")).rsplit(":", 1)[-1])
        cpt = int(opts.get("cpus-per-task", 1))
        need = gpus_needed(t, role, cfg.rollout.engine_tp)
        want = t.n_trainers if role == TRAINER else t.n_generators
        if nodes * per_node != want:
            problems.append(f"het component {k} has {nodes} x {per_node} task(s) but the config has "
                            f"{want} {role} rank(s)")
        short = cores_problem(k, nodes, per_node, cpt, cores_per_node or (node_cores[k] if node_cores else None))
        if short:
            problems.append(short)
        for n in range(nodes):
            for lr in range(per_node):
                p = RankPlacement(rank=rank, role=role, node=f"{role}-node{n}", host=f"{role}-node{n}",
                                  local_rank=lr, local_size=per_node, cpus_asked=cpt,
                                  cpus_allocated=cpt, address="(trainer-node0)")
                try:
                    p.gpus = choose_gpus([str(g) for g in range(gpus)], need, lr, per_node)
                except PlacementError as exc:
                    p.problems.append(str(exc))
                placements.append(p)
                rank += 1
    return placements, problems + check(placements)


def summary(placements: list[RankPlacement]) -> str:
    """`table` of the first node of each role, and a count of the nodes laid out like it."""
    out = []
    for role in (TRAINER, GENERATOR):
        ps = [p for p in placements if p.role == role]
        if not ps:
            continue
        nodes = list(dict.fromkeys(p.node for p in ps))
        first = [p for p in ps if p.node == nodes[0]]
        out.append(table(first).rsplit("\nrendezvous:", 1)[0])
        if len(nodes) > 1:
            out.append(f"  ... and {len(nodes) - 1} more {role} node(s) laid out alike")
    return "\n".join(out)


def add_parser(sub) -> None:
    p = sub.add_parser("placement", help="which rank holds which GPUs and cores, from a batch script")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--script", required=True, help="the batch script whose #SBATCH lines to lay out "
                                                   "(e.g. slurm/areal_7b.sh)")
    p.add_argument("--cores-per-node", type=int, default=None,
                   help="every node's CPU count, to refuse more asked per node (default: each node's from "
                        "sinfo, in the script's --partition; 0: no check)")


def plan_command(args, console=None) -> int:
    """`python -m areal_hpc.plan placement CONFIG --script S`: the plan, exit 2 on a problem."""
    from pathlib import Path

    try:
        cfg = load(args.config, args.overrides)
        text = Path(args.script).read_text()
    except (ConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    comps = sbatch_components(text)
    node_cores = None
    if args.cores_per_node is None:
        node_cores = [sinfo_cores(opts.get("partition")) for opts in comps]
    placements, problems = plan_layout(cfg, comps, args.cores_per_node or 0, node_cores)
    print(summary(placements))
    if node_cores and any(node_cores):
        print("nodes x CPUs (sinfo): " + "; ".join(f"component {k}: {core_counts(c) if c else 'unknown'}"
                                                   for k, c in enumerate(node_cores)))
    elif node_cores:
        print("CPUs per node: not checked (no sinfo here; --cores-per-node N names the count)")
    for line in problems:
        print(f"error: placement: {line}", file=sys.stderr)
    if not problems:
        nodes = len({p.node for p in placements})
        print(f"placement: {len(placements)} rank(s) on {nodes} node(s), GPUs disjoint on every node "
              f"(on the cluster: sbatch {args.script} --dry-run)")
    return 2 if problems else 0
