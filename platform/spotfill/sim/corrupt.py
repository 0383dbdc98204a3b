"""The corrupt_checkpoint scenario action: damage the newest committed checkpoint in storage."""
from __future__ import annotations

import time


def corrupt_newest_checkpoint(job, say, wait_s: float = 15.0) -> dict:
    """The corrupt_checkpoint action: flip one byte in every file of the newest committed checkpoint in
    storage (the store's `latest`; any file a restore downloads is then damaged -- a node may still restore
    it from its own kept snapshot, which matches the manifest). A save still uploading is waited for (up to
    `wait_s`), so the damage lands on the checkpoint a restart would pick. Returns {"tag", "step", "file"
    (the largest), "files", "t"} or {"skipped"}."""
    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore

    store = CheckpointStore(open_storage(job.config.storage).child(job.config.name))
    deadline = time.time() + wait_s
    while store.uploading() and time.time() < deadline:
        time.sleep(0.1)
    tag = store.latest_tag()
    if tag is None:
        say("skipped: corrupt_checkpoint (nothing committed yet)")
        return {"skipped": "no committed checkpoint yet"}
    manifest = store.manifest(tag)
    files = manifest["files"]
    for rel in sorted(files):
        key = f"{store.prefix}/{tag}/{rel}"
        data = bytearray(store.storage.get_bytes(key))
        data[len(data) // 2] ^= 0xFF
        store.storage.put_bytes(key, bytes(data))
    rel = max(sorted(files), key=lambda r: files[r]["size"])
    say(f"corrupted {tag} (one byte flipped in each of its {len(files)} files)")
    return {"tag": tag, "step": int(manifest["step"]), "file": rel, "files": len(files), "t": round(time.time(), 3)}
