"""The registry of fill-in tenant kinds: one line per kind (pure: no Ray, nothing imported but the stdlib).

Each kind says where training's claim reclaims it (`reclaim_rank`: lowest first -- policy.DEFAULT_ORDER),
its band's colour in a run's timeline (telemetry/timeline.py), the class the arbiter keeps for one of its
tenants (`tenant`, "module:Class", implementing fillin/tenant.py's `Tenant`) and what runs it in a scenario
(`scenario_driver`, "module" or "module:name" under spotfill.sim). The last two are dotted paths, not
imports: this module sits at the bottom of the layers (config), below telemetry that reads the colours, and
the fill-in and simulator modules it names import it, never the reverse.

A new tenant kind is one module (its `Tenant`) plus one line here (docs/fillin.md, "Adding a tenant kind").
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class KindInfo:
    reclaim_rank: int          # training's claim reclaims lower ranks first
    colour: str                # RGB hex of its timeline band
    tenant: str                # "module:Class" the arbiter keeps for one tenant of this kind
    scenario_driver: str       # "module[:name]" that runs it in a scenario (spotfill.sim)


KINDS: dict[str, KindInfo] = {
    "serve": KindInfo(2, "#1f77b4", "spotfill.fillin.serve_tenant:ServeTenant", "spotfill.sim.fillin_serve:ServeFillin"),
    "batch": KindInfo(1, "#9467bd", "spotfill.fillin.job_tenant:JobTenant", "spotfill.sim.fillin_batch"),
    "sweep": KindInfo(0, "#17becf", "spotfill.fillin.job_tenant:JobTenant", "spotfill.sim.fillin_sweep"),
}


def reclaim_order() -> tuple[str, ...]:
    """Every kind, in the order training's claim reclaims them (by rank; ties by name)."""
    return tuple(sorted(KINDS, key=lambda k: (KINDS[k].reclaim_rank, k)))


def kinds_of(tenant: str) -> tuple[str, ...]:
    """The kinds whose tenants the class at `tenant` ("module:Class") is."""
    return tuple(k for k, info in KINDS.items() if info.tenant == tenant)


def colours() -> dict[str, str]:
    return {k: info.colour for k, info in KINDS.items()}


def resolve(path: str):
    """The object at "module:name" (or the module at "module")."""
    module, _, name = path.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, name) if name else obj


def info(kind: str) -> KindInfo:
    """The registry's line for `kind`; ValueError naming the kinds accepted when there is none."""
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"tenant kind {kind!r}: accepted {', '.join(sorted(KINDS))}") from None
