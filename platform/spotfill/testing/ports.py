"""Free TCP ports for local clusters, stand-ins and tests, picked where nothing else takes them unasked.

A port the kernel hands out for `bind(0)` comes from its ephemeral range (ip_local_port_range, 32768-60999 by
default): the range every outgoing connection's local port comes from too. Between our probe and the real bind
(a Serve proxy, a Ray head, a stand-in) a Ray cluster opens hundreds of connections, and one of them may take
the port: CI saw `Failed to bind to address '127.0.0.1:46857'` from Serve's proxy. Ray's worker processes take
theirs from 10002-19999 (its min/max_worker_port defaults). The ports here come from between the two, which
nothing allocates on its own; a candidate is still checked free before it is given.
"""
from __future__ import annotations

import random
import socket

LOW = 20000                      # above Ray's default worker port range (10002-19999)
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> int:
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768             # Linux's default


def bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` now, from the range below the kernel's ephemeral ports (the kernel's
    own pick where that range is empty or full)."""
    high = _ephemeral_low()
    rng = random.Random()        # seeded from the OS: parallel test processes pick apart
    chosen: list[int] = []
    tries = 0
    while len(chosen) < n and high > LOW and tries < 200 * n:
        tries += 1
        port = rng.randrange(LOW, high)
        if port not in chosen and bindable(host, port):
            chosen.append(port)
    while len(chosen) < n:
        port = _kernel_port(host)
        if port not in chosen:
            chosen.append(port)
    return chosen


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on `host` now (see free_ports)."""
    return free_ports(1, host)[0]
