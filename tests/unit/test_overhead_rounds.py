"""The overhead benchmark's rounds: each spotfill time slice is compared with the plain slices around it,
on hand-made rates whose machine speed drifts over the bench."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.overhead import round_ratios  # noqa: E402


def test_a_drifting_machine_cancels_out_of_each_rounds_ratio():
    # the machine slows 10% per run; spotfill is 0.95 of plain throughout
    speed = [1.0, 0.9, 0.81, 0.729, 0.6561]        # plain, spotfill, plain, spotfill, plain
    plain = [1000 * speed[0], 1000 * speed[2], 1000 * speed[4]]
    ours = [950 * speed[1], 950 * speed[3]]
    rounds = round_ratios(ours, plain)
    # each round: 950*0.9 / ((1000 + 810) / 2) = 855 / 905; 950*0.729 / ((810 + 656.1) / 2) = 692.55 / 733.05
    assert [r["ratio"] for r in rounds] == pytest.approx([855 / 905, 692.55 / 733.05])
    assert [r["plain_tokens_s"] for r in rounds] == pytest.approx([905, 733.05])
    # compared with all plain runs pooled, the same runs read 0.941 (drift charged to spotfill)
    pooled = sum(ours) / len(ours) / (sum(plain) / len(plain))
    assert pooled == pytest.approx(773.775 / (2466.1 / 3))
    assert all(abs(r["ratio"] - 0.95) < 0.006 for r in rounds) and abs(pooled - 0.95) > 0.008


@pytest.mark.parametrize("ours,plain", [([], [1.0]), ([1.0], [1.0]), ([1.0, 1.0], [1.0, 1.0])])
def test_rounds_need_a_plain_run_on_both_sides(ours, plain):
    with pytest.raises(ValueError, match="one more plain run"):
        round_ratios(ours, plain)
