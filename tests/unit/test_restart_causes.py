"""Every worker-group start carries its cause: planned (what the previous attempt said when it left) or
the failure Ray Train's controller saw; attempt_history in report.json shows it."""
from __future__ import annotations

from spotfill.train.restarts import attempt_cause, classify_failure
from spotfill.train.summary import attempt_history

# Shaped like Ray Train 2.60's TrainingFailedError texts (WorkerGroupError / ControllerError).
NODE_LOST = ("Training failed due to worker errors:\n[Rank 2 Error Snippet]:\n"
             "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n"
             "\tclass_name: RayTrainWorker\n")
USER_BUG = ("Training failed due to worker errors:\n[Rank 0 Error Snippet]:\nTraceback (most recent call last):\n"
            "  File \"loop.py\", line 3, in f\nZeroDivisionError: division by zero\n")
START_TIMEOUT = ("WorkerGroupStartupTimeoutError: The worker group startup timed out after 8.0 seconds "
                 "waiting for 4 workers.")


def test_failures_are_classified_with_their_telling_line():
    died = classify_failure(NODE_LOST)
    assert died.kind == "worker died or node lost" and died.detail.startswith("ray.exceptions.ActorDiedError")
    bug = classify_failure(USER_BUG)
    assert bug.kind == "worker error" and bug.detail == "ZeroDivisionError: division by zero"
    assert classify_failure(START_TIMEOUT).kind == "workers not scheduled in time"
    assert classify_failure("...PlannedExit: preemption notice at step 40").kind == "planned exit"


def test_attempt_cause_planned_unplanned_and_unknown():
    assert attempt_cause(True, None, None) == {"cause": "first start", "planned": True}
    assert attempt_cause(True, None, None, earlier_attempts=4) == {"cause": "first start", "planned": True,
                                                                   "earlier_attempts": 4}
    assert attempt_cause(False, "grow", classify_failure("PlannedExit: capacity")) == {"cause": "planned: grow",
                                                                                   "planned": True}
    c = attempt_cause(False, None, classify_failure(NODE_LOST))
    assert c["cause"] == "unplanned: worker died or node lost" and not c["planned"] and "ActorDiedError" in c["error"]
    assert attempt_cause(False, None, None)["cause"].startswith("unplanned: the previous attempt ended without")


def test_attempt_history_shows_each_attempts_cause():
    events = [
        {"t": 1, "kind": "attempt", "attempt": 0, "world_size": 4, "cause": "first start", "planned": True},
        {"t": 2, "kind": "start", "attempt": 0, "step": 0, "world_size": 4},
        {"t": 3, "kind": "step", "attempt": 0, "step": 10},
        {"t": 4, "kind": "planned_exit", "attempt": 0, "reason": "preemption"},
        {"t": 5, "kind": "attempt", "attempt": 1, "world_size": 2, "cause": "planned: preemption", "planned": True},
        {"t": 6, "kind": "resume", "attempt": 1, "step": 10, "world_size": 2},
        {"t": 7, "kind": "step", "attempt": 1, "step": 15},
        {"t": 8, "kind": "attempt", "attempt": 2, "world_size": 1, "cause": "unplanned: worker died or node lost",
         "planned": False, "error": "ray.exceptions.ActorDiedError: The actor died"},
        {"t": 9, "kind": "resume", "attempt": 2, "step": 10, "world_size": 1},
        {"t": 10, "kind": "finish", "ok": True, "attempt": 2},
    ]
    h = attempt_history(events)
    assert [a["cause"] for a in h] == ["first start", "planned: preemption", "unplanned: worker died or node lost"]
    assert h[2]["error"].startswith("ray.exceptions.ActorDiedError") and h[2]["planned"] is False
    assert [a["ended"] for a in h] == ["preemption", "failed", "finished"]


def test_a_run_torn_down_under_its_live_controller_is_named_so():
    from spotfill.train.restarts import PLACEMENT_GROUP_REMOVED
    f = classify_failure(f"{PLACEMENT_GROUP_REMOVED}\n{NODE_LOST}")
    assert f.kind == "placement group removed (cleaner teardown)" and "ActorDiedError" in f.detail
    assert attempt_cause(False, None, f)["cause"] == "unplanned: placement group removed (cleaner teardown)"


def _state(name, **extra):
    from types import SimpleNamespace
    return SimpleNamespace(_state_type=SimpleNamespace(state_name=name), **extra)


def _callback():
    """A RestartCauseCallback whose sink records (previous, state, fields) of each report."""
    from types import SimpleNamespace

    from spotfill.train.sink import RestartCauseCallback
    sent = []
    cb = RestartCauseCallback("sink", "ns")
    cb._sink = SimpleNamespace(controller_state=SimpleNamespace(
        remote=lambda st, prev, t, **fields: sent.append((prev, st, fields))))
    return cb, sent


def test_controller_callback_reports_changes_not_repeats():
    """The controller calls back on every poll; a state that did not change (RUNNING while it runs,
    INITIALIZING while it waits for nodes) is not an event -- unless it carries a failure."""
    from types import SimpleNamespace

    cb, sent = _callback()
    state = _state
    cb.after_controller_state_update(state("INITIALIZING"), state("INITIALIZING"))
    cb.after_controller_state_update(state("INITIALIZING"), state("INITIALIZING"))
    cb.after_controller_state_update(state("INITIALIZING"), state("SCHEDULING",
                                     scaling_decision=SimpleNamespace(num_workers=4)))
    cb.after_controller_state_update(state("RUNNING"), state("RUNNING"))
    cb.after_controller_state_update(state("RUNNING"), state("RUNNING", training_failed_error="boom"))
    assert [(p, s) for p, s, _ in sent] == [("INITIALIZING", "SCHEDULING"), ("RUNNING", "RUNNING")]
    assert sent[0][2] == {"num_workers": 4} and sent[1][2] == {"error": "boom"}


def test_only_a_running_groups_failure_with_its_placement_group_removed_is_a_cleaner_teardown():
    """After a node loss Ray Train removes the old group's placement group itself and schedules a new group;
    that group's start failing (SCHEDULING -> RESCHEDULING) was read as a cleaner teardown because the old
    group's removed placement group was still the one on record (seen in a demo)."""
    from spotfill.train.restarts import PLACEMENT_GROUP_REMOVED

    cb, sent = _callback()
    state = _state
    cb._placement_group = object()
    cb._placement_group_removed = lambda: True           # the group on record: removed
    cb.after_controller_state_update(state("SCHEDULING"), state("RESCHEDULING", training_failed_error="timeout"))
    cb.after_controller_state_update(state("RUNNING"), state("RESTARTING", training_failed_error=NODE_LOST))
    assert sent[0][2]["error"] == "timeout"
    assert sent[1][2]["error"].startswith(PLACEMENT_GROUP_REMOVED) and NODE_LOST in sent[1][2]["error"]


def test_a_heading_line_is_kept_with_what_it_introduces():
    f = classify_failure("Training failed due to controller error:\n  Worker group startup failed: placement "
                         "group not ready within 30.0s")
    assert f.kind == "worker error"
    assert f.detail == ("Training failed due to controller error: Worker group startup failed: placement group "
                        "not ready within 30.0s")
    assert classify_failure("one line only").detail == "one line only"
