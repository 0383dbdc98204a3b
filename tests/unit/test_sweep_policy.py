"""The sweep's pure decisions (fillin/sweep_policy.py): how many trials to pause, resume and admit given the
grant, with a fake clock for who started last and who has been paused longest."""
from __future__ import annotations

import pytest

from spotfill.fillin import sweep_policy as sp


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def tick(self, s: float = 1.0) -> float:
        self.t += s
        return self.t


def book_with(clock, *trials):
    """trials: (id, state) in the order they happen, one clock tick apart."""
    book = sp.TrialBook(clock)
    for tid, state in trials:
        clock.tick()
        book.observe(tid, state)
    return book


def test_nothing_is_admitted_or_resumed_while_the_grant_is_zero():
    clock = Clock()
    book = book_with(clock, ("a", sp.RUNNING), ("a", sp.PAUSED))
    p = sp.plan(0, book.views(), unstarted=5)
    assert p.admit == 0 and p.resume == [] and p.pause == []
    assert sp.plan(0, [], unstarted=5).admit == 0


def test_admits_up_to_the_grant_counting_trials_that_are_still_starting():
    clock = Clock()
    book = book_with(clock, ("a", sp.RUNNING), ("b", sp.STARTING))
    assert sp.plan(3, book.views(), unstarted=5).admit == 1
    assert sp.plan(2, book.views(), unstarted=5).admit == 0
    assert sp.plan(10, book.views(), unstarted=1).admit == 1      # no more configurations than remain


def test_a_drop_pauses_the_newest_started_trials_and_starting_ones_first():
    clock = Clock()
    book = book_with(clock, ("old", sp.RUNNING), ("mid", sp.RUNNING), ("new", sp.RUNNING))
    assert sp.plan(2, book.views(), 0).pause == ["new"]
    assert sp.plan(1, book.views(), 0).pause == ["new", "mid"]
    assert sp.plan(0, book.views(), 0).pause == ["new", "mid", "old"]
    # a trial still waiting for its placement group goes first, even though it is not the newest running
    clock.tick()
    book.observe("waiting", sp.STARTING)
    assert sp.plan(2, book.views(), 0).pause == ["waiting", "new"]


def test_a_resumed_trial_counts_as_newest_started():
    clock = Clock()
    book = book_with(clock, ("a", sp.RUNNING), ("b", sp.RUNNING), ("a", sp.PAUSED))
    clock.tick(5)
    book.observe("a", sp.STARTING)          # resumed later than b started
    book.observe("a", sp.RUNNING)           # running again: its start time stays the resume time
    assert sp.plan(1, book.views(), 0).pause == ["a"]


def test_paused_trials_resume_before_new_ones_start_longest_paused_first():
    clock = Clock()
    book = book_with(clock, ("a", sp.RUNNING), ("b", sp.RUNNING), ("b", sp.PAUSED), ("a", sp.PAUSED))
    p = sp.plan(1, book.views(), unstarted=4)
    assert p.resume == ["b"] and p.admit == 0
    p = sp.plan(4, book.views(), unstarted=4)
    assert p.resume == ["b", "a"] and p.admit == 0            # new trials wait until no paused one is left
    book.observe("a", sp.STARTING)
    book.observe("b", sp.STARTING)
    assert sp.plan(4, book.views(), unstarted=4).admit == 2


def test_finished_trials_hold_nothing_and_leave_the_demand():
    clock = Clock()
    book = book_with(clock, ("a", sp.RUNNING), ("b", sp.RUNNING), ("a", sp.DONE))
    assert sp.plan(1, book.views(), 0).pause == []
    assert sp.demand(book.views(), unstarted=3) == 4         # b + 3 not started
    book.observe("b", sp.PAUSED)
    assert sp.demand(book.views(), unstarted=0) == 1


def test_book_rejects_unknown_states_and_keeps_times_on_repeats():
    clock = Clock()
    book = sp.TrialBook(clock)
    with pytest.raises(ValueError):
        book.observe("a", "weird")
    book.observe("a", sp.STARTING)
    clock.tick(10)
    book.observe("a", sp.STARTING)
    book.observe("a", sp.RUNNING)
    (v,) = book.views()
    assert v.started_at == 100.0 and v.state == sp.RUNNING


def test_tally_counts_and_best():
    tally = sp.SweepTally(trials=3)
    tally.on_pause("a", 1.0, 8)
    tally.on_complete("a", {"lr": 1e-3}, "eval_loss", 2.5)
    tally.on_complete("b", {"lr": 3e-3}, "eval_loss", 2.1)
    tally.on_complete("c", {"lr": 1e-2}, "eval_loss", None)
    r = tally.as_report()
    assert r["completed"] == 3 and r["paused"] == 1
    assert r["best"] == {"config": {"lr": 3e-3}, "metric": 2.1, "metric_name": "eval_loss", "trial": "b"}


def test_tally_counts_trials_an_earlier_driver_completed_as_completed_and_carried_over():
    tally = sp.SweepTally(trials=3, restored=True)
    tally.on_complete("a", {"lr": 1e-3}, "eval_loss", 2.0, carried=True)     # finished before the restore
    tally.on_complete("b", {"lr": 3e-3}, "eval_loss", 2.4)
    tally.restored_trials += 1
    r = tally.as_report()
    assert (r["completed"], r["carried_over"], r["restored_trials"], r["restored"]) == (2, 1, 1, True)
    assert r["best"]["trial"] == "a"                  # a carried-over trial can be the best one
    assert sp.SweepTally(trials=1).as_report()["restored"] is False
