"""Serve fill-in in a scenario (`fillin.serve`): the arbiter and Serve come up while the data is prepared, the
generation app is deployed on the GPUs training leaves spare, and an HTTP load (the official clients' calls,
from threads at nice 19: they stand in for remote clients) runs once the endpoint has a model."""
from __future__ import annotations

import json
import logging
import os
import threading
import time

from spotfill.sim.scenario import Scenario

log = logging.getLogger("spotfill.sim.runner")
SETTLE_S = 15.0       # Serve fill-in: the timeline starts this long after the app answers (replicas on the spare GPUs)
LOAD_NICE = 19        # the HTTP load generator stands in for remote clients: it must not take training's CPU


def fillin_arbiter(scenario: Scenario, name: str, out_dir: str, env: dict):
    """The arbiter with the scenario's reclaim order and state file, started through the product's wiring
    (fillin/wiring.py) -- it finds out itself whether the cluster autoscales -- and told about the training
    job before any tenant starts (TrainingJob.fit announces it again, as on a real cluster)."""
    from spotfill.fillin import wiring
    from spotfill.fillin.arbiter import IDLE_RECLAIM_S
    handle = wiring.arbiter(scenario.cluster.gpu_resource, order=tuple(scenario.fillin.reclaim_order),
                            state_path=os.path.join(out_dir, "arbiter", "state.json"), runtime_env={"env_vars": env},
                            launch_nodes=bool(scenario.fillin.serve.get("launch_nodes")), idle_reclaim_s=IDLE_RECLAIM_S,
                            turn_s=scenario.fillin.turn_s)
    wiring.announce_training(name, scenario.training.min_workers, scenario.training.max_workers, 1)
    return handle


def run_storage_uri(storage: str, name: str) -> str:
    """The URI of a run's checkpoints (its job's storage joined with the job name) for serving/app.py."""
    from urllib.parse import urlsplit, urlunsplit
    if "://" not in storage:
        return "file://" + os.path.join(os.path.abspath(storage), name)
    parts = urlsplit(storage)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + name))


