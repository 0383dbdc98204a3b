"""The arbiter's state file on the head node: what a restarted arbiter reads back to carry on -- training
jobs, tenants and their targets, lease records, open reclaim orders, recent decisions and the journal. It
is written atomically (temp file, then rename), and only when its text changed: most ticks change nothing,
and the head's CPU is shared."""
from __future__ import annotations

import json
import logging
import os
import time

from spotfill.fillin.journal import Journal, ReclaimOrder
from spotfill.fillin.policy import Decision, Lease, TrainingJob
from spotfill.fillin.tenant import tenant_class

log = logging.getLogger("spotfill.fillin.arbiter")


def read_state(path: str) -> dict | None:
    """The state a previous arbiter wrote, or None (no file, or not readable as JSON)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def restore(arb, state: dict) -> None:
    """Put `state` (read_state) back into the arbiter `arb`."""
    arb.jobs = {j["job"]: TrainingJob(**j) for j in state.get("jobs", [])}
    for spec in state.get("tenants", []):
        kind = spec["spec"].get("kind", "serve")
        try:
            tenant = tenant_class(kind).from_spec(spec["spec"])     # the registry's class (config/tenant_kinds.py)
        except ValueError as exc:
            log.warning("fill-in: tenant %s not restored: %s", spec["spec"], exc)
            continue
        tenant.target = spec.get("target")
        arb.tenants[tenant.tenant] = tenant
    arb.leases = tuple(Lease(**le) for le in state.get("leases", []))
    arb.reclaiming = dict(state.get("reclaiming", {}))
    arb.decisions.add(Decision(**d) for d in state.get("decisions", []))
    arb.handbacks = state.get("handbacks", [])
    arb.journal = Journal(seq=int(state.get("journal_seq", 0)), items=state.get("journal", []))
    arb.nodes_seen = dict(state.get("nodes_seen", {}))
    arb.orders = [ReclaimOrder(**o) for o in state.get("orders", [])]


def load(arb, keep, record) -> bool:
    """Put the state file's contents back into the arbiter `arb` -- each tenant as `keep(tenant)` keeps it --
    and `record` a decision saying so. False: there is no state to read back."""
    state = read_state(arb.state_path)
    if state is None:
        return False
    restore(arb, state)
    arb.tenants = {k: keep(t) for k, t in arb.tenants.items()}
    record([Decision("adopt", "arbiter", 0, at=time.time(), reason=(
        f"arbiter restarted: {len(arb.jobs)} training job(s), {len(arb.tenants)} tenant(s) and "
        f"{len(arb.leases)} lease record(s) read from {arb.state_path}; leases re-checked against "
        f"what the tenants hold"))])
    return True


def state_text(arb) -> str:
    """What `restore` reads back, as the file's text."""
    return json.dumps({
        "jobs": [j.__dict__ for j in arb.jobs.values()],
        "tenants": [{"spec": t.spec.as_dict(), "target": t.target} for t in arb.tenants.values()],
        "leases": [le.__dict__ for le in arb.leases], "reclaiming": arb.reclaiming,
        "decisions": [d.as_dict() for d in arb.decisions.items[-50:]],
        "handbacks": arb.handbacks[-200:], "journal_seq": arb.journal.seq,
        "journal": arb.journal.items[-500:], "nodes_seen": arb.nodes_seen,
        "orders": [o.as_dict() for o in arb.orders]})


def write_atomically(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_dashboard_url() -> str | None:
    """The dashboard's address from the GCS (tenants' health links), or None with a warning."""
    try:
        from spotfill.ray_compat import dashboard_url
        return dashboard_url()
    except Exception as exc:  # noqa: BLE001 - a tenant registered with its own URL still works
        log.warning("fill-in: the dashboard's address could not be read from the GCS: %s", exc)
        return None
