"""DeepSpeed checkpoints through object storage, resharded to any world size.

Save: every rank writes a local snapshot (`engine.save_checkpoint` into a node-local folder; the only part
of a save the step loop waits for), then a background thread uploads that rank's files and rank 0 commits
the manifest once every rank's part is stored (checkpoint_store.py). At most one upload is in flight.

Restore: rank 0 picks the newest intact committed checkpoint (falling back past a partial or corrupt one)
and broadcasts its tag; one rank per node downloads it and flattens the rank folders into a DeepSpeed
checkpoint folder. When the world size changed (and ZeRO partitions the optimizer), that rank converts it
once with DeepSpeed's universal-checkpoint converter, and every rank loads it with `load_universal`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time

from spotfill.config import constants
from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
from spotfill.storage.uploader import AsyncUploader

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


class Checkpointer:
    """Local snapshot + async upload + commit, for one rank of one training attempt."""

    def __init__(self, store: CheckpointStore, local_root: str, rank: int, world_size: int, attempt: str):
        self.store, self.rank, self.world_size, self.attempt = store, rank, world_size, attempt
        self.disk_root = os.path.join(local_root, f"snap-rank-{rank}")
        # tmpfs twin of disk_root, named after it so the next attempt clears what a dead one left in RAM
        self._name = "spotfill-" + os.path.relpath(os.path.abspath(local_root), "/").replace(os.sep, "-")
        self.shm_root = os.path.join(SHM, self._name, f"snap-rank-{rank}")
        self.snap_root = self.disk_root
        self._last_bytes = 0
        for root in (self.disk_root, self.shm_root):
            shutil.rmtree(root, ignore_errors=True)
        self.uploader = AsyncUploader(name=f"ckpt-upload-r{rank}")
        self.committed: list[dict] = []

    def save(self, engine, step: int, client_state: dict, *, kind: str,
             deadline_unix_s: float | None = None) -> dict:
        """Snapshot now; `periodic` uploads in the background, `final`/`grow`/`emergency` wait for the
        commit (emergency: with the time left before `deadline_unix_s` as the commit timeout)."""
        sync = kind != "periodic"
        commit_timeout_s = None if deadline_unix_s is None else max(0.0, deadline_unix_s - time.time())
        tag = tag_for(step)
        t0 = time.perf_counter()
        state = {**client_state, "step": step, "world_size": self.world_size,
                 "universal_checkpoint_info": {}}
        self.snap_root = self._choose_root(engine)
        with _no_zip_crc32():
            engine.save_checkpoint(self.snap_root, tag=tag, client_state=state, save_latest=False)
        snapshot_s = time.perf_counter() - t0
        blocked_s = self.uploader.submit(self._upload, tag, step, os.path.join(self.snap_root, tag),
                                         commit_timeout_s)
        wait_s = 0.0
        if sync:
            t1 = time.perf_counter()
            self.uploader.wait()
            wait_s = time.perf_counter() - t1
        return {"tag": tag, "step": step, "kind": kind, "path": self.snap_root, "reason": kind,
                "committed": sync, "snapshot_s": snapshot_s, "blocked_s": blocked_s,
                "wait_s": wait_s, "stall_s": snapshot_s + blocked_s + wait_s}

    def _choose_root(self, engine) -> str:
        """tmpfs when it has room for two snapshots of every local rank (the one uploading and the new
        one) plus 10% of it to spare; else the node-local disk folder. SPOTFILL_SNAPSHOT_DIR overrides."""
        if constants.SNAPSHOT_DIR != "auto":
            return os.path.join(constants.SNAPSHOT_DIR, self._name, f"snap-rank-{self.rank}")
        try:
            st = os.statvfs(SHM)
        except OSError:
            return self.disk_root
        per_rank = self._last_bytes or 16 * sum(p.numel() for p in engine.module.parameters())
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        need = 2 * per_rank * local + st.f_blocks * st.f_frsize // 10
        return self.shm_root if st.f_bavail * st.f_frsize > need else self.disk_root

    def _upload(self, tag: str, step: int, local_dir: str, commit_timeout_s: float | None) -> dict:
        t0 = time.perf_counter()
        marker = self.store.upload_part(tag, self.rank, self.world_size, local_dir, attempt=self.attempt)
        self._last_bytes = int(marker.get("bytes") or 0)
        if self.rank == 0:
            manifest = self.store.commit(tag, step, self.world_size, attempt=self.attempt,
                                         timeout_s=commit_timeout_s,
                                         meta={"attempt": self.attempt})
            self.committed.append({"tag": tag, "step": step, "bytes": manifest.get("bytes"),
                                   "upload_s": time.perf_counter() - t0, "t": time.time()})
        shutil.rmtree(local_dir, ignore_errors=True)
        return marker

    def pop_skipped(self) -> list[dict]:
        """Checkpoints dropped without a commit (none here: every save is uploaded in turn)."""
        return []

    def pop_committed(self) -> list[dict]:
        done, self.committed = self.committed, []
        return done

    def close(self, wait: bool = True) -> None:
        try:
            self.uploader.close(wait=wait)
        finally:
            if wait or not self.uploader.busy:
                shutil.rmtree(self.shm_root, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(self.shm_root))  # when no other local rank uses it
