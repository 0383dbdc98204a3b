"""The TrainingJob SDK object: validate up front, run the elastic Ray Train job, write report.json.

    job = spotfill.TrainingJob(spotfill.load_job_config("job.yaml"))
    report = job.fit()

Validation happens before any GPU time is spent: config, storage reachability and credentials, the
prepared dataset, the model and the batch arithmetic for every size in the elastic range.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import uuid

from spotfill.config import constants
from spotfill.config.job import JobConfig
from spotfill.config.errors import JobFailed
from spotfill.telemetry.events import log_size, read_events
from spotfill.storage.base import open_storage
from spotfill.train.summary import checkpoints_section, training_section

log = logging.getLogger(__name__)


def ray_train_env() -> dict[str, str]:
    """Ray Train knobs spotfill sets for the controller and workers (see constants.py). They must be in
    the job's runtime_env (ray.init) since Ray Train's controller actor reads them."""
    return {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(constants.WORKER_GROUP_START_TIMEOUT_S),
            "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": os.environ.get("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1"),
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(constants.HEALTH_CHECK_INTERVAL_S)}


def worker_env_vars(base: dict[str, str] | None = None, warm_imports: bool = False,
                    job_runtime_env: dict | None = None, cpus_per_worker: float = 1.0) -> dict[str, str]:
    """Environment for the training workers: the job's own, plus this environment's JIT op cache folder
    (DeepSpeed ops built by another virtual environment must not be loaded or rebuilt here). With
    `warm_imports` (spotfill runs), each worker process starts importing torch, DeepSpeed and Ray Train's
    torch backend the moment it starts (spotfill.train.warm, as the processes' setup hook) -- unless the
    job's runtime_env (`job_runtime_env`) or `base` already names one.

    The hook imports torch before Ray sets OMP_NUM_THREADS for the worker's task (Ray sets it, when unset,
    to the worker's CPUs as the task starts: too late, torch's OpenMP runtime read it at import). So it is
    set here, as Ray would: floor(`cpus_per_worker`), at least 1. Without it each worker ran one intra-op
    thread per core of its node (2 here where it asked for 1 CPU), and stalled whenever another process
    took one of them. A value the user set (`base`, the job's runtime_env, this environment) is kept."""
    from spotfill.train.engine import jit_cache_dir
    env = dict(base or {})
    env.setdefault("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR") or jit_cache_dir())
    # DeepSpeed's process groups in the workers time out with the default group (engine.build_engine)
    env.setdefault("SPOTFILL_COLLECTIVE_TIMEOUT_S", str(constants.COLLECTIVE_TIMEOUT_S))
    if warm_imports:
        from spotfill.ray_compat import worker_setup_hook_env
        from spotfill.train.warm import HOOK
        env = worker_setup_hook_env(HOOK, env, job_runtime_env)
        users = ((job_runtime_env or {}).get("env_vars") or {}).get("OMP_NUM_THREADS") or os.environ.get(
            "OMP_NUM_THREADS")
        if users is None:
            env.setdefault("OMP_NUM_THREADS", str(max(1, math.floor(cpus_per_worker))))
    return env


