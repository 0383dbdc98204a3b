"""Pipeline bubble arithmetic (train/bubble.py): the theory, a stage's step accounting, estimates and chunks."""
from __future__ import annotations

import pytest

from spotfill.train.bubble import (BubbleEstimates, Instr, Point, account, chunk_rows, fill_budget, overrun,
                                   per_stage, percentile, theory_fraction)


def test_theory_matches_the_schedules_idle_slots():
    # a stage of a 1F1B schedule idles 2(S-1) of its 2(M+S-1) slots
    assert theory_fraction(2, 4) == pytest.approx(0.2)
    assert theory_fraction(4, 8) == pytest.approx(3 / 11)
    assert theory_fraction(8, 16) == pytest.approx(7 / 23)
    assert theory_fraction(1, 4) == 0.0
    with pytest.raises(ValueError):
        theory_fraction(2, 0)


def test_a_stages_step_splits_into_busy_and_bubble():
    """Stage 0 of S=2, M=2 in time units (forward 1, backward 2): it blocks 2 units for the first gradient
    and 1 unit for the loss at the end; fill work at the first point counts as bubble, not as busy."""
    instrs = [Instr("LoadMicroBatch", 0.0, 0.0), Instr("ForwardPass", 0.0, 1.0),
              Instr("SendActivation", 1.0, 1.0), Instr("LoadMicroBatch", 1.0, 1.0),
              Instr("ForwardPass", 1.0, 2.0),
              Instr("RecvGrad", 2.5, 4.0),                   # 0.5 of fill before it, then blocked 1.5
              Instr("SendActivation", 4.0, 4.0), Instr("BackwardPass", 4.0, 6.0),
              Instr("RecvGrad", 6.0, 7.0), Instr("BackwardPass", 7.0, 9.0),
              Instr("ReduceTiedGrads", 9.0, 9.0), Instr("ReduceGrads", 9.0, 9.2),
              Instr("OptimizerStep", 9.2, 9.5)]
    points = [Point(0, "SendActivation", 0.0, 0.0), Point(1, "RecvGrad", 0.5, 1.5),
              Point(2, "SendActivation", 0.0, 0.0), Point(3, "RecvGrad", 0.0, 1.0), Point(4, "End", 0.0, 0.5)]
    s = account(instrs, points, 0.0, 10.0)
    assert s.busy_s == pytest.approx(1 + 1 + 2 + 2 + 0.2 + 0.3)
    assert s.bubble_s == pytest.approx(10.0 - 6.5) and s.fill_s == pytest.approx(0.5)
    assert s.forward_backward_s == pytest.approx(6.0) and s.optimizer_s == pytest.approx(0.5)
    assert s.fraction == pytest.approx(0.35)
    assert [p.bubble_s for p in s.points] == [0.0, 2.0, 0.0, 1.0, 0.5]


def test_estimates_are_the_recent_median_of_fill_plus_wait():
    est = BubbleEstimates(window=5)
    assert est.estimate(1) is None
    for fill, wait in ((0.0, 0.010), (0.008, 0.002), (0.0, 0.5)):     # one outlier (a slow step)
        est.add([Point(1, "RecvGrad", fill, wait)])
    assert est.estimate(1) == pytest.approx(0.010)
    for _ in range(5):
        est.add([Point(1, "RecvGrad", 0.0, 0.020)])
    assert est.estimate(1) == pytest.approx(0.020)      # only the last 5 count


def test_budget_leaves_a_margin_and_skips_tiny_bubbles():
    assert fill_budget(None) == 0.0 and fill_budget(0.001) == 0.0
    assert fill_budget(0.1, margin=0.15) == pytest.approx(0.085)


def test_chunks_fit_the_budget():
    assert chunk_rows(0.1, None, 64) == 1                 # cost unknown: one row to measure it
    assert chunk_rows(0.1, 0.03, 64) == 3
    assert chunk_rows(0.1, 0.001, 64) == 64
    assert chunk_rows(0.02, 0.03, 64) == 0
    assert chunk_rows(0.0, 0.001, 64) == 0 and chunk_rows(1.0, 0.001, 0) == 0


def test_overrun_percentiles_and_per_stage():
    assert overrun(0.012, 0.010) == pytest.approx(0.002) and overrun(0.008, 0.010) == 0.0
    assert percentile([], 50) is None
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile(range(101), 99) == pytest.approx(99.0)
    assert per_stage([1.0, 2.0, 3.0, 6.0], 2) == [2.0, 4.0]    # ranks (0,0) (0,1) (1,0) (1,1)
    with pytest.raises(ValueError):
        per_stage([1.0, 2.0, 3.0], 2)
