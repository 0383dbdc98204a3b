"""The exactly-once ledger: how many times the model was fed each stream position (pure: numpy only).

Every rank records the stream positions of the rows it actually fed to the model -- the positions the
dataset row ids stored in the rows read say they are (feed.py, data.StepBatch.fed), not a recomputation
from the step number.
At each checkpoint the ranks' records since the previous checkpoint are combined (one collective, at
checkpoint time only) into the ledger, and the ledger travels in the checkpoint's client_state: a resume
restores exactly the ledger of the model state it loads. So the final checkpoint's ledger describes the
final model's whole history, across restarts, resizes and rollbacks.

The ledger is a multiset of positions kept as sorted, disjoint segments [lo, hi) each seen `count` times:
a healthy run is one segment (0, steps * global_batch, 1) whatever its length; each fault (a resume off by
k steps, a rank feeding a wrong slice) adds a few segments.

Against the schedule (steps x global_batch positions owed):
    consumed    rows fed in total
    duplicates  feeds beyond the first of a position, plus feeds of positions the schedule never owed
    missing     owed positions never fed
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FORMAT = "spotfill-ledger/1"

Segments = np.ndarray    # int64 [k, 3]: lo, hi (exclusive), count >= 1; sorted, disjoint


def _empty() -> Segments:
    return np.zeros((0, 3), dtype=np.int64)


def runs(positions: np.ndarray) -> Segments:
    """Segments of count 1 covering `positions` (any order, repeats allowed: a repeat opens a new run)."""
    p = np.sort(np.asarray(positions, dtype=np.int64).ravel())
    if p.size == 0:
        return _empty()
    breaks = np.flatnonzero(np.diff(p) != 1) + 1
    lo = p[np.concatenate(([0], breaks))]
    hi = p[np.concatenate((breaks - 1, [p.size - 1]))] + 1
    return np.stack([lo, hi, np.ones_like(lo)], axis=1)


def normalize(*parts: Segments) -> Segments:
    """Sum overlapping segments into sorted, disjoint ones (a sweep over segment ends)."""
    segs = np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1, 3) for s in parts] or [_empty()])
    if segs.size == 0:
        return _empty()
    points = np.concatenate([segs[:, 0], segs[:, 1]])
    deltas = np.concatenate([segs[:, 2], -segs[:, 2]])
    cuts, inverse = np.unique(points, return_inverse=True)
    level = np.cumsum(np.bincount(inverse, weights=deltas, minlength=cuts.size)).astype(np.int64)
    lo, hi, count = cuts[:-1], cuts[1:], level[:-1]
    keep = count > 0
    lo, hi, count = lo[keep], hi[keep], count[keep]
    if lo.size == 0:
        return _empty()
    # join neighbours that touch and share a count
    new = np.concatenate(([True], (lo[1:] != hi[:-1]) | (count[1:] != count[:-1])))
    starts = np.flatnonzero(new)
    ends = np.concatenate((starts[1:], [lo.size])) - 1
    return np.stack([lo[starts], hi[ends], count[starts]], axis=1)


@dataclass(frozen=True)
class LedgerSummary:
    consumed: int
    duplicates: int
    missing: int
    owed: int

    def as_report(self) -> dict:
        return {"consumed": self.consumed, "duplicates": self.duplicates, "missing": self.missing,
                "source": "checkpoint-ledger"}


class SampleLedger:
    """Seen counts per stream position of one model state. Immutable: `with_fed` returns a new ledger."""

    __slots__ = ("segments",)

    def __init__(self, segments: Segments | None = None):
        self.segments = _empty() if segments is None else normalize(segments)

    def with_fed(self, *parts: Segments) -> "SampleLedger":
        """This ledger plus the segments fed since (from every rank)."""
        out = SampleLedger()
        out.segments = normalize(self.segments, *parts)
        return out

    def count(self, position: int) -> int:
        s = self.segments
        i = np.searchsorted(s[:, 0], position, side="right") - 1
        return int(s[i, 2]) if i >= 0 and position < s[i, 1] else 0

    def summary(self, owed: int) -> LedgerSummary:
        """Against the first `owed` stream positions (steps x global_batch)."""
        s = self.segments
        length = s[:, 1] - s[:, 0]
        inside = np.clip(s[:, 1], None, owed) - np.clip(s[:, 0], None, owed)     # part within [0, owed)
        consumed = int((length * s[:, 2]).sum())
        seen_owed = int(inside.sum())
        duplicates = int((inside * (s[:, 2] - 1)).sum() + ((length - inside) * s[:, 2]).sum())
        return LedgerSummary(consumed=consumed, duplicates=duplicates, missing=owed - seen_owed, owed=owed)

    def to_state(self) -> dict:
        """For a checkpoint's client_state (plain ints: loads without numpy pickles)."""
        return {"format": FORMAT, "segments": self.segments.tolist()}

    @classmethod
    def from_state(cls, state: dict | None) -> "SampleLedger":
        """The ledger a checkpoint carried; an empty one for a fresh start (state None)."""
        if state is None:
            return cls()
        if state.get("format") != FORMAT:
            raise ValueError(f"checkpoint sample ledger: unknown format {state.get('format')!r}; "
                             f"accepted: {FORMAT}")
        return cls(np.asarray(state["segments"], dtype=np.int64).reshape(-1, 3))

    def __eq__(self, other) -> bool:
        return isinstance(other, SampleLedger) and np.array_equal(self.segments, other.segments)

    def __repr__(self) -> str:
        return f"SampleLedger({self.segments.tolist()})"


class FeedRecorder:
    """One rank's record of the positions it fed since the last checkpoint. `record` is one list append
    per step (the step loop's hot path); the run-length encoding happens at checkpoint time in `take`."""

    def __init__(self):
        self._fed: list[np.ndarray] = []

    def record(self, positions: np.ndarray) -> None:
        self._fed.append(positions)

    def take(self) -> Segments:
        """The segments fed since the last call, and start over."""
        fed, self._fed = self._fed, []
        return runs(np.concatenate(fed)) if fed else _empty()
