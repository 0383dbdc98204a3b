"""The embedded cluster starts beside another local Ray: its dashboard's usual port (8265) taken -- also when
a check a moment before had found it free (two `spotfill serve` started together) -- the dashboard binds a
free port of its own, the head registers where, and the dashboard answers there."""
from __future__ import annotations

import json
import socket
import urllib.request

import pytest

pytestmark = pytest.mark.timeout(300)


def test_a_cluster_starts_with_the_dashboards_port_taken(monkeypatch):
    from spotfill.sim import cluster as sim_cluster
    held = socket.socket()
    try:
        try:
            held.bind(("127.0.0.1", 8265))
            held.listen()
        except OSError:
            pass                                   # another local Ray's dashboard has it already
        # any check of the port says "free": the moment between such a check and the dashboard's bind
        monkeypatch.setattr(sim_cluster, "free_port", lambda preferred=0, *a, **k: preferred or 8265)
        c = sim_cluster.EmbeddedCluster(head_cpus=1)
        try:
            url = c.cluster.webui_url
            assert url and not url.endswith(":8265"), url
            with urllib.request.urlopen(f"http://{url}/api/version", timeout=30) as r:
                assert "ray_version" in json.loads(r.read())
        finally:
            c.shutdown()
    finally:
        held.close()
