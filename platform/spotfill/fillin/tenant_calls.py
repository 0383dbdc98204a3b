"""Calls to tenants that may be slow, made off the arbiter's lock.

Training's claim takes the arbiter's lock every 0.1 s; a tenant's call must never make it wait. Two calls
can take seconds: telling Serve a new replica count (an HTTP POST to the dashboard's scale endpoint, 5 s
timeout: fillin/serve_tenant.py) and stopping a job tenant that did not yield (the Jobs API, or a task that
kills its driver: up to 30 s, fillin/job_tenant.py). The arbiter decides under its lock and hands the call to
`TenantCalls`, whose threads make it without the lock and take the lock only to record the outcome.

`Scaled` is a Serve tenant as the arbiter keeps it: `target` is the count the arbiter set -- at once, under
its lock, and what every decision reads -- and `acked` the last count Serve accepted. A count that did not
get through is sent again (backing off to BACKOFF_MAX_S); the count a tenant was taken over with on its
first round is withdrawn instead (target None: taken over again on a later round, from what it then holds).
A reclaim whose count never gets through ends as a `handback_incomplete` journal event (fillin/journal.py).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

log = logging.getLogger("spotfill.fillin.tenant_calls")
BACKOFF_MAX_S = 5.0


class Scaled:
    """A tenant scaled by count from outside (a ServeTenant), whose scale call goes out on TenantCalls: a
    fill-in `Tenant` (fillin/tenant.py) that does not pull its target and is never forced (Serve stops its
    own replicas)."""

    pulls_target = False
    forced_when_overdue = False
    pending_groups: frozenset = frozenset()

    def __init__(self, inner, calls: "TenantCalls"):
        self.inner, self.calls = inner, calls
        self.target: int | None = inner.target      # what the arbiter set
        self.acked: int | None = None                # what Serve last accepted
        self.takeover = False                        # target is the count taken over on the first round
        self.failures = 0

    @property
    def spec(self):
        return self.inner.spec

    @property
    def tenant(self) -> str:
        return self.inner.tenant

    @property
    def scale_url(self):
        return self.inner.scale_url

    @property
    def wanted_units(self) -> int:
        return self.inner.wanted_units

    def holdings(self):
        return self.inner.holdings()

    def set_replicas(self, n: int, *, takeover: bool = False, again: bool = False) -> bool:
        """Set the count now; Serve is told on the calls thread (`again`: even if it accepted it already)."""
        self.target = max(0, min(int(n), self.spec.max_replicas))
        self.takeover = takeover
        self.calls.push(self, again=again)
        return True

    def set_target(self, n: int, *, takeover: bool = False, again: bool = False) -> bool:
        return self.set_replicas(n, takeover=takeover, again=again)

    def shape(self, gpu_resource: str) -> dict[str, float]:
        return {gpu_resource: float(self.spec.gpus_per_replica)}

    def set_demand(self, demand: int, held: int) -> bool:
        return False                # scaled to what it may hold: it states no demand

    def adopt_from(self, old) -> None:
        """The count set for the tenant it replaces, and what Serve last accepted of it."""
        self.target = old.target if old else None
        self.acked = getattr(old, "acked", None)

    def kept(self, calls) -> "Scaled":
        return self

    def force_release(self, dashboard_url: str | None) -> str:
        raise LookupError(f"{self.tenant} is scaled by count: Serve stops its replicas itself")


class TenantCalls:
    """A thread that sends Scaled tenants their counts, and a pool that stops job tenants by force.
    `lock`: the arbiter's; `stop`: set when the arbiter stops."""

    def __init__(self, lock, stop: threading.Event | None = None):
        self.lock = lock
        self.stop = stop or threading.Event()
        self._cv = threading.Condition()
        self._due: dict[str, tuple[Scaled, float, bool]] = {}     # tenant -> (tenant, not before, again)
        self._force = ThreadPoolExecutor(max_workers=2, thread_name_prefix="arbiter-force")
        self.in_flight: str | None = None                          # the tenant whose call is out now
        threading.Thread(target=self._loop, name="arbiter-scale-calls", daemon=True).start()

    def push(self, tenant: Scaled, again: bool = False, delay_s: float = 0.0) -> None:
        with self._cv:
            old = self._due.get(tenant.tenant)
            self._due[tenant.tenant] = (tenant, time.monotonic() + delay_s, again or bool(old and old[2]))
            self._cv.notify()

    def force(self, tenant, dashboard_url: str | None, done: Callable[[str], None]) -> None:
        """Stop a job tenant (`tenant.force_release`) on the pool; `done(how)` runs under the lock after."""
        def run() -> None:
            try:
                how = tenant.force_release(dashboard_url)
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                how = f"could not stop it: {type(exc).__name__}: {exc}"
            with self.lock:
                done(how)
        self._force.submit(run)

    def _next(self) -> tuple[Scaled, bool] | None:
        with self._cv:
            while not self.stop.is_set():
                now = time.monotonic()
                ready = [(k, v) for k, v in self._due.items() if v[1] <= now]
                if ready:
                    name, (tenant, _, again) = min(ready, key=lambda kv: kv[1][1])
                    del self._due[name]
                    return tenant, again
                wait = min((v[1] for v in self._due.values()), default=now + 1.0) - now
                self._cv.wait(max(0.01, min(1.0, wait)))
        return None

    def _loop(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            tenant, again = item
            with self.lock:
                n = tenant.target
                if n is None or (n == tenant.acked and not again):
                    continue
                takeover = tenant.takeover
            self.in_flight = tenant.tenant
            try:
                ok = bool(tenant.inner.set_replicas(n))        # the slow call: no lock held
            except Exception as exc:  # noqa: BLE001 - like a refusal: tried again
                log.warning("fill-in: scale call to %s failed: %s", tenant.tenant, exc)
                ok = False
            finally:
                self.in_flight = None
            with self.lock:
                self._settle(tenant, n, ok, takeover)

    def _settle(self, tenant: Scaled, n: int, ok: bool, takeover: bool) -> None:
        if ok:
            tenant.acked, tenant.failures = n, 0
            if tenant.target == n:
                tenant.takeover = False
            return
        tenant.failures += 1
        if takeover and tenant.target == n:
            tenant.target = None       # Serve not reachable yet: taken over on a later round
            return
        if tenant.target == n:
            self.push(tenant, delay_s=min(BACKOFF_MAX_S, 0.5 * 2 ** (tenant.failures - 1)))
