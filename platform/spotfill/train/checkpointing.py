"""DeepSpeed checkpoints through object storage, resharded to any world size.

Save (`Checkpointer.save(engine, step, client_state, kind=...)`): every rank writes a local snapshot
(`engine.save_checkpoint` into tmpfs or a node-local folder), a background thread uploads that rank's
files, and rank 0 commits the manifest once every rank's part is stored (checkpoint_store.py).

* periodic: the step loop waits for the snapshot only, never for an upload. While an upload runs, the
  new snapshot becomes the single pending one (an older pending one is deleted and reported skipped), so
  a storage outage costs checkpoints, not training time; the newest one commits when storage is back.
* final / grow: cancel what is outstanding, snapshot, and return once committed (raise if not).
* emergency (preemption notice): budget = deadline - now - EMERGENCY_MARGIN_S; a new checkpoint if it
  fits, else the periodic upload already running if that fits, else a best effort; a cancelled upload
  never commits (uploader.py's claim/cancel), and one not committed by deadline - margin is abandoned
  uncommitted. Ray Train tears the workers down at deadline + FailureConfig.preemption_grace_s.

Restore: rank 0 picks the newest intact committed checkpoint (falling back past a partial or corrupt one)
and broadcasts its tag; one rank per node brings the files its node's ranks load -- from the snapshot each
rank keeps after its upload (the newest only) where it matches the manifest, else from storage -- and
flattens the rank folders into a DeepSpeed checkpoint folder. ZeRO-1/2 state is saved in DeepSpeed's elastic layout (recorded in the manifest's
meta.zero_elastic) and loads at any world size as is; otherwise, when the world size changed (ZeRO-3), it is
converted once with DeepSpeed's universal-checkpoint converter and every rank loads it with `load_universal`.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Callable

from spotfill.config import constants
from spotfill.config.errors import CheckpointCorrupt, StorageError, WriterFenced
from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
from spotfill.storage.uploader import AsyncUploader, Cancelled, UploadJob

log = logging.getLogger(__name__)


SHM = "/dev/shm"


@contextlib.contextmanager
def _no_zip_crc32():
    """Skip the CRC32 torch.save computes over every tensor record of its zip container. A snapshot does
    not need it: upload_part records a sha256 of every file, restore verifies it, and torch.load ignores
    the CRC. torch >= 2.5 (torch.utils.serialization.config); a no-op before. Process-wide while it lasts."""
    try:
        from torch.utils.serialization import config
        old = config.save.compute_crc32
    except (ImportError, AttributeError):
        yield
        return
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = old


def zero_elastic_layout(engine) -> bool:
    """Whether `engine` saves its ZeRO-1/2 optimizer state in DeepSpeed's elastic layout (recorded in the
    manifest: restore then loads it at any world size without conversion)."""
    opt = getattr(engine, "optimizer", None)
    return type(opt).__name__ == "DeepSpeedZeroOptimizer" and bool(getattr(opt, "elastic_checkpoint", False))


def snapshot_roots(local_root: str, rank: int) -> list[str]:
    """Where rank `rank`'s snapshots live on this node (checkpoint tag folders inside): the node-local disk
    folder, its tmpfs twin (named after it, so the next attempt finds and clears what a dead one left in
    RAM) and SPOTFILL_SNAPSHOT_DIR's when set."""
    name = "spotfill-" + os.path.relpath(os.path.abspath(local_root), "/").replace(os.sep, "-")
    roots = [os.path.join(local_root, f"snap-rank-{rank}"), os.path.join(SHM, name, f"snap-rank-{rank}")]
    if constants.SNAPSHOT_DIR != "auto":
        roots.append(os.path.join(constants.SNAPSHOT_DIR, name, f"snap-rank-{rank}"))
    return roots


def local_snapshot_copies(local_root: str, tag: str, files) -> dict[str, str]:
    """rel -> path of this node's own snapshot files of `tag` (the newest one each rank uploaded is kept):
    a manifest's `rank-<r>/<name>` is `<snapshot root of rank r>/<tag>/<name>`. Unverified: the caller
    checks size and sha256 against the manifest (storage/verified_fetch.py)."""
    out = {}
    for rel in files:
        folder, _, name = rel.partition("/")
        if not folder.startswith("rank-") or not folder[5:].isdigit():
            continue
        for root in snapshot_roots(local_root, int(folder[5:])):
            path = os.path.join(root, tag, *name.split("/"))
            if os.path.isfile(path):
                out[rel] = path
                break
    return out


