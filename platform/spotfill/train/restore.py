"""Restore: pick the newest intact checkpoint of the live lineage, bring it to every node at once, flatten it
into DeepSpeed's layout. ZeRO-1/2 checkpoints are saved in DeepSpeed's elastic layout (train.engine) and
load at any world size as they are: nothing is converted. A ZeRO-3 checkpoint (or one saved before the
elastic layout) loads through a universal checkpoint when the world size changed.

Rank 0 decides the tag from the manifests and a listing (sizes; no download); then every node's leader
downloads and verifies it in parallel. A tag any leader finds damaged is quarantined (event
`checkpoint_quarantined`) and the next one of the lineage is tried. Where one is needed, a universal
checkpoint is converted
once per checkpoint: the first converter (rank 0's node) uploads the converted copy next to the tag, and
every other node -- and every later restore at another world size -- downloads it instead of converting.
When committed checkpoints exist but none is intact: `training.on_no_intact_checkpoint: fail` raises
NoIntactCheckpoint on every rank, `restart` starts from step 0 with a `fresh_start` event naming the cause."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from spotfill.config import constants
from spotfill.config.errors import CheckpointCorrupt, NoIntactCheckpoint
from spotfill.storage.checkpoint_store import CheckpointStore

log = logging.getLogger(__name__)


@dataclass
class RestorePlan:
    """What to load before training starts; `None` tag means a fresh start."""
    tag: str | None = None
    step: int = 0
    world_size: int = 0
    load_dir: str = ""
    load_tag: str = ""
    universal: bool = False
    elastic: bool = False        # a ZeRO-1/2 checkpoint in DeepSpeed's elastic layout: loads at any size as is
    stages: int = 0              # the pipeline stages it was saved with (0: no pipeline)
    timings: dict = field(default_factory=dict)
    quarantined: list = field(default_factory=list)     # [(tag, reason)] found damaged by this restore
    fresh_start_cause: str | None = None                 # set when on_no_intact_checkpoint=restart fired


def flatten_ranks(tag_dir: str, out_dir: str) -> None:
    """Hard-link (or copy) `tag_dir/rank-*/<file>` into `out_dir/<file>` (DeepSpeed's flat layout)."""
    os.makedirs(out_dir, exist_ok=True)
    for part in sorted(os.listdir(tag_dir)):
        src_dir = os.path.join(tag_dir, part)
        if not (part.startswith("rank-") and os.path.isdir(src_dir)):
            continue
        for name in os.listdir(src_dir):
            src, dst = os.path.join(src_dir, name), os.path.join(out_dir, name)
            if os.path.exists(dst):
                continue
            if os.path.isdir(src):
                shutil.copytree(src, dst)
                continue
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)


