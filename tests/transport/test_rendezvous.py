"""Rendezvous ports (areal_hpc.transport.rendezvous): a port trainer rank 0 reserves stays its own
until the TCPStore serves on it. A port only found free was taken by another process in CI (a
TCPStore failed with EADDRINUSE at start-up, ending the job)."""
import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from areal_hpc.transport import rendezvous
from areal_hpc.transport.rendezvous import free_port, rendezvous_store, reserve_port

T = timedelta(seconds=60)


def _take(port: int) -> socket.socket:
    """Another process's listener on `port` (the thief)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", port))
    s.listen(1)
    return s


def test_a_port_only_found_free_can_be_taken_before_the_store_binds_it():
    port = free_port()
    thief = _take(port)
    try:
        with pytest.raises(dist.DistNetworkError, match="EADDRINUSE|address already in use"):
            rendezvous_store("127.0.0.1", port, 1, True, T)
    finally:
        thief.close()


def test_a_reserved_port_cannot_be_taken_and_the_store_serves_on_it():
    port = reserve_port()
    with pytest.raises(OSError):
        _take(port)
    # a client that connects before the master's store starts waits in the listen queue
    got = {}

    def client():
        c = rendezvous_store("127.0.0.1", port, 2, False, T)
        got["v"] = c.get("k")

    t = threading.Thread(target=client)
    t.start()
    master = rendezvous_store("127.0.0.1", port, 2, True, T)     # waits for the client to join
    master.set("k", "v")
    t.join(60)
    assert not t.is_alive() and got["v"] == b"v"
    assert master.port == port and port not in rendezvous._HELD  # handed over, once
