"""The storage-level checkpoint commit protocol (directories of files; knows nothing about DeepSpeed).

Layout under a Storage (usually a run's prefix), with `prefix="checkpoints"`::

    checkpoints/<tag>/rank-<r>/<files...>      each rank's files, uploaded in parallel
    checkpoints/<tag>/rank-<r>.done.json       {rank, world_size, tag, bytes, files}, written after its files
    checkpoints/<tag>/manifest.json            {tag, step, world_size, created, bytes, files, meta}: COMMITTED
    checkpoints/latest                         {"tag", "step", "committed", "generation", "writer"}, moved
                                               only after a manifest
    checkpoints/writers/gen-<N>.json           the writer generations (storage/fence.py)
    checkpoints/<tag>/holds/<reader>           {"until", "holder"}: a reader downloading <tag> (hold())

`files` maps the path relative to the tag directory ("rank-0/model.pt") to {size, sha256}. The manifest is
written only after every rank's marker exists, and `latest` only after the manifest, so a reader that trusts
manifests never sees a partial checkpoint. `restore()` still verifies sizes and sha256 and falls back to the
previous committed tag of the live lineage (storage/lineage.py) when the newest is damaged, and
quarantines the damaged one: `<tag>/quarantined.json` ({tag, reason, t}) marks it, it is never restored
again, and retention keeps the newest few for inspection. Each manifest records its `parent` (the tag this
training state descends from), so retention and `latest` follow the lineage, not the step number.

A training attempt's store takes a writer generation (take_generation) before it restores: its commits,
`latest` moves, quarantines and deletions are refused (WriterFenced) once a newer writer took the store,
and the newest writer's commit always moves `latest` (its lineage is the live one). Stores that take no
generation (readers, tools) write unfenced. A download verifies against the manifest and re-checks a
mismatch in storage before calling the checkpoint damaged (storage/verified_fetch.py).

Tags sort by step, then attempt: `tag_for(120)` is "step-00000120", `tag_for(120, 3)` "step-00000120-a3"
(unique per attempt: a step re-saved after a rollback never writes into a committed tag).

Readers of a store training writes (Serve, batch, export: restore(resume=False)) hold the tag they download
(`<tag>/holds/<reader>`, released when the download ends, expiring after CHECKPOINT_READ_HOLD_S): retention
keeps a held tag past keep_last, so a reader slower than training's checkpoint cadence still gets a
checkpoint. A tag that retention deleted while it was read anyway (before the hold landed) is "rotated
away", not damaged: the reader lists again and takes the newest, and quarantines nothing.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

from spotfill.config import constants
from spotfill.config.errors import CheckpointCorrupt, ConfigError
from spotfill.storage.base import Storage, join_key, local_files, sha256_file  # noqa: F401 (re-exported)
from spotfill.storage.fence import WRITERS, Generation, WriterFence
from spotfill.storage.lineage import Lineage, build_lineage
from spotfill.storage.verified_fetch import fetch_verified, hash_files

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
QUARANTINE = "quarantined.json"
HOLDS = "holds"
UNIVERSAL = "universal"                 # <tag>/universal/...: the converted (universal) copy
UNIVERSAL_INDEX = "universal.json"      # <tag>/universal.json: its files {rel: {size, sha256}}, written last
LATEST = "latest"
_MARKER_RE = re.compile(r"^rank-(\d+)\.done\.json$")
_TAG_RE = re.compile(r"^step-(\d+)(?:-a([A-Za-z0-9_.]+))?$")


def tag_for(step: int, attempt: str | int | None = None) -> str:
    """The tag of the checkpoint taken at `step` (by `attempt`, when given): zero-padded so tags sort like
    steps; "step-00000120" or "step-00000120-a3". Characters outside [A-Za-z0-9_.] in `attempt` become _."""
    tag = f"step-{int(step):08d}"
    if attempt is None:
        return tag
    return f"{tag}-a{re.sub(r'[^A-Za-z0-9_.]', '_', str(attempt)) or '_'}"


def parse_tag(tag: str) -> tuple[int, str | None] | None:
    """(step, attempt or None) of a tag made by tag_for; None for other names."""
    m = _TAG_RE.match(tag)
    return (int(m.group(1)), m.group(2)) if m else None


def next_attempt(tags: Iterable[str]) -> int:
    """The first attempt number a new run over a store holding `tags` may use: one past the largest
    numeric attempt in them (0 for a store without attempt-numbered tags). A second fit() over the same
    store then never writes into a tag an earlier run committed."""
    attempts = [int(p[1]) for p in map(parse_tag, tags) if p and p[1] and p[1].isdigit()]
    return max(attempts) + 1 if attempts else 0


def tag_key(tag: str) -> tuple[int, str]:
    """Sort key for tags: the step, then the text (so one step's attempts sort together)."""
    parsed = parse_tag(tag)
    if parsed:
        return (parsed[0], tag)
    m = re.search(r"(\d+)$", tag)
    return (int(m.group(1)) if m else -1, tag)


class CheckpointStore:
    """Upload rank parts, commit a manifest when all ranks are in, move `latest`, restore verified."""

    def __init__(self, storage: Storage, prefix: str = "checkpoints", keep_last: int | None = None):
        keep_last = constants.CHECKPOINT_KEEP_LAST if keep_last is None else keep_last
        if not isinstance(keep_last, int) or keep_last < 0:
            raise ConfigError("keep_last", keep_last, accepted="an integer >= 0 (0 keeps all)")
        self.storage, self.prefix, self.keep_last = storage, prefix.strip("/"), keep_last
        # The tag this process's training state descends from: set by a restore (None: fresh start) and
        # by each commit; written into the next manifest as its `parent`. Unknown until then.
        self._head: str | None = None
        self._head_known = False
        # The writer generation this process holds (take_generation); None: an unfenced reader or tool.
        self.fence: WriterFence | None = None

    def __repr__(self) -> str:
        return f"CheckpointStore({self.storage.uri!r}, prefix={self.prefix!r}, keep_last={self.keep_last})"

    def _k(self, *parts: str) -> str:
        return join_key(self.prefix, *parts)

    # -- the writer fence (storage/fence.py) --------------------------------------------------------
    def take_generation(self, **info) -> WriterFence:
        """Become the store's newest writer (a training attempt's rank 0 does this before its restore):
        from now on this store's commits, `latest` moves, quarantines and deletions are refused
        (WriterFenced) once a newer writer takes a generation. `info` (attempt=...) names the holder."""
        self.fence = WriterFence.take(self.storage, self.prefix, **info)
        return self.fence

    def adopt_generation(self, generation: Generation, **info) -> WriterFence:
        """Write as the holder of an earlier `generation` (a zombie writer, in a rehearsal)."""
        self.fence = WriterFence.adopt(self.storage, self.prefix, generation, **info)
        return self.fence

    def _guard(self, op: str, tag: str | None) -> None:
        if self.fence is not None:
            self.fence.check(op, tag)

    # -- writing ------------------------------------------------------------------------------------
    def upload_part(self, tag: str, rank: int, world_size: int, local_dir: str,
                    attempt: str | None = None) -> dict[str, Any]:
        """Upload one rank's files (parallel; hashed meanwhile), then write its done marker last.

        `attempt` (any string all ranks of this training attempt share, e.g. a restart counter) is stored
        in the marker; commit(attempt=...) ignores markers of other attempts, i.e. stale ones left at the
        same tag by ranks of a run that died before committing it. Refuses (CheckpointCorrupt) to write
        into a tag that is committed or quarantined: its manifest would then describe other bytes.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        for name in (MANIFEST, QUARANTINE):
            if self.storage.exists(self._k(tag, name)):
                raise CheckpointCorrupt(f"{tag}: refusing to write rank {rank} into a committed checkpoint "
                                        f"({name} exists); save under a new tag (tag_for(step, attempt))")
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

    def _wait_markers(self, tag: str, world_size: int, timeout_s: float, attempt: str | None,
                      guard=None) -> dict:
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
                return markers
            if time.monotonic() - t0 > timeout_s:
                raise CheckpointCorrupt(f"{tag}: ranks {sorted(missing)} of {world_size} did not finish "
                                        f"uploading within {timeout_s:.0f}s")
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)

    def commit(self, tag: str, step: int, world_size: int, meta: dict | None = None,
               timeout_s: float | None = None, attempt: str | None = None, guard=None) -> dict[str, Any]:
        """Wait for all ranks' markers, write the manifest (with its `parent`), move `latest`, then
        retention + orphans.

        `guard` (optional; e.g. an uploader.UploadJob): `guard.check()` runs each time the markers are
        polled and `guard.claim()` right before the manifest is written; either raises to stop the commit
        (a cancelled checkpoint never gets a manifest).

        Raises CheckpointCorrupt when some rank's marker does not appear within `timeout_s` (markers of
        another `attempt` do not count) or disagrees on world_size, or a listed file is missing.
        """
        timeout_s = constants.CHECKPOINT_COMMIT_TIMEOUT_S if timeout_s is None else timeout_s
        t0 = time.monotonic()
        markers = self._wait_markers(tag, world_size, timeout_s, attempt, guard)
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
        parent_known, parent = self._head_known, self._head
        if parent_known:
            manifest["parent"] = parent
        if guard is not None:
            guard.claim()
        self._guard("commit", tag)
        self.storage.put_bytes(self._k(tag, MANIFEST), json.dumps(manifest, indent=1).encode())
        self._head, self._head_known = tag, True
        lineage, current = self.lineage(head=tag), self.latest_tag()
        if self.fence is not None:   # the newest writer's lineage is the live one: it moves `latest`
            self._point_latest(tag, int(step), manifest["created"])
        elif self._moves_latest(current, parent_known, parent, lineage, tag):
            self._point_latest(tag, int(step), manifest["created"])
        else:   # another attempt resumed meanwhile: its lineage is the live one
            log.warning("checkpoint %s committed but `latest` stays at %s: training resumed from it after "
                        "this attempt's last commit or restore", tag, current)
            lineage = self.lineage()
        log.info("checkpoint %s committed: step %d, %d ranks, %d files, %.1f MB (waited %.2fs)", tag, step,
                 world_size, len(files), manifest["bytes"] / 1e6, time.monotonic() - t0)
        self.cleanup(lineage)
        return manifest

    @staticmethod
    def _moves_latest(current: str | None, parent_known: bool, parent: str | None, lineage: Lineage,
                      tag: str) -> bool:
        """A commit moves `latest` when `latest` is what it descends from (the parent this process
        recorded, or an ancestor when unknown), or points at nothing intact."""
        if current is None or (parent_known and current == parent):
            return True
        if current in lineage.damaged or all(c.tag != current for c in lineage.checkpoints):
            return True
        return not parent_known and lineage.descends_from(tag, current)

    def _point_latest(self, tag: str | None, step: int, created: float | None = None) -> None:
        if self.fence is not None:     # compare-and-swap, refused once a newer writer exists
            self.fence.write_pointer(LATEST, lambda _: {"tag": tag, "step": int(step), "committed": created},
                                     "move latest", tag)
            return
        if tag is None:
            self.storage.delete(self._k(LATEST))
            return
        self.storage.put_bytes(self._k(LATEST), json.dumps(
            {"tag": tag, "step": int(step), "committed": created}).encode())

    def mark_resumed(self, tag: str | None, step: int = 0) -> None:
        """Training resumes from `tag` (None: starts fresh): the next commit descends from it, and
        `latest` points at it (the live lineage's newest commit) until then."""
        self._head, self._head_known = tag, True
        if self.latest_tag() != tag:
            self._point_latest(tag, step)

    def quarantine(self, tag: str, reason: str) -> None:
        """Mark a damaged committed tag: never restored again, listed by quarantined()."""
        self._guard("quarantine", tag)
        self.storage.put_bytes(self._k(tag, QUARANTINE), json.dumps(
            {"tag": tag, "reason": reason, "t": time.time()}).encode())
        log.warning("checkpoint %s quarantined: %s", tag, reason)

    # -- a reader's hold against retention ---------------------------------------------------------
    def hold(self, tag: str, ttl_s: float | None = None) -> str | None:
        """Hold `tag` for a reader: retention (cleanup) keeps it until release() or `ttl_s` (default
        CHECKPOINT_READ_HOLD_S) passes. The hold's key, or None where this reader may not write the store
        (it then reads unheld, as before holds existed)."""
        ttl = constants.CHECKPOINT_READ_HOLD_S if ttl_s is None else ttl_s
        holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        key = self._k(tag, HOLDS, holder)
        try:
            self.storage.put_bytes(key, json.dumps({"until": time.time() + ttl, "holder": holder}).encode())
        except Exception as exc:  # noqa: BLE001 - read-only credentials: read without a hold
            log.info("checkpoint %s read without a hold (the store refused it: %s)", tag, exc)
            return None
        return key

    def release(self, key: str | None) -> None:
        if key is not None:
            try:
                self.storage.delete(key)
            except Exception as exc:  # noqa: BLE001 - an unreleased hold expires on its own
                log.info("checkpoint hold %s not released (%s); it expires on its own", key, exc)

    def held_until(self, tag: str, now: float | None = None) -> float | None:
        """The latest expiry of `tag`'s live holds, or None when no reader holds it."""
        now, until = time.time() if now is None else now, None
        for key in self.storage.list(self._k(tag, HOLDS) + "/"):
            try:
                t = float(json.loads(self.storage.get_bytes(key))["until"])
            except FileNotFoundError:
                continue                       # released meanwhile
            except (ValueError, KeyError, TypeError):
                continue                       # unreadable: holds nothing
            if t > now and (until is None or t > until):
                until = t
        return until

    def _rotated_away(self, tag: str) -> bool:
        """`tag` lost its manifest: retention deleted it (manifest first) -- gone, not damaged."""
        return not self.storage.exists(self._k(tag, MANIFEST))

    # -- reading ------------------------------------------------------------------------------------
    def _tags(self) -> tuple[list[str], set[str], set[str]]:
        """(all tag directories, tags with a manifest, quarantined tags) from one listing."""
        tags, committed, quarantined = set(), set(), set()
        for key in self.storage.list(self._k() + "/" if self.prefix else ""):
            rest = key[len(self.prefix) + 1:] if self.prefix else key
            if "/" not in rest:
                continue  # `latest` and other top-level files
            tag, name = rest.split("/", 1)
            if tag == WRITERS:
                continue  # the writer generations (storage/fence.py)
            tags.add(tag)
            if name == MANIFEST:
                committed.add(tag)
            elif name == QUARANTINE:
                quarantined.add(tag)
        return sorted(tags, key=tag_key, reverse=True), committed, quarantined

    def next_attempt(self) -> int:
        """next_attempt() over every tag in the store, committed, quarantined or not."""
        return next_attempt(self._tags()[0])

    def uploading(self) -> list[str]:
        """Uncommitted tags newer than `latest`: saves still uploading (or debris of a dead attempt)."""
        tags, done, bad = self._tags()
        head = self.latest_tag()
        return [t for t in tags if t not in done and t not in bad and (head is None or tag_key(t) > tag_key(head))]

    def committed(self) -> list[str]:
        """Committed, not quarantined tags, newest (by step) first."""
        tags, done, bad = self._tags()
        return [t for t in tags if t in done and t not in bad]

    def quarantined(self) -> dict[str, str]:
        """tag -> reason of every quarantined tag."""
        out = {}
        for tag in self._tags()[2]:
            try:
                out[tag] = json.loads(self.storage.get_bytes(self._k(tag, QUARANTINE)))["reason"]
            except (FileNotFoundError, ValueError, KeyError):
                out[tag] = "quarantined (marker unreadable)"
        return out

    def _manifests(self) -> tuple[dict[str, dict], dict[str, str], dict[str, str]]:
        """(readable manifests, unreadable ones tag -> reason, quarantined tag -> reason)."""
        tags, done, bad = self._tags()
        manifests, unreadable = {}, {}
        for tag in tags:
            if tag not in done:
                continue
            try:
                manifests[tag] = self.manifest(tag)
            except FileNotFoundError:
                continue  # deleted meanwhile
            except ValueError as exc:
                unreadable[tag] = f"{tag}: unreadable manifest ({exc})"
        quarantined = self.quarantined() if bad else {}
        return manifests, unreadable, quarantined

    def lineage(self, head: str | None = None, resumes=()) -> Lineage:
        """The lineage of this store's checkpoints; `head` defaults to the `latest` pointer."""
        manifests, unreadable, quarantined = self._manifests()
        damaged = {**{t: r for t, r in unreadable.items()}, **quarantined}
        return build_lineage(manifests, damaged, head if head is not None else self.latest_tag(), resumes)

    def latest(self) -> dict | None:
        """The `latest` pointer ({"tag", "step", "committed"}) or None."""
        try:
            raw = self.storage.get_bytes(self._k(LATEST)).decode().strip()
        except FileNotFoundError:
            return None
        try:
            pointer = json.loads(raw)
        except ValueError:
            return {"tag": raw, "step": tag_key(raw)[0]}  # a plain-text tag is fine too
        return pointer if pointer.get("tag") is not None else None   # claimed by a writer, no commit yet

    def latest_tag(self) -> str | None:
        """The tag `latest` points to, or None before the first commit."""
        pointer = self.latest()
        return pointer["tag"] if pointer else None

    def manifest(self, tag: str) -> dict:
        """The manifest of a committed tag (FileNotFoundError if it has none)."""
        return json.loads(self.storage.get_bytes(self._k(tag, MANIFEST)))

    def restore_candidates(self) -> list[str]:
        """Tags a restore tries, best first (the live lineage's intact ones, newest first). Quarantines
        committed tags whose manifest is unreadable on the way (listed in `self.last_quarantined`)."""
        manifests, unreadable, quarantined = self._manifests()
        self.last_quarantined: list[tuple[str, str]] = []
        for tag, reason in unreadable.items():
            if tag not in quarantined:
                log.warning("checkpoint %s skipped on restore: %s", tag, reason)
                self.quarantine(tag, reason)
                quarantined[tag] = reason
                self.last_quarantined.append((tag, reason))
        return list(build_lineage(manifests, quarantined, self.latest_tag()).restore_order)

    def restore(self, local_dir: str, tag: str | None = None, verify: bool = True,
                ranks: Iterable[int] | None = None, resume: bool = True) -> dict | None:
        """Download the newest intact checkpoint of the live lineage to `local_dir/<tag>/`; its manifest
        or None.

        Intact: every manifest file exists with its size and (verify=True) its sha256. A damaged one is
        quarantined and skipped with a WARNING naming tag and reason; with an explicit `tag` it raises
        CheckpointCorrupt instead. `ranks` limits the download to those ranks' files. The returned manifest
        carries `path` (the local tag directory) and `download_seconds`. The tags quarantined by this call
        are in `self.last_quarantined` [(tag, reason)]. Without an explicit tag the store then resumes
        from the restored tag (mark_resumed) -- training's restore; a reader of a store training writes
        (serving) passes resume=False, or a tag it listed before training's next commit would move
        `latest` back under the live run.
        """
        candidates = [tag] if tag else self.restore_candidates()
        self.last_quarantined = [] if tag else self.last_quarantined
        self.last_rotated: list[str] = []
        want = None if ranks is None else {f"rank-{r}/" for r in ranks}
        relists = 0
        while True:
            rotated = False
            for cand in candidates:
                held = None if resume else self.hold(cand)     # a reader: keep retention off this tag
                try:
                    manifest = self.check_listing(cand, want)
                    out = self.download(manifest, local_dir, verify, want)
                except (CheckpointCorrupt, FileNotFoundError) as exc:
                    if self._rotated_away(cand):
                        self.last_rotated.append(cand)
                        if tag:
                            raise CheckpointCorrupt(f"{cand}: deleted by retention while it was read") from None
                        log.info("checkpoint %s deleted by retention while it was read; listing again", cand)
                        rotated = True
                        break
                    if tag or isinstance(exc, FileNotFoundError):
                        raise
                    log.warning("checkpoint %s skipped on restore: %s; falling back to an older one", cand, exc)
                    self.quarantine(cand, str(exc))
                    self.last_quarantined.append((cand, str(exc)))
                    continue
                finally:
                    self.release(held)
                if not tag and resume:
                    self.mark_resumed(cand, int(out["step"]))
                return out
            if not rotated or relists >= 3:
                break
            relists += 1                       # newer tags were committed meanwhile: the newest of those
            found = self.last_quarantined
            candidates = self.restore_candidates()
            self.last_quarantined = found + self.last_quarantined      # the listing starts its own list
        if candidates:
            log.warning("no intact checkpoint among %d committed in %s", len(candidates), self.storage.uri)
        return None

    def check_listing(self, tag: str, want: set[str] | None = None) -> dict:
        """The manifest of `tag` when it is readable, not quarantined and every file it lists (those of
        `want` rank prefixes) is stored with its size; CheckpointCorrupt otherwise. No download."""
        if self.storage.exists(self._k(tag, QUARANTINE)):
            raise CheckpointCorrupt(f"{tag}: quarantined")
        try:
            manifest = self.manifest(tag)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{tag}: no manifest (not committed)") from None
        except ValueError as exc:
            raise CheckpointCorrupt(f"{tag}: unreadable manifest ({exc})") from None
        listed = self.storage.list(self._k(tag) + "/")
        for rel, info in sorted(_wanted(manifest["files"], want).items()):
            size = listed.get(self._k(tag, rel))
            if size is None:
                raise CheckpointCorrupt(f"{tag}: partial, {rel} is missing")
            if size != info["size"]:
                raise CheckpointCorrupt(f"{tag}: {rel} has {size} bytes, manifest says {info['size']}")
        return manifest

    def download(self, manifest: dict, local_dir: str, verify: bool = True,
                 want: set[str] | None = None, local_copies: dict[str, str] | None = None) -> dict:
        """Bring the files of a checked manifest (those under the `want` prefixes, or all) to
        `local_dir/<tag>/`, verifying sizes and (verify) sha256 (storage/verified_fetch.py: `local_copies`,
        rel -> path, are used where they match; a mismatch is checked again in storage before it is called
        damaged). CheckpointCorrupt when storage's bytes are wrong, LocalCopyCorrupt when only this node's
        copy is. Returns the manifest with `path`, `download_seconds` and `io` (bytes by source)."""
        t0, tag = time.monotonic(), manifest["tag"]
        files = _wanted(manifest["files"], want)
        final = os.path.join(local_dir, tag)
        io = fetch_verified(self.storage, self._k(tag), files, final, verify, local_copies, tag)
        with open(os.path.join(final, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        manifest = dict(manifest, path=final, download_seconds=time.monotonic() - t0, io=io.as_dict())
        log.info("checkpoint %s restored to %s: %d files, %.1f MB in %.2fs (%.1f MB from local copies)%s", tag,
                 final, len(files), sum(i["size"] for i in files.values()) / 1e6, manifest["download_seconds"],
                 io.bytes_local / 1e6, " (sha256 verified)" if verify else "")
        return manifest

    # -- the universal (converted) copy -------------------------------------------------------------
    def has_universal(self, tag: str) -> bool:
        return self.storage.exists(self._k(tag, UNIVERSAL_INDEX))

    def put_universal(self, tag: str, local_dir: str) -> int:
        """Upload a universal-checkpoint folder converted from `tag` next to it (index written last, so
        a reader never sees a partial copy); returns bytes. The first converter shares it with the rest."""
        sizes = local_files(local_dir)
        digests = hash_files(local_dir, list(sizes))
        stats = self.storage.upload_dir(local_dir, self._k(tag, UNIVERSAL))
        index = {rel: {"size": size, "sha256": digests[rel]} for rel, size in sizes.items()}
        self.storage.put_bytes(self._k(tag, UNIVERSAL_INDEX), json.dumps({"tag": tag, "files": index}).encode())
        return stats.bytes

    def get_universal(self, tag: str, local_dir: str) -> dict:
        """Download `tag`'s universal copy into `local_dir` (verified); CheckpointCorrupt when absent or
        damaged (a damaged copy is deleted: the caller converts again)."""
        try:
            index = json.loads(self.storage.get_bytes(self._k(tag, UNIVERSAL_INDEX)))["files"]
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{tag}: no universal copy") from None
        except (ValueError, KeyError) as exc:
            raise CheckpointCorrupt(f"{tag}: unreadable universal index ({exc})") from None
        try:
            fetch_verified(self.storage, self._k(tag, UNIVERSAL), index, local_dir, True, tag=tag)
        except CheckpointCorrupt:
            self.storage.delete(self._k(tag, UNIVERSAL_INDEX))
            raise
        return index

    # -- retention ----------------------------------------------------------------------------------
    def discard_uncommitted(self) -> list[str]:
        """Delete every tag without a manifest (quarantined ones stay). Call it when (re)starting training,
        before any rank uploads: at that moment every uncommitted tag is debris of a dead attempt."""
        tags, done, bad = self._tags()
        doomed = [t for t in tags if t not in done and t not in bad]
        for tag in doomed:
            self._guard("delete", tag)
            self.storage.delete_prefix(self._k(tag))
        if doomed:
            log.info("checkpoint: discarded uncommitted tags %s", doomed)
        return doomed

    def cleanup(self, lineage: Lineage | None = None) -> list[str]:
        """Retention by lineage: delete committed tags beyond the newest keep_last of the live lineage
        (never its newest intact one), dead branches and old quarantined tags (the newest keep_last of
        those stay for inspection), and uncommitted tags older than the head."""
        lineage = lineage or self.lineage()
        tags, done, bad = self._tags()
        if lineage.head is None:
            return []
        doomed = [t for t in lineage.deletable(self.keep_last) if t in done or t in bad]
        held = {t: until for t in doomed if (until := self.held_until(t)) is not None}
        if held:                               # a reader downloads it: deleted by a later cleanup
            log.info("checkpoint retention keeps %s: held by a reader until %s", sorted(held),
                     {t: time.strftime("%H:%M:%S", time.localtime(u)) for t, u in held.items()})
            doomed = [t for t in doomed if t not in held]
        newest = tag_key(lineage.head)
        orphans = [t for t in tags if t not in done and t not in bad and tag_key(t) < newest]
        for tag in doomed:  # manifest first: a half-deleted tag must not look committed
            self._guard("delete", tag)
            self.storage.delete(self._k(tag, MANIFEST))
            self.storage.delete_prefix(self._k(tag))
        for tag in orphans:
            self._guard("delete", tag)
            self.storage.delete_prefix(self._k(tag))
        if doomed or orphans:
            log.info("checkpoint retention (keep_last=%d, live lineage %s): deleted %s; orphans deleted %s",
                     self.keep_last, list(lineage.live[:4]), doomed or "none", orphans or "none")
        return doomed + orphans


def _wanted(files: dict[str, dict], want: set[str] | None) -> dict[str, dict]:
    return {rel: info for rel, info in files.items() if want is None or any(rel.startswith(w) for w in want)}
