"""The count the arbiter sets for a Serve deployment is published for the app's Ingress
(fillin.serve_tenant.TARGET_KEY): after Serve's scale endpoint took it, not when Serve refused it. A stand-in
for the dashboard's scale endpoint on 127.0.0.1 and a dict for the GCS key-value store."""
from __future__ import annotations

import http.server
import json
import threading

from spotfill.fillin import serve_tenant
from spotfill.fillin.serve_tenant import ServeTenant, ServeTenantSpec, lent_target
from spotfill import ray_compat
from spotfill.ray_compat import ray_core


class _Scale(http.server.BaseHTTPRequestHandler):
    status = 200
    asked: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).asked.append(body["target_num_replicas"])
        self.send_response(type(self).status)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_the_count_serve_took_is_published_for_the_ingress(monkeypatch):
    store: dict = {}

    def put(k, v):
        store[k] = v

    def get(k):
        return store.get(k, "").encode() or None
    # where it lives, and on the package too: its attributes load lazily, and another test's patch there may
    # have left the real one cached on it
    for where in (ray_core, ray_compat):
        monkeypatch.setattr(where, "kv_put", put, raising=False)
        monkeypatch.setattr(where, "kv_get", get, raising=False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scale)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tenant = ServeTenant(ServeTenantSpec(app="app", deployment="Gen",
                                             dashboard_url=f"127.0.0.1:{server.server_address[1]}"))
        assert lent_target("app", "Gen") is None                  # nothing set yet: the Ingress forwards
        assert tenant.set_replicas(1) and lent_target("app", "Gen") == 1
        assert tenant.set_replicas(0) and lent_target("app", "Gen") == 0
        _Scale.status = 500                                        # Serve refused: the last count stands
        assert not tenant.set_replicas(1) and lent_target("app", "Gen") == 0
        assert store == {f"{serve_tenant.TARGET_KEY}app/Gen": "0"} and _Scale.asked == [1, 0, 1]
    finally:
        _Scale.status = 200
        server.shutdown()
