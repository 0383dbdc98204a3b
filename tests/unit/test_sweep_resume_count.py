"""A sweep trial paused with a checkpoint and resumed counts as resumed (report.json fillin.sweep.resumed), also
when the resumed incarnation's only result is its last one: Tune hands a done result to the scheduler's
on_trial_complete, never to on_trial_result. Seen in a demo: a trial paused at step 90 of 100 (its checkpoint
taken behind the train() call that finished the trial), resumed, completed -- and the report said 0 resumed."""
from __future__ import annotations

from types import SimpleNamespace

from spotfill.fillin.grant import FixedGrant
from spotfill.fillin.sweep import SweepControl, _scheduler_class


def _control():
    events = []
    control = SweepControl(FixedGrant(1), [{"lr": 0.1}], emit=lambda kind, **f: events.append({"kind": kind, **f}))
    return control, events


def test_a_trial_resumed_only_to_complete_counts_as_resumed():
    control, events = _control()
    scheduler = _scheduler_class()(control)
    trial = SimpleNamespace(trial_id="t1", config={"lr": 0.1})
    scheduler.on_trial_result(None, trial, {"step": 90, "incarnation": "a", "restored_from": None})
    control.paused_with_checkpoint.add("t1")            # what the scheduler records when it pauses a running trial
    scheduler.on_trial_complete(None, trial, {"step": 100, "incarnation": "b", "restored_from": 100, "done": True})
    assert control.tally.resumed == 1 and control.tally.completed == 1
    assert [e["action"] for e in events] == ["started", "resumed", "completed"]


def test_a_trial_that_completes_in_its_first_incarnation_is_not_a_resume():
    control, events = _control()
    scheduler = _scheduler_class()(control)
    trial = SimpleNamespace(trial_id="t1", config={"lr": 0.1})
    scheduler.on_trial_result(None, trial, {"step": 5, "incarnation": "a", "restored_from": None})
    scheduler.on_trial_complete(None, trial, {"step": 10, "incarnation": "a", "restored_from": None, "done": True})
    assert control.tally.resumed == 0 and control.tally.recovered == 0 and control.tally.completed == 1
    assert [e["action"] for e in events] == ["started", "completed"]
