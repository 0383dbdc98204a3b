"""Small exception hierarchy.

`ConfigError` is bad usage, config or input: the CLI prints its one-line message and exits 2.
`JobFailed` means a job ran and failed (exit 1). `RetryableError` marks transient faults (storage
outage, network hiccup) that callers may retry; everything else is fatal.
"""
from __future__ import annotations

from typing import Any, Iterable


class SpotfillError(Exception):
    """Base class for every error spotfill raises on purpose."""

    exit_code = 1


class ConfigError(SpotfillError, ValueError):
    """Bad usage, config or input. One line: the field, the bad value, what is accepted."""

    exit_code = 2

    def __init__(self, field: str, value: Any = None, accepted: str | Iterable[Any] | None = None,
                 reason: str | None = None):
        self.field, self.value, self.reason = field, value, reason
        if accepted is not None and not isinstance(accepted, str):
            accepted = ", ".join(str(a) for a in accepted)
        self.accepted = accepted
        parts = [f"{field}: "]
        parts.append(reason if reason else f"bad value {value!r}")
        if reason and value is not None:
            parts.append(f" (got {value!r})")
        if accepted:
            parts.append(f"; accepted: {accepted}")
        super().__init__("".join(parts).replace("\n", " "))


class JobFailed(SpotfillError):
    """The job ran and failed, or a demo invariant did not hold."""

    exit_code = 1


class RetryableError(SpotfillError):
    """A transient fault: retrying may succeed."""


class StorageError(SpotfillError):
    """Object storage failed in a way retries did not fix."""


class CheckpointCorrupt(SpotfillError):
    """A checkpoint is partial or fails checksum verification."""

    report = None       # raised by a verified fetch: its FetchReport (storage/verified_fetch.py)


class LocalCopyCorrupt(SpotfillError):
    """A checkpoint file is intact in storage (its sha256 read from storage matches the manifest) but this
    node's local copy kept failing verification: a local disk or memory fault, not the checkpoint's. It is
    never quarantined for it."""

    report = None       # the fetch's FetchReport (storage/verified_fetch.py): the last fault unrecovered


class NoIntactCheckpoint(SpotfillError):
    """Committed checkpoints exist but none is intact (training.on_no_intact_checkpoint: fail)."""


class ConditionalWritesUnsupported(StorageError):
    """The storage backend (or S3 endpoint) cannot make a write conditional on the object's state."""


class WriterFenced(SpotfillError):
    """A checkpoint write (commit, `latest` move, deletion, quarantine) refused: a newer writer took the
    store (storage/fence.py). The writer that gets it is stale and must stop writing."""

    def __init__(self, op: str, tag: str | None, generation: str, newest: str, holder: dict | None = None):
        self.op, self.tag, self.generation, self.newest = op, tag, generation, newest
        self.holder = dict(holder or {})
        who = f" (attempt {self.holder['attempt']})" if self.holder.get("attempt") is not None else ""
        super().__init__(f"{op} of {tag or 'the store'} refused: this writer holds generation {generation}, "
                         f"the store's newest is {newest}{who}; a newer writer owns the store")

    @classmethod
    def from_record(cls, record: dict) -> "WriterFenced":
        """The refusal another process reported (record(): it crosses process boundaries as a dict)."""
        holder = {"attempt": record["newest_attempt"]} if "newest_attempt" in record else {}
        return cls(record["op"], record.get("tag"), record["generation"], record["newest_generation"], holder)

    def record(self) -> dict:
        """What the report lists under checkpoints.fenced."""
        return {"op": self.op, "tag": self.tag, "generation": self.generation, "newest_generation": self.newest,
                **({"newest_attempt": self.holder["attempt"]} if self.holder.get("attempt") is not None else {})}
class DataMismatch(SpotfillError):
    """The data a worker read is not the data the dataset's manifest and the schedule name: a shard changed,
    swapped or replaced after prepare, another data seed or dataset than the checkpoint's, a row-mapping
    fault. One line naming the shard and what differed. Fatal: a restart would read the same data."""
