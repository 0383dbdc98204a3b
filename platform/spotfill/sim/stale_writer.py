"""The `stale_writer` scenario action: a zombie writer of the previous attempt writes to the live store.

A rank 0 that outlived its worker group (a network partition: Ray Train already runs the next attempt)
still holds the previous attempt's writer generation and carries on: it uploads its part of a new
checkpoint, commits it, moves `latest` to it and runs retention. The action plays that writer in the
runner process, against the live store, with the previous attempt's generation (read from the store's
generation objects, storage/fence.py). Each of its writes must be refused (WriterFenced); the refusals go
to the run's events as `checkpoint_fenced` (report.json checkpoints.fenced) and the action's report entry
says what the zombie tried, what was refused and whether the live lineage was left as it was.

Without a previous attempt (the live attempt took the store's first generation) there is no zombie to
play: the event is skipped with that cause.
"""
from __future__ import annotations

import os
import tempfile
import time

from spotfill.config.errors import WriterFenced
from spotfill.storage.base import open_storage
from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
from spotfill.storage.fence import Generation, WriterFence


def stale_write(job, say) -> dict:
    """Play the previous attempt's writer once (commit, `latest` move, retention). Returns the report
    entry: {tag, step, generation, live_generation, attempted, refused, lineage_intact, t} or {skipped}."""
    storage = open_storage(job.config.storage).child(job.config.name)
    holders = WriterFence.holders(storage, "checkpoints")
    if len(holders) < 2:
        say("skipped: stale_writer (the live attempt holds the store's first writer generation)")
        return {"skipped": "no previous attempt: the live attempt holds the store's first writer generation"}
    live, previous = holders[-1], holders[-2]
    attempt = previous.get("attempt")
    zombie = CheckpointStore(storage, keep_last=job.config.training.keep_checkpoints)
    zombie.adopt_generation(Generation.parse(previous["generation"]), attempt=attempt)
    watcher = CheckpointStore(storage)
    before_latest, before = watcher.latest(), set(watcher.committed())
    step = int((before_latest or {}).get("step") or 0) + 1
    tag = tag_for(step, attempt)
    refused: list[dict] = []
    attempted = []

    def attempt_write(op: str, fn) -> None:
        attempted.append(op)
        try:
            fn()
        except WriterFenced as exc:
            refused.append({**exc.record(), "t": time.time()})

    with tempfile.TemporaryDirectory(prefix="spotfill-zombie-") as part:
        with open(os.path.join(part, "zombie_state.pt"), "wb") as f:
            f.write(b"a stale writer's checkpoint: never to be committed\n" * 64)
        zombie.upload_part(tag, 0, 1, part, attempt=str(attempt))
    attempt_write("commit", lambda: zombie.commit(tag, step, 1, attempt=str(attempt), timeout_s=30,
                                                  meta={"attempt": str(attempt), "stale_writer": True}))
    attempt_write("move latest", lambda: zombie.mark_resumed(tag, step))
    attempt_write("delete", zombie.discard_uncommitted)      # its own part, and any live upload in flight
    after_latest, after = watcher.latest(), set(watcher.committed())
    committed_by_zombie = storage.exists(f"checkpoints/{tag}/manifest.json")
    latest_moved_by_zombie = (after_latest or {}).get("tag") == tag
    intact = not committed_by_zombie and not latest_moved_by_zombie and \
        (after_latest or {}).get("writer") != str(previous["generation"])
    _report(job, refused, attempt)
    say(f"stale writer (attempt {attempt}, generation {previous['generation']}; live generation "
        f"{live['generation']}): {len(refused)}/{len(attempted)} writes refused"
        + ("" if intact else "; THE LIVE LINEAGE WAS CHANGED"))
    return {"tag": tag, "step": step, "attempt": attempt, "generation": str(previous["generation"]),
            "live_generation": str(live["generation"]), "attempted": attempted,
            "refused": [r["op"] for r in refused], "lineage_intact": intact,
            "committed_lost": sorted(before - after - {tag}), "t": round(time.time(), 3)}


def _report(job, refused: list[dict], attempt) -> None:
    """The refusals into the run's events (the live run's event sink), as a real stale rank 0 reports."""
    import ray

    prefix = f"spotfill-sink-{job.config.name}-"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == "spotfill" and a["name"].startswith(prefix)]
    if not names or not refused:
        return
    sink = ray.get_actor(names[-1], namespace="spotfill")
    ray.get(sink.log.remote([{**r, "kind": "checkpoint_fenced", "attempt": attempt, "writer": "stale_writer"}
                             for r in refused]))


def stale_writer_invariant(entries: list[dict], report: dict) -> dict:
    """Every fired stale_writer had every write refused, left the live lineage alone, and its refusals are
    in report.json checkpoints.fenced."""
    fenced = {(f.get("generation"), f.get("op")) for f in report.get("checkpoints", {}).get("fenced", [])}
    bad = []
    for e in entries:
        if sorted(e["refused"]) != sorted(e["attempted"]):
            bad.append(f"{e['tag']}: only {e['refused']} of {e['attempted']} refused")
        if not e["lineage_intact"]:
            bad.append(f"{e['tag']}: the zombie changed the live lineage")
        missing = [op for op in e["refused"] if (e["generation"], op) not in fenced]
        if missing:
            bad.append(f"{e['tag']}: refusals {missing} not in checkpoints.fenced")
    return {"ok": not bad, "detail": "; ".join(bad) or
            f"{len(entries)} stale writer(s): every write refused, the live lineage untouched"}
