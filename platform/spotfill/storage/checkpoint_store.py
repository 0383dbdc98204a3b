"""The storage-level checkpoint commit protocol (directories of files; knows nothing about DeepSpeed).

Layout under a Storage (usually a run's prefix), with `prefix="checkpoints"`::

    checkpoints/<tag>/rank-<r>/<files...>      each rank's files, uploaded in parallel
    checkpoints/<tag>/rank-<r>.done.json       {rank, world_size, tag, bytes, files}, written after its files
    checkpoints/<tag>/manifest.json            {tag, step, world_size, created, bytes, files, meta}: COMMITTED
    checkpoints/latest                         {"tag", "step", "committed"}, moved only after a manifest

`files` maps the path relative to the tag directory ("rank-0/model.pt") to {size, sha256}. The manifest is
written only after every rank's marker exists, and `latest` only after the manifest, so a reader that trusts
manifests never sees a partial checkpoint. `restore()` still verifies sizes and sha256 and falls back to the
previous committed tag (with a WARNING) when the newest is damaged. Tags sort by step: `tag_for(120)` is
"step-00000120".
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

from spotfill.config import constants
from spotfill.config.errors import CheckpointCorrupt, ConfigError
from spotfill.storage.base import Storage, join_key, local_files, sha256_file

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
LATEST = "latest"
_MARKER_RE = re.compile(r"^rank-(\d+)\.done\.json$")


def tag_for(step: int) -> str:
    """The tag of the checkpoint taken at `step`: zero-padded so tags sort like steps."""
    return f"step-{int(step):08d}"


def tag_key(tag: str) -> tuple[int, str]:
    """Sort key for tags: the trailing number (the step), then the text."""
    m = re.search(r"(\d+)$", tag)
    return (int(m.group(1)) if m else -1, tag)


def hash_files(root: str, rels: Iterable[str], threads: int = 4) -> dict[str, str]:
    """relpath -> sha256 for files under `root`, hashed in parallel."""
    rels = list(rels)
    with ThreadPoolExecutor(max(1, min(threads, len(rels) or 1))) as pool:
        return dict(zip(rels, pool.map(lambda r: sha256_file(os.path.join(root, *r.split("/"))), rels)))


class CheckpointStore:
    """Upload rank parts, commit a manifest when all ranks are in, move `latest`, restore verified."""

    def __init__(self, storage: Storage, prefix: str = "checkpoints", keep_last: int | None = None):
        keep_last = constants.CHECKPOINT_KEEP_LAST if keep_last is None else keep_last
        if not isinstance(keep_last, int) or keep_last < 0:
            raise ConfigError("keep_last", keep_last, accepted="an integer >= 0 (0 keeps all)")
        self.storage, self.prefix, self.keep_last = storage, prefix.strip("/"), keep_last

    def __repr__(self) -> str:
        return f"CheckpointStore({self.storage.uri!r}, prefix={self.prefix!r}, keep_last={self.keep_last})"

    def _k(self, *parts: str) -> str:
        return join_key(self.prefix, *parts)

    # -- writing ------------------------------------------------------------------------------------
    def upload_part(self, tag: str, rank: int, world_size: int, local_dir: str,
                    attempt: str | None = None) -> dict[str, Any]:
        """Upload one rank's files (parallel; hashed meanwhile), then write its done marker last.

        `attempt` (any string all ranks of this training attempt share, e.g. a restart counter) is stored
        in the marker; commit(attempt=...) ignores markers of other attempts, i.e. stale ones left at the
        same tag by ranks of a run that died before committing it.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        t0 = time.monotonic()
        self.storage.delete(self._k(tag, f"rank-{rank}.done.json"))  # a stale one must not count
        sizes = local_files(local_dir)
        with ThreadPoolExecutor(1) as pool:  # hash while the upload runs
            hashing = pool.submit(hash_files, local_dir, list(sizes))
            stats = self.storage.upload_dir(local_dir, self._k(tag, f"rank-{rank}"))
            digests = hashing.result()
        if stats.files != sizes:
            raise CheckpointCorrupt(f"{tag} rank {rank}: {local_dir} changed during upload")
        marker = {"tag": tag, "rank": rank, "world_size": world_size, "bytes": stats.bytes,
                  "created": time.time(), "attempt": attempt,
                  "files": {f"rank-{rank}/{rel}": {"size": size, "sha256": digests[rel]}
                            for rel, size in sizes.items()}}
        self.storage.put_bytes(self._k(tag, f"rank-{rank}.done.json"), json.dumps(marker).encode())
        log.info("checkpoint %s: rank %d/%d uploaded %d files, %.1f MB in %.2fs", tag, rank, world_size,
                 len(sizes), stats.bytes / 1e6, time.monotonic() - t0)
        return marker

    def commit(self, tag: str, step: int, world_size: int, meta: dict | None = None,
               timeout_s: float | None = None, attempt: str | None = None, guard=None) -> dict[str, Any]:
        """Wait for all ranks' markers, write the manifest, move `latest`, then retention + orphans.

        `guard` (optional; e.g. an uploader.UploadJob): `guard.check()` runs each time the markers are
        polled and `guard.claim()` right before the manifest is written; either raises to stop the commit
        (a cancelled checkpoint never gets a manifest).

        Raises CheckpointCorrupt when some rank's marker does not appear within `timeout_s` (markers of
        another `attempt` do not count) or disagrees on world_size, or a listed file is missing.
        """
        timeout_s = constants.CHECKPOINT_COMMIT_TIMEOUT_S if timeout_s is None else timeout_s
        t0, delay = time.monotonic(), 0.05
        missing, markers = set(range(world_size)), {}
        while True:
            if guard is not None:
                guard.check()
            for r in sorted(missing):
                try:
                    marker = json.loads(self.storage.get_bytes(self._k(tag, f"rank-{r}.done.json")))
                except (FileNotFoundError, ValueError):
                    continue
                if attempt is None or marker.get("attempt") == attempt:
                    markers[r] = marker
            missing -= set(markers)
            if not missing:
                break
            if time.monotonic() - t0 > timeout_s:
                raise CheckpointCorrupt(f"{tag}: ranks {sorted(missing)} of {world_size} did not finish "
                                        f"uploading within {timeout_s:.0f}s")
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)
        files: dict[str, dict] = {}
        for rank, marker in sorted(markers.items()):
            if marker.get("world_size") != world_size:
                raise CheckpointCorrupt(f"{tag}: rank {rank} uploaded for world_size "
                                        f"{marker.get('world_size')}, committing {world_size}")
            files.update(marker["files"])
        listed = self.storage.list(self._k(tag) + "/")
        for rel, info in files.items():
            if listed.get(self._k(tag, rel)) != info["size"]:
                raise CheckpointCorrupt(f"{tag}: {rel} missing or wrong size in storage")
        manifest = {"tag": tag, "step": int(step), "world_size": world_size, "created": time.time(),
                    "bytes": sum(f["size"] for f in files.values()), "files": files, "meta": meta or {}}
        if guard is not None:
            guard.claim()
        self.storage.put_bytes(self._k(tag, MANIFEST), json.dumps(manifest, indent=1).encode())
        current = self.latest()
        if current is None or tag_key(current["tag"]) <= tag_key(tag):
            self.storage.put_bytes(self._k(LATEST), json.dumps(
                {"tag": tag, "step": int(step), "committed": manifest["created"]}).encode())
        else:
            log.warning("checkpoint %s committed but `latest` stays at newer %s", tag, current["tag"])
        log.info("checkpoint %s committed: step %d, %d ranks, %d files, %.1f MB (waited %.2fs)", tag, step,
                 world_size, len(files), manifest["bytes"] / 1e6, time.monotonic() - t0)
        self.cleanup()
        return manifest

    # -- reading ------------------------------------------------------------------------------------
    def _tags(self) -> tuple[list[str], set[str]]:
        """(all tag directories, committed tags) from one listing."""
        tags, committed = set(), set()
        for key in self.storage.list(self._k() + "/" if self.prefix else ""):
            rest = key[len(self.prefix) + 1:] if self.prefix else key
            if "/" not in rest:
                continue  # `latest` and other top-level files
            tag, name = rest.split("/", 1)
            tags.add(tag)
            if name == MANIFEST:
                committed.add(tag)
        return sorted(tags, key=tag_key, reverse=True), committed

    def committed(self) -> list[str]:
        """Committed tags (those with a manifest), newest first."""
        tags, done = self._tags()
        return [t for t in tags if t in done]

    def latest(self) -> dict | None:
        """The `latest` pointer ({"tag", "step", "committed"}) or None."""
        try:
            raw = self.storage.get_bytes(self._k(LATEST)).decode().strip()
        except FileNotFoundError:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {"tag": raw, "step": tag_key(raw)[0]}  # a plain-text tag is fine too

    def latest_tag(self) -> str | None:
        """The tag `latest` points to, or None before the first commit."""
        pointer = self.latest()
        return pointer["tag"] if pointer else None

    def manifest(self, tag: str) -> dict:
        """The manifest of a committed tag (FileNotFoundError if it has none)."""
        return json.loads(self.storage.get_bytes(self._k(tag, MANIFEST)))

    def restore(self, local_dir: str, tag: str | None = None, verify: bool = True,
                ranks: Iterable[int] | None = None) -> dict | None:
        """Download the newest intact committed checkpoint to `local_dir/<tag>/`; its manifest or None.

        Intact: every manifest file exists with its size and (verify=True) its sha256. A damaged newest
        checkpoint is skipped with a WARNING naming tag and reason; with an explicit `tag` it raises
        CheckpointCorrupt instead. `ranks` limits the download to those ranks' files. The returned manifest
        carries `path` (the local tag directory) and `download_seconds`.
        """
        candidates = [tag] if tag else self.committed()
        want = None if ranks is None else {f"rank-{r}/" for r in ranks}
        for cand in candidates:
            try:
                return self._restore_one(cand, local_dir, verify, want)
            except CheckpointCorrupt as exc:
                if tag:
                    raise
                log.warning("checkpoint %s skipped on restore: %s; falling back to an older one", cand, exc)
        if candidates:
            log.warning("no intact checkpoint among %d committed in %s", len(candidates), self.storage.uri)
        return None

    def _restore_one(self, tag: str, local_dir: str, verify: bool, want: set[str] | None) -> dict:
        t0 = time.monotonic()
        try:
            manifest = self.manifest(tag)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{tag}: no manifest (not committed)") from None
        except ValueError as exc:
            raise CheckpointCorrupt(f"{tag}: unreadable manifest ({exc})") from None
        files = {rel: info for rel, info in manifest["files"].items()
                 if want is None or any(rel.startswith(w) for w in want)}
        listed = self.storage.list(self._k(tag) + "/")
        for rel, info in sorted(files.items()):
            size = listed.get(self._k(tag, rel))
            if size is None:
                raise CheckpointCorrupt(f"{tag}: partial, {rel} is missing")
            if size != info["size"]:
                raise CheckpointCorrupt(f"{tag}: {rel} has {size} bytes, manifest says {info['size']}")
        stage = os.path.join(local_dir, f".partial-{tag}-{uuid.uuid4().hex[:8]}")
        os.makedirs(stage)
        try:
            prefixes = sorted({rel.split("/", 1)[0] for rel in files})
            for top in prefixes:  # rank-<r> directories
                self.storage.download_dir(self._k(tag, top), os.path.join(stage, top))
            got = local_files(stage)
            for rel, info in files.items():
                if got.get(rel) != info["size"]:
                    raise CheckpointCorrupt(f"{tag}: {rel} downloaded with {got.get(rel)} bytes, "
                                            f"manifest says {info['size']}")
            if verify:
                digests = hash_files(stage, files)
                for rel, info in sorted(files.items()):
                    if digests[rel] != info["sha256"]:
                        raise CheckpointCorrupt(f"{tag}: checksum mismatch in {rel}")
            with open(os.path.join(stage, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
            final = os.path.join(local_dir, tag)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(stage, final)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        manifest.update(path=final, download_seconds=time.monotonic() - t0)
        log.info("checkpoint %s restored to %s: %d files, %.1f MB in %.2fs%s", tag, final, len(files),
                 sum(i["size"] for i in files.values()) / 1e6, manifest["download_seconds"],
                 " (sha256 verified)" if verify else "")
        return manifest

    # -- retention ----------------------------------------------------------------------------------
    def discard_uncommitted(self) -> list[str]:
        """Delete every tag without a manifest. Call it when (re)starting training, before any rank
        uploads: at that moment every uncommitted tag is debris of a dead attempt."""
        tags, done = self._tags()
        doomed = [t for t in tags if t not in done]
        for tag in doomed:
            self.storage.delete_prefix(self._k(tag))
        if doomed:
            log.info("checkpoint: discarded uncommitted tags %s", doomed)
        return doomed

    def cleanup(self) -> list[str]:
        """Delete committed tags beyond keep_last, and uncommitted tags older than the newest commit."""
        tags, done = self._tags()
        committed = [t for t in tags if t in done]
        if not committed:
            return []
        newest = tag_key(committed[0])
        doomed = committed[self.keep_last:] if self.keep_last else []
        orphans = [t for t in tags if t not in done and tag_key(t) < newest]
        for tag in doomed:  # manifest first: a half-deleted tag must not look committed
            self.storage.delete(self._k(tag, MANIFEST))
            self.storage.delete_prefix(self._k(tag))
        for tag in orphans:
            self.storage.delete_prefix(self._k(tag))
        if doomed or orphans:
            log.info("checkpoint retention (keep_last=%d): deleted %s; orphans deleted %s", self.keep_last,
                     doomed or "none", orphans or "none")
        return doomed + orphans
