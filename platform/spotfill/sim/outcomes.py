"""Per-event outcomes and invariants of a scenario run, from events.jsonl (pure).

For a node event fired at time T: the next worker-group attempt that started after T is the recovery.
lost_steps = the last step the previous attempt finished - the step the recovery resumed from;
recovery_seconds = the recovery's first finished step - T (notice or loss to stepping again);
detected_s = the first controller_state after T that leaves RUNNING (RESTARTING, RESIZING, RESCHEDULING) - T.
"""
from __future__ import annotations

import json
import re

from spotfill.telemetry.diagnosis import RESTART_STATES
from spotfill.telemetry.events import step_count


def _tag_step(tag: str) -> int:
    m = re.match(r"step-(\d+)", tag)
    return int(m.group(1)) if m else 0


def _attempt_after(events: list[dict], t: float) -> int | None:
    for e in events:
        if e["kind"] == "attempt" and e["t"] >= t:
            return e["attempt"]
    return None


def node_event_outcome(events: list[dict], fired_at: float, deadline_s: float | None = None) -> dict:
    after = _attempt_after(events, fired_at)
    if after is None:      # training never restarted after it: said with how many steps it still ran
        return {"affected": False, "lost_steps": 0, "recovery_seconds": None, "emergency_checkpoint": False,
                "steps_after": sum(step_count(e) for e in events if e["kind"] == "step" and e["t"] >= fired_at)}
    hit = after - 1         # the attempt the event came into (stepping, or still starting)
    # the recovery: the first attempt after it that resumed (one that left during its start -- a second
    # notice came into it -- is passed over)
    resumed = {e["attempt"] for e in events if e["kind"] in ("resume", "start")}
    nxt = next((e["attempt"] for e in events if e["kind"] == "attempt" and e["t"] >= fired_at
                and e["attempt"] in resumed), after)
    prev_steps = [e["step"] for e in events if e["kind"] == "step" and e["attempt"] == hit]
    resume = next((e for e in events if e["kind"] in ("resume", "start") and e["attempt"] == nxt), None)
    first = next((e for e in events if e["kind"] == "step" and e["attempt"] == nxt), None)
    resumed_from = resume["step"] if resume else 0
    # the attempt the event hit never stepped (it came while that group started or restored): what it held
    # is the newest checkpoint committed before the event
    committed = [e["step"] for e in events if e["kind"] == "checkpoint" and e["t"] <= fired_at]
    held = max(prev_steps) if prev_steps else max(committed, default=resumed_from)
    lost = max(0, held - resumed_from)
    saves = [e for e in events if e["kind"] == "checkpoint_save" and e["attempt"] == hit
             and e.get("emergency") and e["t"] >= fired_at]
    commit = None
    if saves:
        commit = next((e for e in events if e["kind"] == "checkpoint" and e["attempt"] == hit
                       and e["step"] == saves[0]["step"]), None)
    planned = next((e for e in events if e["kind"] == "planned_exit" and e["attempt"] == hit), None)
    damaged = [_tag_step(e["tag"]) for e in events if e["kind"] == "checkpoint_quarantined" and e.get("attempt") == nxt]
    # Checkpoints upload in the background: a loss while the newest one uploads rolls back to the one
    # before it, so the bound on lost steps is the interval plus the steps run since that newest save.
    prev_saves = [e["step"] for e in events if e["kind"] == "checkpoint_save" and e["attempt"] == hit]
    newest_save = max(prev_saves) if prev_saves else None
    # the controller leaving RUNNING: Ray Train saw the fault (a failed worker, a preemption notice)
    left = next((e for e in events if e["kind"] == "controller_state" and e["t"] >= fired_at
                 and e.get("state") in RESTART_STATES), None)
    out = {
        "affected": True,
        "lost_steps": lost,
        "detected_s": round(left["t"] - fired_at, 2) if left else None,
        "recovery_seconds": round(first["t"] - fired_at, 2) if first else None,
        "emergency_checkpoint": bool(saves),
        "resumed_from_step": resumed_from,
        "world_size_after": resume["world_size"] if resume else None,
        "planned_exit": planned["reason"] if planned else None,
        "upload_in_flight": bool(newest_save is not None and resumed_from < newest_save),
        "steps_since_newest_save": (max(prev_steps) - newest_save) if (prev_steps and newest_save) else None,
        # newer checkpoints the recovery found damaged and went past (quarantined): steps they held are
        # lost on top of the interval
        "skipped_damaged_steps": max(0, max(damaged) - resumed_from) if damaged else 0,
    }
    if not saves and planned and resume and deadline_s is not None:
        # the notice reached a group already leaving on a planned exit (e.g. a grow): the checkpoint that
        # exit committed -- the one the next attempt resumed from -- is what must beat the deadline
        commit = next((e for e in events if e["kind"] == "checkpoint" and e["attempt"] == hit
                       and e["step"] == resumed_from), None)
        out["covered_by_planned_exit"] = planned["reason"]
        if not prev_steps and planned["reason"] == "preemption":
            # the notice reached a group before its first step (train.notice_watch): it left at once, its
            # state the checkpoint it restored -- committed before the notice, and resumed from again
            commit = next((e for e in events if e["kind"] == "checkpoint" and e["step"] == resumed_from
                           and e["t"] <= fired_at), None)
            out["notice_during_start"] = {"attempt": hit, "phase": planned.get("phase", "loaded"),
                                          "left_s_after_notice": round(planned["t"] - fired_at, 2)}
    if (saves or "covered_by_planned_exit" in out) and deadline_s is not None:
        out["committed_before_deadline"] = bool(commit and commit["t"] <= fired_at + deadline_s)
        out["commit_seconds_after_notice"] = round(commit["t"] - fired_at, 2) if commit else None
    return out


