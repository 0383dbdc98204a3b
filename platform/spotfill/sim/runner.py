"""Run a scenario on the embedded local cluster: training in a thread, the timeline in the main thread.

Cluster changes happen in the main thread (ray.cluster_utils needs it). Events fire `at` seconds after
training's first step or when training reaches `at_step`. The report joins TrainingJob's sections with
per-event outcomes (outcomes.py) and the invariants; `ok` is true only if every invariant held.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time
from collections import Counter
from dataclasses import replace

from spotfill.config.job import JobConfig, PrepareConfig, from_mapping
from spotfill.config.errors import ConfigError
from spotfill.sim import fillin_batch, fillin_sweep
from spotfill.sim.data_faults import check_shard_refs, swap_outcome, swap_shards
from spotfill.sim.corrupt import corrupt_newest_checkpoint
from spotfill.sim.freeze import dead_since
from spotfill.sim.mass import add_node_ends, choose_nodes, fire as fire_mass, gpus_of, mass_report
from spotfill.sim.mass_spec import MASS_ACTION
from spotfill.sim.outcomes import grow_outcome, invariants, node_event_outcome
from spotfill.sim.scenario import Event, Scenario, pick_node
from spotfill.sim.fillin_serve import ServeFillin, fillin_arbiter, run_storage_uri  # noqa: F401 -- also the runner's API
from spotfill.sim.triggers import during_restart, owners, spares_ready
from spotfill.telemetry.events import EventTail, remove_log

log = logging.getLogger(__name__)
NODE_EVENTS = ("drain_node", "kill_node", "remove_node", "freeze_node")   # reported in `preemptions`
HARD_LOSSES = ("kill_node", "freeze_node")                               # no notice
CORPUS_PACKAGES = ("json", "http", "logging", "urllib")
SEQ_LEN = 64          # the runner prepares byte-level shards of this length


def default_corpus() -> str:
    """A real corpus on every machine: a few packages of the Python standard library, copied together."""
    import json as _json
    return os.path.dirname(os.path.dirname(os.path.abspath(_json.__file__)))


class _Tail(EventTail):
    """The run's events so far (`events`), read as they are written."""

    def __init__(self, path: str):
        super().__init__(path)
        self.events: list[dict] = []

    def poll(self) -> list[dict]:
        new = super().poll()
        self.events.extend(new)
        return new


def run_scenario(scenario: Scenario, out_dir: str, storage: str | None = None, quiet: bool = False,
                 wait_for_fillin: bool = False, cpu_layout: dict | None = None) -> dict:
    """Run the scenario; unless `quiet`, show it live on stderr (telemetry.liveview: a panel on a TTY, one
    line per event elsewhere) with the runner's own actions among the events. `wait_for_fillin` (tests and
    benchmarks): no timeline event fires until Serve fill-in answers and had SETTLE_S to take the spare GPUs
    and batch and sweep fill-in hold lent GPUs, so node events meet them running whatever this machine's
    speed. `cpu_layout` (benchmarks; sim.cpu_layout.plan_layout over cluster.nodes): the head and each node
    on cores of their own."""
    from spotfill.telemetry.liveview import LiveView

    view = None if quiet else LiveView(sys.stderr, steps_target=scenario.training.steps, job=scenario.name,
                                       console_log=os.path.join(os.path.abspath(out_dir), "console.log"))
    # Serve's own INFO lines ("Connecting to existing Serve app ...") are not for the scenario's screen: the
    # runner says what Serve fill-in does, and Serve writes them to its log files in the session anyway
    with _quiet_logger("ray.serve", logging.WARNING):
        if view is None:
            return _run_scenario(scenario, out_dir, storage, None, wait_for_fillin, cpu_layout)
        with view:
            return _run_scenario(scenario, out_dir, storage, view, wait_for_fillin, cpu_layout)


def _gpu_capacity(resource: str):
    import ray
    return ray.cluster_resources().get(resource, 0.0) if ray.is_initialized() else None


