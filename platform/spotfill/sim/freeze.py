"""The `freeze_node` fault: a node whose processes stop answering without a word.

A spot host that vanishes (or hangs) sends no TCP reset: its peers' sockets stay open, and every request to
it just waits. SIGSTOP on every process of a local node does the same to the rest of the cluster: the
kernel keeps the sockets, nothing on the node reads or answers. The GCS's health checks time out, the
surviving training workers block in their next collective with the frozen ranks. The frozen processes are
killed (SIGKILL reaches a stopped process) when the cluster shuts down, so nothing is left behind.
"""
from __future__ import annotations

import logging
import signal

log = logging.getLogger(__name__)


def freeze_process_tree(root_pids: list[int]) -> list:
    """SIGSTOP the roots, then every descendant, until a pass finds no new one (a process stopped before
    its children cannot start more). Returns the stopped processes (psutil.Process: a later signal checks
    the process is still the same one, not a reused pid)."""
    import psutil

    stopped: dict[int, psutil.Process] = {}
    todo = [p for p in (_process(pid) for pid in root_pids) if p is not None]
    while todo:
        for proc in todo:
            try:
                proc.send_signal(signal.SIGSTOP)
                stopped[proc.pid] = proc
            except psutil.Error:
                pass
        found = {}
        for proc in stopped.values():
            try:
                found.update((c.pid, c) for c in proc.children(recursive=True))
            except psutil.Error:
                continue
        todo = [c for pid, c in sorted(found.items()) if pid not in stopped]
    return list(stopped.values())


def kill_frozen(procs: list) -> int:
    """SIGKILL the frozen processes still running (a stopped process dies on SIGKILL); returns how many."""
    import psutil

    killed = 0
    for proc in procs:
        try:
            proc.kill()          # psutil refuses when the pid now belongs to another process
            killed += 1
        except psutil.Error:
            pass
    if killed:
        log.info("killed %d frozen processes", killed)
    return killed


def _process(pid: int):
    import psutil
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def dead_since(frozen_at: dict[int, float], node_ids: list[str], now: float) -> dict[int, float]:
    """The frozen nodes (index -> freeze time) the GCS lists as dead now: index -> `now` (needs ray.init;
    the caller polls about once a second, so the time is that late at most)."""
    if not frozen_at:
        return {}
    import ray
    dead = {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
    return {i: now for i in frozen_at if node_ids[i] in dead}
