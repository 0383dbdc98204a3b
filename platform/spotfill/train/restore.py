"""Restore: pick the newest intact checkpoint of the live lineage, bring it to every node at once, flatten it
into DeepSpeed's layout. ZeRO-1/2 checkpoints are saved in DeepSpeed's elastic layout (train.engine) and
load at any world size as they are: nothing is converted. A ZeRO-3 checkpoint (or one saved before the
elastic layout) loads through a universal checkpoint when the world size changed.

Rank 0 decides the tag from the manifests and a listing (sizes; no download); then every node's leader
brings what its ranks load (train/checkpoint_files.py) to its node and verifies it, all nodes in parallel:
from the snapshots this node kept after uploading them where they match the manifest, else from storage
(the `reads` of the restore events: bytes per node and source). A tag whose bytes are wrong in storage is
quarantined (event `checkpoint_quarantined`) and the next one of the lineage is tried; a node's own disk
fault is retried from storage (`checkpoint_local_error`), never quarantined. Where one is needed, a universal
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
from spotfill.config.errors import CheckpointCorrupt, NoIntactCheckpoint, WriterFenced
from spotfill.ray_compat import usable
from spotfill.storage.checkpoint_store import CheckpointStore
from spotfill.train.checkpoint_files import node_files
from spotfill.train.checkpointing import local_snapshot_copies

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


def _fetch_raw(store: CheckpointStore, manifest: dict, node_dir: str, ds_root: str, want: set[str] | None = None,
               local_root: str | None = None) -> tuple[float, dict]:
    """Bring `want` (manifest entries; None: all) of `manifest` to this node, verified -- this node's own
    kept snapshot files where they match the manifest, the rest from storage -- and flatten them into
    ds_root/<tag>. Returns (seconds, bytes by source)."""
    t0 = time.perf_counter()
    files = manifest["files"] if want is None else want
    copies = local_snapshot_copies(local_root, manifest["tag"], files) if local_root else None
    got = store.download(manifest, node_dir, verify=True, want=want, local_copies=copies)
    flatten_ranks(got["path"], os.path.join(ds_root, manifest["tag"]))
    return time.perf_counter() - t0, got["io"]


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
        seconds, info["io"] = _fetch_raw(store, manifest, node_dir, ds_root)
        info["download_s"] = round(seconds, 3)
    info["convert_s"] = round(convert_to_universal(os.path.join(ds_root, tag), out,
                                                   int(manifest.get("bytes") or 0)), 3)
    return info


def _prepare_candidate(store, comms, choice: dict, rank: int, world: int, node: tuple[str, list[int]],
                       node_dir: str, zero_stage: int, local_root: str | None = None,
                       stages: int = 1, emit=None) -> tuple[RestorePlan | None, str | None, list]:
    """Collective: every leader brings `choice` to its node -- the files its ranks read (node = (node id,
    the ranks on it)). (plan, None, per-rank info) when every node has it, (None, reason, ...) when some
    leader found it damaged. The local faults of a fetch that failed are emitted (rank 0's `emit`) as
    `checkpoint_local_error` before that; a successful one's are in its info's `io`."""
    manifest = choice["manifest"]
    tag, saved_world = manifest["tag"], int(manifest["world_size"])
    elastic = zero_stage in (1, 2) and bool((manifest.get("meta") or {}).get("zero_elastic"))
    saved_stages = check_pipeline_shape(manifest, stages, zero_stage)
    universal = (saved_world != world or max(1, saved_stages) != stages) and zero_stage > 0 and not elastic
    load_tag = f"{tag}-universal" if universal else tag
    ds_root = os.path.join(node_dir, "ds")
    # phase 1: the raw checkpoint, where needed -- every node, or only rank 0's converter
    leader = node[1][0] == rank
    need_raw = leader and (not universal or (rank == 0 and not choice["has_universal"]))
    info: dict = {"node_leader": leader, "node": node[0]}
    failed = error = None
    lost: list[dict] = []       # the local faults of a fetch that raised (its exception's report)
    if need_raw:
        shutil.rmtree(node_dir, ignore_errors=True)
        # a rigid-layout ZeRO-1/2 checkpoint loads through DeepSpeed's loader, which reads every partition
        own_only = elastic or zero_stage not in (1, 2)
        # the files of its own ranks only where DeepSpeed names its files as spotfill reads them (else all)
        want = None if universal or not usable("restore_node_files") else node_files(
            manifest["files"], node[1], saved_world, world, own_only)
        try:
            seconds, info["io"] = _fetch_raw(store, manifest, node_dir, ds_root, want, local_root)
            info["download_s"] = round(seconds, 3)
        except CheckpointCorrupt as exc:
            error, lost = str(exc), _local_faults(exc, node[0])
        except Exception as exc:  # noqa: BLE001 -- e.g. storage down: raised on every rank
            failed, lost = f"{type(exc).__name__}: {exc}", _local_faults(exc, node[0])
    error = _outcome(comms, world, failed, error, f"downloading {tag} failed", tag, lost, emit)
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
                error, lost = str(exc), _local_faults(exc, node[0])
            except Exception as exc:  # noqa: BLE001
                failed, lost = f"{type(exc).__name__}: {exc}", _local_faults(exc, node[0])
        error = _outcome(comms, world, failed, error, f"preparing the universal copy of {tag} failed", tag, lost,
                         emit)
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


def _local_faults(exc: BaseException, node: str) -> list[dict]:
    """The local faults a failed verified fetch saw (its exception's FetchReport; storage/verified_fetch.py),
    each {node, file, detail, recovered}: the last one unrecovered where this node's copy kept failing."""
    report = getattr(exc, "report", None)
    return [{"node": node, **e} for e in getattr(report, "local_errors", None) or []]


def _outcome(comms, world: int, failed: str | None, damaged: str | None, what: str, tag: str | None = None,
             lost: list[dict] | None = None, emit=None) -> str | None:
    """Collective: raise any rank's failure on every rank; else the first damage reason (or None). First,
    rank 0 (`emit`) records every rank's `lost` (_local_faults) as `checkpoint_local_error` events of `tag`."""
    outcomes = _gather(comms, (failed, damaged, lost or []), world)
    for _, _, faults in outcomes if emit else []:
        for fault in faults:
            emit("checkpoint_local_error", tag=tag, **fault)
    fatal = [f for f, _, _ in outcomes if f]
    if fatal:
        raise RuntimeError(f"{what}: {fatal[0]}")
    return next((d for _, d, _ in outcomes if d), None)


def _raise_everywhere(comms, failed: str | None, what: str) -> None:
    """Collective: rank 0's failure (a string) raised on every rank, so none waits for it forever."""
    failed = comms.bcast(failed)
    if failed:
        raise RuntimeError(f"{what}: {failed}")


def _timings(manifest_bytes, infos: list, t0: float) -> dict:
    """The restore's numbers for the `checkpoint_restored` / `resume` events: `reads` says, per node, how
    many bytes it read from storage and from its own kept snapshot (and the local faults it got past)."""
    leaders = [i for i in infos if i.get("node_leader")]
    mine = infos[0]
    reads = [{"node": i["node"], **i["io"]} for i in leaders if i.get("io")]
    return {"download_s": mine.get("download_s", 0.0), "convert_s": mine.get("convert_s", 0.0),
            "bytes": manifest_bytes, "nodes": len(leaders), "reads": reads,
            "read_bytes_storage": sum(r["bytes_storage"] for r in reads),
            "read_bytes_local": sum(r["bytes_local"] for r in reads),
            "universal_sources": sorted(i["source"] for i in leaders if "source" in i),
            "conversions": sum(1 for i in leaders if i.get("source") == "converted"),
            "restore_wall_s": round(time.perf_counter() - t0, 3)}


def restore_on_workers(store: CheckpointStore, comms, rank: int, world: int, node_id: str, node_dir: str,
                       zero_stage: int, *, on_no_intact: str = "fail", emit=None,
                       local_root: str | None = None, stages: int = 1) -> RestorePlan:
    """Collective: every rank of a starting worker group calls it; returns the same plan on every rank.

    Rank 0 chooses the newest intact checkpoint of the live lineage (checked against its listing), the
    lowest rank on each node (Ray's local_rank groups by IP, and several raylets can share one IP) brings
    it to its node, all nodes at once. `emit(kind, **fields)` (rank 0) records `checkpoint_quarantined`,
    `checkpoint_restored` and `fresh_start` events. Raises NoIntactCheckpoint on every rank when
    committed checkpoints exist, none is intact and `on_no_intact` is "fail"; WriterFenced on every rank
    when a newer writer took the store meanwhile (rank 0's discard, quarantine or `latest` move refused)."""
    t0 = time.perf_counter()
    node_ids = _gather(comms, node_id, world)
    node = (node_id, [r for r, n in enumerate(node_ids) if n == node_id])   # leader: its lowest rank
    found: list = []
    candidates: list[str] = []
    r0 = _Rank0Writes(rank)

    def start() -> None:
        store.discard_uncommitted()
        candidates.extend(store.restore_candidates())
        for tag, reason in store.last_quarantined:   # unreadable manifests
            found.append((tag, reason))
            if emit:
                emit("checkpoint_quarantined", tag=tag, reason=reason)
    r0.run(start)
    while True:
        choice = r0.run(lambda: _next_candidate(store, candidates, found, emit))
        choice = r0.share(comms, choice)
        if choice is None:
            break
        plan, reason, infos = _prepare_candidate(store, comms, choice, rank, world, node, node_dir, zero_stage,
                                                 local_root, stages, emit if rank == 0 else None)
        if plan is not None:
            plan.timings = _timings(choice["manifest"].get("bytes"), infos, t0)
            plan.quarantined = comms.bcast(found)

            def resumed() -> None:
                store.mark_resumed(plan.tag, plan.step)
                for read in plan.timings["reads"] if emit else []:    # local faults got past: not damage
                    for e in read.get("local_errors", []):
                        emit("checkpoint_local_error", tag=plan.tag, node=read["node"], **e)
                if emit:
                    emit("checkpoint_restored", tag=plan.tag, step=plan.step, world_size=world,
                         from_world_size=plan.world_size, universal=plan.universal,
                         zero_elastic=plan.elastic, **plan.timings)
            r0.run(resumed)
            r0.share(comms, None)
            return plan
        r0.run(lambda: _quarantine(store, choice["manifest"]["tag"], reason, found, emit))
    damaged = r0.share(comms, r0.run(lambda: sorted(store.quarantined())))
    found = comms.bcast(found)
    if not damaged:
        r0.run(lambda: store.mark_resumed(None))
        r0.share(comms, None)
        return RestorePlan()
    cause = (f"no intact checkpoint: {len(damaged)} committed, all damaged "
             f"({', '.join(damaged)}; reasons in events.jsonl `checkpoint_quarantined`)")
    if on_no_intact != "restart":
        raise NoIntactCheckpoint(f"{cause}; set training.on_no_intact_checkpoint: restart to start from step 0")

    def fresh() -> None:
        store.mark_resumed(None)
        if emit:
            emit("fresh_start", cause=cause, damaged=damaged)
    r0.run(fresh)
    r0.share(comms, None)
    log.warning("starting from step 0: %s (training.on_no_intact_checkpoint: restart)", cause)
    return RestorePlan(quarantined=found, fresh_start_cause=cause)


class _Rank0Writes:
    """Rank 0's writes during a restore. Once one is refused (WriterFenced: a newer writer took the store)
    rank 0 writes nothing more, and the next share() raises the refusal on every rank."""

    def __init__(self, rank: int):
        self.rank, self.fenced = rank, None

    def run(self, fn):
        """fn() on rank 0 while not fenced (its result; None elsewhere)."""
        if self.rank != 0 or self.fenced is not None:
            return None
        try:
            return fn()
        except WriterFenced as exc:
            self.fenced = exc.record()
            return None

    def share(self, comms, value):
        """Collective: rank 0's `value`, or its refusal raised on every rank."""
        fenced, value = comms.bcast((self.fenced, value) if self.rank == 0 else None)
        if fenced is not None:
            raise WriterFenced.from_record(fenced)
        return value