def checkpoint_events(ckpt, attempt) -> list[dict]:
    """The events of what rank 0's Checkpointer `ckpt` did since the last call, for the run's event sink:
    `checkpoint` (committed), `checkpoint_skipped`, `checkpoint_fenced` (its writes refused: the report's
    checkpoints.fenced comes from these alone). The event's own kind last: a record's fields never overwrite
    it."""
    events = [{**c, "kind": "checkpoint", "attempt": attempt} for c in ckpt.pop_committed()]
    events += [{**s, "kind": "checkpoint_skipped", "attempt": attempt} for s in ckpt.pop_skipped()]
    events += [{**f, "kind": "checkpoint_fenced", "attempt": attempt} for f in ckpt.pop_fenced()]
    return events


KINDS = ("periodic", "final", "grow", "emergency")
NO_DEADLINE = 1e18   # "no deadline known" inside collectives (min over ranks)


@dataclass(frozen=True)
class EmergencyPlan:
    """Which way an emergency save goes: "fresh" (cancel the periodic uploads, snapshot now, upload and
    commit), "inflight" (keep the periodic upload already running, drop the pending one) or "abandon"
    (no time left: nothing is uploaded, nothing half-done commits)."""
    path: str
    reason: str
    budget_s: float


def plan_emergency(now: float, deadline: float, margin_s: float, fresh_s: float,
                   inflight_step: int | None, inflight_left_s: float, snapshot_s: float = 0.0) -> EmergencyPlan:
    """Pure: budget = deadline - now - margin. `fresh_s`: estimated snapshot + upload + commit of a new
    checkpoint, `snapshot_s` the snapshot alone (0 when nothing was measured yet); `inflight_left_s`:
    estimated rest of the running periodic upload of `inflight_step` (None: none runs). A new checkpoint
    wins whenever it fits (it loses no steps); else the running one if it fits; else, as a best effort
    abandoned at the budget's end, the running one or a new one -- unless even the snapshot cannot fit."""
    budget = deadline - now - margin_s
    if deadline >= NO_DEADLINE:
        return EmergencyPlan("fresh", "no preemption deadline known: a new checkpoint, no budget", math.inf)
    if budget <= 0:
        return EmergencyPlan("abandon", f"no time: the deadline is {deadline - now:.1f}s away and "
                             f"{margin_s:.1f}s are kept as margin", budget)
    if fresh_s <= budget:
        return EmergencyPlan("fresh", f"a new checkpoint needs ~{fresh_s:.1f}s of the {budget:.1f}s budget"
                             + (f"; the periodic upload of step {inflight_step} is cancelled"
                                if inflight_step is not None else ""), budget)
    if inflight_step is not None and inflight_left_s <= budget:
        return EmergencyPlan("inflight", f"a new checkpoint needs ~{fresh_s:.1f}s > the {budget:.1f}s "
                             f"budget; the running upload of step {inflight_step} needs ~{inflight_left_s:.1f}s "
                             f"more: kept", budget)
    why = f"a new checkpoint needs ~{fresh_s:.1f}s > the {budget:.1f}s budget" + (
        f" and the running upload of step {inflight_step} ~{inflight_left_s:.1f}s" if inflight_step is not None
        else "")
    if inflight_step is not None and inflight_left_s <= fresh_s:
        return EmergencyPlan("inflight", f"best effort: {why}; the running one is closer", budget)
    if snapshot_s > budget:
        return EmergencyPlan("abandon", f"{why}; even its snapshot (~{snapshot_s:.1f}s) does not fit", budget)
    return EmergencyPlan("fresh", f"best effort: {why}; abandoned uncommitted if not done in time", budget)


class _Deadline:
    """Commit guard of an emergency upload: the job's own check/claim, plus no claim after `until`."""

    def __init__(self, ckpt: "Checkpointer", job: UploadJob, until: float):
        self.ckpt, self.job, self.until = ckpt, job, until

    def check(self) -> None:
        self.job.check()
        if time.time() >= self.until:
            self.ckpt._cancel(self.job, "not committed by deadline - margin")
            self.job.check()

    def claim(self) -> None:
        self.check()
        self.job.claim()


