"""A mass preemption on a real local multi-node Ray cluster, driven by the scenario runner: 5 of 8 nodes
(one GPU slot each) taken in one pass while nothing adds capacity -- without notice (every node's workers
killed, then the nodes removed) and, in a second run, with a notice each (drains with a deadline). Training
goes on on the 3 survivors; nothing committed is lost; every sample is trained on exactly once; the report
lists each node's end.

Heavy for a small machine (8 worker processes): the smallest run that shows it. Training's elastic range
[1, 8] needs a global batch every size from 1 to 8 divides (840); 60 steps with a checkpoint every 10."""
from __future__ import annotations

import contextlib
import io

import pytest

from spotfill.sim.outcomes import digest
from spotfill.sim.runner import run_scenario
from spotfill.sim.scenario import parse_scenario

# Slow (CI's 40-minute budget): the mass preemption scenario (8 nodes, twice: about 8 minutes on 2 cores) passed
# in the full run of 2026-12-07 (see issue 34's note); its logic runs in CI in tests/unit/test_scenario_mass.py.
# Run with -m slow.
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

STEPS, BATCH, LOST = 60, 840, 5


def _scenario(notice: bool) -> dict:
    action = {"at_step": 25, "min_world": 8, "action": "preempt_nodes", "count": LOST, "notice": notice}
    if notice:
        # 20 s: the emergency checkpoint of 8 workers on a busy 2-core machine (drain_node's tests use 20 too)
        action["deadline_s"] = 20
    return {
        "cluster": {"gpu_resource": "GPU_SLOT", "nodes": [{"gpus": 1}] * 8},
        "training": {"model": "tiny", "workers": [1, 8], "steps": STEPS, "global_batch": BATCH,
                     "max_micro_batch": 105, "checkpoint_every": 10, "zero_stage": 2, "warmup_steps": 5},
        # mid-interval (step 25, the newest commit at 20), once training runs all 8 workers
        "events": [action],
    }


def _run(tmp_path_factory, notice: bool):
    out = tmp_path_factory.mktemp("mass-notice" if notice else "mass-hard")
    with contextlib.redirect_stdout(io.StringIO()):   # what Ray's driver prints while nodes die on purpose
        report = run_scenario(parse_scenario(_scenario(notice), "mass"), str(out), quiet=True)
    return report


@pytest.fixture(scope="module")
def hard_run(tmp_path_factory):
    return _run(tmp_path_factory, notice=False)


@pytest.fixture(scope="module")
def notice_run(tmp_path_factory):
    return _run(tmp_path_factory, notice=True)


def _check_common(report: dict, kind: str) -> tuple[list[dict], dict]:
    assert report["ok"], digest(report)
    tr = report["training"]
    assert tr["steps_completed"] == STEPS
    # the ledger carried in the final checkpoint: every sample exactly once
    assert tr["samples"]["consumed"] == STEPS * BATCH, tr["samples"]
    assert tr["samples"]["duplicates"] == 0 and tr["samples"]["missing"] == 0, tr["samples"]
    (entry,) = [e for e in report["events"] if e["action"] == "preempt_nodes"]
    assert entry["fired"] and len(entry["nodes"]) == LOST and len(entry["nodes_left"]) == 8 - LOST, entry
    pre = [p for p in report["preemptions"] if p["action"] == "preempt_nodes"]
    assert sorted(p["node"] for p in pre) == entry["nodes"], pre
    assert all(p["kind"] == kind and p["world_size_before"] == 8 for p in pre), pre
    # the target: the 5 nodes preempted within 1 s (one pass of the runner: drains or SIGKILLs)
    assert entry["fire_spread_s"] <= 1.0, entry
    # 0 committed checkpoints lost: every restore after the action resumed at or past the newest commit
    assert entry["committed_step_before"] is not None
    assert entry["resumed_from_steps"] and min(entry["resumed_from_steps"]) >= entry["committed_step_before"], entry
    for name in ("mass_preemption_no_committed_checkpoint_lost", "mass_preemption_training_continues"):
        assert report["invariants"][name]["ok"], report["invariants"][name]
    # training stepping again on the survivors
    assert entry["stepped_again"] and entry["gpus_left"] == 8 - LOST, entry
    assert entry["world_size_after"] == 8 - LOST, entry
    return pre, entry


def test_five_of_eight_nodes_killed_at_once(hard_run):
    pre, entry = _check_common(hard_run, "hard")
    # hard loss: rolled back at most to the newest commit before it (step 20 for a loss at 25..)
    assert all(p["affected"] and p["lost_steps"] <= 10 + (p["steps_since_newest_save"] or 0) for p in pre), pre
    # each node's end: removed by the runner in the same pass, and dead in Ray's node table
    assert entry["gone_spread_s"] is not None
    for p in pre:
        assert p["gone_at"] is not None and p["gone_at"] >= p["at"], p
        assert p["end"] and p["end"]["ended"] is not None and p["end"]["death_reason"], p


def test_five_of_eight_nodes_preempted_with_notice(notice_run):
    pre, _ = _check_common(notice_run, "announced")
    # a notice each: the emergency checkpoint committed before the deadline, no step lost
    assert notice_run["invariants"]["announced_preemption_loses_nothing"]["ok"]
    assert all(p["lost_steps"] == 0 and p["committed_before_deadline"] for p in pre), pre
    for p in pre:      # removed at its deadline (if training still ran then), else still up at the end
        if p["gone_at"] is not None:
            assert p["gone_at"] >= p["at"] + 20 and p["end"]["ended"] is not None, p
