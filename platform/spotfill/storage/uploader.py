"""Background checkpoint upload: one job in flight, with back-pressure (no Ray, no torch)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)


class AsyncUploader:
    """One background upload at a time, with back-pressure.

    `submit(fn, *args)` hands a job to the worker thread and returns at once when the worker is idle; if
    the previous job is still running it BLOCKS until it finishes (the time is counted in
    `stats()["blocked_seconds_total"]`). So at most one upload is in flight and none is queued; the caller's
    next snapshot should go to a fresh directory (e.g. one per tag). A job that failed raises its error
    from the next `submit()` or `wait()` (the new job is then not started). A job may return an int (bytes)
    or a dict with "bytes" (like upload_part's marker) for the stats.
    """

    def __init__(self, name: str = "checkpoint-upload"):
        self._cond = threading.Condition()
        self._job: tuple[Callable, tuple, dict] | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._stats = {"jobs": 0, "failed": 0, "bytes_total": 0, "upload_seconds": [],
                       "blocked_seconds_total": 0.0, "blocked_seconds_max": 0.0, "last_blocked_seconds": 0.0}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a job is running now."""
        with self._cond:
            return self._busy

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
        """Run fn(*args, **kwargs) in the background; returns the seconds this call was blocked."""
        t0 = time.monotonic()
        with self._cond:
            if self._closed:
                raise RuntimeError("AsyncUploader is closed")
            while self._busy:
                self._cond.wait()
            blocked = time.monotonic() - t0
            st = self._stats
            st["blocked_seconds_total"] += blocked
            st["blocked_seconds_max"] = max(st["blocked_seconds_max"], blocked)
            st["last_blocked_seconds"] = blocked
            if blocked > 0.01:
                log.info("checkpoint upload back-pressure: waited %.2fs for the previous upload", blocked)
            self._raise_pending()
            self._job, self._busy = (fn, args, kwargs), True
            self._cond.notify_all()
        return blocked

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no job runs (True) or `timeout` passes (False); raise a failed job's error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            self._raise_pending()
        return True

    def close(self, wait: bool = True) -> None:
        """Stop the worker (after the running job when wait=True, raising its error)."""
        try:
            if wait:
                self.wait()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        """jobs, failed, bytes_total, upload_seconds (per job), blocked_seconds_total/max/last."""
        with self._cond:
            out = dict(self._stats)
            out["upload_seconds"] = list(self._stats["upload_seconds"])
            return out

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._job is None:
                    return
                fn, args, kwargs = self._job
            t0 = time.monotonic()
            error, result = None, None
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - surfaced to the caller on submit/wait
                error = exc
                log.error("background checkpoint upload failed: %s: %s", type(exc).__name__, exc)
            seconds = time.monotonic() - t0
            nbytes = result if isinstance(result, int) else \
                result.get("bytes", 0) if isinstance(result, dict) else 0
            with self._cond:
                st = self._stats
                st["jobs"] += 1
                st["upload_seconds"].append(seconds)
                if error is not None:
                    st["failed"] += 1
                    self._error = error
                else:
                    st["bytes_total"] += int(nbytes or 0)
                self._job, self._busy = None, False
                self._cond.notify_all()
