"""Worker counting and the raylet reachability probe the elastic policy sizes restarts with."""
from __future__ import annotations

import socket
import time

from spotfill.train.capacity import count_workers, reachable


def test_count_workers_per_node_and_capped():
    nodes = {"a": {"GPU": 2.0, "CPU": 8.0}, "b": {"GPU": 1.0, "CPU": 1.0}, "head": {"CPU": 4.0}}
    assert count_workers(nodes, {"GPU": 1, "CPU": 1}, max_workers=8) == 3
    assert count_workers(nodes, {"GPU": 1, "CPU": 2}, max_workers=8) == 2      # b lacks the CPUs
    assert count_workers(nodes, {"GPU": 1, "CPU": 1}, max_workers=2) == 2
    assert count_workers({}, {"GPU": 1}, max_workers=4) == 0


def test_reachable_tells_a_listening_port_from_a_closed_one():
    live = socket.socket()
    live.bind(("127.0.0.1", 0))
    live.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()                              # nothing listens there now: refused at once
    try:
        t0 = time.monotonic()
        found = reachable({"live": live.getsockname(), "dead": ("127.0.0.1", dead_port)}, timeout_s=2.0)
        assert found == {"live"} and time.monotonic() - t0 < 1.5
    finally:
        live.close()
    assert reachable({}, 0.5) == set()


def test_reachable_probes_every_node_with_the_given_connect():
    seen = []

    def connect(addr):
        seen.append(addr)
        return addr[1] % 2 == 0

    assert reachable({f"n{i}": ("10.0.0.1", i) for i in range(6)}, 0.5, connect=connect) == {"n0", "n2", "n4"}
    assert sorted(p for _, p in seen) == list(range(6))
