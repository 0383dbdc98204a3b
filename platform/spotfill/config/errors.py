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


class NoIntactCheckpoint(SpotfillError):
    """Committed checkpoints exist but none is intact (training.on_no_intact_checkpoint: fail)."""


class DataMismatch(SpotfillError):
    """The data a worker read is not the data the dataset's manifest and the schedule name: a shard changed,
    swapped or replaced after prepare, another data seed or dataset than the checkpoint's, a row-mapping
    fault. One line naming the shard and what differed. Fatal: a restart would read the same data."""
