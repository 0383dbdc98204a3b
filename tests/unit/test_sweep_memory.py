"""The sweep's host-memory state of paused trials (fillin/sweep_memory.py, no Ray): a resume takes a kept
state only when it is exactly the checkpoint being restored; the shelf keeps one state per trial within its
budget (oldest evicted, an oversized state refused with a reason); the tally counts where restores came from."""
from __future__ import annotations

import pytest

from spotfill.fillin.sweep_memory import SHA_KEY, Shelf, StateId, digest, mismatch, wanted_state
from spotfill.fillin.sweep_policy import SweepTally


def state(trial: str = "t1", step: int = 12, data: bytes = b"weights@12", ckpt: str | None = None):
    return StateId(trial, step, ckpt or f"/tune/{trial}/checkpoint_{step:06d}", digest(data)), data


def test_the_exact_checkpoints_state_is_taken_from_memory():
    sid, data = state()
    shelf = Shelf(1000)
    assert shelf.put(sid, data) == {"kept": True, "evicted": [], "why": None}
    assert shelf.take(sid) == (data, None)
    assert shelf.take(sid) == (data, None)     # kept on: a trial dying before its next checkpoint restores it again
    assert shelf.stats()["hits"] == 2


@pytest.mark.parametrize("other, words", [
    (lambda s: StateId(s.trial, s.step - 4, s.checkpoint, s.sha256), "step 8's"),
    (lambda s: StateId(s.trial, s.step, "/tune/t1/checkpoint_000001", s.sha256), "checkpoint"),
    (lambda s: StateId(s.trial, s.step, s.checkpoint, digest(b"other")), "checksum"),
    (lambda s: StateId("t2", s.step, s.checkpoint, s.sha256), "trial t2's"),
])
def test_a_kept_state_of_another_step_checkpoint_checksum_or_trial_is_refused(other, words):
    sid, data = state()
    why = mismatch(sid, other(sid), data)
    assert why is not None and words in why, why


def test_a_stale_state_kept_for_the_trial_is_not_handed_out():
    """The keeper holds the trial's step-8 state (its step-12 save never reached it, or Tune restores an
    older checkpoint): the resume of step 12 gets nothing from memory, and says why."""
    old, old_data = state(step=8, data=b"weights@8")
    wanted, _ = state(step=12)
    shelf = Shelf(1000)
    shelf.put(old, old_data)
    data, why = shelf.take(wanted)
    assert data is None and "step 8's" in why and "step 12's" in why
    assert shelf.stats()["misses"] == 1


def test_bytes_that_do_not_hash_to_the_checksum_are_refused():
    sid, _ = state()
    assert "do not hash" in mismatch(sid, sid, b"weights@12 but damaged")
    assert mismatch(sid, None, None) == "no state kept for this trial"


def test_a_newer_save_replaces_the_trials_state_and_done_trials_are_dropped():
    shelf = Shelf(1000)
    s8, d8 = state(step=8, data=b"a" * 100)
    s12, d12 = state(step=12, data=b"b" * 150)
    shelf.put(s8, d8)
    shelf.put(s12, d12)
    st = shelf.stats()
    assert (st["states"], st["held_bytes"], st["replaced"]) == (1, 150, 1)
    assert shelf.take(s8)[0] is None and shelf.take(s12)[0] == d12
    assert shelf.drop("t1") and not shelf.drop("t1")
    assert shelf.stats()["held_bytes"] == 0 and shelf.take(s12)[1] == "no state kept for this trial"


def test_the_budget_evicts_the_oldest_states_and_refuses_one_larger_than_itself():
    shelf = Shelf(300)
    a, da = state("a", data=b"a" * 120)
    b, db = state("b", data=b"b" * 120)
    c, dc = state("c", data=b"c" * 120)
    shelf.put(a, da)
    shelf.put(b, db)
    out = shelf.put(c, dc)
    assert out == {"kept": True, "evicted": ["a"], "why": None}
    assert shelf.take(a)[0] is None and shelf.take(b)[0] == db and shelf.take(c)[0] == dc
    assert shelf.stats()["held_bytes"] == 240 <= shelf.budget
    big, dbig = state("d", data=b"d" * 301)
    out = shelf.put(big, dbig)
    assert out["kept"] is False and "301 bytes is over the memory budget of 300" in out["why"]
    assert shelf.take(b)[0] == db                      # nothing evicted for a state that cannot fit anyway
    assert shelf.stats()["not_kept"] == 1 and shelf.stats()["not_kept_detail"][0]["trial"] == "d"


def test_a_zero_budget_keeps_nothing():
    sid, data = state()
    shelf = Shelf(0)
    assert shelf.put(sid, data)["kept"] is False and shelf.take(sid)[0] is None


def test_the_wanted_state_comes_from_tunes_record_of_the_checkpoint():
    sid, _ = state()
    assert wanted_state("t1", sid.checkpoint, {"step": 12, SHA_KEY: sid.sha256}) == (sid, None)
    none, why = wanted_state("t1", sid.checkpoint, {"step": 12})       # saved without a keeper
    assert none is None and "checksum" in why
    assert wanted_state("t1", None, {"step": 12, SHA_KEY: sid.sha256})[0] is None


def test_the_report_counts_restores_by_where_the_state_came_from():
    tally = SweepTally(trials=2)
    tally.on_restore("memory", 0.01234567)
    tally.on_restore("memory", 0.02)
    tally.on_restore("storage", 0.5)
    out = tally.as_report()
    assert out["resumed_from"] == {"memory": 2, "storage": 1}
    assert out["restore_s"] == {"memory": [0.0123, 0.02], "storage": [0.5]}
