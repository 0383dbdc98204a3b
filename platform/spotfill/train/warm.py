"""Warm imports for Ray Train worker processes of spotfill runs (elastic_restarts: spotfill).

A restarted worker group's processes spend seconds importing torch, DeepSpeed and Ray Train before the
training function can build its engine; the training function itself starts late (after Ray Train's worker
set-up and torch.distributed's rendezvous). `start` runs as the worker processes' setup hook
(spotfill.ray_compat.worker_setup_hook_env), the moment each process starts, and imports them on a daemon
thread while the process registers, Ray Train sets it up and the checkpoint downloads: the training function
then finds them loaded. A failed import here is ignored: the training function's own import raises it.
"""
from __future__ import annotations

import importlib
import os
import threading
import time

HOOK = "spotfill.train.warm.start"
_started = threading.Event()
marks: dict[str, float] = {}     # unix s: "warm_hook_t" (the hook ran), "warm_main_t" (Ray Train's worker
                                 # module imported), "warm_done_t" (the thread's imports finished),
                                 # "warm_after_t" (the main thread's imports after torch finished)


def _load() -> None:
    # Nothing that imports Ray's own modules: the process's main thread imports those meanwhile, and two
    # threads importing one package tree in different orders can deadlock. torch and DeepSpeed import no
    # Ray; DeepSpeed's Muon modules load only at deepspeed.initialize (after skip_deepspeed_muon there).
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
        import deepspeed  # noqa: F401

        from spotfill.ray_compat.names import DYNAMO_MODULE
        importlib.import_module(DYNAMO_MODULE)
    except Exception:  # noqa: BLE001 -- surfaced by the training function's own import
        pass
    marks["warm_done_t"] = round(time.time(), 3)


# What the worker's main thread imports next, all after torch: the training function's module, the run
# config's callbacks Ray Train unpickles into every worker's train context, Ray Train's torch backend.
AFTER_TORCH = ("ray.train.torch", "spotfill.train.worker_loop", "spotfill.train.sink", "spotfill.train.teardown",
               "spotfill.train.fillin_claims")


def start() -> None:
    """Start the warm-import thread (once per process), then, on the calling (main) thread, import Ray
    Train's worker module, wait for the thread's imports and import AFTER_TORCH: the imports the actor's
    creation and train context would do on that thread a moment later, in the same order, so a process
    started for an actor loses nothing, and a spare process that waits idle for the next worker group
    (train.worker_loop's spares) has done them all before it gets its actor. Every Ray and spotfill import
    stays on the main thread, after the thread's torch (two threads importing one package tree in
    different orders can deadlock)."""
    if _started.is_set():
        return
    _started.set()
    from spotfill.telemetry.process import process_start_time
    process_start_time()                     # read (and kept) at the process's start: see its docstring
    marks["warm_hook_t"] = round(time.time(), 3)
    from spotfill.config import constants
    from spotfill.ray_compat.names import RAY_TRAIN_WORKER_MODULE
    from spotfill.train.spares import bounded_hold
    # a spare gives way to its node's training workers while it warms up (constants.SPARE_WARM_CLASS: nice 19,
    # or SCHED_IDLE), and a watcher process wakes it the moment one of them is gone (the group stops for a
    # restart: train.readiness) or after SPOTFILL_SPARE_HOLD_MAX_S (only where it has a group to watch)
    kind = _is_spare()
    spare = bool(kind)
    group = _group_workers() if spare else []
    # a reserve spare (train.readiness.GrowPlanner.reserve) is for a restart that may come, not for a grow
    # waiting on it: SCHED_IDLE and no bound -- it imports on CPU time the node leaves unused, and a restart
    # wakes it (on a 2-core demo, reserve spares warming at the group's priority after the bound slowed its
    # steps threefold)
    reserve = kind == "reserve"
    marks["warm_reserve"] = reserve
    low = constants.SPARE_WARM_CLASS == "low" and not reserve
    with bounded_hold(spare, low, constants.SPARE_HOLD_MAX_S if group and not reserve else 0.0, group,
                      constants.SPARE_WAKE_POLL_S) as hold:
        marks["warm_idle"], marks["warm_class"] = hold["idle"], hold["class"]
        _record(ready=False)                 # on its way: a restart that stops the steps finds it
        thread = threading.Thread(target=_load, name="spotfill-warm-start", daemon=True)
        thread.start()
        _import(RAY_TRAIN_WORKER_MODULE)
        marks["warm_main_t"] = round(time.time(), 3)
        thread.join()
        for name in AFTER_TORCH:
            _import(name)
    if "woken_by" in hold:
        marks["warm_woken_t"], marks["warm_woken_moved"], marks["warm_woken_by"] = (
            hold["woken_t"], hold["woken_moved"], hold["woken_by"])
    marks["warm_after_t"] = round(time.time(), 3)
    _record(ready=True)


def _group_workers() -> list[int]:
    """This host's training workers of this process's Ray job (train.spares.group_worker_pids)."""
    try:
        from spotfill.ray_compat.names import RAY_TRAIN_WORKER_TITLE
        from spotfill.train.spares import group_worker_pids
        return group_worker_pids(os.environ.get("RAY_JOB_ID"), RAY_TRAIN_WORKER_TITLE)
    except Exception:  # noqa: BLE001 -- none known: warm up at normal priority
        return []


def _is_spare() -> str:
    """Did a training worker on this node (a file token) or a grow warming this node from elsewhere (a token
    in the GCS key-value store) leave a token for this process (train.spares)? "spare", "reserve" (a grow's
    reserve for a restart) or "" (no: a process started for an actor)."""
    try:
        import ray

        from spotfill.ray_compat import kv_del, kv_list
        from spotfill.train.spares import claim, claim_kv
        node = ray.get_runtime_context().get_node_id()
        return "spare" if claim(node) else claim_kv(node, kv_list, kv_del)
    except Exception:  # noqa: BLE001 -- not known: warm up as a process started for an actor
        return ""


def _record_key() -> str:
    import os

    import ray

    from spotfill.train.readiness import record_key
    ctx = ray.get_runtime_context()
    return record_key(ctx.get_job_id(), ctx.get_node_id(), os.getpid())


def _record(ready: bool) -> None:
    """Record in the GCS key-value store that this process is warming up, or (`ready`) finished its warm-up
    (train.readiness): the resize check and the restart sizing count a node's spares from these records.
    The training function removes it when a worker group takes the process (`withdraw`)."""
    try:
        from spotfill.config import constants
        from spotfill.ray_compat import kv_put
        from spotfill.train.readiness import record_value
        now = time.time()
        since = marks.get("warm_hook_t", now)                 # the warm-up began (the process registered)
        kv_put(_record_key(), record_value(now if ready else None, now + constants.WARM_SPARE_KEEP_ALIVE_S,
                                           marks.get("warm_idle"), since_t=since))
    except Exception:  # noqa: BLE001 -- unrecorded: this node counts as cold, as without readiness
        pass


def withdraw() -> None:
    """This process is a worker group's now: its readiness record goes (it is no spare any more)."""
    if not _started.is_set():
        return
    try:
        from spotfill.ray_compat import kv_del
        kv_del(_record_key())
    except Exception:  # noqa: BLE001 -- a stale record ends with its keep-alive
        pass


def _import(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 -- surfaced by the actor's, or the training function's, own import
        pass
