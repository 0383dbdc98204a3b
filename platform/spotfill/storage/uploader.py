"""Background checkpoint uploads that never block the step loop (no Ray, no torch).

`AsyncUploader` runs at most one ACTIVE upload job at a time and holds at most one PENDING job behind it:

* `submit()` never waits. With no active job the new one starts at once (on its own thread); otherwise it
  becomes the pending job, and a pending job it replaces is SUPERSEDED (returned, so the caller can delete
  its snapshot and report it skipped). That is coalescing: during a storage outage the step loop keeps
  going and only the newest snapshot waits for the endpoint to come back.
* `cancel()` is safe against a concurrent commit: a job's commit step calls `job.claim()` right before it
  writes anything that makes the checkpoint visible (the manifest), and claim and cancel decide under one
  lock. Whichever comes first wins: a cancelled job can never commit (claim raises `Cancelled`), and a job
  that claimed can no longer be cancelled (cancel returns False and the caller knows it may commit).
  Jobs also call `job.check()` between phases, so a cancelled one stops at the next phase boundary.
* A cancelled running job stops being active at once: the next job starts on a fresh thread while the
  old one winds down (an upload already on the wire cannot be interrupted; its caller deletes its files,
  which makes the rest of it fail fast).

A job is `fn(job, *args)`; it may return an int (bytes) or a dict with "bytes" for the stats. A job's
error is kept on the job (`job.error`), never raised into submit(): a failed periodic upload is a skipped
checkpoint, not a crashed training run; callers that need the result wait on the job and raise it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

PENDING, RUNNING, COMMITTING, DONE, FAILED, CANCELLED, SUPERSEDED = (
    "pending", "running", "committing", "done", "failed", "cancelled", "superseded")
_FINAL = (DONE, FAILED, CANCELLED, SUPERSEDED)


class Cancelled(Exception):
    """Raised inside a job (by check() or claim()) once it was cancelled: it must not commit."""


class UploadJob:
    """One upload: its state machine, its outcome and a wait handle. `key` names it (a tag)."""

    def __init__(self, owner: "AsyncUploader", key: str, step: int | None, fn: Callable, args: tuple):
        self._owner, self.key, self.step, self.fn, self.args = owner, key, step, fn, args
        self.state, self.reason = PENDING, ""
        self.result: Any = None
        self.error: BaseException | None = None
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.finished: float | None = None
        self._done = threading.Event()   # set when the job reached a final state AND its thread let go

    def __repr__(self) -> str:
        return f"UploadJob({self.key!r}, {self.state})"

    @property
    def cancelled(self) -> bool:
        return self.state in (CANCELLED, SUPERSEDED)

    def check(self) -> None:
        """Raise Cancelled if this job was cancelled (call it between phases)."""
        if self.cancelled:
            raise Cancelled(f"{self.key}: {self.reason}")

    def claim(self) -> None:
        """Call right before making the upload visible (the commit): afterwards cancel() cannot stop it;
        raises Cancelled if cancel() came first."""
        with self._owner._cond:
            self.check()
            self.state = COMMITTING

    def wait(self, timeout: float | None = None) -> bool:
        """Until the job's thread is done with it (True), or `timeout` seconds (False)."""
        return self._done.wait(timeout)

    def running_s(self, now: float | None = None) -> float:
        """Seconds since the job started (0 if it has not)."""
        if self.started is None:
            return 0.0
        return (self.finished or (time.monotonic() if now is None else now)) - self.started