def grow_outcome(events: list[dict], fired_at: float) -> dict:
    nxt = _attempt_after(events, fired_at)
    if nxt is None:
        return {"grew": False}
    resume = next((e for e in events if e["kind"] in ("resume", "start") and e["attempt"] == nxt), None)
    first = next((e for e in events if e["kind"] == "step" and e["attempt"] == nxt), None)
    prev = [e for e in events if e["kind"] == "step" and e["attempt"] == nxt - 1]
    return {"grew": bool(resume and prev and resume["world_size"] > prev[-1]["world_size"]),
            "world_size_after": resume["world_size"] if resume else None,
            "seconds_to_grow": round(first["t"] - fired_at, 2) if first else None,
            "lost_steps": max(0, prev[-1]["step"] - resume["step"]) if (prev and resume) else 0}


def mass_outcome(events: list[dict], first_at: float, last_at: float) -> dict:
    """What training did after a preempt_nodes action fired (its nodes between `first_at` and `last_at`):
    the newest checkpoint committed before it, the step every later restore resumed from, whether training
    stepped again after it (on a group started after it, if it restarted) and whether it finished."""
    committed = [e["step"] for e in events if e["kind"] == "checkpoint" and e["t"] <= first_at]
    nxt = _attempt_after(events, first_at)
    later = [e for e in events if nxt is not None and e.get("attempt") is not None and e["attempt"] >= nxt]
    return {
        "committed_step_before": max(committed) if committed else None,
        "restarted": nxt is not None,
        "resumed_from_steps": [e["step"] for e in later if e["kind"] in ("resume", "start")],
        "stepped_again": any(e["kind"] == "step" and e["t"] > last_at and (nxt is None or e["attempt"] >= nxt)
                             for e in events),
        "finished_after": any(e["kind"] == "finish" and e.get("ok") and e["t"] >= first_at for e in events),
        "quarantined_after": sum(1 for e in events if e["kind"] == "checkpoint_quarantined" and e["t"] >= first_at),
    }


def mass_invariants(entries: list[dict]) -> dict:
    """preempt_nodes events that fired (report events[] entries with mass_outcome's keys, `gpus_left` and
    `min_workers`): no restore after one went back past a checkpoint committed before it (unless the scenario
    itself damaged checkpoints: quarantined ones), and training stepped again after it whenever the nodes
    left had GPUs for `min_workers` (below: it waits at its checkpoint, which is not a failure)."""
    lost, stalled, kept, went_on = [], [], [], []
    for e in entries:
        before, resumed = e.get("committed_step_before"), e.get("resumed_from_steps") or []
        if before is not None and any(s < before for s in resumed) and not e.get("quarantined_after"):
            lost.append(f"event {e['index']}: resumed from {resumed}, step {before} was committed before it")
        kept.append(f"event {e['index']}: committed {before}, resumed from {resumed}")
        room = e.get("gpus_left") is None or e["gpus_left"] >= e["min_workers"]
        if room and not (e.get("stepped_again") or (not e.get("restarted") and e.get("finished_after"))):
            stalled.append(f"event {e['index']}: {e.get('gpus_left')} GPUs left, training never stepped again")
        went_on.append(f"event {e['index']}: {e.get('gpus_left')} GPUs left (min {e['min_workers']}), "
                       + ("stepped again" if e.get("stepped_again") else
                          "finished" if e.get("finished_after") else "waits below min" if not room else "stalled"))
    return {"mass_preemption_no_committed_checkpoint_lost": {"ok": not lost, "detail": "; ".join(lost or kept)},
            "mass_preemption_training_continues": {"ok": not stalled, "detail": "; ".join(stalled or went_on)}}