def convert_to_universal(ds_dir: str, out_dir: str, nbytes: int = 0) -> float:
    """Convert with DeepSpeed's ds_to_universal; returns seconds.

    Small checkpoints convert in this process (no interpreter start-up: that dominates for them); large
    ones in a subprocess with parallel extract/merge workers (the converter forks a process pool)."""
    t0 = time.perf_counter()
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if nbytes < constants.UNIVERSAL_INPROCESS_MAX_BYTES:
        import argparse
        import contextlib
        import io

        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
        args = argparse.Namespace(input_folder=ds_dir, output_folder=tmp, num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=False)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal(args)
    else:
        workers = str(max(1, min(8, (os.cpu_count() or 2) // 2)))
        proc = subprocess.run(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", ds_dir,
             "--output_folder", tmp, "--num_extract_workers", workers, "--num_merge_workers", workers],
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ds_to_universal failed ({proc.returncode}): {proc.stderr[-2000:]}")
    os.replace(tmp, out_dir)
    return time.perf_counter() - t0


def _gather(comms, obj, world: int) -> list:
    out: list = [None] * world
    comms.dist.all_gather_object(out, obj)
    return out


def _next_candidate(store: CheckpointStore, candidates: list[str], found: list, emit) -> dict | None:
    """Rank 0: the manifest of the first candidate whose listing matches it (quarantining the rest)."""
    while candidates:
        tag = candidates.pop(0)
        try:
            manifest = store.check_listing(tag)
        except CheckpointCorrupt as exc:
            _quarantine(store, tag, str(exc), found, emit)
            continue
        return {"manifest": {k: v for k, v in manifest.items()}, "has_universal": store.has_universal(tag)}
    return None


def _quarantine(store: CheckpointStore, tag: str, reason: str, found: list, emit) -> None:
    store.quarantine(tag, reason)
    found.append((tag, reason))
    if emit:
        emit("checkpoint_quarantined", tag=tag, reason=reason)


def _fetch_raw(store: CheckpointStore, manifest: dict, node_dir: str, ds_root: str) -> float:
    """Download + verify all ranks' files of `manifest` and flatten them into ds_root/<tag>; seconds."""
    t0 = time.perf_counter()
    got = store.download(manifest, node_dir, verify=True)
    flatten_ranks(got["path"], os.path.join(ds_root, manifest["tag"]))
    return time.perf_counter() - t0


def _node_universal(store: CheckpointStore, manifest: dict, node_dir: str, ds_root: str, load_tag: str,
                    shared: bool, have_raw: bool) -> dict:
    """This node's universal copy of `manifest`'s tag: the shared converted copy when there is one, else
    convert here (downloading the raw checkpoint first if needed). Returns what it did, with seconds."""
    tag, out = manifest["tag"], os.path.join(ds_root, load_tag)
    if shared:
        t0 = time.perf_counter()
        try:
            store.get_universal(tag, out)
            return {"source": "shared", "universal_download_s": round(time.perf_counter() - t0, 3)}
        except CheckpointCorrupt as exc:
            log.warning("universal copy of %s unusable (%s): converting on this node", tag, exc)
    info: dict = {"source": "converted"}
    if not have_raw:
        info["download_s"] = round(_fetch_raw(store, manifest, node_dir, ds_root), 3)
    info["convert_s"] = round(convert_to_universal(os.path.join(ds_root, tag), out,
                                                   int(manifest.get("bytes") or 0)), 3)
    return info


def _prepare_candidate(store, comms, choice: dict, rank: int, world: int, leader: bool, node_dir: str,
                       zero_stage: int, stages: int = 1) -> tuple[RestorePlan | None, str | None, list]:
    """Collective: every leader brings `choice` to its node. (plan, None, per-rank info) when every node
    has it, (None, reason, ...) when some leader found it damaged."""
    manifest = choice["manifest"]
    tag, saved_world = manifest["tag"], int(manifest["world_size"])
    elastic = zero_stage in (1, 2) and bool((manifest.get("meta") or {}).get("zero_elastic"))
    saved_stages = check_pipeline_shape(manifest, stages, zero_stage)
    universal = (saved_world != world or max(1, saved_stages) != stages) and zero_stage > 0 and not elastic
    load_tag = f"{tag}-universal" if universal else tag
    ds_root = os.path.join(node_dir, "ds")
    # phase 1: the raw checkpoint, where needed -- every node, or only rank 0's converter
    need_raw = leader and (not universal or (rank == 0 and not choice["has_universal"]))
    info: dict = {"node_leader": leader}
    failed = error = None
    if need_raw:
        shutil.rmtree(node_dir, ignore_errors=True)
        try:
            info["download_s"] = round(_fetch_raw(store, manifest, node_dir, ds_root), 3)
        except CheckpointCorrupt as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 -- e.g. storage down: raised on every rank
            failed = f"{type(exc).__name__}: {exc}"
    error = _outcome(comms, world, failed, error, f"downloading {tag} failed")
    if error:
        return None, error, []
    if universal:
        shared = choice["has_universal"]
        if not choice["has_universal"]:   # rank 0 converts, once for this checkpoint; the rest wait
            if rank == 0:
                failed, shared = _convert_and_share(store, manifest, node_dir, ds_root, load_tag, info)
            _raise_everywhere(comms, failed, f"converting {tag} to a universal checkpoint failed")
        shared = comms.bcast(shared)
        if leader and not (rank == 0 and not choice["has_universal"]):
            if not need_raw:
                shutil.rmtree(node_dir, ignore_errors=True)
            try:
                info.update(_node_universal(store, manifest, node_dir, ds_root, load_tag, shared, need_raw))
            except CheckpointCorrupt as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001
                failed = f"{type(exc).__name__}: {exc}"
        error = _outcome(comms, world, failed, error, f"preparing the universal copy of {tag} failed")
        if error:
            return None, error, []
    infos = _gather(comms, info, world)
    plan = RestorePlan(tag=tag, step=int(manifest["step"]), world_size=saved_world, load_dir=ds_root,
                       load_tag=load_tag, universal=universal, elastic=elastic, stages=saved_stages)
    return plan, None, infos


def check_pipeline_shape(manifest: dict, stages: int, zero_stage: int) -> int:
    """The pipeline stage count `manifest`'s checkpoint was saved with (0: no pipeline; a pipeline's manifest
    records its count, 1 included). A pipeline checkpoint holds weights per layer: with pipeline_stages 1 it
    resumes as a one-stage pipeline (worker_loop); an unpipelined one does not load into a pipeline, and
    only ZeRO-1 optimizer state reshards across stage counts (through a universal checkpoint): both raise a
    one-line error on every rank."""
    meta = manifest.get("meta") or {}
    saved = int(meta.get("pipeline_stages") or 0)
    if stages > 1 and not saved:
        raise PipelineShapeError(f"checkpoint {manifest['tag']} was saved without pipeline stages: its weights "
                                 f"do not load into pipeline_stages={stages} (per-layer weights); resume it "
                                 "with pipeline_stages: 1, or start a new run")
    if max(1, saved) != stages and zero_stage == 0:
        raise PipelineShapeError(f"checkpoint {manifest['tag']} was saved with {saved} pipeline stages and "
                                 f"ZeRO-0: its optimizer state reshards to {stages} stages only from ZeRO-1 "
                                 f"(universal checkpoint); resume it with pipeline_stages={saved}")
    return saved


class PipelineShapeError(RuntimeError):
    """A checkpoint cannot be resumed with this job's pipeline shape (raised on every rank alike)."""


def _convert_and_share(store, manifest: dict, node_dir: str, ds_root: str, load_tag: str,
                       info: dict) -> tuple[str | None, bool]:
    """Rank 0: convert the raw copy here, then upload the result next to the tag.
    Returns (failure or None, whether the copy is shared)."""
    try:
        info.update(_node_universal(store, manifest, node_dir, ds_root, load_tag, False, True))
    except Exception as exc:  # noqa: BLE001 -- raised on every rank by the caller
        return f"{type(exc).__name__}: {exc}", False
    t0 = time.perf_counter()
    shared = False
    try:
        info["universal_upload_bytes"] = store.put_universal(manifest["tag"], os.path.join(ds_root, load_tag))
        shared = True
    except Exception as exc:  # noqa: BLE001 -- storage trouble: the other nodes convert themselves
        log.warning("could not share the universal copy of %s: %s", manifest["tag"], exc)
    info["universal_upload_s"] = round(time.perf_counter() - t0, 3)
    return None, shared


def _outcome(comms, world: int, failed: str | None, damaged: str | None, what: str) -> str | None:
    """Collective: raise any rank's failure on every rank; else the first damage reason (or None)."""
    outcomes = _gather(comms, (failed, damaged), world)
    fatal = [f for f, _ in outcomes if f]
    if fatal:
        raise RuntimeError(f"{what}: {fatal[0]}")
    return next((d for _, d in outcomes if d), None)


def _raise_everywhere(comms, failed: str | None, what: str) -> None:
    """Collective: rank 0's failure (a string) raised on every rank, so none waits for it forever."""
    failed = comms.bcast(failed)
    if failed:
        raise RuntimeError(f"{what}: {failed}")


def _timings(manifest_bytes, infos: list, t0: float) -> dict:
    leaders = [i for i in infos if i.get("node_leader")]
    mine = infos[0]
    return {"download_s": mine.get("download_s", 0.0), "convert_s": mine.get("convert_s", 0.0),
            "bytes": manifest_bytes, "nodes": len(leaders),
            "universal_sources": sorted(i["source"] for i in leaders if "source" in i),
            "conversions": sum(1 for i in leaders if i.get("source") == "converted"),
            "restore_wall_s": round(time.perf_counter() - t0, 3)}


def restore_on_workers(store: CheckpointStore, comms, rank: int, world: int, node_id: str, node_dir: str,
                       zero_stage: int, *, on_no_intact: str = "fail", emit=None, stages: int = 1) -> RestorePlan:
    """Collective: every rank of a starting worker group calls it; returns the same plan on every rank.

    Rank 0 chooses the newest intact checkpoint of the live lineage (checked against its listing), the
    lowest rank on each node (Ray's local_rank groups by IP, and several raylets can share one IP) brings
    it to its node, all nodes at once. `emit(kind, **fields)` (rank 0) records `checkpoint_quarantined`,
    `checkpoint_restored` and `fresh_start` events. Raises NoIntactCheckpoint on every rank when
    committed checkpoints exist, none is intact and `on_no_intact` is "fail"."""
    t0 = time.perf_counter()
    node_ids = _gather(comms, node_id, world)
    leader = node_ids.index(node_id) == rank
    found: list = []
    candidates: list[str] = []
    if rank == 0:
        store.discard_uncommitted()
        candidates = store.restore_candidates()
        for tag, reason in store.last_quarantined:   # unreadable manifests
            found.append((tag, reason))
            if emit:
                emit("checkpoint_quarantined", tag=tag, reason=reason)
    while True:
        choice = _next_candidate(store, candidates, found, emit) if rank == 0 else None
        choice = comms.bcast(choice)
        if choice is None:
            break
        plan, reason, infos = _prepare_candidate(store, comms, choice, rank, world, leader, node_dir, zero_stage,
                                                 stages)
        if plan is not None:
            plan.timings = _timings(choice["manifest"].get("bytes"), infos, t0)
            plan.quarantined = comms.bcast(found)
            if rank == 0:
                store.mark_resumed(plan.tag, plan.step)
                if emit:
                    emit("checkpoint_restored", tag=plan.tag, step=plan.step, world_size=world,
                         from_world_size=plan.world_size, universal=plan.universal,
                         zero_elastic=plan.elastic, **plan.timings)
            comms.barrier()
            return plan
        if rank == 0:
            _quarantine(store, choice["manifest"]["tag"], reason, found, emit)
    damaged = comms.bcast(sorted(store.quarantined()) if rank == 0 else None)
    found = comms.bcast(found)
    if not damaged:
        if rank == 0:
            store.mark_resumed(None)
        return RestorePlan()
    cause = (f"no intact checkpoint: {len(damaged)} committed, all damaged "
             f"({', '.join(damaged)}; reasons in events.jsonl `checkpoint_quarantined`)")
    if on_no_intact != "restart":
        raise NoIntactCheckpoint(f"{cause}; set training.on_no_intact_checkpoint: restart to start from step 0")
    if rank == 0:
        store.mark_resumed(None)
        if emit:
            emit("fresh_start", cause=cause, damaged=damaged)
    log.warning("starting from step 0: %s (training.on_no_intact_checkpoint: restart)", cause)
    return RestorePlan(quarantined=found, fresh_start_cause=cause)