class ServeFillin:
    """Serve fill-in for a scenario: the capacity arbiter (told about the training job before training
    starts: GPUs training may grow into are never lent), the Serve generation app (reading this run's
    checkpoints) deployed at the scenario's start -- the arbiter lends it the GPUs training cannot use (the
    job is registered first: the GPUs its group will take are never lent; its start claims them through
    the arbiter anyway) -- and a steady HTTP load on it
    until training ends (on an autoscaled cluster: until the scale-down is over). Serve's GPUs are
    harvested while training starts up, not only once it steps."""

    def __init__(self, cluster, scenario: Scenario, storage: str, name: str, out_dir: str, env: dict, say):
        import socket

        self.cluster, self.scenario, self.say = cluster, scenario, say
        self.uri, self.name, self.out_dir, self.env = run_storage_uri(storage, name), name, out_dir, env
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.arbiter = None
        self.serving_since = 0.0
        self.load = None
        self.load_after_s: float | None = None        # deploy -> the endpoint had a model (the load starts)
        self._stopping = threading.Event()
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        # the arbiter, Serve's controller and proxy, and the app come up while the data is prepared (on a
        # small machine they take tens of seconds)
        self._prestart = threading.Thread(target=self._prestart_run, name="serve-fillin-prestart", daemon=True)
        self._prestart.start()
        # deployed at once, once the arbiter knows the training job (after the prestart). On an autoscaled
        # cluster with 0 replicas (only the arbiter's lends create replicas: no demand the autoscaler would
        # launch a node for); on fixed nodes with 1, which Serve places on the node it fits best (a small
        # node, not the one training's whole group needs) and the arbiter adopts: a fixed replica count has
        # no Serve autoscaling policy, whose cold-start rule starts a replica by itself when requests are
        # counted while none runs (one did, as training's claim took the last ones back: 4 s hand-backs)
        self.start()

    def _prestart_run(self) -> None:
        from spotfill.serving.deploy import start_serve
        try:
            self.arbiter = fillin_arbiter(self.scenario, self.name, self.out_dir, self.env)
            start_serve(self.port, self.scenario.cluster.gpu_resource)
        except Exception as exc:  # noqa: BLE001 - reported, and the run is not ok
            self.error = f"serve fill-in did not start: {type(exc).__name__}: {exc}"
            log.exception("serve fill-in prestart failed")

    def ready(self) -> None:
        """Wait for the arbiter (training's start claims GPUs through it)."""
        self._prestart.join(timeout=180)

    def start(self) -> None:
        """Deploy Serve and start the load, in the background (the timeline keeps firing meanwhile)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._start, name="serve-fillin", daemon=True)
            self._thread.start()

    def _start(self) -> None:
        from spotfill.fillin.load import ServeLoad
        from spotfill.serving.deploy import deploy_serve
        spec, c = self.scenario.fillin.serve, self.scenario.cluster      # total: + what may be launched
        total = sum(n.get("gpus", 1) for n in c.nodes) + sum(t.gpus * t.max_workers for t in c.node_types())
        self.ready()
        if self.error:
            return
        try:
            out = deploy_serve(self.uri, port=self.port, gpu_resource=self.scenario.cluster.gpu_resource,
                               max_replicas=spec["max_replicas"] or total, max_tokens=16, fillin="true",
                               replicas=0 if self.scenario.cluster.autoscaler else 1, floor_cpus=0,
                               floor_replicas=spec["floor_replicas"], standby_per_node=spec["standby_per_node"],
                               cpu_nice=self.scenario.fillin.cpu_nice,
                               cpu_idle=self.scenario.fillin.cpu_idle)
            # clients come once the endpoint has a model to serve (as a load balancer's health check sends
            # them): before training's first committed checkpoint every request would be a 503
            self.say(f"serve fill-in: generation app on {out['url']} (replicas only on GPUs training leaves "
                     f"spare); load {spec['load_rps']:g} requests/s once it has a checkpoint (GET /healthz)")
            waited = _await_model(out["url"], self._stopping)
            self.serving_since = time.time()
            self.load = ServeLoad(out["url"], spec["load_rps"], nice=LOAD_NICE).start()
            self.load_after_s = waited
            self.say(f"serve fill-in: the endpoint has a model after {waited:.1f}s: load started")
        except Exception as exc:  # noqa: BLE001 - reported, and the run is not ok
            self.error = f"serve fill-in did not start: {type(exc).__name__}: {exc}"
            log.exception("serve fill-in did not start")

    def serving(self) -> bool:
        """The app answers, the load runs, and the arbiter had SETTLE_S to lend the rest of the spare GPUs
        (or Serve could not start: the timeline does not wait forever)."""
        return self.error is not None or (self.load is not None and time.time() - self.serving_since >= SETTLE_S)

    def stop(self) -> dict:
        self._stopping.set()
        self._prestart.join(timeout=180)
        if self._thread is not None:
            self._thread.join(timeout=30)
        summary = self.load.stop() if self.load else {
            "requests": 0, "requests_ok": 0, "requests_failed": 0, "requests_rejected_503": 0, "p50_ms": None,
            "p99_ms": None}
        if self.load_after_s is not None:
            summary["load_started_after_s"] = round(self.load_after_s, 1)
        if self.error:
            summary["error"] = self.error
        elif self.load is None:
            summary["note"] = "training ended before the Serve app was up: no request was sent"
        self.say(f"serve fill-in: {summary['requests_ok']} ok, {summary['requests_rejected_503']} rejected with "
                 f"503, {summary['requests_failed']} failed; p50 {summary['p50_ms']} ms, p99 {summary['p99_ms']} ms")
        try:
            from ray import serve
            serve.shutdown()
        except Exception as exc:  # noqa: BLE001 - the cluster goes down next anyway
            log.warning("serve shutdown: %s", exc)
        return summary


def _await_model(url: str, stop: threading.Event, poll_s: float = 1.0) -> float:
    """Seconds until the Serve endpoint at `url` names a checkpoint (GET /healthz), or until `stop`."""
    import urllib.request
    t0 = time.time()
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=10) as resp:
                if (json.loads(resp.read()).get("checkpoint") or {}).get("tag"):
                    break
        except (OSError, ValueError):
            pass
        stop.wait(poll_s)
    return time.time() - t0
