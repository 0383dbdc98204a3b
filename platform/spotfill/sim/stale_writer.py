"""The `stale_writer` scenario action: a zombie writer of the previous attempt writes to the live store.

A rank 0 that outlived its worker group (a network partition: Ray Train already runs the next attempt)
still holds the previous attempt's writer generation and carries on: it saves a new checkpoint (uploads its
part and commits it), moves `latest` to it and runs retention. The action plays that rank 0 in the runner
process, against the live store, with the previous attempt's generation (read from the store's generation
objects, storage/fence.py) and its own Checkpointer (train/checkpointing.py): each of its writes must be
refused (WriterFenced). The refusals reach the run's events the way a real rank 0's do -- recorded by that
Checkpointer, turned into `checkpoint_fenced` events by checkpoint_events, sent to the run's event sink --
and so report.json checkpoints.fenced; this module writes no refusal of its own. The action's report entry
says what the zombie tried, which writes raised WriterFenced and whether the live lineage was left as it
was; stale_writer_invariant checks the report's figure against it.

Without a previous attempt (the live attempt took the store's first generation) there is no zombie to
play: the event is skipped with that cause.
"""
from __future__ import annotations

import os
import tempfile
import time
from types import SimpleNamespace

from spotfill.config.errors import WriterFenced
from spotfill.storage.base import open_storage
from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
from spotfill.storage.fence import Generation, WriterFence
from spotfill.train.checkpointing import Checkpointer, checkpoint_events

ZOMBIE_STATE = b"a stale writer's checkpoint: never to be committed\n" * 64


class _ZombieEngine:
    """The zombie rank 0's training state, as its Checkpointer saves it (engine.save_checkpoint): one file;
    no model runs in the runner process."""

    module = SimpleNamespace(parameters=lambda: ())

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool = False) -> None:
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        with open(os.path.join(save_dir, tag, "zombie_state.pt"), "wb") as f:
            f.write(ZOMBIE_STATE)


def stale_write(job, say, send=None) -> dict:
    """Play the previous attempt's rank 0 once (a checkpoint save, a `latest` move, retention) through its
    own Checkpointer; `send(events)` delivers that Checkpointer's events (default: the live run's event
    sink). Returns the report entry: {tag, step, generation, live_generation, attempted, refused,
    lineage_intact, t} or {skipped}."""
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
    attempted: list[str] = []
    refused: list[str] = []          # the writes that raised WriterFenced here (the report's come from ckpt)

    def attempt_write(op: str, fn) -> None:
        attempted.append(op)
        try:
            fn()
        except WriterFenced:
            refused.append(op)

    with tempfile.TemporaryDirectory(prefix="spotfill-zombie-") as local_root:
        ckpt = Checkpointer(zombie, local_root, rank=0, world_size=1, attempt=str(attempt),
                            meta={"stale_writer": True})
        try:
            attempt_write("commit", lambda: ckpt.save(_ZombieEngine(), step, {"attempt": attempt}, kind="final"))
            attempt_write("move latest", lambda: ckpt.store_write(lambda store: store.mark_resumed(tag, step)))
            # its own uploaded part, and any live upload in flight
            attempt_write("delete", lambda: ckpt.store_write(CheckpointStore.discard_uncommitted))
        finally:
            ckpt.close()
        (send or _sink_log(job))(checkpoint_events(ckpt, attempt))
    after_latest, after = watcher.latest(), set(watcher.committed())
    committed_by_zombie = storage.exists(f"checkpoints/{tag}/manifest.json")
    latest_moved_by_zombie = (after_latest or {}).get("tag") == tag
    intact = not committed_by_zombie and not latest_moved_by_zombie and \
        (after_latest or {}).get("writer") != str(previous["generation"])
    say(f"stale writer (attempt {attempt}, generation {previous['generation']}; live generation "
        f"{live['generation']}): {len(refused)}/{len(attempted)} writes refused"
        + ("" if intact else "; THE LIVE LINEAGE WAS CHANGED"))
    return {"tag": tag, "step": step, "attempt": attempt, "generation": str(previous["generation"]),
            "live_generation": str(live["generation"]), "attempted": attempted, "refused": refused,
            "lineage_intact": intact, "committed_lost": sorted(before - after - {tag}), "t": round(time.time(), 3)}


def _sink_log(job):
    """Send events to the live run's event sink, as a real stale rank 0 does (the newest sink of the job)."""
    import ray

    prefix = f"spotfill-sink-{job.config.name}-"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == "spotfill" and a["name"].startswith(prefix)]

    def send(events: list[dict]) -> None:
        if names and events:
            ray.get(ray.get_actor(names[-1], namespace="spotfill").log.remote(events))
    return send


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
