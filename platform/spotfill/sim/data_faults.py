"""The scenario's faults in the training data: `swap_shards` exchanges two shards' contents in storage.

The manifest is left as prepare wrote it, so the dataset now holds rows where the manifest places others.
Workers read each shard from storage once per node (then from the node's cache, checked when opened): a
worker that reads a swapped shard after the swap -- a group starting on a node that has not cached it --
finds another sha256 and other row ids than the manifest names, and the job ends with one line naming the
shard (data.DataMismatch, the sink's `data_mismatch` event). Workers that cached the shard before the swap
keep feeding the rows they verified.
"""
from __future__ import annotations

import time

from spotfill.config.errors import ConfigError


def check_shard_refs(events: list, manifest: dict) -> None:
    """Every swap_shards event names shards the prepared dataset has (known once the data is prepared)."""
    n = len(manifest["shards"])
    for e in events:
        if e.action == "swap_shards" and max(e.shards) >= n:
            raise ConfigError(f"events[{e.index}].shards", list(e.shards),
                              reason=f"the prepared dataset has {n} shard{'s' if n != 1 else ''}",
                              accepted=f"two different indices in 0..{n - 1}" if n > 1
                              else "a dataset of 2 shards or more")


def swap_shards(data_uri: str, shards: tuple[int, int], say) -> dict:
    """Exchange the contents of shards `shards` (manifest indices) in the dataset's storage. Returns
    {"shards": [key_a, key_b], "t"}."""
    from spotfill.storage.base import open_storage
    from spotfill.train.data import read_manifest

    storage = open_storage(data_uri)
    keys = [read_manifest(storage)["shards"][i]["key"] for i in shards]
    a, b = (storage.get_bytes(k) for k in keys)
    storage.put_bytes(keys[0], b)
    storage.put_bytes(keys[1], a)
    say(f"swapped the contents of data shards {keys[0]} and {keys[1]} in storage")
    return {"shards": keys, "t": round(time.time(), 3)}


def swap_outcome(events: list[dict], fired_at: float) -> dict:
    """`caught`: the first data mismatch a worker reported after the swap (None: no worker read a swapped
    shard from storage), with the attempt and rank that read it."""
    hit = next((e for e in events if e["kind"] == "data_mismatch" and e["t"] >= fired_at), None)
    if hit is None:
        return {"caught": None}
    return {"caught": hit["reason"], "caught_by": {"attempt": hit.get("attempt"), "rank": hit.get("rank")}}
