"""The sweep's state keeper: one Ray actor per sweep driver (0 CPU, 0 GPU, named, owned by the driver and
placed on the head node when it can be) holding paused trials' states in host memory (fillin/sweep_memory.py's
Shelf), so a resumed trial restores without a storage round trip.

It outlives the trial actors (they exit on every pause), not the driver: a rerun that restores an
experiment an earlier driver left reads storage, as a restore always could. The driver starts it
(`start_keeper`), names it to the trials (the trainable's `job["keeper"]`), drops a trial's state when the
trial is done and stops it at the end (`stop_keeper`, which answers its counts for report.json).
A trial that cannot reach it (gone, slow) restores from storage and says so."""
from __future__ import annotations

import logging
import threading
import uuid

from spotfill.fillin.sweep_memory import Shelf, StateId

log = logging.getLogger("spotfill.fillin.sweep_keeper")

PREFIX = "spotfill-sweep-keeper:"
PUT_TIMEOUT_S, TAKE_TIMEOUT_S = 30.0, 10.0


class StateKeeper:
    """The actor's body (Ray runs it with max_concurrency > 1: a take does not wait behind a big put)."""

    def __init__(self, budget_bytes: int, name: str = ""):
        self.shelf, self.lock, self.name = Shelf(budget_bytes), threading.Lock(), name

    def put(self, sid: dict, data: bytes) -> dict:
        sid = StateId.from_dict(sid)
        with self.lock:
            out = self.shelf.put(sid, bytes(data))
        if not out["kept"]:
            log.warning("sweep state keeper %s: trial %s's state at step %d not kept in memory: %s",
                        self.name, sid.trial, sid.step, out["why"])
        for trial in out["evicted"]:
            log.info("sweep state keeper %s: evicted trial %s's state to make room", self.name, trial)
        return out

    def take(self, wanted: dict) -> tuple[bytes | None, str | None]:
        with self.lock:
            return self.shelf.take(StateId.from_dict(wanted))

    def peek(self, trial: str) -> dict | None:
        with self.lock:
            sid = self.shelf.peek(trial)
        return None if sid is None else sid.as_dict()

    def drop(self, trial: str) -> bool:
        with self.lock:
            return self.shelf.drop(trial)

    def stats(self) -> dict:
        with self.lock:
            return self.shelf.stats()


START_TRIES = 2


def start_keeper(sweep_name: str, budget_bytes: int, tries: int = START_TRIES):
    """Start this driver's keeper; returns (handle, name) -- or (None, None) when it could not be started
    `tries` times (its node died as it started: a demo's keeper, placed on a spot GPU node the moment the head
    could not take it, died with that node's hard loss and took the sweep driver with it). Without a keeper
    the sweep runs as before it had one: a resumed trial restores from storage, and says so."""
    import ray

    from spotfill.fillin.arbiter_handle import head_node_strategy

    for attempt in range(1, max(1, tries) + 1):
        name = f"{PREFIX}{sweep_name}:{uuid.uuid4().hex[:8]}"
        options = dict(name=name, num_cpus=0, num_gpus=0, max_concurrency=4, max_restarts=0)
        head = head_node_strategy()       # the head (not a spot GPU node that may go), elsewhere when it cannot
        if head is not None:
            options["scheduling_strategy"] = head
        actor = ray.remote(StateKeeper).options(**options).remote(budget_bytes, name)
        try:
            ray.get(actor.stats.remote(), timeout=60)
            return actor, name
        except Exception as exc:  # noqa: BLE001 -- a keeper is a head start of resumes, never the sweep
            log.warning("sweep %s: state keeper not started (try %d of %d: %s: %s)", sweep_name, attempt,
                        tries, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 -- already gone
                pass
    log.warning("sweep %s: running without a state keeper: paused trials resume from storage", sweep_name)
    return None, None


def stop_keeper(actor) -> dict:
    """The keeper's counts (report.json fillin.sweep.state_keeper), then the actor is gone."""
    import ray
    try:
        stats = ray.get(actor.stats.remote(), timeout=30)
    except Exception as exc:  # noqa: BLE001 - the report says it could not read them
        stats = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    ray.kill(actor, no_restart=True)
    return stats


def drop_state(actor, trial: str) -> None:
    if actor is not None:
        actor.drop.remote(trial)          # fire and forget: a missed drop is evicted later


_found: dict[str, object] = {}


def _keeper(name: str):
    import ray
    if name not in _found:
        _found[name] = ray.get_actor(name)
    return _found[name]


def keep(name: str, sid: StateId, data: bytes) -> dict:
    """From a trial: hand its just-saved state to the keeper `name`; {"kept", "why", ...}."""
    import ray
    try:
        return ray.get(_keeper(name).put.remote(sid.as_dict(), data), timeout=PUT_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - the storage checkpoint is written: only the fast resume is lost
        _found.pop(name, None)
        return {"kept": False, "evicted": [], "why": f"state keeper unreachable ({type(exc).__name__}: {exc})"[:300]}


def fetch(name: str, wanted: StateId) -> tuple[bytes | None, str | None]:
    """From a resuming trial: the kept bytes of exactly `wanted`, or (None, why)."""
    import ray
    try:
        return ray.get(_keeper(name).take.remote(wanted.as_dict()), timeout=TAKE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - storage still has the checkpoint
        _found.pop(name, None)
        return None, f"state keeper unreachable ({type(exc).__name__}: {exc})"[:300]
