"""step_policy.py: what the group does after each step, table-driven, with a fake clock."""
from __future__ import annotations

import pytest

from spotfill.train.step_policy import (CONTINUE, EXIT, FINISH, SAVE, SAVE_AND_EXIT, StepFacts,
                                        StepPolicy)

NOW = 1_700_000_000.0       # the fake clock's "now" (unix s)
POLICY = StepPolicy(total_steps=100, checkpoint_every=20, margin_s=1.0)

# (name, facts, action, save_kind, reason, budget_s, save_deadline) -- budgets worked out by hand:
# deadline - now - 1.0 s margin.
CASES = [
    ("plain step", StepFacts(done=5, now=NOW), CONTINUE, None, "", None, None),
    ("periodic", StepFacts(done=40, now=NOW), SAVE, "periodic", "periodic", None, None),
    ("periodic, upload in flight", StepFacts(done=40, now=NOW, upload_in_flight=True),
     SAVE, "periodic", "periodic", None, None),
    ("notice, 30 s left", StepFacts(done=7, now=NOW, preempt_votes=1, deadline_unix_s=NOW + 30),
     SAVE_AND_EXIT, "emergency", "preemption", 29.0, NOW + 29),
    ("notice on two ranks, no deadline", StepFacts(done=7, now=NOW, preempt_votes=2),
     SAVE_AND_EXIT, "emergency", "preemption", None, None),
    ("notice, 0.5 s left: no time to save", StepFacts(done=7, now=NOW, preempt_votes=1, deadline_unix_s=NOW + 0.5),
     EXIT, None, "preemption", -0.5, NOW - 0.5),
    ("notice, exactly the margin left", StepFacts(done=7, now=NOW, preempt_votes=1, deadline_unix_s=NOW + 1.0),
     EXIT, None, "preemption", 0.0, NOW),
    ("notice beats grow", StepFacts(done=7, now=NOW, preempt_votes=1, deadline_unix_s=NOW + 10, grow_workers=2),
     SAVE_AND_EXIT, "emergency", "preemption", 9.0, NOW + 9),
    ("notice on a periodic step", StepFacts(done=60, now=NOW, preempt_votes=1, deadline_unix_s=NOW + 5),
     SAVE_AND_EXIT, "emergency", "preemption", 4.0, NOW + 4),
    ("grow", StepFacts(done=7, now=NOW, grow_workers=2), SAVE_AND_EXIT, "grow", "grow", None, None),
    ("grow on a periodic step", StepFacts(done=20, now=NOW, grow_workers=1), SAVE_AND_EXIT, "grow", "grow",
     None, None),
    ("last step", StepFacts(done=100, now=NOW), FINISH, "final", "last step", None, None),
    # defect 8: a flag raised on the last step finishes the job (final save), it does not restart it
    ("notice on the last step", StepFacts(done=100, now=NOW, preempt_votes=1, deadline_unix_s=NOW + 10),
     FINISH, "final", "last step", 9.0, NOW + 9),
    ("grow on the last step", StepFacts(done=100, now=NOW, grow_workers=3), FINISH, "final", "last step",
     None, None),
    ("notice and grow on the last step", StepFacts(done=100, now=NOW, preempt_votes=2, grow_workers=1),
     FINISH, "final", "last step", None, None),
]


@pytest.mark.parametrize("name,facts,action,kind,reason,budget,deadline", CASES, ids=[c[0] for c in CASES])
def test_decision_table(name, facts, action, kind, reason, budget, deadline):
    d = POLICY.decide(facts)
    assert (d.action, d.save_kind, d.reason) == (action, kind, reason)
    assert d.budget_s == (pytest.approx(budget) if budget is not None else None)
    assert d.save_deadline_unix_s == (pytest.approx(deadline) if deadline is not None else None)
    assert d.saves == (kind is not None)
    assert d.leaves == (action in (SAVE_AND_EXIT, EXIT))


@pytest.mark.parametrize("flags", [{"preempt_votes": 1, "deadline_unix_s": NOW + 10}, {"grow_workers": 1},
                                   {"preempt_votes": 1, "grow_workers": 1}])
def test_a_flag_on_the_last_step_finishes_instead_of_restarting(flags):
    d = POLICY.decide(StepFacts(done=100, now=NOW, **flags))
    assert d.action == FINISH and not d.leaves and d.save_kind == "final"
    assert "finishing instead of restarting" in d.detail


class FakeClock:
    def __init__(self, t: float):
        self.t = t

    def advance(self, s: float) -> float:
        self.t += s
        return self.t


def _drive(policy: StepPolicy, step_s: float, notice_at: float | None, deadline_after_s: float):
    """Run steps 1.. on a fake clock until the policy leaves or finishes; a notice shows up on the first
    step that ends at or after `notice_at`. Returns [(done, now, decision)] of the non-continue steps."""
    clock, out = FakeClock(NOW), []
    for done in range(1, policy.total_steps + 1):
        now = clock.advance(step_s)
        notice = notice_at is not None and now >= notice_at
        d = policy.decide(StepFacts(done=done, now=now, preempt_votes=int(notice),
                                    deadline_unix_s=notice_at + deadline_after_s if notice else None))
        if d.action != CONTINUE:
            out.append((done, now, d))
        if d.action in (FINISH, SAVE_AND_EXIT, EXIT):
            return out
    raise AssertionError("never finished")


def test_fake_clock_notice_mid_run_gives_an_emergency_save_with_the_remaining_budget():
    # steps of 0.5 s from NOW: step 25 ends at NOW+12.5 (periodic save at 20 first); the notice comes at
    # NOW+12.2 with 30 s: seen after step 25, at NOW+12.5 -> budget 30 - 0.3 - 1.0 = 28.7 s
    out = _drive(StepPolicy(100, 20), step_s=0.5, notice_at=NOW + 12.2, deadline_after_s=30)
    assert [(done, d.action, d.save_kind) for done, _, d in out] == [
        (20, SAVE, "periodic"), (25, SAVE_AND_EXIT, "emergency")]
    assert out[-1][2].budget_s == pytest.approx(28.7)


def test_fake_clock_slow_steps_eat_the_budget():
    # steps of 4 s: the notice at NOW+1 with 4 s is first seen at NOW+4: 1 s left, all of it the margin
    out = _drive(StepPolicy(100, 20), step_s=4.0, notice_at=NOW + 1, deadline_after_s=4.0)
    assert [(done, d.action) for done, _, d in out] == [(1, EXIT)]
    assert out[0][2].budget_s == pytest.approx(0.0)


def test_fake_clock_notice_during_the_last_step_finishes():
    out = _drive(StepPolicy(10, 20), step_s=1.0, notice_at=NOW + 9.5, deadline_after_s=30)
    assert [(done, d.action, d.save_kind) for done, _, d in out] == [(10, FINISH, "final")]
    assert out[0][2].budget_s == pytest.approx(30 - 0.5 - 1.0)
