"""A steady HTTP load on the Serve fill-in tenant (the scenario runner's, for the whole scenario).

Open loop: a request starts every 1/rps seconds whatever the earlier ones are doing (up to `max_in_flight`
at once; a start that finds them all busy is counted as `skipped_client_busy`, never queued), each a
`POST /v1/completions` with a bounded generation. Every answer is kept; `summary()` reduces them to
report.json's `fillin.serve` (pure: `summarize_requests`):

  requests_ok            HTTP 200 with a completion
  requests_rejected_503  HTTP 503 for a request no replica took (none ran: its GPUs went back to training,
                         one was still starting past max_queue_wait_s, no checkpoint yet) -- refused, never
                         admitted
  requests_lost          HTTP 503 with code `replica_lost`: a replica took the request, was lost under it,
                         and no replica could continue it within the queue bound -- admitted, then lost;
                         counted in requests_failed too
  requests_failed        every admitted request that failed: the lost ones, another status, a connection
                         error, or no answer within the client timeout
  p50_ms / p99_ms        latency of the OK requests
  rejected_503_reasons   each distinct reason the 503 bodies gave, with its count (why requests were
                         refused: no replica, none picked it up, no checkpoint yet)

`nice` (the scenario runner: 19): the generator's threads run at that CPU nice value. It stands in for
clients that are elsewhere on a real cluster; on one machine it must not take CPU time from training
(the thread that starts requests is reniced, and the pool threads it starts inherit its nice value).
"""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

# the 503 codes of an admitted request that was lost (serving/app.py): a failure, not a refusal
LOST_CODES = frozenset({"replica_lost"})


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 100)) - 1))
    return ordered[k]


def summarize_requests(results: list[dict], rps: float | None = None, skipped: int = 0) -> dict:
    """report.json fillin.serve from the answers: {t, latency_s, status, error}."""
    ok = [r["latency_s"] * 1000 for r in results if r.get("status") == 200]
    lost = [r for r in results if r.get("status") == 503 and r.get("code") in LOST_CODES]
    rejected = [r for r in results if r.get("status") == 503 and r.get("code") not in LOST_CODES]
    failed = [r for r in results if r.get("status") not in (200, 503)] + lost
    p50, p99 = percentile(ok, 50), percentile(ok, 99)
    out = {"requests": len(results), "requests_ok": len(ok), "requests_failed": len(failed),
           "requests_lost": len(lost), "requests_rejected_503": len(rejected),
           "p50_ms": None if p50 is None else round(p50, 1), "p99_ms": None if p99 is None else round(p99, 1),
           "rejected_503_max_ms": round(max(r["latency_s"] for r in rejected) * 1000, 1) if rejected else None,
           "rejected_503_reasons": rejection_reasons(rejected),
           "skipped_client_busy": skipped,
           # which replicas answered: lent (fill-in, on GPUs training left) or the app's floor
           "answered_by": {k: sum(1 for r in results if r.get("status") == 200 and r.get("served_by") == k)
                           for k in ("lent", "floor")},
           "failures": [{"t": round(r["t"], 3), "status": r.get("status"),
                         "error": r.get("error") or r.get("reason")} for r in failed[:10]]}
    if rps is not None:
        out["load_rps"] = rps
    return out


def rejection_reasons(rejected: list[dict]) -> dict[str, int]:
    """{reason: count} over the 503 answers (their body's message; "?" where it had none)."""
    return dict(Counter(r.get("reason") or "?" for r in rejected).most_common())


def _error_fields(body: bytes) -> tuple[str | None, str | None]:
    """(message, code) of a JSON error body ({"error": {"message", "code"}} or {"error": "..."})."""
    try:
        err = json.loads(body or b"{}").get("error")
    except (ValueError, AttributeError):
        return None, None
    msg = err.get("message") if isinstance(err, dict) else err
    code = err.get("code") if isinstance(err, dict) else None
    return (str(msg)[:160] if msg else None), (str(code) if code is not None else None)


# the client's patience: longer than the app's own bound on an answer (serving/app.py: a request waits up to
# max_queue_wait_s, 15 s by default, for a replica starting; a taken request up to 5 s more to be picked up;
# then its generation) -- at 20 s a demo counted 2 requests queued for a starting replica as failed
CLIENT_TIMEOUT_S = 60.0


class ServeLoad:
    def __init__(self, url: str, rps: float, max_tokens: int = 8, timeout_s: float = CLIENT_TIMEOUT_S,
                 max_in_flight: int = 16, nice: int = 0, extra_body: dict | None = None):
        self.url, self.rps, self.max_tokens, self.timeout_s = url.rstrip("/"), float(rps), max_tokens, timeout_s
        self.extra_body = dict(extra_body or {})       # more request fields (e.g. ignore_eos: long answers)
        self.nice = int(nice)
        self.results: list[dict] = []
        self.skipped = 0
        self._slots = threading.Semaphore(max_in_flight)
        self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="serve-load")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serve-load", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> "ServeLoad":
        self._thread.start()
        return self

    def _run(self) -> None:
        if self.rps <= 0:          # load_rps 0: Serve deployed and lent GPUs, no request sent
            return
        if self.nice > 0:          # Linux: per thread; the pool's threads are started here and inherit it
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError:
                pass
        period, n, t0 = 1.0 / self.rps, 0, time.monotonic()
        while not self._stop.is_set():
            if self._slots.acquire(blocking=False):
                self._pool.submit(self._one, n)
            else:
                self.skipped += 1
            n += 1
            self._stop.wait(max(0.0, t0 + n * period - time.monotonic()))

    def _one(self, n: int) -> None:
        t, t0 = time.time(), time.monotonic()
        body = json.dumps({"model": "spotfill", "prompt": f"def f{n % 97}(", "max_tokens": self.max_tokens,
                           "temperature": 0, **self.extra_body}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        rec: dict = {"t": t}
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                answer = resp.read()
                rec["status"] = resp.status
                try:
                    rec["served_by"] = json.loads(answer or b"{}").get("served_by")
                except ValueError:
                    pass
        except urllib.error.HTTPError as exc:
            rec["status"] = exc.code
            rec["retry_after"] = exc.headers.get("Retry-After")
            if exc.code == 503:
                try:
                    rec["reason"], rec["code"] = _error_fields(exc.read())
                except OSError:
                    rec["reason"] = None
        except Exception as exc:  # noqa: BLE001 - a connection error or timeout is a failed request
            rec["status"], rec["error"] = None, f"{type(exc).__name__}: {exc}"[:200]
        finally:
            rec["latency_s"] = time.monotonic() - t0
            with self._lock:
                self.results.append(rec)
            self._slots.release()

    def stop(self) -> dict:
        """Stop starting requests, wait for those in flight, return the summary."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=True)
        return self.summary()

    def summary(self) -> dict:
        with self._lock:
            return summarize_requests(list(self.results), self.rps, self.skipped)
