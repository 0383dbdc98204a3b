"""Did each fill-in tenant of a scenario give its GPUs back and then carry on? (pure: report.json's `fillin`)

What fill-in is for: a tenant runs on GPUs training leaves spare, gives them back when training (or the
node's spot notice) takes them, and continues where it stopped once GPUs are lent again. Per tenant, from
what each one measured itself, never from what the scenario planned:
- each: one of its leases ended by a reclaim (the arbiter's journal: training's claim, a spot notice), and
  one of its leases started after that reclaim;
- batch also: a wave stopped with units still to do (fillin.batch.stops, the job's own counters), and every
  row written exactly once in the end (read back from its output; on an autoscaled cluster, what it left
  at training's end is its rerun's: sim/fillin_batch.invariant);
- sweep also: a trial paused with its checkpoint and one restarted from it (fillin.sweep.paused / resumed,
  from the sweep's own trial events).
On an autoscaled cluster no GPU is lent once training ends: a tenant taken back in the run's last lending
window carries on in its rerun -- it counts when what it left is exactly its rerun's (batch: its uncommitted
units; sweep: trials paused with checkpoints in a restorable experiment), said as such in the detail.
"""
from __future__ import annotations

from spotfill.config.tenant_kinds import KINDS

TENANTS = tuple(KINDS)          # ("serve", "batch", "sweep"): the registry's kinds (config/tenant_kinds.py)


def taken_and_lent_again(leases: list[dict], workload: str) -> tuple[bool, str]:
    """A lease of `workload` ended by a reclaim, and one of its leases started after that reclaim."""
    mine = [le for le in leases if le.get("workload") == workload]
    taken = [le for le in mine if le.get("ended_by") == "reclaim" and le.get("end") is not None]
    back = [le for le in mine if any(le.get("start", 0) >= t["end"] for t in taken)]
    causes = sorted({t.get("cause") or "?" for t in taken})
    return bool(taken and back), (f"{len(taken)} lease(s) reclaimed ({', '.join(causes) or 'none'}), "
                                  f"{len(back)} lent again after")


def reclaimed(leases: list[dict], workload: str) -> bool:
    return any(le.get("workload") == workload and le.get("ended_by") == "reclaim" and le.get("end") is not None
               for le in leases)


def batch_outcome(batch: dict, leases: list[dict]) -> tuple[bool, str]:
    """Taken back mid-job, lent again and finished -- or, taken back and then stopped at training's end on
    an autoscaled cluster (no lend after it), its rest exactly left for its rerun (carried on there)."""
    again, detail = taken_and_lent_again(leases, "batch")
    stops = batch.get("stops") or []
    mid = [s for s in stops if s.get("done", 0) < s.get("units", 0)]
    from spotfill.sim.fillin_batch import invariant
    finished = batch.get("rows_target") is not None and invariant(batch)["ok"]
    left = (batch.get("left_for_rerun") or {}).get("rows")
    in_rerun = bool(left) and reclaimed(leases, "batch") and finished
    return (again or in_rerun) and bool(mid) and finished, (
        f"{detail}; its waves stopped {len(stops)} time(s) ({len(mid)} with units left), "
        f"{batch.get('rows_written', 0)} of {batch.get('rows_target', '?')} rows written"
        + (f", {left} left for its rerun" if left else ""))


def sweep_outcome(sweep: dict, leases: list[dict]) -> tuple[bool, str]:
    """A trial paused with its checkpoint and resumed from it after a later lend -- or, taken back and then
    stopped at training's end on an autoscaled cluster, its paused trials left in a restorable experiment
    (its rerun resumes them from those checkpoints)."""
    again, detail = taken_and_lent_again(leases, "sweep")
    paused, resumed = int(sweep.get("paused") or 0), int(sweep.get("resumed") or 0)
    left = sweep.get("left_for_rerun") or {}
    in_rerun = bool(left.get("restorable")) and reclaimed(leases, "sweep") and paused >= 1 and not sweep.get("failed")
    return (again and paused >= 1 and resumed >= 1) or in_rerun, (
        f"{detail}; {paused} trial pause(s), {resumed} resumed from their checkpoints"
        + (f"; {len(left.get('trials') or {})} paused or pending trial(s) left for its rerun "
           "(experiment restorable)" if in_rerun else ""))


def reclaimed_and_resumed(fill: dict) -> dict:
    """{tenant: {"ok", "detail"}} for each tenant the scenario ran (report.json fillin.reclaimed_and_resumed)."""
    out: dict[str, dict] = {}
    leases = fill.get("leases") or []
    if fill.get("serve"):
        ok, detail = taken_and_lent_again(leases, "serve")
        out["serve"] = {"ok": ok, "detail": detail}
    if fill.get("batch"):
        ok, detail = batch_outcome(fill["batch"], leases)
        out["batch"] = {"ok": ok, "detail": detail}
    if fill.get("sweep"):
        ok, detail = sweep_outcome(fill["sweep"], leases)
        out["sweep"] = {"ok": ok, "detail": detail}
    return out


def as_invariant(resumes: dict) -> dict:
    """The invariant `fillin_reclaimed_and_resumed` (scenario `fillin.require_resumes`): every tenant that ran."""
    ok = bool(resumes) and all(r["ok"] for r in resumes.values())
    return {"ok": ok, "detail": "; ".join(f"{t}: {'yes' if r['ok'] else 'no'} ({r['detail']})"
                                          for t, r in resumes.items()) or "no tenant ran"}
