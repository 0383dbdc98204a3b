"""The benchmark's recovery breakdown (detect, decide, workers start, state load, first step) from
events.jsonl, on a hand-written event sequence with known gaps."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.recovery import recovery_breakdown  # noqa: E402


def test_breakdown_splits_the_recovery_at_each_recorded_moment():
    fired = 100.0
    events = [
        {"t": 99.0, "kind": "step", "attempt": 0, "step": 40},
        {"t": 100.5, "kind": "controller_state", "state": "RESTARTING", "previous": "RUNNING"},
        {"t": 101.0, "kind": "controller_state", "state": "SCHEDULING", "previous": "RESTARTING"},
        {"t": 103.0, "kind": "attempt", "attempt": 1, "world_size": 2},
        {"t": 103.1, "kind": "controller_state", "state": "RUNNING", "previous": "SCHEDULING"},
        {"t": 106.0, "kind": "resume", "attempt": 1, "step": 40, "restore_prep_s": 0.8, "load_s": 0.3},
        {"t": 106.25, "kind": "step", "attempt": 1, "step": 41},
    ]
    b = recovery_breakdown(events, fired)
    assert b == {"detect_s": 0.5, "decide_s": 0.5, "workers_start_s": 2.0, "state_load_s": 3.0,
                 "state_load.restore_prep_s": 0.8, "state_load.load_s": 0.3, "first_step_s": 0.25}
    assert sum(v for k, v in b.items() if "." not in k) == 106.25 - fired


def test_rank_zeros_own_moments_split_worker_start_and_state_load():
    events = [
        {"t": 100.5, "kind": "controller_state", "state": "RESTARTING", "previous": "RUNNING"},
        {"t": 101.0, "kind": "controller_state", "state": "SCHEDULING", "previous": "RESTARTING"},
        {"t": 105.0, "kind": "attempt", "attempt": 1, "world_size": 2},
        {"t": 110.0, "kind": "resume", "attempt": 1, "step": 40, "process_started_t": 102.0,
         "loop_entered_t": 104.5, "restored_t": 106.0, "imported_t": 106.5, "engine_t": 109.0},
    ]
    b = recovery_breakdown(events, 100.0)
    assert b["workers_start_s"] == 4.0 and b["state_load_s"] == 5.0
    assert (b["workers_start.process_s"], b["workers_start.init_s"], b["workers_start.loop_s"]) == (1.0, 2.5, 0.5)
    assert (b["state_load.restore_s"], b["state_load.imports_s"], b["state_load.engine_s"],
            b["state_load.checkpoint_s"]) == (1.0, 0.5, 2.5, 1.0)


def test_without_controller_events_the_first_three_are_one_number_and_failed_schedules_count():
    events = [{"t": 10.0, "kind": "controller_state", "state": "RESCHEDULING", "previous": "SCHEDULING"},
              {"t": 18.0, "kind": "attempt", "attempt": 3},
              {"t": 20.0, "kind": "start", "attempt": 3, "step": 0}]
    b = recovery_breakdown(events, 5.0)
    assert "detect_s" not in b and b["detect_decide_workers_start_s"] == 13.0
    assert b["failed_schedules"] == 1 and b["state_load_s"] == 2.0 and "first_step_s" not in b
    assert recovery_breakdown([{"t": 1.0, "kind": "attempt", "attempt": 0}], 5.0) == {}


def test_a_process_started_before_the_decision_is_a_spare_and_its_idle_time_is_not_start_up():
    events = [
        {"t": 100.5, "kind": "controller_state", "state": "RESTARTING", "previous": "RUNNING"},
        {"t": 101.0, "kind": "controller_state", "state": "SCHEDULING", "previous": "RESTARTING"},
        {"t": 102.0, "kind": "attempt", "attempt": 1, "world_size": 2},
        {"t": 103.0, "kind": "resume", "attempt": 1, "step": 40, "process_started_t": 60.0,
         "loop_entered_t": 101.75, "restored_t": 102.2, "imported_t": 102.2, "engine_t": 102.9},
    ]
    b = recovery_breakdown(events, 100.0)
    assert b["workers_start.prestarted"] is True
    assert (b["workers_start.process_s"], b["workers_start.init_s"], b["workers_start.loop_s"]) == (0.0, 0.75, 0.25)
    assert b["workers_start_s"] == 1.0
