"""Writer fencing for a checkpoint store: only the newest writer commits, moves `latest` or deletes.

Two writers on one store destroy each other's work: a rank 0 that outlived its worker group (a network
partition; Ray Train already runs the next attempt) or two `fit()` runs over one store each commit, move
`latest` to their own lineage and let retention delete the other's "dead branch". So every writer (a
training attempt's rank 0, before its restore) takes a *generation* from the store, and each commit,
`latest` move, quarantine and deletion first checks that no newer generation exists; a stale writer's
write is refused (WriterFenced) -- it deletes nothing, and it stops.

Layout under the store's prefix::

    writers/gen-00000007.json          one object per generation: {generation, attempt, t, host, pid, ...}
    latest                             {"tag", "step", "committed", "generation"}: the writer that last set it

Taking a generation: N = one past the newest listed, created only where absent (`Storage.put_if_absent`:
S3 PutObject If-None-Match: *, a hard link locally); a writer that loses the race for N tries N+1. Where
the endpoint has no conditional writes (probed: storage.s3), each writer creates a key of its own,
`gen-<N>-<nonce>.json`, and generations order by (N, nonce): two writers that picked the same N are still
ordered, and the one that is not the newest finds out at its first check (S3 listings are strongly
consistent).

Checking and the race between a check and the write it guards:
- `latest` is written with compare-and-swap (`put_if_version`: S3 If-Match on the ETag read, a locked
  compare-and-replace locally), refusing a pointer that a newer generation wrote. A newer writer claims
  `latest` right after taking its generation (WriterFence.take rewrites it with its generation), so a
  stale writer's `latest` write that raced the check fails its If-Match, re-reads and is refused; one that
  landed before the claim is simply older than everything the new writer reads.
- A manifest is a new object (a new tag): a stale commit that passes its check just before a newer writer
  takes its generation is never on the new writer's lineage (the new writer builds from its own restore and
  moves `latest` itself), so the new writer's retention removes it as a dead branch.
- Deletions check before each tag. A stale writer's retention only ever deletes tags that are not its own
  newest ones; the newer writer restores the newest tag of the lineage it read after its generation was
  taken, so a deletion racing that one check can only hit a tag the new writer did not choose.
- Without conditional writes (`mechanism` says so) `latest` is checked, then written: a stale write can
  land in that window and the new writer's next commit corrects it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from spotfill.config.errors import StorageError, WriterFenced
from spotfill.storage.base import Storage, join_key

log = logging.getLogger(__name__)
WRITERS = "writers"             # <prefix>/writers/: the generation objects (never a checkpoint tag)
KEEP_GENERATIONS = 16           # older generation objects are pruned by the newest writer
POINTER_TRIES = 20
LISTING = "listing: a unique generation key per writer, the newest by listing; `latest` checked, then written"
_GEN_RE = re.compile(r"^gen-(\d+)(?:-([0-9a-f]+))?\.json$")


@dataclass(frozen=True, order=True)
class Generation:
    number: int
    nonce: str = ""

    def __str__(self) -> str:
        return f"{self.number}-{self.nonce}" if self.nonce else str(self.number)

    @classmethod
    def parse(cls, text: Any) -> "Generation | None":
        if text is None:
            return None
        number, _, nonce = str(text).partition("-")
        return cls(int(number), nonce) if number.isdigit() else None

    def key_name(self) -> str:
        return f"gen-{self.number:08d}" + (f"-{self.nonce}" if self.nonce else "") + ".json"


class WriterFence:
    """The generation one writer holds on a store (`storage` rooted where the store is, `prefix` its
    folder, e.g. "checkpoints"), and the checks that refuse its writes once a newer one exists."""

    def __init__(self, storage: Storage, prefix: str, generation: Generation, mechanism: str,
                 info: dict | None = None):
        self.storage, self.prefix, self.generation = storage, prefix.strip("/"), generation
        self.mechanism, self.info = mechanism, dict(info or {})

    def __repr__(self) -> str:
        return f"WriterFence({self.storage.uri!r}, generation={self.generation}, {self.mechanism!r})"

    # -- taking one ----------------------------------------------------------------------------------
    @classmethod
    def take(cls, storage: Storage, prefix: str, **info: Any) -> "WriterFence":
        """Take the next generation (see the module docstring); `info` (e.g. attempt=3) is stored in its
        object and names the holder in refusals."""
        mechanism = storage.conditional_writes()
        listed = cls.generations(storage, prefix)
        number = (listed[-1][0].number if listed else 0) + 1
        body = {**info, "t": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
        if mechanism:
            while not storage.put_if_absent(cls._key(prefix, Generation(number)), cls._body(number, body)):
                number += 1       # another writer took it first
            generation = Generation(number)
        else:
            mechanism, generation = LISTING, Generation(number, _nonce())
            storage.put_bytes(cls._key(prefix, generation), cls._body(number, body, generation))
        fence = cls(storage, prefix, generation, mechanism, info)
        fence.claim_latest()
        fence._prune(listed)
        log.info("checkpoint writer: generation %s taken (%s) on %s", generation, mechanism, storage.uri)
        return fence

    @classmethod
    def adopt(cls, storage: Storage, prefix: str, generation: Generation, **info: Any) -> "WriterFence":
        """A writer that took `generation` earlier (a zombie of an earlier attempt, in a rehearsal)."""
        mechanism = storage.conditional_writes() or LISTING
        return cls(storage, prefix, generation, mechanism, info)

    @staticmethod
    def _key(prefix: str, generation: Generation) -> str:
        return join_key(prefix, WRITERS, generation.key_name())

    @staticmethod
    def _body(number: int, info: dict, generation: Generation | None = None) -> bytes:
        return json.dumps({"generation": str(generation or Generation(number)), **info}).encode()

    @classmethod
    def generations(cls, storage: Storage, prefix: str) -> list[tuple[Generation, str]]:
        """Every generation object in the store, oldest first: (generation, key)."""
        out = []
        for key in storage.list(join_key(prefix, WRITERS) + "/"):
            m = _GEN_RE.match(key.rsplit("/", 1)[-1])
            if m:
                out.append((Generation(int(m.group(1)), m.group(2) or ""), key))
        return sorted(out)

    @classmethod
    def holders(cls, storage: Storage, prefix: str) -> list[dict]:
        """Every generation's object ({generation, attempt, t, ...}), oldest first (unreadable: skipped)."""
        out = []
        for _, key in cls.generations(storage, prefix):
            try:
                out.append(json.loads(storage.get_bytes(key)))
            except (FileNotFoundError, ValueError):
                continue
        return out

    def _prune(self, listed: list[tuple[Generation, str]]) -> None:
        old = [key for gen, key in listed[:-KEEP_GENERATIONS] if gen < self.generation]
        if old:
            self.check("prune generations")
            self.storage.delete(old)

    # -- checks --------------------------------------------------------------------------------------
    def check(self, op: str, tag: str | None = None) -> None:
        """Raise WriterFenced when a newer generation than this writer's exists."""
        listed = self.generations(self.storage, self.prefix)
        if listed and listed[-1][0] > self.generation:
            raise self._refusal(op, tag, listed[-1][0], listed[-1][1])

    def _refusal(self, op: str, tag: str | None, newest: Generation, key: str | None) -> WriterFenced:
        holder: dict = {}
        if key is not None:
            try:
                holder = json.loads(self.storage.get_bytes(key))
            except (FileNotFoundError, ValueError, StorageError):
                holder = {}
        exc = WriterFenced(op, tag, str(self.generation), str(newest), holder)
        log.warning("checkpoint writer fenced: %s", exc)
        return exc

    def claim_latest(self) -> None:
        """Rewrite `latest` (its tag unchanged) with this generation: from now on a stale writer's
        compare-and-swap on it fails."""
        def keep(pointer: dict | None) -> dict:
            return {k: v for k, v in (pointer or {"tag": None, "step": 0}).items()
                    if k not in ("generation", "writer")}
        self.write_pointer("latest", keep, "claim latest", None)

    def write_pointer(self, name: str, make, op: str, tag: str | None) -> dict:
        """Compare-and-swap `<prefix>/<name>` to `make(current pointer or None)` plus this generation;
        refused (WriterFenced) when a newer generation exists or wrote the pointer. Returns the body."""
        key = join_key(self.prefix, name)
        for _ in range(POINTER_TRIES):
            self.check(op, tag)
            current = self.storage.get_versioned(key)
            pointer, version = (None, None) if current is None else (_parse(current[0]), current[1])
            writer = Generation.parse((pointer or {}).get("writer"))
            if writer is not None and writer > self.generation:
                raise self._refusal(op, tag, writer, self._key(self.prefix, writer))
            body = {**make(pointer), "generation": self.generation.number, "writer": str(self.generation)}
            data = json.dumps(body).encode()
            if self.mechanism == LISTING:
                self.storage.put_bytes(key, data)
                return body
            if self.storage.put_if_version(key, data, version):
                return body
            # another write came between our read and our write: read again and decide again
        raise StorageError(f"{op}: {key} at {self.storage.uri} kept changing under compare-and-swap "
                           f"({POINTER_TRIES} tries)")


def _nonce() -> str:
    """A listing writer's own key suffix: orders two writers that picked the same number (random, so which
    of them is newer is arbitrary; a new writer is newer than every writer it listed by its number alone)."""
    return uuid.uuid4().hex[:12]


def _parse(raw: bytes) -> dict | None:
    text = raw.decode(errors="replace").strip()
    try:
        value = json.loads(text)
    except ValueError:
        return {"tag": text}          # a plain-text tag (older stores)
    return value if isinstance(value, dict) else None
