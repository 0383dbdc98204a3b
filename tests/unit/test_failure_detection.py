"""How fast a silent node and a silent rank are noticed: the health-check settings (config/failure_detection.py)
checked against what Ray itself reads, and the collective timeout a training run gets (no Ray cluster)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from spotfill.config.failure_detection import CLUSTER, EMBEDDED, RAY_DEFAULT, HealthCheck

READ = ("import json, ray; print(json.dumps({k: getattr(ray._config, 'health_check_' + k)() "
        "for k in ('period_ms', 'timeout_ms', 'failure_threshold')}))")


def ray_reads(env: dict[str, str]) -> HealthCheck:
    """The health-check settings Ray's config reader (RayConfig, the GCS's) takes from `env`, in a fresh
    interpreter with no other RAY_ variable."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", READ], env={**base, **env}, capture_output=True, text=True,
                         check=True, timeout=60)
    return HealthCheck(**json.loads(out.stdout.strip().splitlines()[-1]))


def test_bounds_by_hand():
    hc = HealthCheck(period_ms=2000, timeout_ms=3000, failure_threshold=4)
    # worst: frozen right after a passed check -> next check 2 s later, 4 checks of 3 s timeout, 2 s apart
    assert hc.silent_node_bound_s() == 4 * (2 + 3) == 20
    assert hc.silent_node_min_s() == 4 * 3 + 3 * 2 == 18       # a check in flight fails first
    assert hc.killed_node_bound_s() == 8                     # refused at once, a period apart
    assert hc.system_config() == {"health_check_period_ms": 2000, "health_check_timeout_ms": 3000,
                                  "health_check_failure_threshold": 4}
    assert hc.env() == {"RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "3000",
                        "RAY_health_check_failure_threshold": "4"}


def test_ray_default_is_what_the_installed_ray_uses():
    assert ray_reads({}) == RAY_DEFAULT
    assert RAY_DEFAULT.silent_node_bound_s() == 65.0


@pytest.mark.parametrize("settings", [CLUSTER, EMBEDDED])
def test_the_environment_names_are_the_ones_ray_reads(settings):
    assert ray_reads(settings.env()) == settings


def test_cluster_settings_detect_a_silent_node_well_before_ray_defaults():
    assert CLUSTER.silent_node_bound_s() <= 20 < RAY_DEFAULT.silent_node_min_s()
    assert EMBEDDED.silent_node_bound_s() <= CLUSTER.silent_node_bound_s()


def test_the_embedded_cluster_uses_the_embedded_settings():
    from spotfill.sim.cluster import FAST_FAILURE_DETECTION
    assert FAST_FAILURE_DETECTION == EMBEDDED.system_config()


# --- the collective timeout -------------------------------------------------------------------------
def _job(cluster=None, **training):
    from spotfill.config.job import JobConfig, from_mapping
    return from_mapping(JobConfig, {"storage": "/tmp/unused", "data": {"path": "/tmp/unused"},
                                    "cluster": cluster or {}, "training": {"workers": [1, 2], **training}})


def test_the_default_process_group_gets_the_collective_timeout():
    """TrainingJob's TorchConfig carries SPOTFILL_COLLECTIVE_TIMEOUT_S (Ray Train passes it to
    init_process_group), not Ray Train's 1800 s, and the workers get the variable (DeepSpeed's groups)."""
    from ray.train.torch import TorchConfig

    from spotfill.config import constants
    from spotfill.train.backend import DeviceAwareTorchConfig
    from spotfill.train.job import TrainingJob, worker_env_vars

    for mode in ("spotfill", "stock"):
        for resource, config_cls in (("GPU", DeviceAwareTorchConfig), ("GPU_SLOT", TorchConfig)):
            trainer = TrainingJob(_job({"gpu_resource": resource}, elastic_restarts=mode))._trainer("sink", "ns")
            assert type(trainer.backend_config) is config_cls, (mode, resource)
            assert trainer.backend_config.timeout_s == constants.COLLECTIVE_TIMEOUT_S, (mode, resource)
    assert constants.COLLECTIVE_TIMEOUT_S == constants.CHECKPOINT_COMMIT_TIMEOUT_S + 60 < 1800
    assert worker_env_vars({})["SPOTFILL_COLLECTIVE_TIMEOUT_S"] == str(constants.COLLECTIVE_TIMEOUT_S)
    assert worker_env_vars({"SPOTFILL_COLLECTIVE_TIMEOUT_S": "99"})["SPOTFILL_COLLECTIVE_TIMEOUT_S"] == "99"


def test_the_backend_chosen_on_the_first_worker_keeps_the_timeout(monkeypatch):
    """DeviceAwareTorchConfig replaces the backend Ray filled in by what the first worker has; the process
    group Ray Train then sets up still gets timeout_s (not Ray Train's 1800 s)."""
    from ray.train.torch.config import _TorchBackend

    from spotfill.config import constants
    from spotfill.train.backend import DeviceAwareTorchConfig

    started = []
    monkeypatch.setattr(_TorchBackend, "on_start", lambda self, worker_group, backend_config:
                        started.append(backend_config))

    class FirstWorkerWithoutCuda:
        def execute_single(self, rank, fn):
            return {"cuda_devices": 0, "nccl_built": True}

    cfg = DeviceAwareTorchConfig(backend="nccl", timeout_s=constants.COLLECTIVE_TIMEOUT_S)   # as Ray fills it in
    backend = cfg.backend_cls()
    assert isinstance(backend, _TorchBackend) and type(backend) is not _TorchBackend
    backend.on_start(FirstWorkerWithoutCuda(), cfg)
    (seen,) = started
    assert seen.backend == "gloo" and seen.timeout_s == constants.COLLECTIVE_TIMEOUT_S


def test_the_variable_sets_it():
    import spotfill
    code = "from spotfill.config import constants; print(constants.COLLECTIVE_TIMEOUT_S)"
    here = os.path.dirname(os.path.dirname(spotfill.__file__))          # this checkout's platform/
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SPOTFILL_COLLECTIVE_TIMEOUT_S": "42",
                                                            "PYTHONPATH": here},
                         capture_output=True, text=True, check=True, timeout=60)
    assert float(out.stdout) == 42.0


def test_new_groups_get_the_timeout_instead_of_torchs_global_default():
    """What DeepSpeed's `new_group(ranks)` gets: torch's _get_default_timeout, per backend."""
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import constants as torch_defaults

    from spotfill.ray_compat import new_groups_timeout
    before = (c10d.default_pg_timeout, c10d.default_pg_nccl_timeout)
    # torch's own defaults first (an engine built earlier in this pytest process set the module's values)
    c10d.default_pg_timeout = torch_defaults.default_pg_timeout
    c10d.default_pg_nccl_timeout = getattr(torch_defaults, "default_pg_nccl_timeout", before[1])
    try:
        assert c10d._get_default_timeout(c10d.Backend.GLOO) == timedelta(minutes=30)
        assert new_groups_timeout(12.5) is True
        assert c10d._get_default_timeout(c10d.Backend.GLOO) == timedelta(seconds=12.5)
        if before[1] is not None:                      # a torch built with NCCL
            assert c10d._get_default_timeout(c10d.Backend.NCCL) == timedelta(seconds=12.5)
    finally:
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = before
