"""Rendezvous ports: TCP ports for a torch TCPStore (the trainer group's, the weight group's),
chosen on trainer rank 0 and broadcast by `areal_hpc.topology.Topology.build`."""
from __future__ import annotations

import random
import socket


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _ports_below_ephemeral(tries: int = 64):
    """Random ports below the kernel's ephemeral range: a port from bind(("", 0)) is ephemeral,
    and an outgoing connection can take it before a listener started a moment later binds it."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    return (rng.randrange(max(1024, low - 12000), low) for _ in range(tries))


def _listener(port: int) -> socket.socket | None:
    """A socket bound to `port` and listening (None: the port is taken)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))
        s.listen(1024)
    except OSError:
        s.close()
        return None
    return s


def free_port() -> int:
    """A TCP port to listen on, free now (for a test or tool whose listener starts at once;
    a job's rendezvous holds its port: `reserve_port`)."""
    for port in _ports_below_ephemeral():
        s = _listener(port)
        if s is not None:
            s.close()
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# Ports reserved by `reserve_port`, their sockets bound and listening until a store takes them.
_HELD: dict[int, socket.socket] = {}


def reserve_port() -> int:
    """A TCP port this process keeps: bound and listening from now until `rendezvous_store`
    serves a TCPStore on it. A port only found free (`free_port`) can be taken by another
    process (another job's rank on a shared node, another CI run) before the store binds it,
    seconds later here and minutes on a large model's start-up: the store then fails with
    EADDRINUSE and the job dies at start-up. A held one cannot be taken; a client that connects
    before the store starts waits in the listen queue."""
    for port in [*_ports_below_ephemeral(), 0]:     # 0: any ephemeral one, as a last resort
        s = _listener(port)
        if s is not None:
            port = s.getsockname()[1]
            _HELD[port] = s
            return port
    raise OSError("no TCP port to listen on")


def rendezvous_store(host: str, port: int, world_size: int, is_master: bool, timeout):
    """A torch TCPStore at host:port, every member joined before it returns. Its master serves
    on the socket `reserve_port` holds for `port` in this process (handed over, so it is never
    unbound), or binds the port itself where this process holds none."""
    from torch.distributed import TCPStore
    held = _HELD.pop(port, None) if is_master else None
    fd = held.detach() if held is not None else None
    return TCPStore(host, port, world_size, is_master=is_master, timeout=timeout,
                    wait_for_workers=True, master_listen_fd=fd)
