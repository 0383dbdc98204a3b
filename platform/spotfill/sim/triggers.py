"""What a scenario event waits for before it fires, read from the running cluster: the GPUs-by-owner view a
node pick is made from, and the warm spares an event with `spares_ready` waits for."""
from __future__ import annotations

from collections import Counter

from spotfill.sim.scenario import SPARES_WAIT_S, Event, in_restart, missing_spares


def owners(say) -> dict[str, dict]:
    """GPUs per node by owner (training, each fill-in kind, reclaiming, idle) from the fill-in arbiter, for
    a scenario's node pick; {} (the pick finds nothing, the event is skipped and says so) without one."""
    import ray

    from spotfill.fillin.arbiter import get_arbiter
    try:
        arbiter = get_arbiter()
        return ray.get(arbiter.status.remote(1), timeout=15)["nodes"] if arbiter is not None else {}
    except Exception as exc:  # noqa: BLE001 - reported, and the event is skipped with its cause
        say(f"the fill-in arbiter did not answer for a node pick: {type(exc).__name__}: {exc}")
        return {}


def spares_ready(ev: Event, group: Counter, cluster, waits: dict[int, dict], now: float, say) -> bool:
    """An event with `spares_ready`: whether it may fire now -- every node of the group (the event's own
    aside) has a warm spare per worker (train.readiness records: started, warming or ready -- what a restart
    there counts), or it waited SPARES_WAIT_S (it then fires, and its entry in the report says what was
    missing)."""
    from spotfill.train.elastic import ready_spares
    wait = waits.setdefault(ev.index, {"since": now, "ready": False})
    leaving = cluster.node_ids[ev.node] if isinstance(ev.node, int) and ev.node < len(cluster.node_ids) else None
    missing = missing_spares(dict(group), ready_spares(warming=True), leaving) if group else {"?": 1}
    wait["waited_s"] = round(now - wait["since"], 2)
    if not missing:
        wait["ready"] = True
        return True
    if now - wait["since"] < SPARES_WAIT_S:
        return False
    wait["missing"] = missing
    say(f"event {ev.index}: the other nodes' spares were not ready after {SPARES_WAIT_S:g}s "
        f"(missing {missing}): it fires anyway")
    return True


def during_restart(ev: Event, starting: dict | None, waits: dict[int, dict], now: float) -> bool:
    """An event with `during_restart`: whether it may fire now (sim.scenario.in_restart); once it may, its
    wait ({since, attempt, fired_after_attempt_s}) says which group's start it was timed into and how far in."""
    wait = waits.setdefault(ev.index, {"since": round(now, 3)})
    if not in_restart(starting, wait["since"]):
        return False
    wait.update(attempt=starting["attempt"], fired_after_attempt_s=round(now - starting["t"], 3))
    return True
