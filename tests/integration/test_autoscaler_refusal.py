"""What Ray 2.60's autoscaler v2 does when the cloud *refuses* a spot launch outright (EC2's
InsufficientInstanceCapacity), as docs/cluster-lifecycle.md reports: it retries the spot type and never
falls back to the on-demand type; a spot request that is accepted and never runs Ray (`unfulfilled`) is
what makes it fall back (tests/integration/test_autoscaler.py). No training here: a standing resource
request (ray.autoscaler.sdk.request_resources, what Ray Train's autoscaling coordinator sets) is the demand.
Slow (about 1.5 min): it waits to see that a fallback does not come."""
from __future__ import annotations

import logging
import time

import pytest

pytestmark = pytest.mark.slow
WAIT_S = 45


@pytest.fixture()
def cluster(tmp_path):
    import ray

    from spotfill.sim.autoscaler_config import NodeTypeSpec
    from spotfill.sim.autoscaling import AutoscalingCluster
    c = AutoscalingCluster([NodeTypeSpec("gpu_spot", gpus=2, market="spot", max_workers=1, priority=10),
                            NodeTypeSpec("gpu_ondemand", gpus=2, market="on-demand", max_workers=1, priority=0)],
                           idle_timeout_s=5, workdir=str(tmp_path / "autoscaler"))
    try:
        ray.init(address=c.address, logging_level=logging.WARNING, log_to_driver=False)
        yield c
    finally:
        c.shutdown()


def test_refused_spot_launches_are_retried_and_never_fall_back(cluster):
    from ray.autoscaler.sdk import request_resources

    cluster.set_unavailable("gpu_spot", "refuse")
    request_resources(bundles=[{"GPU_SLOT": 1, "CPU": 1}] * 2)
    time.sleep(WAIT_S)
    log = cluster.provider_log()
    refused = [e for e in log if e["event"] == "refused"]
    assert len(refused) >= 5 and {e["node_type"] for e in refused} == {"gpu_spot"}
    assert not [e for e in log if e["event"] == "launched"], log     # no on-demand node came
    assert cluster.worker_nodes() == []
    # the same demand is met by spot at once when the market reopens: the refusals were the only obstacle
    cluster.set_unavailable("gpu_spot", None)
    nodes = cluster.wait_for(lambda: cluster.worker_nodes(), 60, "a node once spot is open again")
    assert [n["type"] for n in nodes] == ["gpu_spot"]
    request_resources(bundles=[])
