"""The scenario's HTTP load generator against a real loopback HTTP server that answers 200, 503 or 500
(and one that never answers in time): each answer lands in the right count of report.json fillin.serve."""
from __future__ import annotations

import http.server
import itertools
import threading
import time

from spotfill.fillin.load import ServeLoad, percentile, summarize_requests


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0


def test_summary_counts_503_as_rejected_and_everything_else_as_failed():
    results = [{"t": 0, "latency_s": 0.010, "status": 200}, {"t": 0, "latency_s": 0.030, "status": 200},
               {"t": 0, "latency_s": 0.002, "status": 503}, {"t": 1, "latency_s": 0.5, "status": 500},
               {"t": 2, "latency_s": 20.0, "status": None, "error": "TimeoutError: timed out"}]
    s = summarize_requests(results, rps=2)
    assert (s["requests_ok"], s["requests_rejected_503"], s["requests_failed"]) == (2, 1, 2)
    assert s["p50_ms"] == 10.0 and s["p99_ms"] == 30.0 and s["rejected_503_max_ms"] == 2.0
    assert [f["status"] for f in s["failures"]] == [500, None]


def test_a_request_lost_after_a_replica_took_it_is_a_failure_not_a_refusal():
    """serving/app.py answers 503 both for a request no replica took (refused) and for one whose replica was
    lost and could not be continued (code replica_lost: admitted, then lost) -- only the first is a refusal."""
    results = [{"t": 0, "latency_s": 0.01, "status": 503, "code": "replicas_reclaimed", "reason": "reclaimed"},
               {"t": 1, "latency_s": 3.2, "status": 503, "code": "replica_lost", "reason": "lost after 7 tokens"},
               {"t": 2, "latency_s": 0.02, "status": 200}]
    s = summarize_requests(results)
    assert (s["requests_ok"], s["requests_rejected_503"], s["requests_lost"], s["requests_failed"]) == (1, 1, 1, 1)
    assert s["failures"] == [{"t": 1, "status": 503, "error": "lost after 7 tokens"}]
    assert s["rejected_503_reasons"] == {"reclaimed": 1}


class _Handler(http.server.BaseHTTPRequestHandler):
    answers = itertools.cycle([200, 200, 503, 500, "slow"])
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.lock:
            answer = next(self.answers)
        if answer == "slow":
            time.sleep(1.5)
            answer = 200
        self.send_response(answer)
        if answer == 503:
            self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(b'{"error": {"message": "no generation replica", "code": 503}}' if answer == 503
                         else b'{"choices": []}')

    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):   # the client gave up on the slow answer: expected
        pass


def test_open_loop_load_against_a_real_server():
    server = _Server(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        load = ServeLoad(f"http://127.0.0.1:{server.server_port}", rps=20, timeout_s=1.0).start()
        time.sleep(1.0)
        s = load.stop()
    finally:
        server.shutdown()
    assert 15 <= s["requests"] <= 25, s
    # the cycle: 2 ok, 1 x 503, 1 x 500, 1 answered after the client's timeout: each counted where it belongs
    assert s["requests_ok"] > 0 and s["requests_rejected_503"] > 0
    assert s["requests_failed"] >= 2 and {f["status"] for f in s["failures"]} == {500, None}
    assert s["requests_ok"] + s["requests_rejected_503"] + s["requests_failed"] == s["requests"]
    # why each 503 was refused comes from its body, counted per reason
    assert s["rejected_503_reasons"] == {"no generation replica": s["requests_rejected_503"]}, s
