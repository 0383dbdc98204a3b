"""spotfill runs' worker processes start importing torch and DeepSpeed at process start (Ray's worker
process setup hook, for Ray Train's worker_runtime_env only); stock runs do not; a user's hook is kept."""
from __future__ import annotations

import importlib

import ray._private.ray_constants as ray_constants

from spotfill.train.job import worker_env_vars
from spotfill.train.warm import HOOK

HOOK_VAR = ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR   # what Ray's default_worker.py reads at start


def test_spotfill_workers_get_the_hook_and_stock_workers_do_not(monkeypatch):
    monkeypatch.delenv(HOOK_VAR, raising=False)
    env = worker_env_vars({"A": "1"}, warm_imports=True)
    assert env[HOOK_VAR] == HOOK and env["A"] == "1" and env["TORCH_EXTENSIONS_DIR"]
    assert HOOK_VAR not in worker_env_vars({"A": "1"}, warm_imports=False)


def test_a_users_own_setup_hook_is_kept(monkeypatch):
    monkeypatch.delenv(HOOK_VAR, raising=False)
    assert worker_env_vars({HOOK_VAR: "mine.setup"}, warm_imports=True)[HOOK_VAR] == "mine.setup"
    monkeypatch.setenv(HOOK_VAR, "job.level")
    assert HOOK_VAR not in worker_env_vars({}, warm_imports=True)   # the job-level one reaches the workers


def test_a_job_level_setup_hook_is_kept(monkeypatch):
    monkeypatch.delenv(HOOK_VAR, raising=False)
    for job in ({"worker_process_setup_hook": "user.setup"}, {"env_vars": {HOOK_VAR: "user.setup"}}):
        assert HOOK_VAR not in worker_env_vars({}, warm_imports=True, job_runtime_env=job)
    assert worker_env_vars({}, warm_imports=True, job_runtime_env={"env_vars": {"X": "1"}})[HOOK_VAR] == HOOK


def test_the_hook_path_resolves_to_a_function_that_returns_at_once():
    module, _, name = HOOK.rpartition(".")
    start = getattr(importlib.import_module(module), name)
    assert callable(start)


def test_zero_elastic_layout_is_recorded_only_for_zero12_engines_saving_it():
    from spotfill.train.checkpointing import zero_elastic_layout

    class DeepSpeedZeroOptimizer:           # the class name DeepSpeed's ZeRO-1/2 optimizer has
        def __init__(self, elastic):
            self.elastic_checkpoint = elastic

    class Engine:
        def __init__(self, opt):
            self.optimizer = opt

    assert zero_elastic_layout(Engine(DeepSpeedZeroOptimizer(True)))
    assert not zero_elastic_layout(Engine(DeepSpeedZeroOptimizer(False)))
    assert not zero_elastic_layout(Engine(object()))      # ZeRO-0 / ZeRO-3 optimizers


def test_workers_that_import_torch_at_start_get_ray_s_omp_num_threads_first(monkeypatch):
    # Ray sets OMP_NUM_THREADS as the worker's task starts, after the hook imported torch: spotfill sets it
    # in the environment the process starts with, to what Ray would (floor of the worker's CPUs, >= 1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(HOOK_VAR, raising=False)
    assert worker_env_vars({}, warm_imports=True)["OMP_NUM_THREADS"] == "1"
    assert worker_env_vars({}, warm_imports=True, cpus_per_worker=4.5)["OMP_NUM_THREADS"] == "4"
    assert worker_env_vars({}, warm_imports=True, cpus_per_worker=0)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in worker_env_vars({}, warm_imports=False)    # Ray sets it in time there
    # the user's value wins
    assert worker_env_vars({"OMP_NUM_THREADS": "8"}, warm_imports=True)["OMP_NUM_THREADS"] == "8"
    job = {"env_vars": {"OMP_NUM_THREADS": "6"}}
    assert "OMP_NUM_THREADS" not in worker_env_vars({}, warm_imports=True, job_runtime_env=job)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in worker_env_vars({}, warm_imports=True)
