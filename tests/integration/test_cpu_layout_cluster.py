"""The embedded cluster with a cpu_layout (the fill-in bench's emulation of separate machines): the head's
processes and this driver run on the head's cores, each node's raylet and every worker it starts on the
node's, and the driver gets its own cores back at shutdown."""
import os

import pytest

from spotfill.sim.cluster import EmbeddedCluster
from spotfill.sim.cpu_layout import plan_layout, thread_affinities

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores for two machines")


def test_head_and_node_processes_run_on_their_own_cores():
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    before = os.sched_getaffinity(0)
    layout = plan_layout([1])
    head_core, node_core = set(layout["head"]), set(layout["nodes"][0])
    cluster = EmbeddedCluster("GPU_SLOT", cpu_layout=layout)
    try:
        cluster.add_node(1)
        assert os.sched_getaffinity(0) == head_core               # the driver runs with the head
        ray.init(address=cluster.address, log_to_driver=False)

        @ray.remote(num_cpus=0)
        def cores() -> tuple[set, set]:
            return os.sched_getaffinity(0), set().union(*thread_affinities(os.getpid()).values())

        # a worker the node's raylet starts now, after the pinning, and one on the head
        on_node = cores.options(resources={"GPU_SLOT": 1}).remote()
        on_head = cores.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            cluster.cluster.head_node.node_id, soft=False)).remote()
        assert ray.get(on_node, timeout=120) == (node_core, node_core)
        assert ray.get(on_head, timeout=120) == (head_core, head_core)
    finally:
        cluster.shutdown()
    assert os.sched_getaffinity(0) == before
