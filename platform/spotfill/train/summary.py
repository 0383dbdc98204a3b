"""Build report.json's `training` and `checkpoints` sections from events.jsonl (pure).

Every number comes from a measured event. MFU/HFU are None unless every lineage step ran on a device whose
peak is known (CPU: None); FLOPs per token and the peak come from each attempt's start/resume event.
"""
from __future__ import annotations

from statistics import mean

from spotfill.telemetry.claims import lineage_keys
from spotfill.telemetry.events import step_totals
from spotfill.train.pipeline_summary import pipeline_section
from spotfill.telemetry.throughput import run_utilization, split_totals


def training_section(events: list[dict], steps_target: int, global_batch: int,
                     gpus_per_worker: float | None = None) -> dict:
    steps = [e for e in events if e["kind"] == "step"]
    # The lineage: the step events whose steps no newer attempt ran again (an event may stand for many
    # steps: telemetry.events, step sampling)
    keep = lineage_keys(events)
    lineage = sorted((e for e in steps if (e["attempt"], e["step"]) in keep), key=lambda e: e["step"])
    history = attempt_history(events)
    completed = lineage[-1]["step"] if lineage else 0
    samples = samples_section(events, completed, global_batch)
    timeline: list[list[float]] = []
    for e in sorted(steps, key=lambda e: e["t"]):
        if not timeline or timeline[-1][1] != e["world_size"]:
            timeline.append([round(e["t"], 3), e["world_size"]])
    # a save follows the step it saved; that step ends a step event (spans end before any other event)
    stall = sum(e["stall_s"] for e in events if e["kind"] == "checkpoint_save" and (e["attempt"], e["step"]) in keep)
    compute = sum(step_totals(e, "step_s") for e in lineage) + stall
    tokens = sum(step_totals(e, "tokens") for e in lineage)
    tokens_per_s = tokens / compute if compute > 0 else None
    js = next((e for e in events if e["kind"] == "job_start"), {})
    gpw = float(gpus_per_worker or js.get("gpus_per_worker") or 1.0)
    devices = {e.get("attempt"): e for e in events if e["kind"] in ("start", "resume")}
    util = run_utilization(lineage, devices, gpw)
    split = split_totals(lineage)
    used = [devices[a] for a in sorted({e["attempt"] for e in lineage}) if a in devices]
    return {
        "steps_target": steps_target,
        "steps_completed": completed,
        "final_loss": lineage[-1]["loss"] if lineage else None,
        "global_batch": global_batch,
        "samples": samples,
        "world_size_timeline": timeline,
        "tokens_per_s": round(tokens_per_s, 2) if tokens_per_s else None,
        "mfu": _round(util["mfu"], 5),
        "hfu": _round(util["hfu"], 5),     # counts activation recompute (training.activation_checkpointing)
        "devices": sorted({str(d.get("device")) for d in used if d.get("device")}),
        "peak_flops_per_gpu": _one([d.get("peak_flops_per_gpu") for d in used]),
        "flops_per_token": _one([d.get("flops_per_token") for d in used]),
        "hardware_flops_per_token": _one([d.get("hardware_flops_per_token") for d in used]),
        "gpu_metrics": gpu_metrics(lineage),
        "attempts": len(history),
        "attempt_history": history,
        # seconds summed over the final lineage's steps (rank 0's clock); phases a step did not measure
        # (events from before the split) are left out rather than guessed
        "step_time_split_s": {k: round(v, 3) for k, v in {
            "data_wait": split["data_wait_s"], "forward_backward": split["forward_backward_s"],
            "optimizer": split["optimizer_s"], "collective_wait": split["collective_wait_s"],
            "compute": split["compute_s"], "checkpoint_stall": stall}.items() if v is not None},
        **({"pipeline": pipe} if (pipe := pipeline_section(lineage)) else {}),
    }


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _one(values: list):
    """The value when every attempt agrees, else None (e.g. a restart on another GPU type)."""
    return values[0] if values and all(v == values[0] for v in values) else None


def gpu_metrics(steps: list[dict]) -> dict | None:
    """NVML readings rank 0 attached to steps (every few seconds): mean utilisation, peak memory."""
    util = [e["gpu_util"] for e in steps if e.get("gpu_util") is not None]
    if not util:
        return None
    mem = [e["gpu_mem_used_gb"] for e in steps if e.get("gpu_mem_used_gb") is not None]
    mem_util = [e["gpu_mem_util"] for e in steps if e.get("gpu_mem_util") is not None]
    return {"samples": len(util), "gpu_util_mean": round(mean(util), 4),
            "gpu_mem_util_mean": round(mean(mem_util), 4) if mem_util else None,
            "gpu_mem_used_gb_max": max(mem) if mem else None,
            "gpu_mem_total_gb": next((e["gpu_mem_total_gb"] for e in steps if e.get("gpu_mem_total_gb")), None)}


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