class TrainingJob:
    # report.html + timeline.png at the end of fit(); a caller that adds to the report and renders it
    # itself (the scenario runner) turns this off so the picture is drawn once.
    render_report = True

    def __init__(self, config: JobConfig, runtime_env: dict | None = None, live: bool = False,
                 bubble_filler=None):
        # Ray Train workers chdir into their own run folder: local paths must be absolute.
        for section, key in ((config, "storage"), (config.data, "path"), (config.training, "export_on_finish")):
            value = getattr(section, key)
            if value and "://" not in value:
                setattr(section, key, os.path.abspath(value))
        self.config = config
        self.runtime_env = runtime_env or {}
        # live=True: a live view on stderr while fit() runs (a panel on a TTY, one line per event elsewhere),
        # and Ray started with its worker and raylet output kept in its log files, off the user's screen.
        self.live = live
        # training.bubble_fill: what runs in the pipeline's bubbles comes from fill-in, above training --
        # `bubble_filler(output, rank, world, device, sync)` builds a rank's filler inside each worker
        # (spotfill.fillin.bubble_fill.bubble_filler; jobs/pretrain.py and the scenario runner pass it)
        self.bubble_filler = bubble_filler
        self.run_dir = os.path.abspath(config.run_dir)
        self.events_path = os.path.join(self.run_dir, "events.jsonl")
        self._manifest: dict | None = None

    def validate(self) -> dict:
        """Check everything checkable before training starts; returns the dataset manifest. Runs once per
        job: fit() reuses a validation the caller already did."""
        if self._manifest is not None:
            return self._manifest
        from spotfill.train.data import read_manifest

        cfg = self.config
        if cfg.training.bubble_fill and self.bubble_filler is None:
            from spotfill.config.errors import ConfigError
            raise ConfigError("training.bubble_fill", cfg.training.bubble_fill,
                              reason="this TrainingJob was given no bubble filler",
                              accepted="TrainingJob(config, bubble_filler=spotfill.fillin.bubble_fill.bubble_filler)"
                                       " (jobs/pretrain.py passes it), or training.bubble_fill \"\"")
        open_storage(cfg.storage).check()
        data = open_storage(cfg.data.path)
        data.check(write=False)
        # Preset models take their vocabulary from the dataset (worker_loop builds them with it).
        manifest = read_manifest(data)
        if cfg.training.model.startswith("hf:"):
            from spotfill.config.presets import check_hf_model
            check_hf_model(cfg.training.model, int(manifest["vocab_size"]), int(manifest["seq_len"]))
        from spotfill.train.preflight import check_storage_from_worker, preflight
        self._init_ray()
        preflight(cfg, manifest, self.runtime_env)  # env numbers, seq_len, cluster resources (connects to Ray)
        # storage and data as a worker sees them (its own credentials and environment), not only the driver
        self.worker_storage_check = check_storage_from_worker(cfg, self._worker_runtime_env())
        self._manifest = manifest
        return manifest

    def _trainer(self, sink_name: str, namespace: str):
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        from spotfill.train.backend import DeviceAwareTorchConfig
        from spotfill.train.elastic import spotfill_trainer
        from spotfill.train.fillin_claims import training_callbacks
        from spotfill.train.sink import RestartCauseCallback
        from spotfill.train.spare_workers import ControllerHelperSpares
        from spotfill.train.teardown import UnreachableWorkerReaper

        from spotfill.train.worker_loop import train_loop_per_worker

        cfg, t, c = self.config, self.config.training, self.config.cluster
        # Ray's GPU resource: Ray assigns whole GPUs and sets CUDA_VISIBLE_DEVICES; the backend (NCCL or
        # gloo) is chosen on the first worker from what it really has (train/backend.py)
        use_gpu = c.gpu_resource == "GPU"
        spotfill = t.elastic_restarts == "spotfill"
        resources = {c.gpu_resource: c.gpus_per_worker, "CPU": c.cpus_per_worker}
        workers = t.min_workers if t.min_workers == t.max_workers else (t.min_workers, t.max_workers)
        scaling = ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources,
                                # spotfill grows gracefully itself (checkpoint, then restart): Ray's
                                # own running-group resize would kill the workers mid-interval.
                                elastic_resize_monitor_interval_s=10 ** 9 if spotfill else 60.0)
        trainer_cls = spotfill_trainer(t.pipeline_stages, sink=(sink_name, namespace)) if spotfill else TorchTrainer
        return trainer_cls(
            train_loop_per_worker,
            train_loop_config={"job": _as_dict(cfg), "sink": sink_name, "namespace": namespace,
                               "bubble_filler": self.bubble_filler},
            scaling_config=scaling,
            # every collective of the default group gives up after SPOTFILL_COLLECTIVE_TIMEOUT_S (constants.py)
            torch_config=(DeviceAwareTorchConfig(timeout_s=constants.COLLECTIVE_TIMEOUT_S) if use_gpu
                          else TorchConfig(backend="gloo", timeout_s=constants.COLLECTIVE_TIMEOUT_S)),
            run_config=RunConfig(
                name=f"{cfg.name}-{uuid.uuid4().hex[:6]}",
                storage_path=os.path.join(self.run_dir, "ray_train"),
                # spotfill keeps its own failure budget (training.max_failures) in the event sink, so
                # planned exits (announced preemption, graceful grow) are not charged to it.
                failure_config=FailureConfig(max_failures=-1),
                worker_runtime_env=self._worker_runtime_env(warm_imports=spotfill),
                # every controller state change (failures it saw, sizes it chose) into events.jsonl
                # and, on a cluster with fill-in, claim the GPUs first (a missing arbiter never blocks)
                # and, on spotfill runs, a teardown that does not wait on workers of a dead node
                callbacks=[RestartCauseCallback(sink_name, namespace),
                           *([UnreachableWorkerReaper(sink_name, namespace), *training_callbacks(cfg),
                              ControllerHelperSpares()]
                             if spotfill else [])],
            ),
        )

    def _worker_runtime_env(self, warm_imports: bool = False) -> dict:
        """The training workers' runtime_env: the job's environment plus the S3 endpoint settings (never
        credentials: workers use their own)."""
        c = self.config.cluster
        return {"env_vars": worker_env_vars({**constants.storage_endpoint_env(), **self.runtime_env.get("env_vars", {})},
                                            warm_imports=warm_imports, job_runtime_env=_job_runtime_env(),
                                            cpus_per_worker=c.cpus_per_worker)}

    def _first_attempt(self) -> int:
        """Attempt numbers continue past those in the checkpoint store (a second fit() over it)."""
        from spotfill.storage.base import open_storage
        from spotfill.storage.checkpoint_store import CheckpointStore
        return CheckpointStore(open_storage(self.config.storage).child(self.config.name)).next_attempt()

    def fit(self) -> dict:
        """Run to completion; returns the report dict (also written to RUN_DIR/report.json)."""
        import ray

        from spotfill.train.sink import LIVE_KEY_PREFIX, EventSink

        manifest = self.validate()
        os.makedirs(self.run_dir, exist_ok=True)
        self._init_ray()
        namespace = "spotfill"
        offset = log_size(self.events_path)      # where this run's events begin (rolled segments included)
        sink_name = f"spotfill-sink-{self.config.name}-{uuid.uuid4().hex[:6]}"
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        sink = EventSink.options(
            name=sink_name, namespace=namespace,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                               soft=False),
        ).remote(self.events_path, self.config.training.max_failures, self._first_attempt(),
                 live_key=f"{LIVE_KEY_PREFIX}{sink_name}", run_dir=self.run_dir)
        ray.get(sink.event.remote("job_start", name=self.config.name, steps=self.config.training.steps,
                                  global_batch=self.config.training.global_batch,
                                  workers=self.config.training.workers, dataset_samples=manifest["num_samples"],
                                  gpus_per_worker=self.config.cluster.gpus_per_worker,
                                  checkpoint_every=self.config.training.checkpoint_every,
                                  prefetch=self.config.data.prefetch))
        # Ray Train propagates these from the driver's environment to its controller and workers; a value
        # the user set wins. "stock" runs with Ray's own defaults, "stock-tuned" with spotfill's knobs.
        tuned = self.config.training.elastic_restarts in ("spotfill", "stock-tuned")
        knobs = {k: (os.environ.get(k, v) if tuned else None) for k, v in ray_train_env().items()}
        t0 = time.time()
        error = None
        view, follower = self._live_view(offset)
        # fill-in leases, reclaims and the GPU nodes the arbiter sees, into this run's events (no arbiter: none)
        from spotfill.train.arbiter_link import LeaseForwarder, announce_training, withdraw_training
        t = self.config.training
        # fill-in never lends the GPUs this job may grow into (an arbiter started later reads the record too)
        announce_training(self.config.name, t.min_workers, t.max_workers, int(self.config.cluster.gpus_per_worker))
        check = getattr(self, "worker_storage_check", None) or {}
        ray.get(sink.event.remote("storage_check", **({"node": check["node"][:12], "seconds": check.get("seconds")}
                                                        if check.get("ok") else {"skipped": check.get("skipped")})))
        forwarder = LeaseForwarder(sink).start()
        try:
            with constants.scoped_env(**knobs):
                try:
                    self._trainer(sink_name, namespace).fit()
                except Exception as exc:  # Ray Train raised: the job ran and failed
                    error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            withdraw_training(self.config.name)
            forwarder.stop()
            if follower is not None:
                follower.stop()
                view.__exit__(None, None, None)
        verdict = ray.get(sink.verdict.remote())
        ray.get(sink.event.remote("job_end", seconds=round(time.time() - t0, 3)))
        ray.get(sink.close.remote())
        ray.kill(sink)
        report = self.report(verdict=verdict, error=error)
        if report["ok"] and self.config.training.export_on_finish:
            report = self._export(report)
        if not report["ok"]:
            raise JobFailed(report.get("error") or "training did not finish")
        return report

    def _export(self, report: dict) -> dict:
        """training.export_on_finish: the final checkpoint as a Hugging Face folder (train/export.py), in
        report.json's `export`; a failed export fails the job (exit 1) with its reason."""
        from spotfill.config.errors import CheckpointCorrupt, ConfigError
        from spotfill.train.export import export_run

        cfg = self.config
        try:
            report["export"] = {"ok": True, **export_run(open_storage(cfg.storage).child(cfg.name),
                                                         cfg.training.export_on_finish)}
        except (ConfigError, JobFailed, CheckpointCorrupt) as exc:
            log.error("training.export_on_finish failed: %s", exc)
            report["export"] = {"ok": False, "out": cfg.training.export_on_finish, "error": str(exc)}
            report.update(ok=False, error=f"training.export_on_finish: {exc}")
        with open(os.path.join(self.run_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=2)
        return report

    def _init_ray(self) -> None:
        import ray

        if not ray.is_initialized():
            quiet = {"log_to_driver": False, "logging_level": logging.WARNING} if self.live else {}
            ray.init(runtime_env=self.runtime_env or None, **quiet)

    def _live_view(self, offset: int = 0):
        """(view, follower) showing events.jsonl as it grows, or (None, None) when live is off."""
        if not self.live:
            return None, None
        import ray

        from spotfill.telemetry.liveview import EventFollower, LiveView

        resource = self.config.cluster.gpu_resource
        view = LiveView(sys.stderr, capacity=lambda: ray.cluster_resources().get(resource),
                        steps_target=self.config.training.steps, job=self.config.name,
                        console_log=os.path.join(self.run_dir, "console.log")).__enter__()
        return view, EventFollower(self.events_path, view, offset=offset).start()

    def report(self, verdict: dict | None = None, error: str | None = None) -> dict:
        events = list(read_events(self.events_path))
        t = self.config.training
        training = training_section(events, t.steps, t.global_batch, self.config.cluster.gpus_per_worker)
        ok = bool(verdict and verdict.get("ok")) and error is None and training["steps_completed"] == t.steps
        report = {"ok": ok, "training": training, "checkpoints": checkpoints_section(events)}
        if not ok:
            report["error"] = error or (verdict or {}).get("reason") or "training did not finish"
        from spotfill.telemetry.report import enrich_report, write_report
        enrich_report(report, events)
        with open(os.path.join(self.run_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=2)
        if self.render_report:
            write_report(self.run_dir, events=events, report=report)
        return report


def _job_runtime_env() -> dict:
    """The connected job's runtime_env ({} when unknown)."""
    import ray
    if not ray.is_initialized():        # get_runtime_context() would start a local Ray
        return {}
    try:
        return dict(ray.get_runtime_context().runtime_env or {})
    except Exception:  # noqa: BLE001 -- not connected: nothing to keep
        return {}


def _as_dict(cfg) -> dict:
    import dataclasses
    return dataclasses.asdict(cfg)