def invariants(report: dict, checkpoint_every: int) -> dict:
    tr = report["training"]
    inv = {
        "all_steps_completed": {"ok": tr["steps_completed"] == tr["steps_target"],
                                "detail": f"{tr['steps_completed']}/{tr['steps_target']} steps"},
        "no_sample_lost_or_repeated": {
            "ok": tr["samples"]["duplicates"] == 0 and tr["samples"]["missing"] == 0,
            "detail": f"{tr['samples']['consumed']} consumed, {tr['samples']['duplicates']} duplicates, "
                      f"{tr['samples']['missing']} missing"},
    }
    announced = [p for p in report.get("preemptions", []) if p["kind"] == "announced" and p.get("affected")]
    if announced:
        bad = [p for p in announced if p["lost_steps"] != 0
               or not (p["emergency_checkpoint"] or p.get("covered_by_planned_exit"))
               or not p.get("committed_before_deadline", False)]
        inv["announced_preemption_loses_nothing"] = {
            "ok": not bad, "detail": f"{len(announced)} announced; lost steps "
                                     f"{[p['lost_steps'] for p in announced]}; emergency checkpoints committed "
                                     f"before the deadline: {[p.get('committed_before_deadline') for p in announced]}"}
    hard = [p for p in report.get("preemptions", []) if p["kind"] == "hard" and p.get("affected")]
    if hard:
        def bound(p: dict) -> int:
            extra = p.get("skipped_damaged_steps") or 0
            if p.get("upload_in_flight"):
                return checkpoint_every + (p.get("steps_since_newest_save") or 0) + extra
            return checkpoint_every + extra
        inv["hard_loss_within_interval"] = {
            "ok": all(p["lost_steps"] <= bound(p) for p in hard),
            "detail": f"lost steps {[p['lost_steps'] for p in hard]} <= {[bound(p) for p in hard]} (checkpoint_every "
                      f"{checkpoint_every}, plus the steps since the newest save when it was still uploading, plus "
                      f"those of damaged checkpoints the restore went past)"}
    corrupted = [e for e in report.get("events", []) if e.get("action") == "corrupt_checkpoint" and e.get("tag")]
    if corrupted:
        inv["corrupted_checkpoints_quarantined"] = corrupted_checkpoint_invariant(corrupted, report)
    stale = [e for e in report.get("events", []) if e.get("action") == "stale_writer" and e.get("attempted")]
    if stale:
        from spotfill.sim.stale_writer import stale_writer_invariant
        inv["stale_writer_fenced"] = stale_writer_invariant(stale, report)
    mass = [e for e in report.get("events", []) if e.get("action") == "preempt_nodes" and e.get("fired")]
    if mass:
        inv.update(mass_invariants(mass))
    return inv


def corrupted_checkpoint_invariant(corrupted: list[dict], report: dict) -> dict:
    """Every corrupted tag ({tag, step, t}; every file damaged in storage) is never restored from storage
    after the corruption -- a restore of it that read no byte from storage (every file from the nodes' own
    kept snapshots, verified against the manifest) loaded the committed bytes and is fine -- and is
    quarantined whenever a later restore went back to an older checkpoint (it was in its way)."""
    ckpt = report.get("checkpoints", {})
    quarantined = {q["tag"] for q in ckpt.get("quarantined", [])}
    bad = []
    for c in corrupted:
        later = [r for r in ckpt.get("restored", []) if (r.get("t") or 0) >= c["t"]]
        if any(r["tag"] == c["tag"] and r.get("read_bytes_storage") != 0 for r in later):
            bad.append(f"{c['tag']} restored from storage after it was corrupted")
        elif any(r["step"] < c["step"] for r in later) and c["tag"] not in quarantined:
            bad.append(f"{c['tag']} not quarantined although a later restore went past it")
    return {"ok": not bad, "detail": "; ".join(bad) or
            f"{len(corrupted)} corrupted ({', '.join(c['tag'] for c in corrupted)}); quarantined: "
            f"{sorted(quarantined)}; never restored after the damage"}


def digest(report: dict) -> str:
    """A failed run in one JSON line: the error, the invariants, what each event did and how each attempt
    ended -- enough to diagnose it from a log alone."""
    keep = {k: report.get(k) for k in ("error", "invariants", "preemptions", "events")}
    keep["attempt_history"] = report.get("training", {}).get("attempt_history")
    return json.dumps(keep, default=str)