class Checkpointer:
    """Local snapshot + background upload + commit, for one rank of one training attempt.

    Multi-rank consistency. A tag commits only when every rank stored its part, so every rank must keep or
    drop the same tags. Periodic saves decide that collectively: each one all-reduces (MAX, one tiny
    tensor; the save is already a collective through engine.save_checkpoint) the step of this rank's pending
    snapshot that has not started uploading, and of its latest failed upload. A step any rank reports is
    dropped on every rank: a pending snapshot is deleted, a running upload is cancelled -- on rank 0 its
    commit then stops waiting for the missing part at once (the commit guard), so a skipped tag neither
    hangs until the commit timeout nor holds up the next one. A tag every rank has started uploading is
    never dropped by a periodic save, so each upload the slowest rank finishes commits: no livelock between
    ranks of different speeds. Final/grow/emergency saves cancel everything outstanding on every rank
    (the same decision everywhere, no communication); the emergency's path is chosen from values reduced
    over all ranks (earliest deadline, slowest estimate), so every rank takes the same one. Skipped tags
    leave uncommitted parts behind, which retention removes (checkpoint_store.cleanup). Rank 0's records
    are the authoritative ones (only rank 0 commits).
    """

    def __init__(self, store: CheckpointStore, local_root: str, rank: int, world_size: int, attempt: str,
                 all_max: Callable[[list[float]], list[float]] | None = None, meta: dict | None = None,
                 part_files: dict[str, str] | None = None):
        self.store, self.rank, self.world_size, self.attempt = store, rank, world_size, attempt
        self.meta = dict(meta or {})     # more of the manifest's meta (a pipeline's stage count, the model card)
        # more files of this rank's part, {path inside the part: local file} (the model card's tokenizer)
        self.part_files = dict(part_files or {})
        self._roots = snapshot_roots(local_root, rank)
        self.disk_root, self.shm_root = self._roots[:2]
        self.snap_root = self.disk_root
        self._last_bytes = 0
        # the restore has read what it could use of a previous attempt's snapshots (it ran before this)
        for root in self._roots:
            shutil.rmtree(root, ignore_errors=True)
        self._kept: str | None = None     # the newest snapshot uploaded: kept for a restore on this node
        self.uploader = AsyncUploader(name=f"ckpt-upload-r{rank}")
        self._all_max = all_max
        self._lock = threading.Lock()
        self.committed: list[dict] = []
        self.skipped: list[dict] = []
        self.fenced: list[dict] = []       # writes refused: a newer writer took the store (storage/fence.py)
        self.stale = False                 # set by the first refusal, for good: this attempt must stop
        self._failed_step = -1            # latest failed upload not yet shared with the other ranks
        self._snapshot_s = 0.0            # last measured snapshot and upload+commit seconds (estimates)
        self._upload_s = 0.0
        self._zero_elastic = False        # the snapshot's ZeRO optimizer state is in the elastic layout

    # -- public ---------------------------------------------------------------------------------------
    def save(self, engine, step: int, client_state: dict, *, kind: str,
             deadline_unix_s: float | None = None) -> dict:
        """Take checkpoint `step` (see the module docstring); returns tag, step, kind, path, reason,
        committed, snapshot_s, blocked_s, wait_s, stall_s (the seconds the caller was held)."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: accepted {', '.join(KINDS)}")
        if kind == "emergency":
            return self._save_emergency(engine, step, client_state, deadline_unix_s)
        t0 = time.perf_counter()
        if kind == "periodic":
            self._drop_collectively(engine, step)
        else:
            self._clear_for(kind, step, wait_s=constants.CHECKPOINT_COMMIT_TIMEOUT_S)
        blocked_s = time.perf_counter() - t0
        tag, snapshot_s, local_dir = self._snapshot(engine, step, client_state)
        job, _ = self.uploader.submit(tag, self._upload, tag, step, kind, local_dir, None, step=step)
        if kind == "periodic":
            running = job.state != "pending"
            path = "started" if running else "pending"
            reason = "upload started at once" if running else (
                f"upload of {self.uploader.active.key if self.uploader.active else 'an older step'} still "
                "running: this snapshot waits, coalesced (a newer one replaces it)")
            return self._result(tag, step, kind, path, reason, False, snapshot_s, blocked_s, 0.0)
        t1 = time.perf_counter()
        committed = self._finish_sync(job, tag, time.time() + constants.CHECKPOINT_COMMIT_TIMEOUT_S, None)
        if not committed:
            raise CheckpointCorrupt(f"{tag}: {kind} checkpoint not committed: "
                                    f"{job.reason or 'no manifest within the commit timeout'}") from job.error
        return self._result(tag, step, kind, "sync", f"{kind} checkpoint committed before returning", True,
                            snapshot_s, blocked_s, time.perf_counter() - t1)

    def pop_committed(self) -> list[dict]:
        """Checkpoints rank 0 committed since the last call: tag, step, save_kind, bytes, upload_s, t."""
        with self._lock:
            done, self.committed = self.committed, []
        return done

    def pop_fenced(self) -> list[dict]:
        """Writes refused since the last call because a newer writer took the store (WriterFenced.record()
        plus t). After one, this attempt is stale: it must stop."""
        with self._lock:
            done, self.fenced = self.fenced, []
        return done

    def store_write(self, write: Callable[[CheckpointStore], object]):
        """`write(self.store)` -- a write to the store outside a save (a `latest` move, a retention pass) --
        as this attempt's writer; its result. A refusal (WriterFenced: a newer writer took the store) is
        recorded as a refused commit is (pop_fenced; this attempt is stale from then on), then raised."""
        try:
            return write(self.store)
        except WriterFenced as exc:
            self._refused(exc)
            raise

    def pop_skipped(self) -> list[dict]:
        """Snapshots superseded, cancelled, abandoned or failed since the last call (never committed):
        tag, step, reason, t."""
        with self._lock:
            done, self.skipped = self.skipped, []
        return done

    def close(self, wait: bool = True, keep_snapshot: bool = False) -> None:
        """Stop uploading; remove this rank's snapshots from tmpfs -- except, with keep_snapshot (the
        attempt ends and training goes on), the newest uploaded one, which the next restore on this node
        reads instead of downloading it."""
        try:
            self.uploader.close(wait=wait)
        finally:
            if wait or not self.uploader.busy:
                kept = self._kept if keep_snapshot else None
                for root in self._roots[1:]:
                    for name in os.listdir(root) if os.path.isdir(root) else []:
                        if os.path.join(root, name) != kept:
                            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                    with contextlib.suppress(OSError):
                        os.rmdir(root)
                        os.rmdir(os.path.dirname(root))  # when no other local rank uses it
                if not keep_snapshot and self._kept:
                    shutil.rmtree(self._kept, ignore_errors=True)

    # -- the save paths -------------------------------------------------------------------------------
    def _drop_collectively(self, engine, step: int) -> None:
        """Periodic: drop, on every rank, the tags some rank cannot finish (see the class docstring)."""
        pending = self.uploader.pending
        mine = [float(pending.step if pending is not None else -1), float(self._failed_step)]
        self._failed_step = -1
        not_started, failed = (int(v) for v in self._reduce(engine, mine))
        for job in self.uploader.outstanding():
            if job.step == not_started and not_started >= 0:
                self._cancel(job, f"superseded by step {step}: " + (
                    "its upload had not started" if job is pending else
                    "another rank had not started uploading it"))
            elif job.step == failed and failed >= 0:
                self._cancel(job, "another rank's upload of it failed")

    def _clear_for(self, kind: str, step: int, wait_s: float) -> None:
        """Final/grow/emergency: cancel every outstanding periodic upload (the same on every rank). One
        that already claimed its commit (all parts stored, manifest being written) is waited for."""
        committing = [job for job in reversed(self.uploader.outstanding())   # pending first
                      if not self._cancel(job, f"superseded by the {kind} checkpoint at step {step}")]
        for job in committing:
            job.wait(wait_s)

    def _save_emergency(self, engine, step: int, client_state: dict, deadline_unix_s: float | None) -> dict:
        t0 = time.perf_counter()
        active = self.uploader.active
        inflight = active.step if active is not None and active.step is not None else -1
        left = max(0.0, self._upload_s - active.running_s()) if active is not None else 0.0
        deadline = NO_DEADLINE if deadline_unix_s is None else float(deadline_unix_s)
        now, neg_deadline, fresh_s, neg_lo, hi, left, snapshot_s = self._reduce(engine, [
            time.time(), -deadline, self._snapshot_s + self._upload_s, -inflight, inflight, left,
            self._snapshot_s])
        deadline, same_inflight = -neg_deadline, int(-neg_lo) == int(hi) and hi >= 0
        plan = plan_emergency(now, deadline, constants.EMERGENCY_MARGIN_S, fresh_s,
                              int(hi) if same_inflight else None, left, snapshot_s)
        until = deadline - constants.EMERGENCY_MARGIN_S
        log.warning("emergency checkpoint at step %d: %s (%s)", step, plan.path, plan.reason)
        if plan.path == "abandon":
            return self._result(tag_for(step, self.attempt), step, "emergency", "abandon", plan.reason, False, 0.0,
                                time.perf_counter() - t0, 0.0, budget_s=plan.budget_s)
        if plan.path == "inflight":
            job = active
            for other in self.uploader.outstanding():
                if other is not job:
                    self._cancel(other, f"dropped for the emergency at step {step}: {plan.reason}")
            blocked_s, snapshot_s, tag, job_step = time.perf_counter() - t0, 0.0, job.key, job.step
        else:
            self._clear_for("emergency", step, wait_s=0.0)
            blocked_s = time.perf_counter() - t0
            tag, snapshot_s, local_dir = self._snapshot(engine, step, client_state)
            job, _ = self.uploader.submit(tag, self._upload, tag, step, "emergency", local_dir,
                                          until if plan.budget_s != math.inf else None, step=step)
            job_step = step
        t1 = time.perf_counter()
        if plan.budget_s == math.inf:
            committed = self._finish_sync(job, tag, time.time() + constants.CHECKPOINT_COMMIT_TIMEOUT_S, None)
        else:
            committed = self._finish_sync(job, tag, until, deadline)
        reason = plan.reason if committed else f"{plan.reason}; abandoned uncommitted: {job.reason or 'late'}"
        return self._result(tag, job_step, "emergency", plan.path, reason, committed, snapshot_s, blocked_s,
                            time.perf_counter() - t1, budget_s=plan.budget_s)

    def _finish_sync(self, job: UploadJob, tag: str, until: float, hard: float | None) -> bool:
        """Wait for `job` until `until` (unix s); cancel it if late. A job that claimed its commit in time
        is waited for until `hard` (None: no bound). Rank 0: whether it committed; other ranks: whether
        rank 0's manifest of `tag` (this attempt's) appeared by `until`."""
        job.wait(max(0.0, until - time.time()))
        if isinstance(job.error, WriterFenced):
            raise job.error
        if self._cancel(job, f"not done {'by deadline - margin' if hard else 'within the commit timeout'}"):
            return False
        if job.state == "committing":           # claimed in time: its manifest is being written
            job.wait(None if hard is None else max(0.0, hard - time.time()))
        if isinstance(job.error, WriterFenced):
            raise job.error
        if job.state != "done":
            return False
        return self.rank == 0 or self._manifest_seen(tag, until)

    def _manifest_seen(self, tag: str, until: float) -> bool:
        delay = 0.05
        while True:
            with contextlib.suppress(FileNotFoundError, ValueError, StorageError):
                if self.store.manifest(tag).get("meta", {}).get("attempt") == self.attempt:
                    return True
            if self.store.fence is not None:     # rank 0's commit refused: a newer writer took the store
                self.store.fence.check("wait for the commit", tag)
            if time.time() + delay > until:
                return False
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    # -- snapshot and upload --------------------------------------------------------------------------
    def _snapshot(self, engine, step: int, client_state: dict) -> tuple[str, float, str]:
        tag = tag_for(step, self.attempt)
        t0 = time.perf_counter()
        state = {**client_state, "step": step, "world_size": self.world_size,
                 "universal_checkpoint_info": {}}
        self.snap_root = self._choose_root(engine)
        self._zero_elastic = zero_elastic_layout(engine)
        with _no_zip_crc32():
            engine.save_checkpoint(self.snap_root, tag=tag, client_state=state, save_latest=False)
        for rel, src in self.part_files.items():
            dst = os.path.join(self.snap_root, tag, *rel.split("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst)
        self._snapshot_s = time.perf_counter() - t0
        return tag, self._snapshot_s, os.path.join(self.snap_root, tag)

    def _choose_root(self, engine) -> str:
        """tmpfs when it has room for three snapshots of every local rank (the newest uploaded one, kept for
        a restore on this node; the one uploading; the new one -- a pending one is dropped before a new
        snapshot is taken) plus 10% of it to spare; else the node-local disk folder.
        SPOTFILL_SNAPSHOT_DIR overrides."""
        if constants.SNAPSHOT_DIR != "auto":
            return self._roots[2]
        try:
            st = os.statvfs(SHM)
        except OSError:
            return self.disk_root
        per_rank = self._last_bytes or 16 * sum(p.numel() for p in engine.module.parameters())
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        need = 3 * per_rank * local + st.f_blocks * st.f_frsize // 10   # + the newest uploaded, kept
        return self.shm_root if st.f_bavail * st.f_frsize > need else self.disk_root

    def _upload(self, job: UploadJob, tag: str, step: int, kind: str, local_dir: str,
                until: float | None) -> dict:
        """The background job: upload this rank's part; rank 0 then commits (guarded: a cancelled job,
        or an emergency one past deadline - margin, never writes a manifest)."""
        t0 = time.perf_counter()
        guard = job if until is None else _Deadline(self, job, until)
        uploaded = False
        try:
            marker = self.store.upload_part(tag, self.rank, self.world_size, local_dir, attempt=self.attempt)
            self._last_bytes = int(marker.get("bytes") or 0)
            guard.check()
            if self.rank == 0:
                timeout = None if until is None else max(0.0, until - time.time())
                manifest = self.store.commit(tag, step, self.world_size, attempt=self.attempt, timeout_s=timeout,
                                             meta={**self.meta, "attempt": self.attempt,
                                                   "zero_elastic": self._zero_elastic},
                                             guard=guard)
                with self._lock:
                    self.committed.append({"tag": tag, "step": step, "save_kind": kind,
                                           "bytes": manifest.get("bytes"),
                                           "upload_s": time.perf_counter() - t0, "t": time.time()})
            self._upload_s = time.perf_counter() - t0
            uploaded = True
            return marker
        except Cancelled:
            raise
        except WriterFenced as exc:
            self._refused(exc)
            self._note_skipped(job, tag, step, f"refused: {exc}")
            raise
        except BaseException as exc:
            if not job.cancelled:
                self._failed_step = step
                self._note_skipped(job, tag, step, f"upload failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            if uploaded and not job.cancelled:
                self._keep(local_dir)
            else:
                shutil.rmtree(local_dir, ignore_errors=True)

    def _keep(self, local_dir: str) -> None:
        """Keep `local_dir` (just uploaded, and committed where this rank can tell) as this rank's newest
        local snapshot; the one kept before goes. Bounded: one kept snapshot per rank."""
        with self._lock:
            old, self._kept = self._kept, local_dir
        if old and old != local_dir:
            shutil.rmtree(old, ignore_errors=True)

    # -- bookkeeping ----------------------------------------------------------------------------------
    def _refused(self, exc: WriterFenced) -> None:
        """The one place a refused write of this writer is recorded (pop_fenced -> checkpoint_events ->
        `checkpoint_fenced` events -> report.json checkpoints.fenced); this attempt is stale from now on."""
        with self._lock:
            self.fenced.append({**exc.record(), "t": time.time()})
            self.stale = True

    def _cancel(self, job: UploadJob, reason: str) -> bool:
        """Cancel `job` (never commits), delete its snapshot, report it skipped. False if it could not
        be cancelled (already committing or finished)."""
        if not self.uploader.cancel(job, reason):
            return False
        local_dir = job.args[3] if len(job.args) > 3 else None
        if local_dir:
            shutil.rmtree(local_dir, ignore_errors=True)   # a running upload of it then fails fast
        self._note_skipped(job, job.key, job.step, job.reason)
        return True

    def _note_skipped(self, job: UploadJob, tag: str, step: int | None, reason: str) -> None:
        with self._lock:
            if getattr(job, "skip_reported", False):
                return
            job.skip_reported = True
            self.skipped.append({"tag": tag, "step": step, "reason": reason, "t": time.time()})
        log.warning("checkpoint %s skipped: %s", tag, reason)

    def _reduce(self, engine, values: list[float]) -> list[float]:
        """Element-wise MAX over all ranks (identity at world size 1)."""
        if self.world_size == 1:
            return list(values)
        if self._all_max is not None:
            return list(self._all_max(list(values)))
        import torch
        import torch.distributed as dist
        buf = torch.tensor(values, dtype=torch.float64, device=engine.device)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        return buf.tolist()

    @staticmethod
    def _result(tag, step, kind, path, reason, committed, snapshot_s, blocked_s, wait_s, **extra) -> dict:
        return {"tag": tag, "step": step, "kind": kind, "path": path, "reason": reason,
                "committed": committed, "snapshot_s": snapshot_s, "blocked_s": blocked_s, "wait_s": wait_s,
                "stall_s": snapshot_s + blocked_s + wait_s, **extra}
