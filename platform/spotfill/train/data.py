"""Token shards: byte-level tokenizer, packing, shard files + manifest, and the training-side reader.

Layout under a dataset URI (local path or s3://...):
    manifest.json      {"format": "spotfill-tokens/2", "seq_len", "dtype", "vocab_size", "tokenizer",
                        "num_samples", "shards": [{"key", "num_samples", "first_id", "sha256"}],
                        "fingerprint": sha256 of the above (dataset_fingerprint)}
    shard-00000.npy    structured array [num_samples] of (id int64, tokens dtype[seq_len + 1]): each row
                       carries its dataset row id (its index in the whole dataset, written by prepare);
                       inputs are tokens[:-1], targets tokens[1:]
The reader checks each shard it opens against the manifest (sha256 on download; the ids it holds against
the rows the manifest places it at) and returns, with every row it reads, the id stored in that row: the
identity the worker loop checks against the schedule and records in the sample ledger (feed.py).
Pure apart from numpy and storage; the Ray Data pipeline that produces shards is in prepare.py.
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from spotfill.config.errors import ConfigError, DataMismatch
from spotfill.storage.base import sha256_file
from spotfill.config.batching import stream_to_rows

log = logging.getLogger(__name__)

EOD = 256                 # end-of-document id for the byte-level tokenizer
BYTE_VOCAB = 257
FORMAT = "spotfill-tokens/2"
OLD_FORMATS = ("spotfill-tokens/1",)   # no row ids in the shards: refused (re-run prepare)


def byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8")) + [EOD]


@functools.lru_cache(maxsize=8)   # Ray Data calls it once per batch: load each tokenizer once per process
def load_tokenizer(spec: str) -> tuple[Callable[[str], list[int]], int]:
    """`bytes` (default) or `hf:/local/path` (a local Hugging Face tokenizer). Returns (encode, vocab)."""
    if spec in ("", "bytes"):
        return byte_encode, BYTE_VOCAB
    if spec.startswith("hf:"):
        path = spec[3:]
        if not os.path.isdir(path):
            raise ConfigError("data.tokenizer", spec, reason="not a local directory")
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ConfigError("data.tokenizer", spec, reason="needs the `transformers` package") from exc
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        return (lambda text: tok.encode(text, add_special_tokens=False) + [eos]), len(tok)
    raise ConfigError("data.tokenizer", spec, accepted="bytes, hf:/local/path")


def pack(token_lists: Iterable[list[int]], seq_len: int) -> np.ndarray:
    """Concatenate documents and cut rows of seq_len + 1 tokens; the incomplete tail is dropped."""
    flat = np.fromiter((t for toks in token_lists for t in toks), dtype=np.int64)
    n = len(flat) // (seq_len + 1)
    return flat[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def shard_dtype(seq_len: int, token: np.dtype) -> np.dtype:
    """One shard row: its dataset row id and its seq_len + 1 tokens."""
    return np.dtype([("id", "<i8"), ("tokens", np.dtype(token).newbyteorder("<"), (seq_len + 1,))])


def dataset_fingerprint(manifest: dict) -> str:
    """sha256 over what names the data: format, shape, tokenizer and every shard (key, rows, first id,
    sha256) in order. The same corpus prepared twice gives the same fingerprint; any changed, replaced,
    added or reordered shard gives another."""
    named = {k: manifest.get(k) for k in ("format", "seq_len", "dtype", "vocab_size", "tokenizer", "num_samples")}
    named["shards"] = [[s["key"], s["num_samples"], s["first_id"], s["sha256"]] for s in manifest["shards"]]
    return hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


class ShardWriter:
    """Accumulates packed rows and writes fixed-size shards and, on close, the manifest."""

    def __init__(self, storage, seq_len: int, vocab_size: int, tokenizer: str, rows_per_shard: int = 8192):
        self.storage, self.seq_len, self.vocab_size = storage, seq_len, vocab_size
        self.tokenizer, self.rows_per_shard = tokenizer, rows_per_shard
        self.dtype = token_dtype(vocab_size)
        self._row_dtype = shard_dtype(seq_len, self.dtype)
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self.shards: list[dict] = []

    def add(self, rows: np.ndarray) -> None:
        if len(rows):
            self._pending.append(rows.astype(self.dtype))
            self._pending_rows += len(rows)
        while self._pending_rows >= self.rows_per_shard:
            self._flush(self.rows_per_shard)

    def _flush(self, n: int) -> None:
        allrows = np.concatenate(self._pending)
        shard, rest = allrows[:n], allrows[n:]
        self._pending, self._pending_rows = ([rest] if len(rest) else []), len(rest)
        first_id = sum(s["num_samples"] for s in self.shards)
        rows = np.empty(len(shard), dtype=self._row_dtype)
        rows["id"] = np.arange(first_id, first_id + len(shard))       # each row's id, stored with its tokens
        rows["tokens"] = shard
        data = _npy_bytes(rows)
        key = f"shard-{len(self.shards):05d}.npy"
        self.storage.put_bytes(key, data)
        self.shards.append({"key": key, "num_samples": int(len(shard)), "first_id": first_id,
                            "sha256": hashlib.sha256(data).hexdigest()})

    def close(self) -> dict:
        if self._pending_rows:
            self._flush(self._pending_rows)
        manifest = {"format": FORMAT, "seq_len": self.seq_len, "dtype": self.dtype.name,
                    "vocab_size": self.vocab_size, "tokenizer": self.tokenizer,
                    "num_samples": sum(s["num_samples"] for s in self.shards), "shards": self.shards}
        if manifest["num_samples"] == 0:
            raise ConfigError("data.source", None, reason="the corpus produced no complete sequence "
                              f"of {self.seq_len + 1} tokens")
        manifest["fingerprint"] = dataset_fingerprint(manifest)
        self.storage.put_bytes("manifest.json", json.dumps(manifest, indent=1).encode())
        return manifest


def read_manifest(storage) -> dict:
    """The dataset's manifest, checked before any shard is read: a known format, shards laid end to end
    from row 0, and a fingerprint that matches what the manifest lists."""
    try:
        manifest = json.loads(storage.get_bytes("manifest.json"))
    except FileNotFoundError as exc:
        raise ConfigError("data.path", storage.uri, reason="no manifest.json (run jobs/prepare_data.py first)") from exc
    fmt = manifest.get("format")
    if fmt in OLD_FORMATS:
        raise ConfigError("data.path", storage.uri, reason=f"a {fmt} dataset: its shards do not store each "
                          f"row's id, which training checks and records; re-run prepare (jobs/prepare_data.py) "
                          f"over the corpus to write {FORMAT}")
    if fmt != FORMAT:
        raise ConfigError("data.path", storage.uri, reason=f"unknown dataset format {fmt!r}", accepted=FORMAT)
    _check_manifest(manifest, storage.uri)
    return manifest


def _check_manifest(manifest: dict, uri: str) -> None:
    try:
        end = 0
        for shard in manifest["shards"]:
            if shard["first_id"] != end:
                raise ConfigError("data.path", uri, reason=f"manifest.json places {shard['key']} at row "
                                  f"{shard['first_id']} where the shards before it end at row {end} (shards "
                                  "removed or reordered after prepare); re-run prepare")
            end += shard["num_samples"]
        if end != manifest["num_samples"] or manifest.get("fingerprint") != dataset_fingerprint(manifest):
            raise ConfigError("data.path", uri, reason="manifest.json does not match its fingerprint (edited "
                              "after prepare); re-run prepare")
    except (KeyError, TypeError) as exc:
        raise ConfigError("data.path", uri, reason=f"malformed manifest.json ({type(exc).__name__}: {exc})") from None


class ShardReader:
    """Random access to dataset rows; shards are cached on local disk and memory-mapped.

    Each shard is checked as it is opened: a download must have the manifest's sha256, and the first and
    last ids stored in it must be the rows the manifest places it at (a cached copy changed on disk). Every
    read returns the id stored in each row and checks it is the row asked for. Any difference raises
    DataMismatch, one line naming the shard."""

    def __init__(self, storage, cache_dir: str):
        self.manifest = read_manifest(storage)
        self.uri = storage.uri
        self.seq_len = self.manifest["seq_len"]
        self.num_samples = self.manifest["num_samples"]
        self.fingerprint = self.manifest["fingerprint"]
        self._dtype = shard_dtype(self.seq_len, np.dtype(self.manifest["dtype"]))
        os.makedirs(cache_dir, exist_ok=True)
        shards = self.manifest["shards"]
        self._arrays = [self._open(storage, shard, cache_dir) for shard in shards]
        self._starts = np.array([s["first_id"] for s in shards] + [self.num_samples], dtype=np.int64)

    def shard_key(self, row: int) -> str:
        """The key of the shard the manifest places dataset row `row` in."""
        s = int(np.searchsorted(self._starts, row, side="right")) - 1
        return self.manifest["shards"][min(max(s, 0), len(self._arrays) - 1)]["key"]

    def _open(self, storage, shard: dict, cache_dir: str) -> np.ndarray:
        local = os.path.join(cache_dir, f"{shard['sha256'][:16]}-{shard['key']}")
        if os.path.exists(local):
            return self._checked(shard, local, f"the copy cached at {local}", "delete that copy")
        tmp = f"{local}.{os.getpid()}.part"
        try:
            storage.get_file(shard["key"], tmp)
            got = sha256_file(tmp)
            if got != shard["sha256"]:
                raise DataMismatch(f"data shard {shard['key']} in {self.uri} is not the shard its manifest names "
                                   f"({self._holds(tmp, shard)}; sha256 {got[:12]}, the manifest's "
                                   f"{shard['sha256'][:12]}): the dataset changed after prepare; restore it, or "
                                   "re-run prepare and start a new job")
            self._checked(shard, tmp, "it", "re-run prepare")
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        os.replace(tmp, local)
        return self._checked(shard, local, f"the copy cached at {local}", "delete that copy")

    def _load(self, path: str) -> np.ndarray | None:
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError):
            return None
        return arr if arr.dtype == self._dtype and arr.ndim == 1 else None

    def _holds(self, path: str, shard: dict) -> str:
        """What a shard file holds, by the ids stored in it (and whose rows those are, by the manifest)."""
        arr = self._load(path)
        if arr is None or not len(arr):
            return f"it is not a {FORMAT} shard of this dataset"
        lo, hi = int(arr["id"][0]), int(arr["id"][-1])
        owner = [s["key"] for s in self.manifest["shards"] if s["first_id"] == lo and s["num_samples"] == hi - lo + 1]
        if owner == [shard["key"]]:
            return f"it holds its own rows {lo}..{hi}, with other bytes"
        return f"it holds rows {lo}..{hi}" + (f", {owner[0]}'s by the manifest" if owner else "")

    def _checked(self, shard: dict, path: str, what: str, remedy: str) -> np.ndarray:
        arr = self._load(path)
        first, n = shard["first_id"], shard["num_samples"]
        if arr is None or len(arr) != n or int(arr["id"][0]) != first or int(arr["id"][-1]) != first + n - 1:
            holds = self._holds(path, shard).replace("it ", "", 1)
            raise DataMismatch(f"data shard {shard['key']}: {what} {holds}, where the manifest places rows "
                               f"{first}..{first + n - 1}; {remedy}")
        return arr

    def rows(self, row_ids: np.ndarray) -> np.ndarray:
        return self.read(row_ids)[0]

    def read(self, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token rows for dataset rows `row_ids`, and the id stored in each row read (checked: the row asked
        for). One fancy-index per shard (no Python loop per row: this runs on the prefetch thread, and a
        per-row loop holds the GIL the step loop needs)."""
        row_ids = np.asarray(row_ids, dtype=np.int64)
        out = np.empty((len(row_ids), self.seq_len + 1), dtype=np.int64)
        stored = np.empty_like(row_ids)
        shard_of = np.searchsorted(self._starts, row_ids, side="right") - 1
        if row_ids.size and (shard_of.min() < 0 or row_ids.max() >= self.num_samples):
            raise IndexError(f"dataset rows out of range [0, {self.num_samples})")
        for s in np.unique(shard_of):
            where = np.flatnonzero(shard_of == s)
            rows = self._arrays[s][row_ids[where] - self._starts[s]]
            out[where] = rows["tokens"]
            stored[where] = rows["id"]
        bad = np.flatnonzero(stored != row_ids)
        if bad.size:
            i = bad[0]
            s = shard_of[i]
            raise DataMismatch(f"data shard {self.manifest['shards'][s]['key']}: row {row_ids[i] - self._starts[s]} "
                               f"holds dataset row {stored[i]}, not row {row_ids[i]} ({bad.size} of {row_ids.size} "
                               "rows read differ)")
        return out, stored


