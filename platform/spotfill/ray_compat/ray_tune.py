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
