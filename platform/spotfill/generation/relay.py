"""A request that outlives its replica: one stream to the client, however many replicas it took.

The Ingress sends a request to a replica as a job (prompt, sampling parameters with a fixed seed, and the
tokens generated so far: none at first) and relays what comes back. When that replica is lost under the
request (its node died, Serve killed it after the shutdown grace) or is being stopped (the arbiter reclaimed
its GPU: `migrate()`), the job goes to another replica with the tokens already generated: that replica
prefills prompt + generated prefix and goes on from there. Sampling is keyed by (seed, token index)
(sampling.py), so the continuation draws what the first replica would have drawn; greedy output is identical.
When no replica runs, it waits for one as long as `replica_ready` allows (the queue bound), else the request
is lost (`Lost`: admitted, then lost -- a failure, not a refusal).

A replica answers a job with a stream of dicts: first {"admitted": true, "replica": id, ...} when it takes the
job, then updates {"ids", "text", "finish_reason", "completion_tokens", "emitted", ...}, or one
{"error": message, "code": ...}. Pure asyncio: the replica calls are passed in (spotfill/serving/app.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

log = logging.getLogger(__name__)


class NotAdmitted(Exception):
    """No replica took the request (none ran any more, or none picked it up in time): never admitted."""


class Lost(Exception):
    """The request was admitted and its replica lost, and no replica could continue it within the bound."""


class GenerationFailed(Exception):
    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class Relay:
    def __init__(self, job: dict, open_stream: Callable[[dict], object], *,
                 is_lost: Callable[[BaseException], bool],
                 replica_ready: Callable[[], Awaitable[bool]],
                 placeable: Callable[[], bool] = lambda: True,
                 admit_timeout_s: float = 30.0, max_attempts: int = 4, poll_s: float = 0.02):
        self.job = dict(job)
        self.open_stream, self.is_lost, self.replica_ready = open_stream, is_lost, replica_ready
        self.placeable, self.admit_timeout_s, self.max_attempts, self.poll_s = (
            placeable, admit_timeout_s, max_attempts, poll_s)
        self.generated: list[int] = list(job.get("generated") or [])
        self.emitted = int(job.get("emitted") or 0)
        self.counts = {k: int(job.get(k) or 0) for k in ("drafted", "accepted", "verify_steps")}
        self.admitted = False
        self.info: dict = {}                 # the admitting replica's first chunk (replica, checkpoint, ...)
        self.replica: str | None = None
        self.continuations: list[dict] = []  # one per replica change: why, after how many tokens
        self._stream = None
        self._migrating = False

    def next_job(self) -> dict:
        return {**self.job, "generated": list(self.generated), "emitted": self.emitted, **self.counts}

    def migrate(self) -> bool:
        """The request's replica is being stopped: continue on another now. False when nothing runs."""
        if self._stream is None or self._migrating:
            return False
        self._migrating = True
        self._stream.cancel()
        return True

    async def _next(self, it):
        return await it.__anext__()

    async def __aiter__(self):
        finished = False
        try:
            async for chunk in self._attempts():
                finished = bool(chunk.get("finish_reason"))
                yield chunk
        finally:
            if not finished and self._stream is not None:   # the client went away: stop the replica's work
                self._stream.cancel()

    async def _attempts(self):
        attempts = 0
        while True:
            attempts += 1
            self._migrating, admitted_here = False, False
            self._stream = self.open_stream(self.next_job())
            it = self._stream.__aiter__()
            why = None
            try:
                t0 = time.monotonic()
                while True:
                    task = asyncio.ensure_future(self._next(it))
                    if not admitted_here:     # not taken yet: give up when no replica can take it
                        while not task.done():
                            await asyncio.wait({task}, timeout=self.poll_s)
                            if not task.done() and (not self.placeable() or
                                                    time.monotonic() - t0 > self.admit_timeout_s):
                                task.cancel()
                                self._stream.cancel()
                                raise _Unplaced()
                    try:
                        chunk = await task
                    except StopAsyncIteration:
                        why = "its stream ended before the request finished"
                        break
                    if chunk.get("admitted"):
                        admitted_here, self.admitted = True, True
                        self.info, self.replica = chunk, chunk.get("replica")
                        continue
                    if "error" in chunk:
                        raise GenerationFailed(str(chunk["error"]), chunk.get("code"))
                    self._absorb(chunk)
                    yield chunk
                    if chunk.get("finish_reason"):
                        return
            except _Unplaced:
                if not self.admitted:
                    raise NotAdmitted("no generation replica picked the request up") from None
                why = "no replica took its continuation"
            except GenerationFailed:
                raise
            except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - judged here
                if not (self._migrating or isinstance(exc, Exception) and self.is_lost(exc)):
                    raise
                why = ("its replica was stopped (GPU reclaimed)" if self._migrating else
                       f"its replica was lost ({type(exc).__name__})")
            self.continuations.append({"t": time.time(), "replica": self.replica, "why": why,
                                       "after_tokens": len(self.generated)})
            log.info("request %s: %s after %d tokens; continuing elsewhere", self.job.get("request_id"), why,
                     len(self.generated))
            if attempts >= self.max_attempts or not await self.replica_ready():
                raise Lost(f"the replica generating it was lost after {len(self.generated)} tokens ({why}) and "
                           "no replica could continue it in time")

    def _absorb(self, chunk: dict) -> None:
        self.generated.extend(chunk.get("ids") or [])
        self.emitted = int(chunk.get("emitted", self.emitted))
        for k in self.counts:
            if k in chunk:
                self.counts[k] = int(chunk[k])


class _Unplaced(Exception):
    pass
