"""On a local multi-node cluster shared with other work: training grows only into FREE capacity (defect 5),
Ray Train's placement-group cleaner does not tear down a live run on a State API miss (defect 10), and
every worker-group start is on record with its cause."""
from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest

from spotfill.config.job import JobConfig, PrepareConfig, from_mapping
from spotfill.telemetry.events import read_events

FIT_DEADLINE_S = 240


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray

    from spotfill.sim.cluster import EmbeddedCluster, quiet_expected_node_deaths, worker_env
    c = EmbeddedCluster("GPU_SLOT")
    for _ in range(2):
        c.add_node(2)
    ray.init(address=c.address, runtime_env={"env_vars": worker_env()}, logging_level=logging.WARNING,
             log_to_driver=False)
    quiet_expected_node_deaths()
    try:
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def dataset(cluster, tmp_path_factory):
    from spotfill.sim.runner import CORPUS_PACKAGES, SEQ_LEN, default_corpus
    from spotfill.train.prepare import prepare
    import shutil
    root = tmp_path_factory.mktemp("data")
    corpus = root / "corpus"
    for pkg in CORPUS_PACKAGES[:2]:
        shutil.copytree(os.path.join(default_corpus(), pkg), corpus / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    prepare(from_mapping(PrepareConfig, {"source": str(corpus), "output": str(root / "shards"),
                                         "seq_len": SEQ_LEN, "suffixes": [".py"]}))
    return str(root / "shards")


def _fit_with_deadline(job) -> tuple[dict | None, str | None]:
    """job.fit() in a thread; (report, error) -- error "hung" when it did not finish in time."""
    out: dict = {}

    def run():
        try:
            out["report"] = job.fit()
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(FIT_DEADLINE_S)
    if thread.is_alive():
        return None, "hung"
    return out.get("report"), out.get("error")


# CI's time budget (`python -m pytest -m slow`); in CI grows onto free capacity run in test_elastic_scenario
# and the sizing in tests/unit/test_capacity.py
@pytest.mark.slow
def test_grow_counts_free_not_total_capacity(cluster, dataset, tmp_path):
    """Another actor holds one of the 4 GPU slots. Counting totals, training believed 4 workers fit:
    it checkpointed and restarted every resize_check_s into a group that could never be placed (or never
    started at all). Counting free capacity, it runs on 3 and never tries to grow."""
    import ray
    from spotfill.sim.cluster import worker_env
    from spotfill.train.job import TrainingJob

    @ray.remote(num_cpus=0, resources={"GPU_SLOT": 1})
    class Squatter:
        def ping(self):
            return True

    squatter = Squatter.remote()
    ray.get(squatter.ping.remote())
    try:
        cfg = from_mapping(JobConfig, {
            "name": "free-capacity", "run_dir": str(tmp_path / "run"), "storage": str(tmp_path / "store"),
            "data": {"path": dataset}, "cluster": {"gpu_resource": "GPU_SLOT"},
            "training": {"model": "tiny", "workers": [1, 4], "steps": 30, "global_batch": 12,
                         "max_micro_batch": 3, "checkpoint_every": 10, "resize_check_s": 1.0,
                         "max_failures": 2}})
        job = TrainingJob(cfg, runtime_env={"env_vars": worker_env()})
        report, error = _fit_with_deadline(job)
        events = list(read_events(job.events_path))
        attempts = [e for e in events if e["kind"] == "attempt"]
        grows = [e for e in events if e["kind"] == "planned_exit" and e["reason"] == "grow"]
        assert error is None and report and report["ok"], (error, attempts, grows)
        assert [a["world_size"] for a in attempts] == [3] and not grows, attempts
        assert report["training"]["attempt_history"][0]["cause"] == "first start"
    finally:
        ray.kill(squatter)


def _with_state_api_miss(cleaner_cls):
    """`cleaner_cls` whose process' State API misses every actor (returns None), as when the dashboard
    is slow or restarting: what ray-project/ray#65447 reports."""

    class StateApiMiss(cleaner_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            import ray.train.v2._internal.state.util as state_util
            state_util.get_actor = lambda *a, **k: None

    return StateApiMiss


def _watched_placement_group(cleaner_cls):
    """(controller stand-in, its placement group, the cleaner watching it) -- monitoring started."""
    import ray
    from ray.util.placement_group import placement_group

    @ray.remote(num_cpus=0)
    class Controller:
        def actor_id(self):
            return ray.get_runtime_context().get_actor_id()

    controller = Controller.remote()
    actor_id = ray.get(controller.actor_id.remote())
    pg = placement_group([{"CPU": 0.01}])
    ray.get(pg.ready(), timeout=30)
    cleaner = ray.remote(num_cpus=0)(cleaner_cls).remote(controller_actor_id=actor_id, check_interval_s=0.2,
                                                         get_actor_timeout_s=2, stop_timeout=2.0)
    ray.get(cleaner.register_placement_group.remote(pg))
    ray.get(cleaner.start_monitoring.remote())
    return controller, pg, cleaner


def _pg_state(pg) -> str:
    import ray
    return ray.util.placement_group_table(pg).get("state", "REMOVED")


def _wait_removed(pg, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _pg_state(pg) == "REMOVED":
            return True
        time.sleep(0.2)
    return False


def test_stock_cleaner_tears_down_a_live_run_on_a_state_api_miss(cluster):
    """The bug, reproduced: Ray 2.60's cleaner removes a live controller's placement group."""
    from ray.train.v2._internal.execution.controller.placement_group_cleaner import PlacementGroupCleaner
    controller, pg, _ = _watched_placement_group(_with_state_api_miss(PlacementGroupCleaner))
    assert _wait_removed(pg, 10), "stock cleaner kept the placement group: the injected miss did not reach it"


def test_gcs_checked_cleaner_keeps_a_live_run_and_cleans_up_a_dead_one(cluster):
    import ray
    from spotfill.ray_compat import GcsCheckedPlacementGroupCleaner
    controller, pg, cleaner = _watched_placement_group(_with_state_api_miss(GcsCheckedPlacementGroupCleaner))
    time.sleep(3)                      # ~15 liveness checks, each a State API miss
    assert _pg_state(pg) == "CREATED"
    ray.kill(controller)               # now the controller really is dead: its placement group goes
    assert _wait_removed(pg, 15)


def test_spotfill_trainer_uses_the_gcs_checked_cleaner():
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from spotfill.ray_compat import GcsCheckedPlacementGroupCleanerCallback, use_spotfill_controller

    seen = {}

    class Base:
        scaling_config = None

        def _initialize_and_run_controller(self, **kwargs):
            seen.update(kwargs)

    use_spotfill_controller(Base)()._initialize_and_run_controller(
        callbacks=[PlacementGroupCleanerCallback(), "other"])
    assert type(seen["callbacks"][0]) is GcsCheckedPlacementGroupCleanerCallback
    assert seen["callbacks"][1] == "other"


def _job(name: str, tmp_path, dataset, store: str, **training):
    from spotfill.sim.cluster import worker_env
    from spotfill.train.job import TrainingJob
    cfg = from_mapping(JobConfig, {
        "name": name, "run_dir": str(tmp_path / f"run-{training['steps']}"), "storage": store,
        "data": {"path": dataset}, "cluster": {"gpu_resource": "GPU_SLOT"},
        "training": {"model": "tiny", "workers": [1, 4], "global_batch": 12, "max_micro_batch": 3,
                     "checkpoint_every": 10, "keep_checkpoints": 5, **training}})
    return TrainingJob(cfg, runtime_env={"env_vars": worker_env()})


@pytest.mark.slow   # CI's time budget: run with `python -m pytest -m slow`
def test_a_second_fit_over_the_same_store_numbers_its_attempts_past_the_first(cluster, dataset, tmp_path):
    """Tags are step + attempt. A second fit() over the same store used to start again at attempt 0 and
    could write into a tag the first run had committed; it continues at attempt 1 and resumes from step
    20, leaving the first run's committed checkpoints as they were."""
    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore

    store_path = str(tmp_path / "store")
    first, error = _fit_with_deadline(_job("two-fits", tmp_path, dataset, store_path, steps=20))
    assert error is None and first and first["ok"], error
    store = CheckpointStore(open_storage(store_path).child("two-fits"))
    before = {t: store.manifest(t) for t in store.committed()}
    assert before and all(t.endswith("-a0") for t in before), before

    job = _job("two-fits", tmp_path, dataset, store_path, steps=40)
    second, error = _fit_with_deadline(job)
    assert error is None and second and second["ok"], error
    attempts = [e for e in read_events(job.events_path) if e["kind"] == "attempt"]
    assert [a["attempt"] for a in attempts] == [1] and attempts[0]["earlier_attempts"] == 1, attempts
    resume = next(e for e in read_events(job.events_path) if e["kind"] == "resume")
    assert resume["step"] == 20
    after = set(store.committed())
    new = after - set(before)
    assert new and all(t.endswith("-a1") for t in new), after
    for tag in set(before) & after:
        assert store.manifest(tag) == before[tag], tag


@pytest.mark.slow   # CI's time budget: run with `python -m pytest -m slow`
def test_a_grow_whose_slot_is_taken_falls_back_to_the_previous_size(cluster, dataset, tmp_path):
    """One slot is held by other work: training runs on 3. The holder leaves; training checkpoints and
    exits to grow -- and at that moment other work takes the slot again (a placement group reserves it).
    The restart falls back to 3 workers within seconds, nothing is lost, and no second grow is tried
    while the capacity stays as it is."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    holder = placement_group([{"GPU_SLOT": 1}])
    ray.get(holder.ready(), timeout=30)
    job = _job("grow-fallback", tmp_path, dataset, str(tmp_path / "store"), steps=160, resize_check_s=1.0,
               max_failures=0)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=_fit_with_deadline(job)), daemon=True)
    thread.start()
    taker, exit_t = None, None
    deadline = time.monotonic() + FIT_DEADLINE_S
    try:
        while thread.is_alive() and time.monotonic() < deadline:
            events = list(read_events(job.events_path)) if os.path.exists(job.events_path) else []
            steps = [e for e in events if e["kind"] == "step"]
            if holder is not None and len(steps) >= 2:
                remove_placement_group(holder)          # the slot is free: training will want it
                holder = None
            grow = next((e for e in events if e["kind"] == "planned_exit" and e["reason"] == "grow"), None)
            if grow and taker is None:
                taker = placement_group([{"GPU_SLOT": 1}])   # ...and other work takes it back at once
                exit_t = grow["t"]
            time.sleep(0.05)
        thread.join(5)
        report, error = out.get("result", (None, "hung"))
        events = list(read_events(job.events_path))
        attempts = [e for e in events if e["kind"] == "attempt"]
        grows = [e for e in events if e["kind"] == "planned_exit" and e["reason"] == "grow"]
        assert error is None and report and report["ok"], (error, attempts)
        assert [a["world_size"] for a in attempts] == [3, 3], attempts
        assert len(grows) == 1 and attempts[1]["cause"] == "planned: grow", (grows, attempts)
        # fell back promptly, no hang (a hang is FIT_DEADLINE_S): the 8 s start timeout plus the controller's
        # restart cycle, 21.5 s once on a slow 2-core run
        assert attempts[1]["t"] - exit_t < 30, attempts
        assert report["training"]["samples"]["duplicates"] == 0 and report["training"]["samples"]["missing"] == 0
        assert ray.util.placement_group_table(taker)["state"] == "CREATED"
    finally:
        for pg in (holder, taker):
            if pg is not None:
                remove_placement_group(pg)
