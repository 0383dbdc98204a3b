"""Cores of their own for the embedded cluster's head and for each of its GPU nodes, as separate machines have.

On a cluster the head (GCS, Serve's controller and proxy, the fill-in arbiter, the training driver) and each
GPU node are separate machines: what one node's processes use costs another node nothing. The embedded
cluster runs them all on this machine's cores, so a benchmark comparing training with and without fill-in
measures the fill-in control plane's idle CPU (a few per cent of a core per Ray actor process) as a training
slowdown that a cluster would not have. `plan_layout` gives the head one core and every node as many cores
as it has GPU slots (one per training worker), disjoint, where the machine has that many; `pin_process_tree`
puts a process, each of its threads and each process it started on given cores (processes it starts later
inherit them). No Ray import: the cluster code hands it process ids.

On a machine with fewer cores (2 here) `training_apart` gives the one training worker a core of its own and
everything else -- the head, every node's raylet and workers (fill-in's tenants, the arbiter, Serve), this
driver -- the other cores: what fill-in costs training is then measured where a cluster has it, on the
tenants' own machines, not as contention for training's core. The worker is moved to its core when it starts
(`pin_training_workers`, called every half second by the embedded cluster): Ray starts it from its node's
raylet, whose cores it inherits.
"""
from __future__ import annotations

import os

from spotfill.fillin.cpu_priority import thread_ids as _threads


def plan_layout(node_slots: list[int], cores: list[int] | None = None) -> dict | None:
    """{"head": [core], "nodes": [[cores of node 0], ...]} from `cores` (this process's allowed cores by
    default): the head gets the last core, node i the next node_slots[i] (at least 1) from the first. None
    when there are fewer cores than that: the caller runs every process on every core, as before."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    need = [max(1, int(n)) for n in node_slots]
    if len(cores) < 1 + sum(need):
        return None
    out, at = [], 0
    for n in need:
        out.append(cores[at:at + n])
        at += n
    return {"head": [cores[-1]], "nodes": out}


TRAINING_WORKER = "ray::RayTrainWorker"     # a Ray Train (v2) worker's process title


def training_apart(n_nodes: int, cores: list[int] | None = None) -> dict | None:
    """{"head": others, "nodes": [others] * n_nodes, "training": [first core]}: the training worker alone on
    the first core, everything else on the others. None with fewer than 2 cores."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if len(cores) < 2:
        return None
    return {"head": cores[1:], "nodes": [cores[1:]] * max(1, int(n_nodes)), "training": cores[:1]}


def describe(layout: dict | None, cores: int | None = None) -> str:
    """One line for a log or a benchmark's notes."""
    if layout is None:
        return f"shared: the head and every node run on all {cores or len(os.sched_getaffinity(0))} cores"
    if layout.get("training"):
        return (f"training apart: the training worker on core(s) {layout['training']}, the head, every node's "
                f"other processes (fill-in, the arbiter, Serve) and the driver on {layout['head']}")
    nodes = ", ".join(f"node {i} {c}" for i, c in enumerate(layout["nodes"]))
    return f"apart: head {layout['head']}, {nodes}"


def as_dict(layout: dict | None, pinned: int | None = None) -> dict:
    """The layout as a benchmark's JSON says it (`pinned`: training worker processes moved to their core)."""
    cores = sorted(os.sched_getaffinity(0))
    if layout is None:
        return {"kind": "shared", "cores": cores, "detail": describe(None)}
    out = {"kind": "training_apart" if layout.get("training") else "apart", "cores": cores,
           "head": layout["head"], "detail": describe(layout)}
    if layout.get("training"):
        out.update(training=layout["training"], others=layout["head"], training_workers_pinned=pinned)
    else:
        out["nodes"] = layout["nodes"]
    return out


def pin_training_workers(root: int, cpus: list[int], done: set[int]) -> int:
    """Every Ray Train worker process under `root` not in `done` (and each of its threads) onto `cpus`;
    returns how many were pinned now (added to `done`)."""
    import psutil

    n = 0
    try:
        procs = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return 0
    for p in procs:
        if p.pid in done:
            continue
        try:
            title = " ".join(p.cmdline()[:1])
        except psutil.Error:
            continue
        if title.startswith(TRAINING_WORKER) and pin_threads(p.pid, cpus):
            done.add(p.pid)
            n += 1
    return n


def pin_threads(pid: int, cpus: list[int]) -> int:
    """Every thread of `pid` onto `cpus` (os.sched_setaffinity sets one thread: the one whose id it is
    given). Returns how many threads were pinned; a thread or process that exits meanwhile is skipped."""
    pinned = 0
    for tid in _threads(pid):
        try:
            os.sched_setaffinity(tid, cpus)
            pinned += 1
        except (ProcessLookupError, PermissionError, OSError):
            continue
    return pinned


def pin_process_tree(pids: list[int], cpus: list[int]) -> int:
    """`pids`, all their descendants and every thread of each onto `cpus`. Returns the processes pinned."""
    import psutil

    seen: set[int] = set()
    for pid in pids:
        try:
            tree = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            continue
        for p in tree:
            if p not in seen and pin_threads(p, cpus):
                seen.add(p)
    return len(seen)


def thread_affinities(pid: int) -> dict[int, set[int]]:
    """The cores each thread of `pid` may run on."""
    out = {}
    for tid in _threads(pid):
        try:
            out[tid] = os.sched_getaffinity(tid)
        except OSError:
            continue
    return out
