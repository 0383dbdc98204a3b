"""What the arbiter needs from a fill-in tenant, whatever its kind (pure: no Ray).

The arbiter (fillin/arbiter.py) holds every tenant as a `Tenant` and never asks which class it is: each
difference between kinds is a member here. Serve (fillin/serve_tenant.py, kept as tenant_calls.Scaled) is
scaled by count from outside; a job tenant (fillin/job_tenant.py: Ray Data batch jobs, Ray Tune sweeps)
pulls its target. The registry of kinds (config/tenant_kinds.py) names the class of each kind.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from spotfill.config.tenant_kinds import info, resolve

if TYPE_CHECKING:
    from spotfill.fillin.policy import Holding


@runtime_checkable
class Tenant(Protocol):
    """One fill-in tenant as the arbiter keeps it.

    `spec`: kind, gpus_per_replica, grace_s, max_replicas and as_dict() (cpus_per_replica when its units
    ask for CPUs too). `target`: the units the arbiter set (None: not decided yet).
    `pulls_target`: True -- its driver reads `target` (Arbiter.tenant_target) and states its demand
    (set_demand); False -- the arbiter scales it from outside (a scale call per change, sent again when it
    runs more units than set, as Serve's cold-start rule may). `forced_when_overdue`: a unit it still holds
    past a reclaim's grace is stopped by force (force_release). `pending_groups`: its placement groups the
    autoscaler waits on (last holdings read)."""

    spec: Any
    target: int | None
    pulls_target: bool
    forced_when_overdue: bool
    pending_groups: frozenset

    @property
    def tenant(self) -> str: ...                        # its name, "<kind>:<name>"

    @property
    def wanted_units(self) -> int: ...                  # units it could use now

    def holdings(self) -> list[Holding]:
        """What it holds now (Ray's public state; slow: read off the arbiter's lock)."""

    def shape(self, gpu_resource: str) -> dict[str, float]:
        """One unit's resource request, as the autoscaler reports it when the unit waits."""

    def set_target(self, n: int, *, takeover: bool = False, again: bool = False) -> bool:
        """Lend / reclaim: it may hold `n` units now (under the arbiter's lock: no slow call here). `takeover`:
        the count it was found holding on its first round; `again`: tell it even if it heard `n` already.
        False: the change did not take."""

    def set_demand(self, demand: int, held: int) -> bool:
        """It could use `demand` units now (`held`: its leases): a target above comes down to it, not below
        what it holds. False: it states no demand (scaled from outside)."""

    def adopt_from(self, old: Tenant | None) -> None:
        """Registered again under the same name: carry over what `old` (None: none) was set."""

    def kept(self, calls) -> Tenant:
        """This tenant as the arbiter keeps it (`calls`: the arbiter's TenantCalls, for slow calls)."""

    def force_release(self, dashboard_url: str | None) -> str:
        """Stop the units it did not let go of (off the lock); how they were stopped."""


def tenant_class(kind: str):
    """The class the registry names for `kind` (ValueError naming the kinds accepted when unknown); it builds a
    tenant from its spec with `from_spec(dict)`."""
    return resolve(info(kind).tenant)