@dataclass
class StepBatch:
    """One rank's rows for one optimizer step, with the identity of every row the loader returned."""
    step: int
    micro_batches: list[np.ndarray]     # accum x [micro, seq_len + 1] token rows, in the order fed
    positions: np.ndarray               # the stream positions the rows were read for, same order
    row_ids: np.ndarray | None = None   # the dataset row id stored in each row read (its shard wrote it)
    fed: np.ndarray | None = None       # the stream position each row read is, by its stored id and the
                                        # schedule's permutation (feed.py): what the sample ledger records


def read_step(reader: ShardReader, step: int, positions: np.ndarray, accum: int, seed: int) -> StepBatch:
    """Read the rows for stream `positions` (this rank's share of `step`); each row comes with the id
    stored in it, which feed.py checks against the schedule and turns into the position it records."""
    positions = np.asarray(positions, dtype=np.int64)
    tokens, stored_ids = reader.read(stream_to_rows(positions, reader.num_samples, seed))
    return StepBatch(step, np.split(tokens, accum), positions, stored_ids)


class Prefetcher:
    """Prepares the next steps' batches on a background thread so data loading overlaps compute.

    `make(step) -> StepBatch`; `get(step)` returns it and adds the time spent waiting to `wait_s`.
    """

    def __init__(self, make: Callable[[int], StepBatch], first_step: int, last_step: int, depth: int = 2):
        self._make, self._q = make, queue.Queue(maxsize=depth)
        self._next, self._last = first_step, last_step
        self._stop = threading.Event()
        self.wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="spotfill-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        step = self._next
        while step < self._last and not self._stop.is_set():
            try:
                item = self._make(step)
            except BaseException as exc:  # surfaced by get()
                item = exc
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            step += 1

    def get(self, step: int) -> StepBatch:
        t0 = time.perf_counter()
        item = self._q.get()
        self.wait_s += time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        assert item.step == step, f"prefetcher out of order: {item.step} != {step}"
        return item

    def close(self) -> None:
        self._stop.set()


def iter_corpus_files(root: str, suffixes: tuple[str, ...] = (".py", ".txt", ".md")) -> Iterator[str]:
    """Files under `root` (sorted, deterministic) with one of `suffixes`."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(suffixes):
                yield os.path.join(dirpath, name)
