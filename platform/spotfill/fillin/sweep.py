"""A Ray Tune sweep that runs only on lent GPUs (jobs/sweep.py; the decisions are in sweep_policy.py).

Tune's pieces, as Ray 2.60 runs them (tune/execution/tune_controller.py):
- New trials come from the searcher, and a PENDING trial is started without asking the scheduler, so
  admission is the searcher's: `GrantSearcher.suggest` returns None while the plan admits nothing (grant 0,
  every lent unit in use, or a paused trial waiting to be resumed first).
- The scheduler's `choose_trial_to_run` is called on every controller step (each event, or 0.1 s idle).
  `GrantScheduler` re-plans there: trials beyond the grant are paused with `pause_trial` (a running trial:
  save -- queued behind its current `train()` call, which lasts `steps_per_report` steps -- then its actor
  is stopped and its placement group removed; a trial still starting: stopped without a save, it keeps its
  previous checkpoint), and a paused trial is handed back to Tune to restart from its checkpoint when a
  unit is free.
- `reuse_actors=False` (a paused trial's actor would otherwise keep its GPU in Tune's actor cache) and
  TUNE_FORCE_TRIAL_CLEANUP_S (a stopped actor is killed after this many seconds, default 600) keep the
  hand-back inside the grace -- with the controller's own patience for an actor that has started (created:
  its setup may still run) lowered to the same CLEANUP_S (ray_compat.tune_force_cleanup_after): Tune waits
  up to a fixed 10 s for such an actor's `stop()`, which is queued behind its setup or its current
  `train()` call; a trial starved of CPU by training (setup 25 s on a busy 2-core machine) held its GPU
  past the grace and the arbiter stopped the whole driver.
- A trial whose actor dies is restarted by Tune from its last checkpoint (`max_failures`).
- A driver that dies (killed by force, crashed) leaves the experiment on storage (STORAGE/NAME): Tune
  saves its state -- every trial's status, last result and checkpoints, and the searcher's state -- at
  most every TUNE_GLOBAL_CHECKPOINT_S (RESTORE_STATE_S here) and on each trial checkpoint. A rerun with
  the same storage and name restores it (`Tuner.can_restore` / `Tuner.restore(resume_unfinished=True,
  resume_errored=True)`): completed trials are kept (not rerun), unfinished and errored ones continue
  from their last checkpoint. Tune restores the searcher and scheduler it pickled when the experiment was
  created; they are rebound to this driver's `SweepControl` (its grant and event sink), the searcher's
  own state (configurations handed out) comes from the trials of the saved experiment state (checked
  first, damaged files set aside: sweep_state.py), and trials Tune re-adds are booked from their
  restored status. A trial that completed after the last saved state is continued from its
  last checkpoint (its steps are still applied once).

The trainable (sweep_trial.py) is a class `tune.Trainable`: `save_checkpoint` writes the model, optimizer,
step and the list of steps applied to these weights (`history`), so a pause checkpoint is exact and the
history proves that a resumed trial continued rather than restarted, and that no step was applied twice.
The driver also starts the sweep's state keeper (sweep_keeper.py: host memory, one actor per driver,
`sweep.keep_in_memory_mb`); a trial hands it each checkpoint's bytes after writing them to storage and a
restored trial takes them back when they are exactly the checkpoint Tune restores (sweep_memory.py), so a
resume reads no storage. The first result of each restored incarnation says where its state came from
(`resumed_from` and `restore_s` in the report, `via` on the event); a completed trial's state is dropped.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Callable

from spotfill.fillin import sweep_keeper
from spotfill.fillin import sweep_policy as sp
from spotfill.fillin.sweep_trial import METRIC, MODE, trainable_class as _trainable_class

log = logging.getLogger("spotfill.fillin.sweep")

CLEANUP_S = "2"      # TUNE_FORCE_TRIAL_CLEANUP_S: a stopping trial actor is killed after this long
RESTORE_STATE_S = "2"   # TUNE_GLOBAL_CHECKPOINT_S: the experiment state a rerun restores is at most this old
JOB_KEYS = ("model", "steps", "batch", "steps_per_report", "eval_rows", "seed")   # must match on restore
_LIVE_CONTROL: "SweepControl | None" = None   # the control a restored searcher/scheduler is rebound to


def experiment_path(storage: str, name: str) -> str:
    """Where Tune keeps the experiment `name` under `storage`: a local path, or a URI whose query (such as
    s3://bucket/prefix?endpoint_override=...) stays at the end."""
    if "://" not in storage:
        return os.path.join(storage, name)
    base, sep, query = storage.partition("?")
    return f"{base.rstrip('/')}/{name}{sep}{query}"


def _rebind(obj) -> None:
    """A searcher/scheduler Tune unpickled from the experiment (restore): share this driver's control."""
    from spotfill.fillin import sweep as this     # the live module, not the pickled class' globals
    if this._LIVE_CONTROL is not None:
        obj.control = this._LIVE_CONTROL


class SweepControl:
    """What the searcher and the scheduler share: the grant, the trial book, the tally and the event sink."""

    def __init__(self, grant, configs: list[dict], clock: Callable[[], float] = time.monotonic,
                 emit: Callable[..., Any] | None = None):
        self.grant, self.configs, self.clock = grant, list(configs), clock
        self.book = sp.TrialBook(clock)
        self.tally = sp.SweepTally(trials=len(configs), mode=MODE)
        self.handed_out = 0                      # configurations the searcher has suggested
        self.config_of: dict[str, dict] = {}     # trial id -> its search config
        self.emit = emit or (lambda kind, **f: None)
        self.lock = threading.RLock()
        self.paused_with_checkpoint: set[str] = set()   # paused while running, not resumed yet
        self.started: set[str] = set()
        self.last_result: dict[str, dict] = {}
        self.job: dict = {}                      # the trainable's settings that a restore must match
        self.experiment = ""                     # STORAGE/NAME
        self.restored_ids: set[str] = set()      # trial ids an earlier driver created (restore)
        self.restored_pending: set[str] = set()  # restored unfinished trials that have not reported yet
        self.restore_trials: dict[str, dict] = {}   # restore: the trials of the saved experiment state
        self.restore_handed_out = 0                 # restore: the configurations those trials account for
        self.keeper = None                          # the state keeper actor (sweep_keeper.py), or None

    def __getstate__(self) -> dict:
        # Tune pickles its config (searcher, scheduler) into the experiment folder; the grant, the lock and
        # the event sink are live objects of this driver: a restored copy has none (and grants nothing).
        return {k: v for k, v in self.__dict__.items() if k not in ("grant", "lock", "emit", "clock", "keeper")}

    def __setstate__(self, state: dict) -> None:
        from spotfill.fillin.grant import FixedGrant
        self.__dict__.update(state)
        self.grant, self.lock, self.emit, self.clock = FixedGrant(0), threading.RLock(), (lambda kind, **f: None), time.monotonic
        self.keeper = None

    def note_result(self, tid: str, result: dict, config: dict | None = None) -> None:
        """A trial's result: the first one of an incarnation (a new trial actor) says whether it started,
        resumed from its pause checkpoint, recovered after its actor died, or continued an earlier driver's
        experiment -- counted in the tally, emitted as a `sweep_trial` event. Caller holds the lock."""
        first = tid not in self.last_result or self.last_result[tid].get("incarnation") != result.get("incarnation")
        self.last_result[tid] = dict(result)
        if not first:
            return
        via = result.get("restored_via")
        source = {"via": via, "restore_s": result.get("restore_s"),
                  **({"why": result.get("restore_why")} if via == "storage" else {})} if via else {}
        if via:
            self.tally.on_restore(via, result.get("restore_s"))
        if tid in self.restored_pending:
            self.restored_pending.discard(tid)
            self.tally.restored_trials += 1
            if tid not in self.started:
                self.started.add(tid)
                self.tally.started += 1
            self.emit("sweep_trial", action="restored", trial=tid, step=result.get("restored_from"),
                      cause="driver_restarted", **source)
        elif tid not in self.started:
            self.started.add(tid)
            self.tally.started += 1
            self.emit("sweep_trial", action="started", trial=tid, config=self.config_of.get(tid, config))
        elif result.get("restored_from") is not None:
            if tid in self.paused_with_checkpoint:
                self.paused_with_checkpoint.discard(tid)
                self.tally.resumed += 1
                self.emit("sweep_trial", action="resumed", trial=tid, step=result["restored_from"],
                          cause="grant_rose", **source)
            else:
                self.tally.recovered += 1
                self.emit("sweep_trial", action="recovered", trial=tid, step=result["restored_from"],
                          cause="trial_actor_died", **source)

    @property
    def unstarted(self) -> int:
        return len(self.configs) - self.handed_out

    def plan(self) -> sp.Plan:
        with self.lock:
            views = self.book.views()
            self.grant.demand(sp.demand(views, self.unstarted))
            return sp.plan(self.grant.allowed(), views, self.unstarted)


def _check_same_sweep(check, c: SweepControl) -> int:
    """The experiment to restore (sweep_state.check_experiment) is this sweep's: its trials are the first
    configurations of this grid, and the searcher state it saved (GrantSearcher.save) has this grid and
    these settings. Returns how many configurations its trials account for."""
    from spotfill.config.errors import ConfigError
    from spotfill.fillin import sweep_state

    job, saved = {k: c.job.get(k) for k in JOB_KEYS}, check.searcher
    n = sweep_state.handed_out(check.trials, c.configs)
    if saved is not None and saved["configs"] != c.configs:
        what, value = "search grid", saved["configs"]
    elif saved is not None and saved["job"] != job:
        what, value = "sweep settings", saved["job"]
    elif n is None:
        what, value = "search grid", list(check.trials.values())
    else:
        return n
    raise ConfigError("storage", c.experiment, reason=f"holds an experiment of this name with another {what} ({value})",
                      accepted="the same sweep config to resume it, or another storage/name")


def _searcher_class():
    from spotfill import ray_compat
    ray_compat.require_sweep()       # the Tune extension points used here (one line where Ray moved one)
    from ray.tune.search import Searcher

    class GrantSearcher(Searcher):
        """Hands out the sweep's configurations one by one, and only while the plan admits a new trial."""

        def __init__(self, control: SweepControl):
            super().__init__()       # no metric: eval_loss comes with a trial's last result only
            self.control = control

        def suggest(self, trial_id: str):
            c = self.control
            with c.lock:
                if c.handed_out >= len(c.configs):
                    return Searcher.FINISHED
                if c.plan().admit <= 0:
                    return None
                config = dict(c.configs[c.handed_out])
                c.handed_out += 1
                c.config_of[trial_id] = config
                c.book.observe(trial_id, sp.STARTING)
                return config

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
            pass

        # Tune saves this with the experiment state; a rerun checks its grid and settings (_check_same_sweep)
        def save(self, checkpoint_path: str):
            import json
            c = self.control
            with c.lock, open(checkpoint_path, "w") as f:
                json.dump({"configs": c.configs, "job": {k: c.job.get(k) for k in JOB_KEYS},
                           "handed_out": c.handed_out, "config_of": c.config_of}, f)
            from spotfill.fillin import sweep_state
            sweep_state.back_up_next_to(checkpoint_path, c.experiment)

        def restore_from_dir(self, checkpoint_dir: str):
            # Tune calls this after restoring the trials; the state comes from those trials
            # (run_sweep: sweep_state.check_experiment), not from the newest searcher-state file, which
            # may be older than them (its newest copy damaged and set aside) or missing
            c = self.control
            with c.lock:
                c.handed_out = c.restore_handed_out
                c.config_of.update(c.restore_trials)
                c.restored_ids = set(c.restore_trials)

        def __setstate__(self, state):
            self.__dict__.update(state)
            _rebind(self)

    return GrantSearcher


def _scheduler_class():
    from spotfill import ray_compat
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import FIFOScheduler, TrialScheduler

    class GrantScheduler(FIFOScheduler):
        """Pauses trials beyond the grant and resumes paused trials when units are lent again."""

        def __init__(self, control: SweepControl):
            super().__init__()
            self.control = control
            self.pausing: set[str] = set()       # pause requested, Tune has not stopped it yet
            self.errored: set[str] = set()
            self.cleanup_set = False             # Tune's stop patience lowered (on the first controller step)

        def set_search_properties(self, metric, mode, **spec):
            return True

        def _sync(self, tc) -> dict:
            c, by_id = self.control, {}
            for trial in tc.get_trials():
                by_id[trial.trial_id] = trial
                status = trial.status
                if trial.trial_id in self.pausing:
                    if status in (Trial.PAUSED, Trial.TERMINATED, Trial.ERROR):
                        self.pausing.discard(trial.trial_id)
                    else:
                        continue                 # leaving: counted as paused already
                state = {Trial.PENDING: sp.STARTING, Trial.RUNNING: sp.RUNNING, Trial.PAUSED: sp.PAUSED,
                         Trial.TERMINATED: sp.DONE, Trial.ERROR: sp.DONE}.get(status)
                if state and c.book.state(trial.trial_id) != sp.DONE:
                    c.book.observe(trial.trial_id, state)
            return by_id

        def _apply(self, tc) -> Trial | None:
            c = self.control
            if not self.cleanup_set:
                # a trial told to stop (paused, deferred, done) is killed CLEANUP_S after, even while its
                # setup or train() call still runs: Tune would wait up to 10 s more for its stop()
                ray_compat.tune_force_cleanup_after(tc, float(CLEANUP_S))
                self.cleanup_set = True
            with c.lock:
                by_id = self._sync(tc)
                plan = c.plan()
                for tid in plan.pause:
                    trial = by_id.get(tid)
                    if trial is None or trial.status not in (Trial.RUNNING, Trial.PENDING):
                        continue
                    step = (c.last_result.get(tid) or {}).get("step")
                    if trial.status == Trial.RUNNING:
                        # save (behind the current train() call), then stop: Tune sets PAUSED afterwards
                        self.pausing.add(tid)
                        c.book.observe(tid, sp.PAUSED)
                        c.tally.on_pause(tid, time.time(), step)
                        c.paused_with_checkpoint.add(tid)
                        c.emit("sweep_trial", action="paused", trial=tid, last_reported_step=step,
                               cause="grant_below_running", allowed=c.grant.allowed())
                        tc.pause_trial(trial, should_checkpoint=True)
                        continue
                    # starting (its group requested or placed, no actor running yet): stop it without a save;
                    # it keeps the checkpoint it had (none for a new trial). A no-op while Tune has not staged
                    # it yet: then it stays `starting` and the next step tries again.
                    tc.pause_trial(trial, should_checkpoint=False)
                    if trial.status == Trial.PAUSED:
                        ray_compat.tune_unstage_trial(tc, trial)
                        c.book.observe(tid, sp.PAUSED)
                        c.emit("sweep_trial", action="deferred", trial=tid, cause="grant_below_running",
                               allowed=c.grant.allowed())
                for tid in plan.resume:
                    trial = by_id.get(tid)
                    if trial is not None and trial.status == Trial.PAUSED:
                        c.book.observe(tid, sp.STARTING)
                        return trial             # Tune starts one per call; the next call resumes the next
            return None

        def choose_trial_to_run(self, tune_controller):
            return self._apply(tune_controller)

        def __setstate__(self, state):
            self.__dict__.update(state)
            self.cleanup_set = False             # a restored scheduler runs in this driver's controller
            _rebind(self)

        def _restored(self, trial) -> None:
            """A trial of the experiment an earlier driver left, as Tune re-adds it (restore)."""
            c, tid = self.control, trial.trial_id
            c.restored_ids.discard(tid)
            last = dict(trial.last_result or {})
            if last.get("step") is not None:
                c.started.add(tid)
                c.tally.started += 1
            if trial.status == Trial.TERMINATED:
                c.book.observe(tid, sp.DONE)
                c.tally.on_complete(tid, c.config_of.get(tid, trial.config), METRIC, last.get(METRIC), carried=True)
                c.emit("sweep_trial", action="carried_over", trial=tid, step=last.get("step"),
                       cause="driver_restarted", **{METRIC: last.get(METRIC)})
            elif trial.status == Trial.ERROR:        # not re-queued by Tune: failed for good
                c.book.observe(tid, sp.DONE)
            else:                                    # re-queued PENDING: continues from its last checkpoint
                c.book.observe(tid, sp.STARTING)
                c.restored_pending.add(tid)

        def on_trial_add(self, tune_controller, trial):
            # also called when Tune requeues a trial whose actor died (after on_trial_error), and for every
            # trial of a restored experiment (before anything runs)
            with self.control.lock:
                if trial.trial_id in self.control.restored_ids:
                    self._restored(trial)
                elif self.control.book.state(trial.trial_id) in (None, sp.DONE):
                    self.control.book.observe(trial.trial_id, sp.STARTING)
                self.errored.discard(trial.trial_id)

        def on_trial_result(self, tune_controller, trial, result):
            c = self.control
            with c.lock:
                c.note_result(trial.trial_id, result, trial.config)
                if trial.trial_id in self.pausing:
                    return TrialScheduler.PAUSE
            return TrialScheduler.CONTINUE

        def on_trial_complete(self, tune_controller, trial, result):
            c = self.control
            with c.lock:
                # Tune hands a trial's last result (done) here, not to on_trial_result: a trial resumed from a
                # checkpoint taken at or just before its last step has no other result to say it resumed
                if result:
                    c.note_result(trial.trial_id, result, trial.config)
                c.book.observe(trial.trial_id, sp.DONE)
                self.pausing.discard(trial.trial_id)
                c.tally.on_complete(trial.trial_id, c.config_of.get(trial.trial_id, trial.config), METRIC,
                                    (result or {}).get(METRIC))
                c.emit("sweep_trial", action="completed", trial=trial.trial_id, step=(result or {}).get("step"),
                       **{METRIC: (result or {}).get(METRIC)})
                sweep_keeper.drop_state(c.keeper, trial.trial_id)      # done: its kept state is not needed

        def on_trial_error(self, tune_controller, trial):
            c = self.control
            with c.lock:
                c.book.observe(trial.trial_id, sp.DONE)
                self.pausing.discard(trial.trial_id)
                self.errored.add(trial.trial_id)     # failed for good unless Tune requeues it (on_trial_add)
                c.emit("sweep_trial", action="error", trial=trial.trial_id, cause="trial_error",
                       retry=trial.should_recover())
                if not trial.should_recover():
                    sweep_keeper.drop_state(c.keeper, trial.trial_id)

        def on_trial_remove(self, tune_controller, trial):
            with self.control.lock:
                self.control.book.observe(trial.trial_id, sp.DONE)

    return GrantScheduler


def run_sweep(cfg, grant, *, emit: Callable[..., Any] | None = None, callbacks: list | None = None,
              clock: Callable[[], float] = time.monotonic, step_sleep_s: float = 0.0,
              setup_sleep_s: float = 0.0) -> dict:
    """Run the sweep of `cfg` (spotfill.config.sweep.SweepJobConfig) on what `grant` lends; returns
    report.json's `fillin.sweep` section plus `results` (one entry per trial). Ray must be initialized.

    When STORAGE/NAME holds an experiment an earlier driver left (`Tuner.can_restore`), it is restored
    and continued rather than started over (`restored`, `carried_over`, `restored_trials` say so); then
    Tune keeps that experiment's run config, so `callbacks` are the ones it was created with."""
    global _LIVE_CONTROL
    from spotfill import ray_compat
    ray_compat.require_sweep()       # Tune's extension points and state-file names (one line where Ray moved one)
    os.environ.setdefault("TUNE_FORCE_TRIAL_CLEANUP_S", CLEANUP_S)
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", RESTORE_STATE_S)
    os.environ.setdefault("TUNE_RESULT_BUFFER_LENGTH", "1")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "0")
    from ray import tune

    s = cfg.sweep
    configs = s.grid()
    control = SweepControl(grant, configs, clock=clock, emit=emit)
    job = {"data": cfg.data.path, "model": s.model, "steps": s.steps, "batch": s.batch,
           "steps_per_report": s.steps_per_report, "eval_rows": s.eval_rows, "seed": s.seed,
           "step_sleep_s": step_sleep_s, "setup_sleep_s": setup_sleep_s,
           "tenant": f"sweep:{cfg.name}", "gpu_resource": cfg.cluster.gpu_resource}
    if s.keep_in_memory_mb > 0:       # paused trials' states in host memory: resumes read no storage
        control.keeper, job["keeper"] = sweep_keeper.start_keeper(cfg.name, s.keep_in_memory_mb * 2**20)
    control.job, control.experiment = dict(job), experiment_path(cfg.storage, cfg.name)
    resources = tune.PlacementGroupFactory([{"CPU": float(cfg.cluster.cpus_per_trial),
                                             cfg.cluster.gpu_resource: 1.0}])
    trainable = tune.with_resources(tune.with_parameters(_trainable_class(), job=job), resources)
    every = max(1, math.ceil(s.checkpoint_every / s.steps_per_report))
    restoring = tune.Tuner.can_restore(control.experiment)
    if restoring:
        try:
            restoring = _prepare_restore(control)
        except BaseException:
            grant.close()
            _stop_keeper(control)
            raise
    if restoring:
        control.tally.restored = True
        control.emit("sweep_restore", experiment=control.experiment, cause="driver_restarted",
                     trials=len(control.restore_trials))
        log.info("restoring the sweep experiment at %s", control.experiment)
        _LIVE_CONTROL = control          # the searcher/scheduler Tune unpickles are rebound to it
        tuner = tune.Tuner.restore(control.experiment, trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = _new_tuner(cfg, trainable, control, callbacks, every)
    t0 = time.time()
    try:
        grid = tuner.fit()
    finally:
        _LIVE_CONTROL = None
        grant.close()
        keeper = _stop_keeper(control)
    results = []
    for r in grid:
        m = r.metrics or {}
        results.append({"trial": m.get("trial_id"), "config": {k: r.config.get(k) for k in configs[0]} if configs else {},
                        "step": m.get("step"), METRIC: m.get(METRIC), "history_ok": m.get("history_ok"),
                        "history_len": m.get("history_len"), "history_unique": m.get("history_unique"),
                        "device": m.get("device"), "dtype": m.get("dtype"), "gpu_ids": m.get("gpu_ids"),
                        "error": None if r.error is None else f"{type(r.error).__name__}: {r.error}"[:300],
                        "path": r.path})
    control.tally.failed = sum(1 for r in results if r["error"])
    out = control.tally.as_report()
    out.update({"steps_per_trial": s.steps, "seconds": round(time.time() - t0, 2), "storage": cfg.storage,
                "state_keeper": keeper, "results": results})
    return out


def _stop_keeper(control: SweepControl) -> dict | None:
    """Stop the state keeper; its counts (kept, evicted, not kept and why, hits, misses) or None."""
    keeper, control.keeper = control.keeper, None
    if keeper is None:
        return None
    stats = sweep_keeper.stop_keeper(keeper)
    for miss in stats.get("not_kept_detail", []):
        control.emit("sweep_state_not_kept", trial=miss["trial"], step=miss["step"], bytes=miss["bytes"],
                     cause="over_memory_budget", detail=miss["why"])
    return stats


def _prepare_restore(control: SweepControl) -> bool:
    """Check the experiment an earlier driver left (sweep_state.check_experiment: damaged state files set
    aside, each reported) and that it is this sweep's (ConfigError if not); False when nothing restorable
    is left -- the sweep then starts anew, and says why."""
    from spotfill.fillin import sweep_state

    check = sweep_state.check_experiment(control.experiment)
    for f in check.set_aside:
        log.warning("sweep experiment state file %s is damaged (%d bytes: an earlier driver was stopped "
                    "while saving it); set aside as %s", f["file"], f["bytes"], f["as"])
        control.emit("sweep_state_damaged", experiment=control.experiment, file=f["file"], set_aside_as=f["as"],
                     bytes=f["bytes"], cause="partial_write")
    for f in check.restored_from:
        log.warning("sweep experiment state file %s put back from its whole copy %s", f["file"], f["from"])
        control.emit("sweep_state_recovered", experiment=control.experiment, file=f["file"], source=f["from"],
                     cause="partial_write" if any(d["file"] == f["file"] for d in check.set_aside) else "missing")
    control.tally.state_set_aside = [f["file"] for f in check.set_aside]
    control.tally.state_recovered = [f["file"] for f in check.restored_from]
    if not check.restorable:
        why = "tuner.pkl damaged" if not check.tuner_intact else "no intact experiment state saved"
        log.warning("the sweep experiment at %s cannot be restored (%s): starting it anew", control.experiment, why)
        control.emit("sweep_start_over", experiment=control.experiment, cause="no_restorable_state", detail=why)
        return False
    control.restore_handed_out = _check_same_sweep(check, control)
    control.restore_trials = dict(check.trials)
    return True


def _new_tuner(cfg, trainable, control: SweepControl, callbacks: list | None, every: int):
    from ray import tune
    from ray.tune import CheckpointConfig, FailureConfig, RunConfig

    s = cfg.sweep
    return tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(search_alg=_searcher_class()(control), scheduler=_scheduler_class()(control),
                                    num_samples=len(control.configs), reuse_actors=False),
        run_config=RunConfig(name=cfg.name, storage_path=cfg.storage, verbose=0, callbacks=callbacks or [],
                             failure_config=FailureConfig(max_failures=s.max_failures),
                             checkpoint_config=CheckpointConfig(checkpoint_frequency=every, checkpoint_at_end=True,
                                                                num_to_keep=2)),
    )