def _run_scenario(scenario: Scenario, out_dir: str, storage: str | None, view, wait_for_fillin: bool = False,
                  cpu_layout: dict | None = None) -> dict:
    from spotfill.sim.cluster import EmbeddedCluster, quiet_expected_node_deaths, worker_env
    from spotfill.fillin.bubble_fill import bubble_filler
    from spotfill.train.job import TrainingJob

    say = (lambda m: None) if view is None else view.note
    if scenario.needs_controlled_storage() and storage:
        raise ConfigError("--storage", storage, reason="the scenario has a storage_outage event, which needs "
                          "the loopback S3 endpoint the runner starts itself", accepted="leave --storage out")
    if scenario.training.model.startswith("hf:"):  # checked against the shards the runner will prepare
        from spotfill.train.data import BYTE_VOCAB
        from spotfill.config.presets import check_hf_model
        check_hf_model(scenario.training.model, BYTE_VOCAB, SEQ_LEN)
    if storage:  # bad URI, bucket or credentials: one line and exit 2 before any cluster starts
        from spotfill.storage.base import open_storage
        open_storage(storage).check()
    out_dir = os.path.abspath(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError("--out", out_dir, reason=f"cannot create it ({exc.strerror})") from None
    remove_log(os.path.join(out_dir, "events.jsonl"))      # with its rolled segments
    if os.path.exists(os.path.join(out_dir, "report.json")):
        os.unlink(os.path.join(out_dir, "report.json"))
    t_begin = time.time()
    s3 = None
    env = worker_env()
    if scenario.needs_controlled_storage():
        from spotfill.testing.s3local import LocalS3
        s3 = LocalS3().start()
        env.update(s3.env())
        os.environ.update(s3.env())
        storage = s3.uri(f"{scenario.name}-{int(t_begin)}")
    storage = storage or os.path.join(out_dir, "storage")
    if not storage.startswith("s3://") and os.path.isdir(storage):
        shutil.rmtree(storage)
    serve_on = scenario.fillin.serve_enabled
    if serve_on or scenario.fillin.batch_enabled or scenario.fillin.sweep_enabled:
        from spotfill.fillin.cpu_priority import ENV as CPU_NICE_ENV, IDLE_ENV as CPU_IDLE_ENV
        env[CPU_NICE_ENV] = str(scenario.fillin.cpu_nice)     # fill-in processes renice themselves
        env[CPU_IDLE_ENV] = "1" if scenario.fillin.cpu_idle else "0"
    if scenario.cluster.autoscaler:
        if cpu_layout is not None:
            raise ValueError("cpu_layout applies to a static cluster.nodes list, not to an autoscaled cluster")
        cluster = _autoscaling_cluster(scenario, out_dir, say)
    else:
        say(f"starting an embedded Ray cluster: {len(scenario.cluster.nodes)} nodes x "
            f"{[n.get('gpus', 1) for n in scenario.cluster.nodes]} {scenario.cluster.gpu_resource}")
        cluster = EmbeddedCluster(scenario.cluster.gpu_resource, cpu_layout=cpu_layout)
    fillin = None
    try:
        for node in scenario.cluster.nodes:
            cluster.add_node(node.get("gpus", 1), launched_by="static")
        import ray
        ray.init(address=cluster.address, runtime_env={"env_vars": env}, logging_level=logging.WARNING,
                 log_to_driver=False)
        if view is not None:
            view.capacity_fn = lambda: _gpu_capacity(scenario.cluster.gpu_resource)
            import ray.data     # Ray Data's progress bars would draw over the live view
            ray.data.DataContext.get_current().enable_progress_bars = False
        quiet_expected_node_deaths()
        name = scenario.name.replace(".", "-")
        if serve_on:
            fillin = ServeFillin(cluster, scenario, storage, name, out_dir, env, say)
        from spotfill.train.prepare import prepare
        data_dir = os.path.join(out_dir, "data")
        say("preparing token shards from the Python standard library with Ray Data")
        corpus = os.path.join(out_dir, "corpus")
        if not os.path.isdir(corpus):
            for pkg in CORPUS_PACKAGES:
                shutil.copytree(os.path.join(default_corpus(), pkg), os.path.join(corpus, pkg),
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        with _quiet_logger("ray.data"):    # its INFO lines stay in the session's ray-data log file
            manifest = prepare(from_mapping(PrepareConfig, {
                "source": corpus, "output": data_dir, "seq_len": SEQ_LEN, "suffixes": [".py"],
                "tokenizer": scenario.data_tokenizer}))
        say(f"{manifest['num_samples']} sequences of 65 tokens in {manifest['seconds']:.1f}s")
        check_shard_refs(scenario.events, manifest)
        job_cfg = from_mapping(JobConfig, {
            "name": name, "run_dir": out_dir, "storage": storage,
            "data": {"path": data_dir}, "cluster": {"gpu_resource": scenario.cluster.gpu_resource}})
        job_cfg.training = scenario.training
        job = TrainingJob(job_cfg, runtime_env={"env_vars": env}, bubble_filler=bubble_filler)
        job.render_report = False          # rendered once below, with the scenario's sections
        if fillin:
            fillin.ready()
        scale_down = batch_report = sweep_report = None
        arbiter = ((fillin and fillin.arbiter) or fillin_arbiter(scenario, name, out_dir, env)) \
            if scenario.fillin.batch_enabled or scenario.fillin.sweep_enabled else None
        batch = fillin_batch.start(cluster, scenario, run_storage_uri(storage, name), name, out_dir, env, say,
                                   data_dir, corpus, arbiter) if scenario.fillin.batch_enabled else None
        sweep = fillin_sweep.start(cluster, scenario, name, out_dir, env, say, data_dir, arbiter) \
            if scenario.fillin.sweep_enabled else None
        firsts = [f.start for f in (batch, sweep) if f]
        # wait_for_fillin: no timeline event fires before Serve answers and the batch and sweep jobs hold
        # lent GPUs (so a node event meets every fill-in tenant running: the hand-backs measured)
        gates = [g for g in (fillin and fillin.serving, batch and batch.holding, sweep and sweep.holding) if g]
        try:
            report = _drive(cluster, scenario, job, s3, say, view.feed if view is not None else None,
                            on_first_step=(lambda: [f() for f in firsts]) if firsts else None,
                            gate=(lambda: all(g() for g in gates)) if wait_for_fillin and gates else None)
            if scenario.cluster.autoscaler:
                # the job tenants first: no GPU is lent once training ends (its nodes go idle and away), they
                # finish what they run and stop -- a pending GPU request of theirs never keeps a node alive
                batch_report = batch.stop() if batch else None
                sweep_report = sweep.stop() if sweep else None
                # with Serve fill-in still deployed and under load: what it holds must not keep a node alive
                scale_down = _await_scale_down(cluster, scenario, say)
        finally:
            serve_report = fillin.stop() if fillin else None
            if batch_report is None and batch:
                batch_report = batch.stop()
            if sweep_report is None and sweep:
                sweep_report = sweep.stop()
        fillin_batch.merge(report, batch_report)
        fillin_sweep.merge(report, sweep_report)
        if serve_report is not None:
            report.setdefault("fillin", {})["serve"] = serve_report
            failed = serve_report["requests_failed"]
            ok = failed == 0 and "error" not in serve_report
            report["invariants"]["serve_no_failed_request"] = {
                "ok": ok, "detail": serve_report.get("error") or serve_report.get("note") or
                f"{serve_report['requests_ok']} ok, {serve_report['requests_rejected_503']} rejected at once "
                f"with 503, {failed} failed"}
            report["ok"] = report["ok"] and ok
        if report.get("fillin"):
            from spotfill.sim.fillin_resumes import as_invariant, reclaimed_and_resumed
            resumes = report["fillin"]["reclaimed_and_resumed"] = reclaimed_and_resumed(report["fillin"])
            if scenario.fillin.require_resumes:
                report["invariants"]["fillin_reclaimed_and_resumed"] = as_invariant(resumes)
                report["ok"] = report["ok"] and report["invariants"]["fillin_reclaimed_and_resumed"]["ok"]
        if scale_down is not None:
            report["autoscaler"]["scale_down"] = scale_down
        report["cluster"] = cluster.node_report()
        add_node_ends(report)     # each preempted node's end (when, Ray's death reason)
        if cpu_layout is not None:
            from spotfill.sim.cpu_layout import as_dict
            report["cpu_layout"] = as_dict(cpu_layout, len(getattr(cluster, "training_pinned", ())))
        if scenario.cluster.autoscaler:
            from spotfill.sim.nodes import autoscaler_invariants
            report["invariants"].update(autoscaler_invariants(report))
            report["ok"] = "error" not in report and all(i["ok"] for i in report["invariants"].values())
    finally:
        cluster.shutdown()
        if s3:
            s3.close()
    report["seconds"] = round(time.time() - t_begin, 1)
    from spotfill.telemetry.events import read_events
    from spotfill.telemetry.report import enrich_report, write_report
    events = list(read_events(os.path.join(out_dir, "events.jsonl")))
    enrich_report(report, events)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    write_report(out_dir, events=events, report=report)
    return report


class _quiet_logger:
    """Raise a logger's level (ERROR by default) for a block (Ray Data's per-dataset INFO lines and its progress-bar
    warning are not for the demo's screen; Ray Data also writes them to its log file in the session)."""

    def __init__(self, name: str, level: int = logging.ERROR):
        self.logger, self.quiet = logging.getLogger(name), level

    def _drop(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.quiet

    def __enter__(self):
        # a filter, not only the level: Serve sets its logger's level again when it configures it
        self.level = self.logger.level
        self.logger.setLevel(self.quiet)
        self.logger.addFilter(self._drop)

    def __exit__(self, *exc):
        self.logger.removeFilter(self._drop), self.logger.setLevel(self.level)


def _autoscaling_cluster(scenario: Scenario, out_dir: str, say):
    """A head-only cluster scaled by Ray's autoscaler v2 (fake multi-node provider): sim/autoscaling.py."""
    from spotfill.sim.autoscaling import AutoscalingCluster
    spec = scenario.cluster.autoscaler
    types = scenario.cluster.node_types()
    say("starting an embedded Ray cluster with Ray's autoscaler (v2, fake multi-node provider): " + ", ".join(
        f"{t.name} ({t.market}, {t.gpus} {scenario.cluster.gpu_resource}, {t.min_workers}..{t.max_workers}, "
        f"priority {t.priority})" for t in types))
    return AutoscalingCluster(types, scenario.cluster.gpu_resource, idle_timeout_s=spec.get("idle_timeout_s", 10),
                              allocate_timeout_s=int(spec.get("allocate_timeout_s", 10)),
                              max_workers=spec.get("max_workers"),
                              workdir=os.path.join(out_dir, "autoscaler"))


def _await_scale_down(cluster, scenario: Scenario, say) -> dict:
    """After training: the autoscaler removes the idle nodes it launched (idle_timeout_s), and spotfill left
    nothing behind that keeps one alive (placement groups, actors on launched nodes)."""
    spec = scenario.cluster.autoscaler
    keep = sum(t.min_workers for t in scenario.cluster.node_types())
    wait_s = float(spec.get("idle_timeout_s", 10)) * 3 + 30
    t0 = time.time()
    say(f"training done; waiting for the autoscaler to remove idle nodes (idle timeout "
        f"{spec.get('idle_timeout_s', 10):g}s, keeping min_workers {keep})")
    while time.time() - t0 < wait_s:
        cluster.refresh()
        if len(cluster.worker_nodes()) <= keep:
            break
        time.sleep(0.5)
    remaining = cluster.worker_nodes()
    left = cluster.leftovers()     # after the wait: Serve fill-in is still deployed (its replicas are gone)
    out = {"seconds": round(time.time() - t0, 1), "nodes_left": len(remaining), "min_workers": keep,
           "request_after": cluster.resource_request(), **left}
    say(f"{len(remaining)} launched nodes left after {out['seconds']}s")
    return out


def _drive(cluster, scenario: Scenario, job, s3, say, feed=None, on_first_step=None, gate=None) -> dict:
    """Run training and fire the timeline. `on_first_step` is called once training steps; while `gate()`
    is false no timeline event fires (Serve fill-in: the timeline waits until Serve answers, so every node
    event meets it running; an event whose trigger passed meanwhile fires as soon as it does)."""
    result: dict = {}

    def fit() -> None:
        try:
            result["report"] = job.fit()
        except Exception as exc:  # JobFailed and anything Ray raised
            result["error"] = f"{type(exc).__name__}: {exc}"

    tail = _Tail(job.events_path)
    thread = threading.Thread(target=fit, name="spotfill-fit", daemon=True)
    thread.start()
    pending = list(scenario.events)
    fired: list[tuple[Event, float]] = []
    skipped: list[tuple[Event, str]] = []
    removals: list[tuple[float, int, bool]] = []
    n_added = len(scenario.cluster.nodes)
    corrupted: dict[int, dict] = {}
    first_step_t, step, world, refreshed = None, 0, 0, 0.0
    group: Counter = Counter()      # node id -> workers of the group that started last
    spares_waits: dict[int, dict] = {}   # event index -> its wait for warm spares (spares_ready)
    restart_waits: dict[int, dict] = {}  # event index -> the group start it was timed into (during_restart)
    starting: dict | None = None    # the newest `attempt` event while its group has not stepped
    requests: list[dict] = []       # the cluster's standing resource request, each time it changed
    world_at: dict[int, int] = {}   # event index -> workers training ran on when the node event fired
    silent: dict[int, float] = {}   # frozen node index -> freeze time, until the GCS declares it dead
    declared_dead: dict[int, float] = {}
    mass: dict[int, tuple] = {}     # preempt_nodes event index -> (its Choice, fire time per node, GPUs left)
    gone: dict[int, float] = {}     # node index -> when the runner removed it
    while thread.is_alive():
        new = tail.poll()
        if feed is not None and new:
            feed(new)
        for e in new:
            if e["kind"] == "step":
                step, starting = e["step"], None
                if first_step_t is None and on_first_step is not None:
                    on_first_step()
                first_step_t = first_step_t or e["t"]
            elif e["kind"] == "attempt":
                starting = e
            elif e["kind"] in ("start", "resume"):
                world = e["world_size"]
                group = Counter(n for n, _ in e.get("workers") or [])
        now = time.time()
        if now - refreshed >= 1.0:     # nodes the autoscaler launched get the next indices
            refreshed = now
            for index in cluster.refresh():
                say(f"node {index} launched by the autoscaler")
            if scenario.cluster.autoscaler:
                request = cluster.resource_request()
                if not requests or requests[-1]["request"] != request:
                    requests.append({"t": round(now, 3), "step": step, "request": request})
        for index, t_dead in dead_since(silent, cluster.node_ids, now).items():   # polled while one is silent
            declared_dead[index] = round(t_dead - silent.pop(index), 2)
            say(f"node {index} declared dead by the GCS {declared_dead[index]:g}s after it froze")
        for when, index, graceful in [r for r in removals if r[0] <= now]:
            removals.remove((when, index, graceful))
            cluster.remove_node(index, graceful=graceful)
            gone[index] = time.time()
            say(f"node {index} is gone (deadline reached)")
        for ev in list(pending) if gate is None or gate() else []:
            due = (ev.at_step is not None and step >= ev.at_step) or \
                  (ev.at is not None and first_step_t is not None and now - first_step_t >= ev.at)
            if not due or (ev.min_world and world < ev.min_world) or any(p.index == ev.after for p in pending):
                continue
            if ev.spares_ready and not spares_ready(ev, group, cluster, spares_waits, now, say):
                continue
            if ev.during_restart and not during_restart(ev, starting, restart_waits, now):
                continue
            pending.remove(ev)
            if isinstance(ev.node, str):
                index = pick_node(ev.node, owners(say), cluster.node_ids, cluster.alive)
                if index is None:
                    skipped.append((ev, f"no alive node had GPUs for the pick {ev.node!r}"))
                    say(f"skipped: {ev.describe()} ({skipped[-1][1]})")
                    continue
                ev = replace(ev, node=index, picked=ev.node)
            if ev.node is not None and not cluster.alive(ev.node):
                skipped.append((ev, f"node {ev.node} is not alive"))
                say(f"skipped: {ev.describe()} (node {ev.node} is not alive)")
                continue
            if ev.action == MASS_ACTION:
                choice = choose_nodes(ev, group, cluster.node_ids, cluster.alive)
                if choice.skip:
                    skipped.append((ev, choice.skip))
                    say(f"skipped: {ev.describe()} ({choice.skip})")
                    continue
            say(f"step {step}: {ev.describe()}")
            t = time.time()
            if ev.action == "drain_node":
                cluster.drain_node(ev.node, ev.deadline_s, "spotfill demo: spot notice")
                if ev.remove:
                    removals.append((t + ev.deadline_s, ev.node, False))
            elif ev.action == "remove_node":
                cluster.drain_node(ev.node, ev.deadline_s, "spotfill demo: scale-down", reason="IDLE_TERMINATION")
                removals.append((t + ev.deadline_s, ev.node, True))
            elif ev.action == "kill_node":
                cluster.remove_node(ev.node, graceful=False)
            elif ev.action == "freeze_node":
                cluster.freeze_node(ev.node)
                silent[ev.node] = t
            elif ev.action == "add_node":
                cluster.add_node(ev.gpus, launched_by="scenario")
                n_added += 1
            elif ev.action == "market":
                cluster.set_unavailable(ev.node_type, None if ev.available else ev.how)
            elif ev.action == "storage_outage":
                s3.outage_for(ev.duration_s)
            elif ev.action == "corrupt_checkpoint":
                corrupted[ev.index] = corrupt_newest_checkpoint(job, say)
            elif ev.action == "stale_writer":
                from spotfill.sim.stale_writer import stale_write
                corrupted[ev.index] = stale_write(job, say)
            elif ev.action == "swap_shards":
                corrupted[ev.index] = swap_shards(job.config.data.path, ev.shards, say)
            elif ev.action == MASS_ACTION:
                at = fire_mass(ev, choice.chosen, cluster, removals, gone)
                mass[ev.index] = (choice, at, gpus_of(cluster, choice.left))
                say(f"nodes {choice.chosen} preempted within {max(at.values()) - min(at.values()):.3f}s")
            if ev.action in NODE_EVENTS or ev.action == MASS_ACTION:
                world_at[ev.index] = world
                world = 0          # unknown until the next start/resume (min_world waits for the regrow)
            fired.append((ev, t))
        time.sleep(0.25)
    thread.join()
    new = tail.poll()
    if feed is not None and new:
        feed(new)
    events = tail.events
    report = dict(result.get("report") or job.report(error=result.get("error")))
    if "error" in result:
        report["error"] = result["error"]
    report["preemptions"], report["events"] = [], []
    for ev, t in fired:
        entry = {"index": ev.index, "action": ev.action, "at": round(t, 3), "fired": True}
        if ev.action in NODE_EVENTS:
            out = node_event_outcome(events, t, ev.deadline_s if ev.action not in HARD_LOSSES else None)
            if ev.action == "freeze_node":   # the GCS's health checks: seconds from the freeze to "dead"
                out["declared_dead_s"] = declared_dead.get(ev.node)
            entry.update(out)
            entry["node_id"] = cluster.node_ids[ev.node]
            if ev.picked:
                entry["picked"] = ev.picked
            report["preemptions"].append({"kind": "hard" if ev.action in HARD_LOSSES else "announced",
                                          "action": ev.action, "node": ev.node, "picked": ev.picked,
                                          "node_id": entry["node_id"],
                                          "at": round(t, 3), "world_size_before": world_at.get(ev.index), **out})
        elif ev.action == "add_node":
            entry.update(grow_outcome(events, t))
        elif ev.action == MASS_ACTION:
            choice, at, left = mass[ev.index]
            entries, out = mass_report(ev, choice, at, gone, events, cluster.node_ids, world_at.get(ev.index), left,
                                       scenario.training.min_workers)
            report["preemptions"].extend(entries)
            entry.update(out)
        if ev.index in restart_waits:
            entry["restart"] = restart_waits[ev.index]
        if ev.index in spares_waits:
            entry["spares"] = spares_waits[ev.index]
        elif ev.action in ("corrupt_checkpoint", "stale_writer"):
            entry.update(corrupted.get(ev.index, {}))
        elif ev.action == "swap_shards":
            entry.update({**corrupted.get(ev.index, {}), **swap_outcome(events, t)})
        report["events"].append(entry)
    for ev, why in skipped:
        report["events"].append({"index": ev.index, "action": ev.action, "fired": False, "skipped": why})
    for ev in pending:
        report["events"].append({"index": ev.index, "action": ev.action, "fired": False,
                                 "skipped": "training finished before the trigger"})
    report["events"].sort(key=lambda e: e["index"])
    if scenario.cluster.autoscaler:
        report["autoscaler"] = {"requests": requests}
    report["invariants"] = invariants(report, scenario.training.checkpoint_every)
    report["ok"] = "error" not in report and all(i["ok"] for i in report["invariants"].values())
    return report
