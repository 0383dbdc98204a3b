"""A local multi-node Ray cluster with the fill-in arbiter, for integration tests of fill-in tenants."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def fillin_cluster(nodes: int, gpus_per_node: int, state_path: str, gpu_resource: str = "GPU"):
    """Yields (EmbeddedCluster, arbiter handle): `nodes` worker nodes declaring `gpus_per_node` GPU slots,
    this process connected, the arbiter keeping its state at `state_path`. Serve (if started), the arbiter and
    the cluster are shut down at the end."""
    import ray
    from ray import serve

    from spotfill.fillin.arbiter_handle import ensure_arbiter
    from spotfill.fillin.wiring import runtime_env
    from spotfill.sim.cluster import EmbeddedCluster, quiet_expected_node_deaths

    cluster = EmbeddedCluster()
    try:
        for _ in range(nodes):
            cluster.add_node(gpus_per_node)
        ray.init(address=cluster.address, runtime_env=runtime_env(), logging_level="WARNING")
        quiet_expected_node_deaths()
        arbiter = ensure_arbiter(gpu_resource, runtime_env=runtime_env(), state_path=state_path)
        try:
            yield cluster, arbiter
        finally:
            try:
                serve.shutdown()
            finally:
                ray.kill(arbiter, no_restart=True)
    finally:
        cluster.shutdown()
