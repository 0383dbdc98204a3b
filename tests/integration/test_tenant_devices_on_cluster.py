"""Fill-in tenants compute on the device Ray assigned them (spotfill.devices), on a local cluster whose worker
node declares one GPU on this CPU machine (one cluster for the module): a num_gpus=1 actor gets the GPU
(ray.get_gpu_ids, CUDA_VISIBLE_DEVICES) and would compute on cuda:0 where CUDA sees a device, a num_gpus=0
actor stays on the CPU even then; a batch wave's actors and a sweep trial are assigned the GPU and, CUDA
being absent here, compute on the CPU in fp32 -- and say so. benchmarks/gpu_check.py runs the same on a GPU."""
from __future__ import annotations

import pytest

from benchmarks import gpu_tenants

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster():
    import ray

    from spotfill.sim.cluster import LOOPBACK_NODE, EmbeddedCluster, worker_env

    c = EmbeddedCluster(head_cpus=1)
    c.cluster.add_node(**LOOPBACK_NODE, num_cpus=2, num_gpus=1)     # Ray's own GPU resource, on a CPU machine
    ray.init(address=c.address, runtime_env={"env_vars": worker_env()}, logging_level="WARNING")
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_the_device_follows_rays_assignment(cluster):
    seen = gpu_tenants.placements()
    assert seen["assigned"]["gpu_ids"] == ["0"] and seen["assigned"]["cuda_visible_devices"] == "0", seen
    assert seen["unassigned"]["gpu_ids"] == [], seen
    assert seen["assigned"]["device"] == seen["unassigned"]["device"] == "cpu", seen     # no CUDA here
    assert seen["assigned"]["dtype"] == "float32", seen
    # where CUDA sees a device (faked inside the actors): the assigned actor takes it, the other does not
    faked = gpu_tenants.placements(fake_cuda_devices=1)
    assert faked["assigned"]["device"] == "cuda:0" and faked["unassigned"]["device"] == "cpu", faked


def test_a_batch_waves_actors_compute_where_ray_put_them(cluster, tmp_path):
    out = gpu_tenants.batch_wave(str(tmp_path))
    assert set(out["markers"]) == {"eval-00000", "generate-00000"}, out
    for marker in out["markers"].values():
        assert marker["gpu_ids"] == ["0"] and marker["device"] == "cpu" and marker["dtype"] == "float32", marker
    assert out["rows_written"] == gpu_tenants.ROWS + len(gpu_tenants.PROMPTS) and out["duplicates"] == 0, out
    assert out["eval"]["loss"] > 0, out


def test_a_sweep_trial_computes_where_ray_put_it(cluster, tmp_path):
    out = gpu_tenants.sweep_trial(str(tmp_path))
    assert out["completed"] == 1 and not out["error"], out
    assert out["gpu_ids"] == ["0"] and out["device"] == "cpu" and out["dtype"] == "float32", out
    assert out["history_ok"] and out["eval_loss"] > 0, out
