"""A paused sweep trial's state kept in host memory, so its resume needs no storage round trip: the pure half
(no Ray import); the keeper actor that holds it is fillin/sweep_keeper.py, the trainable that fills and
reads it fillin/sweep_trial.py.

Each time a trial saves a checkpoint (a pause, a periodic checkpoint), it writes its state to storage as
before and then hands the very same bytes to the sweep's keeper, labelled with a `StateId`: the trial, the
step, the storage checkpoint those bytes were written to, and their SHA-256. The checksum also goes into
the checkpoint's record that Tune keeps and hands back when it restores the trial, so a resumed trial knows
exactly which state it must restore without reading storage. It takes the kept bytes only when `mismatch`
finds nothing: same trial, step, checkpoint and checksum, and bytes that hash to that checksum; otherwise
it reads the storage checkpoint and says why.

`Shelf` holds one state per trial (the newest save replaces the older one) within a memory budget: the
oldest states are evicted to make room; a state larger than the whole budget is not kept (the put answers
why). A trial's state is dropped when the trial is done.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from typing import Callable

MEMORY, STORAGE = "memory", "storage"      # where a restored trial's state came from
SHA_KEY = "state_sha256"                   # the checksum in the checkpoint's metrics (Tune's record of it)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class StateId:
    trial: str
    step: int
    checkpoint: str      # the storage checkpoint these bytes were written to (Tune's persisted path)
    sha256: str          # of the bytes (the storage checkpoint's state.pt)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StateId":
        return cls(str(d["trial"]), int(d["step"]), str(d["checkpoint"]), str(d["sha256"]))


def wanted_state(trial: str, checkpoint: str | None, metrics: dict) -> tuple[StateId | None, str | None]:
    """The state a restore of `checkpoint` (with Tune's `metrics` of it) must get, or (None, why) when the
    checkpoint's record lacks what identifies it (a checkpoint saved without a keeper, or by older code)."""
    step, sha = metrics.get("step"), metrics.get(SHA_KEY)
    if not checkpoint:
        return None, "the checkpoint to restore has no storage path"
    if step is None or not sha:
        return None, "the checkpoint's record has no step or checksum (saved without a state keeper)"
    return StateId(trial, int(step), checkpoint, str(sha)), None


def mismatch(wanted: StateId, got: StateId | None, data: bytes | None) -> str | None:
    """Why a kept state may not stand in for the checkpoint `wanted` (None: it is exactly that state)."""
    if got is None or data is None:
        return "no state kept for this trial"
    if got.trial != wanted.trial:
        return f"the kept state is trial {got.trial}'s, not {wanted.trial}'s"
    if got.step != wanted.step:
        return f"the kept state is step {got.step}'s, the checkpoint restored is step {wanted.step}'s"
    if got.checkpoint != wanted.checkpoint:
        return f"the kept state is checkpoint {got.checkpoint}, not {wanted.checkpoint}"
    if got.sha256 != wanted.sha256:
        return "the kept state's checksum is not the checkpoint's"
    if digest(data) != wanted.sha256:
        return "the kept bytes do not hash to the checkpoint's checksum"
    return None


class Shelf:
    """Trial id -> its newest kept state, at most `budget_bytes` in all (oldest evicted first)."""

    def __init__(self, budget_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.budget = max(0, int(budget_bytes))
        self.clock = clock
        self._states: dict[str, tuple[StateId, bytes, float]] = {}     # insertion order = put order
        self.held = 0
        self.counts = {"kept": 0, "replaced": 0, "evicted": 0, "not_kept": 0, "hits": 0, "misses": 0,
                       "dropped": 0}
        self.held_max = 0
        self.not_kept: list[dict] = []        # {"trial", "step", "bytes", "why"}

    def put(self, sid: StateId, data: bytes) -> dict:
        """Keep `data` as `sid.trial`'s state (replacing its older one). Returns {"kept", "evicted", "why"}."""
        self._remove(sid.trial, "replaced")
        size = len(data)
        if size > self.budget:
            why = f"state of {size} bytes is over the memory budget of {self.budget} bytes"
            self.counts["not_kept"] += 1
            self.not_kept.append({"trial": sid.trial, "step": sid.step, "bytes": size, "why": why})
            return {"kept": False, "evicted": [], "why": why}
        evicted = []
        while self.held + size > self.budget and self._states:
            oldest = next(iter(self._states))
            self._remove(oldest, "evicted")
            evicted.append(oldest)
        self._states[sid.trial] = (sid, data, self.clock())
        self.held += size
        self.held_max = max(self.held_max, self.held)
        self.counts["kept"] += 1
        return {"kept": True, "evicted": evicted, "why": None}

    def take(self, wanted: StateId) -> tuple[bytes | None, str | None]:
        """The kept bytes of exactly `wanted` (kept on: a trial that dies before its next checkpoint is
        restored from the same one), or (None, why)."""
        entry = self._states.get(wanted.trial)
        got, data = (entry[0], entry[1]) if entry else (None, None)
        why = mismatch(wanted, got, data)
        self.counts["misses" if why else "hits"] += 1
        return (None, why) if why else (data, None)

    def peek(self, trial: str) -> StateId | None:
        entry = self._states.get(trial)
        return entry[0] if entry else None

    def drop(self, trial: str) -> bool:
        return self._remove(trial, "dropped")

    def _remove(self, trial: str, why: str) -> bool:
        entry = self._states.pop(trial, None)
        if entry is None:
            return False
        self.held -= len(entry[1])
        self.counts[why] += 1
        return True

    def stats(self) -> dict:
        return {"budget_bytes": self.budget, "held_bytes": self.held, "held_bytes_max": self.held_max,
                "states": len(self._states), **self.counts, "not_kept_detail": list(self.not_kept)}
