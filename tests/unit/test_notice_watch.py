"""A notice that reaches a worker group while it starts or restores (train.notice_watch): every rank's notice
is looked at through one collective at each phase boundary, and the group leaves together before any step."""
from __future__ import annotations

import pytest

from spotfill.train.notice_watch import PHASES, PlannedExit, StartNotice
from spotfill.train.step_policy import StepPolicy


class _Sink:
    def __init__(self):
        self.events: list[dict] = []
        self.planned_exit = type("R", (), {"remote": lambda _, reason, **f: self.events.append(
            {"kind": "planned_exit", "reason": reason, **f})})()


def _start(mine, others, rank=0):
    """A StartNotice on `rank` whose own notice is `mine` and whose peers' rows are `others`."""
    def gather(row):
        return [row, *others] if rank == 0 else [*others, row]
    return StartNotice(StepPolicy(100, 10, margin_s=5.0), lambda: mine, gather, rank, entered_t=0.0)


@pytest.fixture(autouse=True)
def ray_get_answers_at_once(monkeypatch):
    import ray
    monkeypatch.setattr(ray, "get", lambda value, **_: value)


def test_no_notice_on_any_rank_starts_on():
    sink = _Sink()
    for phase in PHASES[:-1]:
        _start(None, [(False, None)]).check(phase, 40, sink)
    assert sink.events == []


@pytest.mark.parametrize("phase", PHASES[:-1])
def test_a_peers_notice_makes_every_rank_leave_before_any_step(phase):
    """Rank 0 holds no notice itself; rank 1 (on the draining node) does: rank 0 leaves too, recording the
    planned exit with the phase it came in and the notice's deadline."""
    sink, left = _Sink(), []
    with pytest.raises(PlannedExit, match="preemption at step 40"):
        _start(None, [(True, 4_000_000_000_000)]).check(phase, 40, sink, on_leave=lambda: left.append(1))
    (e,) = sink.events
    assert e["reason"] == "preemption" and e["phase"] == phase and e["before_first_step"] is True
    assert e["step"] == 40 and e["notice_deadline_unix_s"] == 4_000_000_000.0
    assert "before this group's first step" in e["detail"] and left == [1]


def test_a_rank_other_than_0_leaves_without_recording():
    sink = _Sink()
    notice = type("Notice", (), {"deadline_ms": None})()
    with pytest.raises(PlannedExit):
        _start(notice, [(False, None)], rank=1).check("restored", 40, sink)
    assert sink.events == []


def test_a_group_restored_at_its_last_step_does_not_leave():
    """Nothing is left to run (a checkpoint at the last step): no restart for a notice."""
    _start(None, [(True, None)]).check("restored", 100, _Sink())


def test_a_drain_of_a_group_node_is_a_notice_with_the_earliest_deadline():
    from spotfill.train.notice_watch import DrainNotice, drain_notice
    assert drain_notice({}, ["a", "b"]) is None
    assert drain_notice({"c": 5_000}, ["a", "b"]) is None                     # not this group's node
    assert drain_notice({"b": 9_000, "a": 7_000, "c": 1}, ["a", "b"]) == DrainNotice(7_000, ("a", "b"))
    assert drain_notice({"a": 0}, ["a"]) == DrainNotice(None, ("a",))         # drained without a deadline


def test_the_drain_watch_reads_before_it_returns_and_keeps_a_notice_once_seen():
    """The first read happens in the constructor (a group placed on a node already draining leaves at its
    first look); a notice stays once seen, also after the node left the GCS's list at its deadline."""
    import time

    from spotfill.train.notice_watch import DrainWatch, either
    reads = [{"a": 7_000}, {}, {}]
    watch = DrainWatch(["a"], lambda: reads.pop(0) if reads else {}, poll_s=0.01)
    try:
        assert watch.notice is not None and watch.notice.deadline_ms == 7_000
        time.sleep(0.05)
        assert watch.notice is not None
        assert either(lambda: None, watch)().deadline_ms == 7_000       # Ray Train's notice absent: the watch's
        ray_notice = object()
        assert either(lambda: ray_notice, watch)() is ray_notice
        assert either(lambda: None, None)() is None
    finally:
        watch.close()


def test_the_drain_watch_sees_a_drain_that_comes_later_and_survives_a_failed_read():
    import time

    from spotfill.train.notice_watch import DrainWatch
    calls = []

    def read():
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("GCS busy")
        return {"b": 3_000} if len(calls) >= 4 else {}
    watch = DrainWatch(["a", "b"], read, poll_s=0.01)
    try:
        assert watch.notice is None
        deadline = time.time() + 5
        while watch.notice is None and time.time() < deadline:
            time.sleep(0.01)
        assert watch.notice is not None and watch.notice.nodes == ("b",)
    finally:
        watch.close()
