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
import threading
import time

HOOK = "spotfill.train.warm.start"
_started = threading.Event()
marks: dict[str, float] = {}     # unix s: "warm_hook_t" (the hook ran), "warm_done_t" (the thread's imports
                                 # finished), "warm_main_t" (the main thread's import finished)


def _load() -> None:
    # Nothing that imports Ray's own modules: the process's main thread imports those meanwhile, and two
    # threads importing one package tree in different orders can deadlock. torch and DeepSpeed import no
    # Ray; DeepSpeed's Muon modules load only at deepspeed.initialize (after skip_deepspeed_muon there).
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
        import deepspeed  # noqa: F401
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 -- surfaced by the training function's own import
        pass
    marks["warm_done_t"] = round(time.time(), 3)


# Ray Train's worker actor class lives here; the actor's creation imports it on the process's main thread.
# It imports no torch (so it never waits on the thread's import of torch).
RAY_TRAIN_WORKER_MODULE = "ray.train.v2._internal.execution.worker_group.worker"


def start() -> None:
    """Start the warm-import thread (once per process), then import Ray Train's worker module on the
    calling (main) thread: the same import the actor's creation would do on that thread a moment later
    (no cost to a process started for an actor), done ahead on a spare process that waits idle for the
    next worker group (train.worker_loop's spares)."""
    if _started.is_set():
        return
    _started.set()
    marks["warm_hook_t"] = round(time.time(), 3)
    threading.Thread(target=_load, name="spotfill-warm-start", daemon=True).start()
    try:
        importlib.import_module(RAY_TRAIN_WORKER_MODULE)
    except Exception:  # noqa: BLE001 -- surfaced by the actor's own creation
        pass
    marks["warm_main_t"] = round(time.time(), 3)
