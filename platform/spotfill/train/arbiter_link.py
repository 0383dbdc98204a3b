"""Training's side of the fill-in protocol: what a training job tells the fill-in arbiter and reads from it.

Training sits below fill-in (fill-in's tenants run training's model, data and checkpoints); it reaches the
arbiter (spotfill/fillin/arbiter.py) only as a named Ray actor and a record in the GCS's key-value store,
both defined here, so no training module imports fill-in:

    ARBITER_NAME, NAMESPACE  the arbiter actor's name (fillin/arbiter_handle.py starts it under these)
    get_arbiter()            its handle, or None when no arbiter runs
    announce_training(...)   a training job that fill-in must never take GPUs from: recorded under TRAINING_KEY
                             (an arbiter started later reads it) and told to a running arbiter
    withdraw_training(name)  the job is done
    announce_coming(...)     nodes new to the run that training waits to grow onto (its spares warm there):
                             recorded under COMING_KEY for a short while, so an autoscaled cluster's fill-in
                             lends their GPUs meanwhile (fillin/hosts.py) -- training's grow claims them back
    fillin_reclaimable()     GPUs per node lent to fill-in, which training's claim takes back (restart sizing)
    LeaseForwarder           copies the arbiter's journal (fillin/journal.py) into a run's events.jsonl, so the
                             run's GPU-seconds ledger counts fill-in and its harvest ratio
Claims before each worker group starts are train/fillin_claims.py. Fill-in never stops training: every call
here swallows and logs what goes wrong.
"""
from __future__ import annotations

import json
import logging
import threading
import time

from spotfill import ray_compat

log = logging.getLogger("spotfill.train.arbiter_link")
ARBITER_NAME = "spotfill-arbiter"
NAMESPACE = "spotfill"
TRAINING_KEY = "fillin/training/"          # GCS KV (namespace spotfill): one record per announced training job
COMING_KEY = "fillin/coming/"              # GCS KV: nodes a run waits to grow onto, {"nodes", "t", "until_t"}


def get_arbiter():
    """The running arbiter actor, or None."""
    import ray
    try:
        return ray.get_actor(ARBITER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def training_record(name: str, min_workers: int, max_workers: int, gpus_per_worker: int = 1,
                    ray_job_id: str | None = None) -> dict:
    return {"job": name, "min_workers": int(min_workers), "max_workers": int(max_workers),
            "gpus_per_worker": int(gpus_per_worker), "ray_job_id": ray_job_id, "t": round(time.time(), 3)}


def announce_training(name: str, min_workers: int, max_workers: int, gpus_per_worker: int = 1) -> bool:
    """Tell fill-in that training job `name` runs here and may use up to `max_workers` x `gpus_per_worker`
    GPUs: recorded in the GCS key-value store (an arbiter that starts later registers it from there, and drops
    it when the job's driver is gone) and registered with the running arbiter, if any. Returns whether an
    arbiter was told now. Never raises: fill-in must not stop training."""
    import ray

    try:
        job_id = ray.get_runtime_context().get_job_id()
        ray_compat.kv_put(TRAINING_KEY + name, json.dumps(training_record(name, min_workers, max_workers,
                                                                         gpus_per_worker, job_id)))
        running = get_arbiter()
        if running is None:
            return False
        ray.get(running.register_job.remote(name, min_workers, max_workers, gpus_per_worker), timeout=30)
        return True
    except Exception as exc:  # noqa: BLE001
        log.warning("fill-in: training job %s not announced (%s: %s); fill-in may lend GPUs it could grow into",
                    name, type(exc).__name__, exc)
        return False


def withdraw_training(name: str) -> None:
    """The job is done: its record goes and a running arbiter releases it. Never raises."""
    import ray

    try:
        ray_compat.kv_del(TRAINING_KEY + name)
        running = get_arbiter()
        if running is not None:
            ray.get(running.release_job.remote(name), timeout=10)
    except Exception as exc:  # noqa: BLE001
        log.warning("fill-in: training job %s not withdrawn (%s); the arbiter drops it once its driver is gone",
                    name, exc)


def coming_record(nodes, ttl_s: float, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    return {"nodes": sorted(nodes), "t": round(now, 3), "until_t": round(now + ttl_s, 3)}


def coming_nodes(records: list[dict], now: float) -> set[str]:
    """The nodes of `records` (coming_record values) whose time has not run out."""
    out: set[str] = set()
    for rec in records:
        try:
            if float(rec["until_t"]) > now:
                out.update(str(n) for n in rec["nodes"])
        except (KeyError, TypeError, ValueError):
            continue
    return out


def announce_coming(run: str, nodes, ttl_s: float) -> None:
    """Rank 0 of run `run` waits to grow onto `nodes` (new to the run; its spares warm there): fill-in may lend
    their GPUs until then (the record lasts `ttl_s`, renewed by each resize check while it waits). No nodes:
    the record goes. Never raises."""
    try:
        if nodes:
            ray_compat.kv_put(COMING_KEY + run, json.dumps(coming_record(nodes, ttl_s)))
        else:
            ray_compat.kv_del(COMING_KEY + run)
    except Exception as exc:  # noqa: BLE001 - fill-in never stops training
        log.info("fill-in: the nodes training waits for not announced (%s); they are lent after it grows", exc)


def fillin_reclaimable() -> dict[str, dict[str, float]]:
    """GPUs per node lent to fill-in, which training's claim takes back before its group starts (the
    arbiter's view); {} without an arbiter or when it does not answer in time -- sizing then counts only
    what is free, as it would without fill-in."""
    import ray
    try:
        arbiter = get_arbiter()
        return ray.get(arbiter.reclaimable.remote(), timeout=5) if arbiter is not None else {}
    except Exception as exc:  # noqa: BLE001 - fill-in never stops training
        log.warning("fill-in: cannot read reclaimable GPUs (%s); sizing the restart without them", exc)
        return {}


# -- the arbiter's journal into a run's events ---------------------------------------------------------------
# A thread in the training driver asks the arbiter every `interval_s` for what is new and hands it to the
# run's event sink. No arbiter on the cluster (or one that does not answer) is not an error: the thread keeps
# asking, quietly, and the run simply has no fill-in events until one appears.
class LeaseForwarder:
    def __init__(self, sink, interval_s: float = 1.0):
        self.sink, self.interval_s = sink, interval_s
        self.seq: int | None = None
        self.forwarded = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spotfill-fillin-events", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> "LeaseForwarder":
        self._thread.start()
        return self

    def poll(self) -> int:
        """Forward what is new; returns how many events were written (0 without an arbiter)."""
        import ray

        with self._lock:
            arbiter = get_arbiter()
            if arbiter is None:
                return 0
            answer = ray.get(arbiter.journal_since.remote(self.seq), timeout=10)
            events = answer["events"]
            if events:
                ray.get(self.sink.log.remote(events), timeout=10)
            self.seq = answer["seq"]
            self.forwarded += len(events)
            return len(events)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - fill-in telemetry never disturbs training
                log.debug("fill-in events not forwarded this time: %s", exc)

    def stop(self) -> None:
        """Stop the thread after one last poll (the run's last leases end up in its log)."""
        self._stop.set()
        self._thread.join(timeout=15)
        try:
            self.poll()
        except Exception as exc:  # noqa: BLE001
            log.warning("fill-in: the last lease events were not forwarded: %s", exc)
