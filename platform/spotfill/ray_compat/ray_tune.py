"""Ray Tune's private names the fill-in sweep (fillin/sweep.py) uses on Tune's controller.

The sweep's scheduler and searcher are built on Tune's DeveloperAPI extension points; `require_sweep()`
checks them, and the controller internals below, when a sweep is built (hook tune_fillin_sweep).
"""
from __future__ import annotations

from spotfill.ray_compat.catalog import HOOKS
from spotfill.ray_compat.hooks import RayCompatError, require, required_message, usable


def require_sweep() -> None:
    """RayCompatError (one line) when this Ray lacks what the fill-in sweep is built on."""
    require("tune_fillin_sweep")


def tune_force_cleanup_after(controller, seconds: float) -> bool:
    """Kill a stopping trial actor `seconds` after Tune asked it to stop, whatever it is doing. Ray 2.60's
    TuneController waits TUNE_FORCE_TRIAL_CLEANUP_S, and then, for an actor that started (created, even if
    its setup still runs), up to a fixed `_actor_force_cleanup_timeout` of 10 s more for its `stop()` --
    which is queued behind the actor's constructor or its current `train()` call. A fill-in trial starved of
    CPU held its GPU that long past a reclaim, beyond its grace (fillin/sweep.py). `controller`: as for
    tune_unstage_trial. False (Tune's timeout kept, one warning) where this Ray has no such timeout."""
    ctrl = getattr(controller, "_tune_controller", controller)
    if not usable("tune_fast_trial_cleanup") or not hasattr(ctrl, "_actor_force_cleanup_timeout"):
        return False
    ctrl._actor_force_cleanup_timeout = seconds
    return True


def tune_unstage_trial(controller, trial) -> bool:
    """Forget that Tune staged `trial` (placement group requested, actor not started yet) after the sweep's
    scheduler paused it (fillin/sweep.py: a claim arrived while the trial was starting). Ray 2.60's
    TuneController only unstages a trial when its actor starts; a paused trial left in its staged set is
    only ever started with a cached actor, i.e. never with reuse_actors off. `controller` is what Tune hands
    a TrialScheduler (a TrialRunnerWrapper around the controller) or the controller itself."""
    require("tune_fillin_sweep")
    ctrl = getattr(controller, "_tune_controller", controller)
    staged = getattr(ctrl, "_staged_trials", None)
    if staged is None:
        raise RayCompatError(required_message(HOOKS["tune_fillin_sweep"],
                                              f"{type(ctrl).__name__}._staged_trials (missing)"))
    if trial in staged:
        ctrl._unstage_trial_with_resources(trial)
        return True
    return False


def tune_checkpoint_parts(value) -> tuple[str | None, dict]:
    """(storage path, metrics) of the checkpoint Tune hands `Trainable.restore` or gets back from
    `Trainable.save` -- in Ray 2.60 a _TrainingResult(checkpoint, metrics), whose metrics are Tune's record
    of that checkpoint (the dict itself: a key set in it travels back to the controller with the result).
    (None, {}) where this Ray's result is not that (hook tune_restore_from_memory off): the sweep's trials
    then restore from storage."""
    if isinstance(value, str):
        return value, {}
    if not usable("tune_restore_from_memory"):
        return None, {}
    checkpoint, metrics = getattr(value, "checkpoint", None), getattr(value, "metrics", None)
    return getattr(checkpoint, "path", None), metrics if isinstance(metrics, dict) else {}


def tune_result_on_local_dir(value, local_dir: str):
    """A copy of Tune's checkpoint result `value` whose checkpoint is the local folder `local_dir` (its
    metrics kept), so that `Trainable.restore` -- the bookkeeping it does (iteration, time) and its call of
    `load_checkpoint` -- runs without reading the storage checkpoint (a sweep trial restoring its state
    from host memory: fillin/sweep_keeper.py). None where this Ray has no such result class."""
    if not usable("tune_restore_from_memory"):
        return None
    from ray.train._internal.session import _TrainingResult
    from ray.tune import Checkpoint

    if not isinstance(value, _TrainingResult):
        return None
    return _TrainingResult(checkpoint=Checkpoint.from_directory(local_dir), metrics=dict(value.metrics))


def tune_trial_runtime_env() -> dict | None:
    """The runtime_env Ray Tune gives a trial's actor (Ray 2.60: tune/execution/class_cache.py's
    _ActorClassCache.get: {"env_vars": its defaults plus the variables it propagates from this driver's
    environment}), so a process prestarted with it is one Ray's worker pool hands a trial (fillin/
    sweep_standby.py). None (trials start in fresh processes, one warning) where this Ray has no such names."""
    if not usable("tune_trial_runtime_env"):
        return None
    import os

    from ray.tune.execution import class_cache
    env_vars = dict(class_cache.DEFAULT_ENV_VARS)
    for name in class_cache.ENV_VARS_TO_PROPAGATE:
        if name in os.environ:
            env_vars[name] = os.environ[name]
    return {"env_vars": env_vars}
