"""A fill-in job's grant: how many GPU units a batch or sweep driver may hold right now.

Drivers (jobs/batch_infer.py, jobs/sweep.py) are written against `Grant`:

    grant.allowed() -> int     units it may hold now; it changes at any time (training's claims)
    grant.demand(n)            how many units it could use now (fewer as its work runs out)
    grant.wait(at_least, timeout) -> int
    grant.grace_s              how long it has to let go of a unit after `allowed()` drops
    grant.close()              done: give everything back

`ArbiterGrant` is the real one: it registers the driver's Ray job with the fill-in arbiter as a job tenant
(fillin/job_tenant.py) and polls its target. `FixedGrant` is a grant of N units that a caller changes by
hand (`set`), for a run on GPUs of one's own (no arbiter) and for tests that play the arbiter.
If the arbiter cannot be reached for longer than the grace, an ArbiterGrant answers 0: a tenant that
cannot hear reclaims must not hold GPUs training may need.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("spotfill.fillin.grant")


class FixedGrant:
    """`units` units until someone calls `set`."""

    def __init__(self, units: int, grace_s: float = 5.0):
        self._units, self.grace_s = int(units), float(grace_s)
        self._changed = threading.Condition()
        self.wanted: int | None = None
        self.closed = False

    def set(self, units: int) -> None:
        with self._changed:
            self._units = int(units)
            self._changed.notify_all()

    def allowed(self) -> int:
        return 0 if self.closed else self._units

    def demand(self, units: int) -> None:
        self.wanted = int(units)

    def wait(self, at_least: int = 1, timeout: float | None = None) -> int:
        with self._changed:
            self._changed.wait_for(lambda: self.allowed() >= at_least, timeout)
        return self.allowed()

    def close(self) -> None:
        self.closed = True


class ArbiterGrant:
    """A job tenant of the fill-in arbiter (started detached if absent)."""

    def __init__(self, kind: str, name: str, *, max_units: int, gpus_per_unit: int = 1, grace_s: float = 5.0,
                 gpu_resource: str = "GPU", poll_s: float = 0.25, arbiter=None, runtime_env: dict | None = None,
                 cpus_per_unit: float = 0.0, demand: int | None = None):
        """`demand`: the units it can use at registration (None: `max_units`). A job that still prepares
        (plans its units, starts its keeper, its first trials) registers with 0 and states its demand when it
        can run a unit: a GPU lent before then is held with nothing on it (a demo's batch job was lent a GPU
        53 s before it could start its first wave)."""
        import ray

        from spotfill.fillin import wiring
        self.arbiter = arbiter or wiring.arbiter(gpu_resource, runtime_env=runtime_env)
        self.grace_s, self.poll_s = float(grace_s), float(poll_s)
        self.spec = {"name": name, "kind": kind, "job_id": ray.get_runtime_context().get_job_id(),
                     "max_replicas": int(max_units), "gpus_per_replica": int(gpus_per_unit),
                     "cpus_per_replica": float(cpus_per_unit), "grace_s": self.grace_s, "gpu_resource": gpu_resource}
        self.tenant = f"{kind}:{name}"
        self._target, self._heard_at, self._demand = 0, time.monotonic(), None if demand is None else max(0, int(demand))
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._register()
        self._thread = threading.Thread(target=self._poll, name=f"grant-{self.tenant}", daemon=True)
        self._thread.start()

    def _register(self) -> None:
        import ray
        spec = dict(self.spec, demand=self._demand)
        answer = ray.get(self.arbiter.register_job_tenant.remote(spec), timeout=30)
        self._set(int(answer.get("target", 0)))

    def _set(self, target: int) -> None:
        with self._changed:
            if target != self._target:
                log.info("fill-in grant %s: %d -> %d unit(s)", self.tenant, self._target, target)
            self._target, self._heard_at = target, time.monotonic()
            self._changed.notify_all()

    def _poll(self) -> None:
        import ray
        while not self._stop.wait(self.poll_s):
            try:
                demand = self._demand
                if demand is not None:      # told before the target is read: a lower demand lowers the target
                    ray.get(self.arbiter.set_demand.remote(self.tenant, demand), timeout=5)
                answer = ray.get(self.arbiter.tenant_target.remote(self.tenant), timeout=5)
                if not answer.get("known"):
                    self._register()        # the arbiter restarted without our record: ask again
                else:
                    self._set(int(answer["target"]))
            except Exception as exc:  # noqa: BLE001 - the arbiter restarts; allowed() fails safe meanwhile
                log.warning("fill-in grant %s: arbiter not reachable (%s: %s)", self.tenant, type(exc).__name__, exc)
                with self._changed:
                    self._changed.notify_all()

    def allowed(self) -> int:
        with self._changed:
            if time.monotonic() - self._heard_at > max(self.grace_s, 3 * self.poll_s):
                return 0
            return self._target

    def demand(self, units: int) -> None:
        self._demand = max(0, int(units))

    def wait(self, at_least: int = 1, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while self.allowed() < at_least:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._changed.wait(min(left, 1.0) if left is not None else 1.0)
        return self.allowed()

    def close(self) -> None:
        import ray
        self._stop.set()
        try:
            ray.get(self.arbiter.unregister_tenant.remote(self.tenant), timeout=10)
        except Exception as exc:  # noqa: BLE001
            log.warning("fill-in grant %s: unregister failed (%s)", self.tenant, exc)
