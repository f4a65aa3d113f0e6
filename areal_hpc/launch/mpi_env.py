"""MPICH's netmod under srun's pmi2 plugin: the default slurm/site_gpu.sh applies, and why.

MPICH (pip's `mpich` wheel, or a site build) started by `srun --mpi=pmi2` speaks PMI-1, which
Slurm's pmi2 plugin reads in one read() of at most 1 KiB per request. Over UCX, the default
netmod of an MPICH built with UCX and OFI (the wheel: "MPICH Device: ch4:ucx ofi"), a rank's
business card is ~900 bytes and MPICH puts a node's cards as lines sent back to back: at 8 ranks
per node (the 1.5B and 7B recipes) a line cut at a read's end fails the start-up ("mpi/pmi2: value
not properly terminated"; tools/local_slurm.sh traced it). Over OFI an address is tens of bytes:
one short put. So where the MPI is MPICH with an OFI netmod that is not its default, the plugin is
pmi2 and neither a netmod nor PMI-2 was chosen, the default is MPIR_CVAR_CH4_NETMOD=ofi with
FI_PROVIDER=tcp unless one is set: left to itself the wheel's libfabric picks its legacy `sockets`
provider, under which the 32B rehearsal's 10 ranks on 4 hosts hung in MPI_Init (15 min; with tcp
they start in seconds: areal_hpc/launch/rehearse.py). MPI carries control messages and
trajectories here, not weights, so tcp costs nothing that matters.

Not tcp where the node has a fabric NCCL reaches through libfabric too (EFA, Slingshot's cxi:
`node_fabric`): FI_PROVIDER is libfabric's process-wide filter, read once, and NCCL's OFI
plugin loads the libfabric already in the process (same soname, the wheel's, loaded by MPI
first), so a tcp default there would leave NCCL no EFA or cxi provider in the trainers. The
default there is that fabric's provider, for MPI and NCCL alike (MPI's addresses on it are short
too). With tcp, the interface MPI uses is the one NCCL is told to use: FI_TCP_IFACE from
NCCL_SOCKET_IFNAME (its first match here; read only by libfabric's tcp provider), so that on a
multi-homed node MPI does not take the management network; each rank checks that it names an
interface of its node (launch/placement.py). A site's own FI_PROVIDER or FI_TCP_IFACE wins. Cray
MPICH, Intel MPI, MVAPICH and Open MPI name themselves otherwise and get nothing: they choose
their own fabric.

    eval "$(python -m areal_hpc.launch.mpi_env)"     # export lines; none where nothing applies

What tests/launch/test_slurm.py starts at 8 ranks per node on the local cluster is this default,
through slurm/site_gpu.sh as shipped.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path


def mpich_netmods(library_version: str) -> list[str] | None:
    """The ch4 netmods of an MPICH library, default first, from its MPI_Get_library_version text
    ("MPICH Device:      ch4:ucx ofi" -> ["ucx", "ofi"]; ch3 -> []); None for another MPI."""
    if not library_version.startswith("MPICH Version:"):
        return None
    for line in library_version.splitlines():
        if line.startswith("MPICH Device:"):
            device = line.split(":", 1)[1].strip()
            return device[len("ch4:"):].split() if device.startswith("ch4:") else []
    return []


def node_fabric(root: str = "/") -> str | None:
    """The libfabric provider of a fabric this node has that NCCL would use through its OFI
    plugin: "efa" (an RDMA device driven by efa), "cxi" (a Slingshot NIC); None otherwise.
    `root`: where /sys and /dev are (a test's stand-in tree)."""
    base = Path(root)
    for dev in sorted((base / "sys/class/infiniband").glob("*")):
        driver = dev / "device" / "driver"
        if driver.exists() and driver.resolve().name == "efa":
            return "efa"
    if any((base / "sys/class/cxi").glob("cxi*")) or any((base / "dev").glob("cxi[0-9]*")):
        return "cxi"
    return None


def defaults(library_version: str, env=None, fabric: str | None = None,
             interfaces: list[str] = ()) -> dict[str, str]:
    """The MPI variables to export for this library and environment (see the module
    docstring): `fabric` is `node_fabric()`, `interfaces` this node's interface names."""
    env = os.environ if env is None else env
    netmods = mpich_netmods(library_version)
    if (not netmods or netmods[0] == "ofi" or "ofi" not in netmods
            or env.get("AREAL_SRUN_MPI", "pmi2") != "pmi2"
            or env.get("MPIR_CVAR_CH4_NETMOD") or env.get("MPIR_CVAR_PMI_VERSION") == "2"):
        return {}
    out = {"MPIR_CVAR_CH4_NETMOD": "ofi"}
    if not env.get("FI_PROVIDER"):
        out["FI_PROVIDER"] = fabric or "tcp"
    nccl = env.get("NCCL_SOCKET_IFNAME", "")
    if (env.get("FI_PROVIDER") or out.get("FI_PROVIDER")) == "tcp" and nccl \
            and not env.get("FI_TCP_IFACE"):
        from .placement import interface_matches
        match = interface_matches(nccl, list(interfaces))
        if match:
            out["FI_TCP_IFACE"] = match[0]
    return out


def library_version() -> str:
    """MPI_Get_library_version of the MPI mpi4py loads, without initialising MPI ("" when it
    cannot be loaded: the job's ranks will say why)."""
    try:
        import mpi4py
        mpi4py.rc.initialize = False
        from mpi4py import MPI
        return MPI.Get_library_version()
    except Exception:       # no MPI library here: the ranks' error to report, not this one's
        return ""


def main() -> int:
    import psutil
    for k, v in defaults(library_version(), fabric=node_fabric(),
                         interfaces=list(psutil.net_if_addrs())).items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
