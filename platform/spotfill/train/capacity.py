"""How many workers the cluster holds (pure: no Ray import), for the elastic policy and the grow check."""
from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor


def count_workers(node_resources: dict[str, dict], per_worker: dict[str, float], max_workers: int) -> int:
    """Workers that fit on these nodes (each worker on one node), capped at max_workers (pure)."""
    need = {r: v for r, v in per_worker.items() if v > 0}
    total = sum(int(min(res.get(r, 0.0) // v for r, v in need.items())) for res in node_resources.values())
    return min(total, max_workers)


def reachable(addresses: dict[str, tuple[str, int]], timeout_s: float, connect=None) -> set[str]:
    """The keys whose (host, port) accepts a TCP connection within timeout_s, probed in parallel. A killed
    raylet refuses at once; a vanished machine does not answer and times out."""
    def default_connect(addr: tuple[str, int]) -> bool:
        try:
            socket.create_connection(addr, timeout=timeout_s).close()
            return True
        except OSError:
            return False

    probe = connect or default_connect
    if not addresses:
        return set()
    with ThreadPoolExecutor(min(32, len(addresses))) as pool:
        results = dict(zip(addresses, pool.map(probe, addresses.values())))
    return {key for key, ok in results.items() if ok}
