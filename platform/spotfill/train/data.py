"""Token shards: byte-level tokenizer, packing, shard files + manifest, and the training-side reader.

Layout under a dataset URI (local path or s3://...):
    manifest.json      {"format": "spotfill-tokens/1", "seq_len", "dtype", "vocab_size", "tokenizer",
                        "num_samples", "shards": [{"key", "num_samples", "sha256"}]}
    shard-00000.npy    int array [num_samples, seq_len + 1] (inputs are [:-1], targets [1:])
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

from spotfill.config.errors import CheckpointCorrupt, ConfigError
from spotfill.storage.base import sha256_file
from spotfill.train.batching import stream_to_rows

log = logging.getLogger(__name__)

EOD = 256                 # end-of-document id for the byte-level tokenizer
BYTE_VOCAB = 257
FORMAT = "spotfill-tokens/1"


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
        data = _npy_bytes(shard)
        key = f"shard-{len(self.shards):05d}.npy"
        self.storage.put_bytes(key, data)
        self.shards.append({"key": key, "num_samples": int(len(shard)),
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
        self.storage.put_bytes("manifest.json", json.dumps(manifest, indent=1).encode())
        return manifest


def read_manifest(storage) -> dict:
    try:
        manifest = json.loads(storage.get_bytes("manifest.json"))
    except FileNotFoundError as exc:
        raise ConfigError("data.path", storage.uri, reason="no manifest.json (run jobs/prepare_data.py first)") from exc
    if manifest.get("format") != FORMAT:
        raise ConfigError("data.path", storage.uri, reason=f"unknown dataset format {manifest.get('format')!r}",
                          accepted=FORMAT)
    return manifest


class ShardReader:
    """Random access to dataset rows; shards are cached on local disk and memory-mapped."""

    def __init__(self, storage, cache_dir: str):
        self.manifest = read_manifest(storage)
        self.seq_len = self.manifest["seq_len"]
        self.num_samples = self.manifest["num_samples"]
        os.makedirs(cache_dir, exist_ok=True)
        self._arrays = []
        for shard in self.manifest["shards"]:
            local = os.path.join(cache_dir, f"{shard['sha256'][:16]}-{shard['key']}")
            if not os.path.exists(local):
                tmp = f"{local}.{os.getpid()}.part"
                storage.get_file(shard["key"], tmp)
                if sha256_file(tmp) != shard["sha256"]:
                    os.unlink(tmp)
                    raise CheckpointCorrupt(f"data shard {shard['key']} fails its checksum")
                os.replace(tmp, local)
            self._arrays.append(np.load(local, mmap_mode="r"))
        self._starts = np.cumsum([0] + [len(a) for a in self._arrays])

    def rows(self, row_ids: np.ndarray) -> np.ndarray:
        return self.read(row_ids)[0]

    def read(self, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token rows for dataset rows `row_ids`, and each row's identity as read: its shard's first row
        plus the offset it was read at. One fancy-index per shard (no Python loop per row: this runs on the
        prefetch thread, and a per-row loop holds the GIL the step loop needs)."""
        row_ids = np.asarray(row_ids, dtype=np.int64)
        out = np.empty((len(row_ids), self.seq_len + 1), dtype=np.int64)
        read_ids = np.empty_like(row_ids)
        shard_of = np.searchsorted(self._starts, row_ids, side="right") - 1
        if row_ids.size and (shard_of.min() < 0 or row_ids.max() >= self.num_samples):
            raise IndexError(f"dataset rows out of range [0, {self.num_samples})")
        for s in np.unique(shard_of):
            where = np.flatnonzero(shard_of == s)
            offsets = row_ids[where] - self._starts[s]
            out[where] = self._arrays[s][offsets]
            read_ids[where] = self._starts[s] + offsets
        return out, read_ids


@dataclass
class StepBatch:
    """One rank's rows for one optimizer step, with the identity of every row the loader returned."""
    step: int
    micro_batches: list[np.ndarray]     # accum x [micro, seq_len + 1] token rows, in the order fed
    positions: np.ndarray               # stream position of each row, same order (the ledger records it)
    row_ids: np.ndarray | None = None   # dataset row each was read from (shard + offset of the read)


def read_step(reader: ShardReader, step: int, positions: np.ndarray, accum: int, seed: int) -> StepBatch:
    """Read the rows for stream `positions` (this rank's share of `step`) and keep each row's identity with
    it: the rows fed and the positions recorded come from the same read, not from the step number."""
    positions = np.asarray(positions, dtype=np.int64)
    tokens, read_ids = reader.read(stream_to_rows(positions, reader.num_samples, seed))
    return StepBatch(step, np.split(tokens, accum), positions, read_ids)


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
