"""Build report.json's `training` and `checkpoints` sections from events.jsonl (pure).

Every number comes from a measured event. MFU/HFU are None unless the device's peak is known (CPU: None).
"""
from __future__ import annotations

from statistics import mean

from spotfill.train.batching import audit_samples


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
    records = [(e["attempt"], e["step"], e["ids"]) for e in events if e["kind"] == "samples"]
    completed = max(newest) if newest else 0
    samples = audit_samples(records, completed, global_batch)
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
    }