class AsyncUploader:
    """At most one active upload and one pending one; submit never blocks (see the module docstring)."""

    def __init__(self, name: str = "checkpoint-upload"):
        self.name = name
        self._cond = threading.Condition()
        self._active: UploadJob | None = None
        self._pending: UploadJob | None = None
        self._draining: set[UploadJob] = set()     # cancelled jobs whose thread still runs
        self._closed = False
        self._threads = 0
        self._stats = {"jobs": 0, "failed": 0, "cancelled": 0, "superseded": 0, "bytes_total": 0,
                       "upload_seconds": []}

    # -- state ----------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether an upload is active or pending."""
        with self._cond:
            return self._active is not None or self._pending is not None

    @property
    def active(self) -> UploadJob | None:
        with self._cond:
            return self._active

    @property
    def pending(self) -> UploadJob | None:
        with self._cond:
            return self._pending

    def outstanding(self) -> list[UploadJob]:
        """The active job and the pending one (those that may still commit), oldest first."""
        with self._cond:
            return [j for j in (self._active, self._pending) if j is not None]

    # -- submitting and cancelling ----------------------------------------------------------------------
    def submit(self, key: str, fn: Callable[..., Any], *args: Any, step: int | None = None
               ) -> tuple[UploadJob, UploadJob | None]:
        """Start `fn(job, *args)` now, or make it the pending job. Never blocks.

        Returns (job, superseded): the pending job this one replaced (state SUPERSEDED, never started),
        or None."""
        job = UploadJob(self, key, step, fn, args)
        with self._cond:
            if self._closed:
                raise RuntimeError("AsyncUploader is closed")
            replaced = None
            if self._active is None:
                self._start_locked(job)
            else:
                replaced, self._pending = self._pending, job
                if replaced is not None:
                    self._finish_locked(replaced, SUPERSEDED, f"superseded by {key} while "
                                        f"{self._active.key} was still uploading")
        return job, replaced

    def cancel(self, job: UploadJob, reason: str) -> bool:
        """Cancel a pending or running job: True means it will never commit. False when it had already
        claimed its commit (or finished): it may commit / has committed."""
        with self._cond:
            if job.state not in (PENDING, RUNNING):
                return False
            was_running = job.state == RUNNING
            self._finish_locked(job, CANCELLED, reason)
            if self._pending is job:
                self._pending = None
            if self._active is job:
                self._active = None
                self._draining.add(job)
                if self._pending is not None and not self._closed:
                    nxt, self._pending = self._pending, None
                    self._start_locked(nxt)
            if not was_running:
                job._done.set()
        log.info("checkpoint upload %s cancelled: %s", job.key, reason)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Until no job is active or pending (True), or `timeout` passes (False). Raises nothing: each
        job's outcome is on the job."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._active is not None or self._pending is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop taking jobs; with wait=True first let the active and pending ones finish."""
        try:
            if wait:
                self.wait(timeout)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        """jobs (finished runs), failed, cancelled, superseded, bytes_total, upload_seconds per job."""
        with self._cond:
            out = dict(self._stats)
            out["upload_seconds"] = list(self._stats["upload_seconds"])
            return out

    # -- internals --------------------------------------------------------------------------------------
    def _start_locked(self, job: UploadJob) -> None:
        job.state, job.started, self._active = RUNNING, time.monotonic(), job
        self._threads += 1
        threading.Thread(target=self._run, args=(job,), name=f"{self.name}-{self._threads}",
                         daemon=True).start()

    def _finish_locked(self, job: UploadJob, state: str, reason: str = "") -> None:
        job.state, job.reason = state, reason or job.reason
        job.finished = job.finished or time.monotonic()
        if state in (CANCELLED, SUPERSEDED, FAILED):
            self._stats[{CANCELLED: "cancelled", SUPERSEDED: "superseded", FAILED: "failed"}[state]] += 1
        if state == SUPERSEDED:
            job._done.set()
        self._cond.notify_all()

    def _run(self, job: UploadJob) -> None:
        while job is not None:
            error, result = None, None
            try:
                job.check()
                result = job.fn(job, *job.args)
            except BaseException as exc:  # noqa: BLE001 - kept on the job for its owner
                error = exc
            job = self._after(job, result, error)

    def _after(self, job: UploadJob, result: Any, error: BaseException | None) -> UploadJob | None:
        """Record a job's outcome; return the pending job to run next on this thread (or None)."""
        seconds = job.running_s()
        nbytes = result if isinstance(result, int) else \
            result.get("bytes", 0) if isinstance(result, dict) else 0
        with self._cond:
            self._stats["jobs"] += 1
            self._stats["upload_seconds"].append(seconds)
            job.result = result
            if job.cancelled:
                self._draining.discard(job)
                job.error = error if not isinstance(error, Cancelled) else None
            elif error is not None:
                job.error = error
                log.error("checkpoint upload %s failed: %s: %s", job.key, type(error).__name__, error)
                self._finish_locked(job, FAILED, f"upload failed: {type(error).__name__}: {error}")
            else:
                self._stats["bytes_total"] += int(nbytes or 0)
                self._finish_locked(job, DONE)
            job.finished = job.finished or time.monotonic()
            job._done.set()
            nxt = None
            if self._active is job:
                self._active = None
                if self._pending is not None and not self._closed:
                    nxt, self._pending = self._pending, None
                    nxt.state, nxt.started, self._active = RUNNING, time.monotonic(), nxt
            self._cond.notify_all()
            return nxt
