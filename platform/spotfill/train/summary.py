"""Build report.json's `training` and `checkpoints` sections from events.jsonl (pure).

Every number comes from a measured event. MFU/HFU are None unless the device's peak is known (CPU: None).
"""
from __future__ import annotations

from statistics import mean



def training_section(events: list[dict], steps_target: int, global_batch: int,
                     peak_flops_per_s: float | None = None, flops_per_token: float | None = None) -> dict:
    steps = [e for e in events if e["kind"] == "step"]
    # The lineage: for each step number, the newest attempt that ran it.
    newest: dict[int, dict] = {}
    for e in steps:
        if e["step"] not in newest or e["attempt"] >= newest[e["step"]]["attempt"]:
            newest[e["step"]] = e
    lineage = [newest[s] for s in sorted(newest)]
    history = attempt_history(events)
    completed = max(newest) if newest else 0
    samples = samples_section(events, completed, global_batch)
    timeline: list[list[float]] = []
    for e in sorted(steps, key=lambda e: e["t"]):
        if not timeline or timeline[-1][1] != e["world_size"]:
            timeline.append([round(e["t"], 3), e["world_size"]])
    lineage_keys = {(e["attempt"], e["step"]) for e in lineage}
    stall = sum(e["stall_s"] for e in events if e["kind"] == "checkpoint_save"
                and (e["attempt"], e["step"]) in lineage_keys)
    compute = sum(e["step_s"] for e in lineage) + stall
    tokens = sum(e["tokens"] for e in lineage)
    tokens_per_s = tokens / compute if compute > 0 else None
    mfu = None
    if peak_flops_per_s and flops_per_token and tokens_per_s:
        n_gpus = mean(e["world_size"] for e in lineage)
        mfu = tokens_per_s * flops_per_token / (peak_flops_per_s * n_gpus)
    return {
        "steps_target": steps_target,
        "steps_completed": completed,
        "final_loss": lineage[-1]["loss"] if lineage else None,
        "global_batch": global_batch,
        "samples": samples,
        "world_size_timeline": timeline,
        "tokens_per_s": round(tokens_per_s, 2) if tokens_per_s else None,
        "mfu": mfu,
        "hfu": mfu,   # no activation recompute in the presets: hardware FLOPs == model FLOPs
        "attempts": len(history),
        "attempt_history": history,
        "step_time_split_s": {
            "data_wait": round(sum(e["data_wait_s"] for e in lineage), 3),
            "compute": round(sum(e["compute_s"] for e in lineage), 3),
            "checkpoint_stall": round(stall, 3),
        },
    }


def samples_section(events: list[dict], steps_completed: int, global_batch: int) -> dict:
    """`training.samples`: the exactly-once ledger of the final model -- the one the newest committed
    checkpoint carried (sample_ledger.py), as its checkpoint_save event reported it. No ledger on record
    (no checkpoint committed, or one from before ledgers): nothing is proven, every owed sample counts as
    missing."""
    saves = {(e["attempt"], e["step"]): e["ledger"] for e in events
             if e["kind"] == "checkpoint_save" and e.get("ledger")}
    commits = [e for e in events if e["kind"] == "checkpoint"]
    ledger = saves.get((commits[-1]["attempt"], commits[-1]["step"])) if commits else None
    if ledger is None:
        return {"consumed": 0, "duplicates": 0, "missing": steps_completed * global_batch, "source": "none"}
    return {"consumed": ledger["consumed"], "duplicates": ledger["duplicates"], "missing": ledger["missing"],
            "source": "checkpoint-ledger"}


def attempt_history(events: list[dict]) -> list[dict]:
    """One line per worker-group attempt: its size, the steps it ran, why it started (`cause`: "first
    start", "planned: <reason>" or "unplanned: <what Ray Train saw>", with `error`, its telling line) and
    how it ended -- a planned exit ("preemption" or "grow"), "finished", "failed" (no reason given: a node
    or process died), or "running"."""
    out: dict[int, dict] = {}
    causes: dict[int, dict] = {}   # why each attempt started (the sink's "attempt" event)
    for e in events:
        kind, a = e["kind"], e.get("attempt")
        if kind == "attempt" and "cause" in e:
            causes[a] = {k: e[k] for k in ("cause", "planned", "error") if k in e}
        elif kind in ("start", "resume"):
            out[a] = {"attempt": a, "world_size": e["world_size"], "from_step": e["step"], "to_step": e["step"],
                      "ended": "running", "checkpoints": [], **causes.get(a, {})}
        elif a not in out:
            continue
        elif kind == "step":
            out[a]["to_step"] = max(out[a]["to_step"], e["step"])
        elif kind == "checkpoint":
            out[a]["checkpoints"].append(e["step"])
        elif kind == "planned_exit":
            out[a]["ended"] = e["reason"]
        elif kind == "finish":
            out[a]["ended"] = "finished" if e.get("ok") else "gave up"
    history = [out[a] for a in sorted(out)]
    for h in history[:-1]:
        if h["ended"] == "running":
            h["ended"] = "failed"
    return history


def checkpoints_section(events: list[dict]) -> dict:
    commits = [e for e in events if e["kind"] == "checkpoint"]
    saves = [e for e in events if e["kind"] == "checkpoint_save"]
    stalls = [e["stall_s"] for e in saves if not e.get("emergency") and not e.get("grow")]
    return {
        "committed": len(commits),
        "stall_seconds_max": round(max(stalls), 4) if stalls else 0.0,
        "stall_seconds_total": round(sum(stalls), 4),
        "upload_seconds_mean": round(mean(e["upload_s"] for e in commits), 4) if commits else None,
        "bytes_last": commits[-1]["bytes"] if commits else None,
        "emergency": sum(1 for e in saves if e.get("emergency")),
        # snapshots never committed: superseded while an upload was blocked, or abandoned at a deadline
        "skipped": [{"tag": e.get("tag"), "step": e.get("step"), "reason": e.get("reason")}
                    for e in events if e["kind"] == "checkpoint_skipped"],
        **lineage_report(events),
    }


def lineage_report(events: list[dict]) -> dict:
    """`quarantined`: damaged tags ({tag, reason}, first report of each); `restored`: each restore's tag;
    `fresh_starts`: restarts from step 0 although committed checkpoints existed
    (on_no_intact_checkpoint: restart), with the cause."""
    quarantined: dict[str, dict] = {}
    for e in events:
        if e["kind"] == "checkpoint_quarantined" and e["tag"] not in quarantined:
            quarantined[e["tag"]] = {"tag": e["tag"], "reason": e["reason"]}
    return {"quarantined": list(quarantined.values()),
            "restored": [{"tag": e["tag"], "step": e.get("step"), "attempt": e.get("attempt"), "t": e.get("t")}
                         for e in events if e["kind"] == "checkpoint_restored"],
            "fresh_starts": [{"attempt": e.get("attempt"), "cause": e["cause"]}
                             for e in events if e["kind"] == "fresh_start"]}
