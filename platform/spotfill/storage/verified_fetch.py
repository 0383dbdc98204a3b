"""Bring a checkpoint's files to this node, verified against its manifest, from the cheapest good source.

`fetch_verified(storage, base_key, files, final, ...)` fills the folder `final` with `files` ({rel: {size,
sha256}}, relative to `base_key` in storage) through a staging folder that replaces `final` only when every
file checked out:

- a local copy (`local_copies`: rel -> path, e.g. the snapshot this node uploaded itself) is used when its
  size and sha256 match the manifest -- always hashed, whatever `verify` says;
- the rest is downloaded in parallel and checked (sizes; sha256 when `verify`).

A downloaded file that does not match is checked again *in storage* (its sha256 read from storage, no local
copy) before anyone calls the checkpoint damaged: when storage holds the manifest's bytes the fault is this
node's (disk, memory, a torn write), the file is downloaded again (LOCAL_RETRIES times) and the checkpoint is
never quarantined for it -- LocalCopyCorrupt if the local copy keeps failing; only bytes that are wrong in
storage raise CheckpointCorrupt. The FetchReport says how many bytes came from where, and the local faults;
a fetch that raises (LocalCopyCorrupt, CheckpointCorrupt) carries it as the exception's `report`, its last
local fault `recovered: False` where this node's copy kept failing.
"""
from __future__ import annotations

import logging
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from spotfill.config.errors import CheckpointCorrupt, LocalCopyCorrupt
from spotfill.storage.base import Storage, join_key, local_files, sha256_file

log = logging.getLogger(__name__)
LOCAL_RETRIES = 2


@dataclass
class FetchReport:
    """Where the bytes of one fetch came from, and the local faults it got past (or not)."""
    bytes_storage: int = 0
    bytes_local: int = 0
    files_storage: int = 0
    files_local: int = 0
    local_errors: list[dict] = field(default_factory=list)   # {file, detail, recovered}

    def as_dict(self) -> dict:
        return {"bytes_storage": self.bytes_storage, "bytes_local": self.bytes_local,
                "files_storage": self.files_storage, "files_local": self.files_local,
                **({"local_errors": self.local_errors} if self.local_errors else {})}


def hash_files(root: str, rels, threads: int = 4) -> dict[str, str]:
    """relpath -> sha256 for files under `root`, hashed in parallel."""
    rels = list(rels)
    with ThreadPoolExecutor(max(1, min(threads, len(rels) or 1))) as pool:
        return dict(zip(rels, pool.map(lambda r: sha256_file(os.path.join(root, *r.split("/"))), rels)))


def fetch_verified(storage: Storage, base_key: str, files: dict[str, dict], final: str, verify: bool = True,
                   local_copies: dict[str, str] | None = None, tag: str = "") -> FetchReport:
    """Fill `final` with `files` (see the module docstring); CheckpointCorrupt when storage's bytes are
    wrong, LocalCopyCorrupt when only this node's copy keeps failing -- either with the FetchReport so far
    as its `report`."""
    tag = tag or base_key
    parent = os.path.dirname(final) or "."
    os.makedirs(parent, exist_ok=True)
    stage = os.path.join(parent, f".partial-{os.path.basename(final)}-{uuid.uuid4().hex[:8]}")
    os.makedirs(stage)
    report = FetchReport()
    try:
        reused = _reuse_local(files, local_copies or {}, stage)
        report.files_local, report.bytes_local = len(reused), sum(files[r]["size"] for r in reused)
        wanted = {rel: info for rel, info in files.items() if rel not in reused}
        _download(storage, base_key, wanted, stage)
        report.files_storage, report.bytes_storage = len(wanted), sum(i["size"] for i in wanted.values())
        for attempt in range(LOCAL_RETRIES + 1):
            bad = _mismatches(stage, wanted, verify)
            if not bad:
                break
            for rel, detail in bad.items():
                _check_in_storage(storage, join_key(base_key, rel), rel, files[rel], tag, detail)
                recovered = attempt < LOCAL_RETRIES
                report.local_errors.append({"file": rel, "detail": detail, "recovered": recovered})
                log.warning("checkpoint %s: local copy of %s is bad (%s) but storage holds the manifest's "
                            "bytes: %s", tag, rel, detail, "downloading it again" if recovered else "giving up")
            if attempt == LOCAL_RETRIES:
                raise LocalCopyCorrupt(f"{tag}: the local copy of {sorted(bad)[0]} failed verification "
                                       f"{LOCAL_RETRIES + 1} times ({bad[sorted(bad)[0]]}) while storage holds "
                                       f"the manifest's bytes: a fault of this node's disk, not the checkpoint "
                                       f"(not quarantined)")
            _download(storage, base_key, {rel: wanted[rel] for rel in bad}, stage)
            report.bytes_storage += sum(wanted[rel]["size"] for rel in bad)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(stage, final)
    except (CheckpointCorrupt, LocalCopyCorrupt) as exc:
        exc.report = report       # the local faults this fetch saw, the one it gave up on included
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return report


def _reuse_local(files: dict[str, dict], local_copies: dict[str, str], stage: str) -> set[str]:
    """Link (or copy) into `stage` the local copies whose size and sha256 match the manifest."""
    candidates = {rel: path for rel, path in local_copies.items()
                  if rel in files and os.path.isfile(path) and os.path.getsize(path) == files[rel]["size"]}
    if not candidates:
        return set()
    with ThreadPoolExecutor(max(1, min(4, len(candidates)))) as pool:
        digests = dict(zip(candidates, pool.map(sha256_file, candidates.values())))
    reused = set()
    for rel, path in candidates.items():
        if digests[rel] != files[rel]["sha256"]:
            log.info("local copy %s of %s differs from the manifest: downloading it", path, rel)
            continue
        dst = os.path.join(stage, *rel.split("/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            os.link(path, dst)
        except OSError:     # another filesystem (tmpfs -> disk)
            shutil.copyfile(path, dst)
        reused.add(rel)
    return reused


def _download(storage: Storage, base_key: str, files: dict[str, dict], stage: str) -> None:
    if files:
        storage._move_many([(os.path.join(stage, *rel.split("/")), join_key(base_key, rel), info["size"])
                            for rel, info in sorted(files.items())], upload=False)


def _mismatches(stage: str, files: dict[str, dict], verify: bool) -> dict[str, str]:
    """rel -> what is wrong with the staged copy of it (sizes, then sha256 when `verify`)."""
    got = local_files(stage)
    bad = {rel: f"{got.get(rel)} bytes, manifest says {info['size']}" for rel, info in files.items()
           if got.get(rel) != info["size"]}
    if verify:
        rest = [rel for rel in files if rel not in bad]
        digests = hash_files(stage, rest)
        bad.update({rel: "checksum mismatch" for rel in rest if digests[rel] != files[rel]["sha256"]})
    return bad


def _check_in_storage(storage: Storage, key: str, rel: str, info: dict, tag: str, local_detail: str) -> None:
    """CheckpointCorrupt unless storage holds exactly the manifest's bytes of `rel` (read from storage)."""
    try:
        digest = storage.sha256(key)
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{tag}: partial, {rel} is missing") from None
    if digest != info["sha256"]:
        if "checksum" in local_detail:
            raise CheckpointCorrupt(f"{tag}: checksum mismatch in {rel}")
        raise CheckpointCorrupt(f"{tag}: {rel} downloaded with {local_detail}, and storage's copy differs too")
