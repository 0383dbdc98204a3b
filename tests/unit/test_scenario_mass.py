"""The preempt_nodes scenario action: parsing and one-line errors, which nodes it takes, firing them in one
pass (on a fake cluster), its report entries and invariants, and the runner's wiring (_drive with a fake
cluster and a fake training job writing events.jsonl)."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from spotfill.config.errors import ConfigError
from spotfill.sim.mass import Choice, add_node_ends, choose_nodes, fire, gpus_of, mass_report
from spotfill.sim.outcomes import mass_invariants, mass_outcome
from spotfill.sim.scenario import Event, parse_scenario

EIGHT = {"cluster": {"gpu_resource": "GPU_SLOT", "nodes": [{"gpus": 1}] * 8},
         "training": {"model": "tiny", "workers": [1, 8], "steps": 40, "global_batch": 840,
                      "max_micro_batch": 105, "checkpoint_every": 20}}


def _scenario(*events):
    return parse_scenario({**EIGHT, "events": list(events)}, "mass")


# -- parsing -------------------------------------------------------------------------------------------
def test_preempt_nodes_parses_nodes_or_count_and_describes_them():
    s = _scenario({"at_step": 25, "min_world": 8, "action": "preempt_nodes", "nodes": [4, 0, 2], "notice": False},
                  {"at_step": 30, "action": "preempt_nodes", "count": 5, "deadline_s": 30},
                  {"at": 5, "action": "preempt_nodes", "nodes": list(range(8)), "allow_all": True, "notice": True})
    hard, notice, every = s.events
    assert (hard.nodes, hard.count, hard.notice, hard.allow_all) == ((4, 0, 2), None, False, False)
    assert (notice.nodes, notice.count, notice.notice, notice.deadline_s) == (None, 5, True, 30.0)
    assert every.allow_all and every.deadline_s == 20.0          # the default deadline, as drain_node's
    assert hard.describe() == "preempt nodes 4, 0, 2 at once (no notice: killed) at step 25 once training runs 8 workers"
    assert notice.describe() == ("preempt the 5 nodes training uses most at once (each with a notice, deadline "
                                 "30s) at step 30")


@pytest.mark.parametrize("event, field, says", [
    ({"nodes": [0], "count": 1}, "events[0]", "exactly one of `nodes` or `count`"),
    ({}, "events[0]", "exactly one of `nodes` or `count`"),
    ({"nodes": []}, "events[0].nodes", "distinct node indices"),
    ({"nodes": [1, 1]}, "events[0].nodes", "distinct node indices"),
    ({"nodes": [-1]}, "events[0].nodes", "distinct node indices"),
    ({"nodes": [True]}, "events[0].nodes", "distinct node indices"),
    ({"nodes": 3}, "events[0].nodes", "distinct node indices"),
    ({"count": 0}, "events[0].count", "an integer >= 1"),
    ({"count": True}, "events[0].count", "an integer >= 1"),
    ({"count": 2, "notice": "yes"}, "events[0].notice", "true or false"),
    ({"count": 2, "allow_all": 1}, "events[0].allow_all", "true or false"),
    ({"count": 2, "notice": False, "deadline_s": 10}, "events[0].deadline_s", "applies only with notice: true"),
    ({"count": 2, "deadline_s": 0}, "events[0].deadline_s", ">= 1"),
    ({"count": 2, "node": 1}, "events[0].node", "unknown key for preempt_nodes"),
    ({"nodes": [0, 8]}, "events[0].nodes", "node(s) [8] can never exist"),
    ({"nodes": list(range(8))}, "events[0].nodes", "would preempt all 8 nodes"),
    ({"count": 8}, "events[0].count", "would preempt all 8 nodes"),
])
def test_bad_preempt_nodes_fields_name_the_field(event, field, says):
    with pytest.raises(ConfigError) as err:
        _scenario({"at_step": 3, "action": "preempt_nodes", **event})
    msg = str(err.value)
    assert msg.startswith(field + ":") and says in msg and "\n" not in msg, msg


def test_added_nodes_count_and_an_autoscaler_or_allow_all_lift_the_one_left_rule():
    s = _scenario({"at_step": 3, "action": "add_node", "gpus": 1},
                  {"at_step": 5, "action": "preempt_nodes", "nodes": list(range(8)), "notice": False})
    assert s.events[1].nodes == tuple(range(8))       # node 8 (added) is left
    assert _scenario({"at_step": 5, "action": "preempt_nodes", "count": 9, "allow_all": True}).events[0].count == 9
    auto = parse_scenario({"cluster": {"autoscaler": {"node_types": {"g": {"gpus": 2, "max_workers": 2}}}},
                           "events": [{"at_step": 5, "action": "preempt_nodes", "count": 3}]})
    assert auto.events[0].count == 3


# -- which nodes ---------------------------------------------------------------------------------------
IDS = [f"n{i}" for i in range(6)]


def _ev(**kw):
    return Event(index=0, action="preempt_nodes", at_step=1, **kw)


def test_count_takes_the_alive_nodes_training_uses_most_ties_to_the_lower_index():
    group = {"n1": 1, "n3": 2, "n4": 1, "n5": 1}
    dead = {4}
    choice = choose_nodes(_ev(count=3), group, IDS, lambda i: i not in dead)
    assert choice == Choice([1, 3, 5], [], [0, 2])
    assert choose_nodes(_ev(count=2), {}, IDS, lambda i: True).chosen == [0, 1]


def test_listed_nodes_that_are_gone_are_reported_and_the_rest_fire():
    choice = choose_nodes(_ev(nodes=(5, 1, 2)), {}, IDS, lambda i: i != 2)
    assert (choice.chosen, choice.not_alive, choice.left, choice.skip) == ([1, 5], [2], [0, 3, 4], None)
    assert "none of nodes [2] is alive" == choose_nodes(_ev(nodes=(2,)), {}, IDS, lambda i: i != 2).skip


def test_an_action_that_would_leave_no_gpu_node_is_skipped_unless_allow_all():
    alive = lambda i: i in (1, 4)   # noqa: E731
    assert "would leave no GPU node alive" in choose_nodes(_ev(nodes=(1, 4, 5)), {}, IDS, alive).skip
    assert "3 nodes asked, 2 alive" == choose_nodes(_ev(count=3), {}, IDS, alive).skip
    assert choose_nodes(_ev(count=2, allow_all=True), {}, IDS, alive) == Choice([1, 4], [], [])


# -- firing in one pass (a fake cluster) ---------------------------------------------------------------
class FakeCluster:
    """The runner's cluster interface, recording every call in order."""

    def __init__(self, n: int, gpus: int = 1):
        self.node_ids = [f"n{i}" for i in range(n)]
        self.records = [{"id": "head", "gpus": 0}] + [{"id": i, "gpus": gpus} for i in self.node_ids]
        self.dead: set[int] = set()
        self.calls: list[tuple] = []

    def alive(self, i: int) -> bool:
        return 0 <= i < len(self.node_ids) and i not in self.dead

    def kill_workers(self, i: int) -> int:
        self.calls.append(("kill_workers", i))
        return 1

    def remove_node(self, i: int, graceful: bool) -> None:
        self.calls.append(("remove_node", i, graceful))
        self.dead.add(i)

    def drain_node(self, i: int, deadline_s: float, message: str, reason: str = "PREEMPTION") -> None:
        self.calls.append(("drain_node", i, deadline_s))

    def refresh(self) -> list[int]:
        return []


def _clock(start=100.0, tick=0.01):
    t = [start - tick]

    def now():
        t[0] += tick
        return t[0]
    return now


def test_without_notice_every_nodes_workers_die_before_any_node_is_removed():
    c, removals, gone = FakeCluster(8), [], {}
    at = fire(_ev(nodes=(0, 1, 2, 3, 4), notice=False), [0, 1, 2, 3, 4], c, removals, gone, clock=_clock())
    assert c.calls[:5] == [("kill_workers", i) for i in range(5)]
    assert c.calls[5:] == [("remove_node", i, False) for i in range(5)]
    assert at == pytest.approx({i: 100.0 + 0.01 * i for i in range(5)})      # each node's own fire time
    assert sorted(gone) == [0, 1, 2, 3, 4] and min(gone.values()) > max(at.values()) and removals == []


def test_with_notice_each_node_is_drained_and_removed_at_its_own_deadline():
    c, removals, gone = FakeCluster(8), [], {}
    at = fire(_ev(count=2, notice=True, deadline_s=30.0), [3, 6], c, removals, gone, clock=_clock())
    assert c.calls == [("drain_node", 3, 30.0), ("drain_node", 6, 30.0)]
    assert removals == [(at[3] + 30.0, 3, False), (at[6] + 30.0, 6, False)] and gone == {}
    assert gpus_of(c, [0, 1, 2]) == 3


# -- outcomes and invariants ---------------------------------------------------------------------------
def _timeline(resume_step=20, steps_after=True):
    """8 workers step 1..27 (commit at 20), 5 nodes lost at 50.0-50.004; attempt 1 on 3 from `resume_step`."""
    ev = [{"t": 10.0, "kind": "attempt", "attempt": 0, "world_size": 8},
          {"t": 11.0, "kind": "start", "attempt": 0, "step": 0, "world_size": 8}]
    ev += [{"t": 20.0 + s, "kind": "step", "attempt": 0, "step": s, "world_size": 8} for s in range(1, 28)]
    ev += [{"t": 40.5, "kind": "checkpoint_save", "attempt": 0, "step": 20},
           {"t": 41.0, "kind": "checkpoint", "attempt": 0, "step": 20, "tag": "step-00000020"},
           {"t": 55.0, "kind": "attempt", "attempt": 1, "world_size": 3},
           {"t": 56.0, "kind": "resume", "attempt": 1, "step": resume_step, "world_size": 3}]
    if steps_after:
        ev += [{"t": 57.0 + s, "kind": "step", "attempt": 1, "step": resume_step + s, "world_size": 3}
               for s in range(1, 4)]
    return sorted(ev, key=lambda e: e["t"])


def test_mass_report_lists_each_node_and_the_spread_of_their_fire_times():
    ev = _ev(nodes=(0, 1, 2, 3, 4), notice=False)
    at = {i: 50.0 + 0.001 * i for i in range(5)}
    gone = {i: 50.1 + 0.01 * i for i in range(5)}
    pre, entry = mass_report(ev, Choice([0, 1, 2, 3, 4], [], [5, 6, 7]), at, gone, _timeline(),
                             [f"n{i}" for i in range(8)], 8, 3, 1)
    assert [(p["node"], p["node_id"], p["kind"], p["gone_at"]) for p in pre] == [
        (i, f"n{i}", "hard", round(gone[i], 3)) for i in range(5)]
    assert all(p["affected"] and p["resumed_from_step"] == 20 and p["lost_steps"] == 7 for p in pre)
    assert entry["nodes"] == [0, 1, 2, 3, 4] and entry["fire_spread_s"] == 0.004 and entry["gone_spread_s"] == 0.04
    assert (entry["committed_step_before"], entry["resumed_from_steps"], entry["stepped_again"]) == (20, [20], True)
    assert entry["world_size_after"] == 3 and entry["nodes_left"] == [5, 6, 7]


def _entry(events, gpus_left=3, min_workers=1, first=50.0, last=50.004):
    return {"index": 0, "gpus_left": gpus_left, "min_workers": min_workers, **mass_outcome(events, first, last)}


def test_a_restore_behind_a_checkpoint_committed_before_the_action_fails_the_invariant():
    assert mass_invariants([_entry(_timeline())])["mass_preemption_no_committed_checkpoint_lost"]["ok"]
    bad = mass_invariants([_entry(_timeline(resume_step=0))])["mass_preemption_no_committed_checkpoint_lost"]
    assert not bad["ok"] and "step 20 was committed before it" in bad["detail"]
    damaged = _timeline(resume_step=0) + [{"t": 55.5, "kind": "checkpoint_quarantined", "attempt": 1,
                                          "tag": "step-00000020"}]
    assert mass_invariants([_entry(damaged)])["mass_preemption_no_committed_checkpoint_lost"]["ok"]


def test_training_must_step_again_when_the_nodes_left_hold_min_workers():
    assert mass_invariants([_entry(_timeline())])["mass_preemption_training_continues"]["ok"]
    stalled = mass_invariants([_entry(_timeline(steps_after=False))])["mass_preemption_training_continues"]
    assert not stalled["ok"] and "never stepped again" in stalled["detail"]
    # the old group's steps written after the loss do not count as stepping again
    late = _timeline(steps_after=False) + [{"t": 50.5, "kind": "step", "attempt": 0, "step": 28, "world_size": 8}]
    assert not mass_invariants([_entry(sorted(late, key=lambda e: e["t"]))])[
        "mass_preemption_training_continues"]["ok"]
    below = mass_invariants([_entry(_timeline(steps_after=False), gpus_left=3, min_workers=4)])
    assert below["mass_preemption_training_continues"]["ok"]
    assert "waits below min" in below["mass_preemption_training_continues"]["detail"]


def test_each_preemption_gets_its_nodes_end_from_the_cluster_section():
    report = {"preemptions": [{"node_id": "a"}, {"node_id": "b"}],
              "cluster": {"nodes": [{"id": "a", "ended": 51.2, "death_reason": "UNEXPECTED_TERMINATION: x"}]}}
    add_node_ends(report)
    assert report["preemptions"][0]["end"] == {"ended": 51.2, "death_reason": "UNEXPECTED_TERMINATION: x"}
    assert report["preemptions"][1]["end"] is None


# -- the runner's wiring: _drive with a fake cluster and a fake training job ----------------------------
class FakeJob:
    """Writes a training run's events as the workers would: 8 workers step to 30 (commit at 20), then wait
    until the cluster lost nodes -- all of them removed with notice -- and resume from 20 on the rest."""

    def __init__(self, path: str, cluster: FakeCluster, lost: int, steps: int = 40):
        self.events_path, self.cluster, self.lost, self.steps = path, cluster, lost, steps

    def _emit(self, **e):
        e.setdefault("t", time.time())
        with open(self.events_path, "a") as f:
            f.write(json.dumps(e) + "\n")

    def fit(self) -> dict:
        ids = self.cluster.node_ids
        self._emit(kind="attempt", attempt=0, world_size=8)
        self._emit(kind="start", attempt=0, step=0, world_size=8, workers=[[n, r] for r, n in enumerate(ids)])
        for s in range(1, 31):
            self._emit(kind="step", attempt=0, step=s, world_size=8)
            if s == 20:
                self._emit(kind="checkpoint_save", attempt=0, step=20)
                self._emit(kind="checkpoint", attempt=0, step=20, tag="step-00000020")
        deadline = time.time() + 20
        while len(self.cluster.dead) < self.lost and time.time() < deadline:
            time.sleep(0.05)
        world = 8 - len(self.cluster.dead)
        self._emit(kind="attempt", attempt=1, world_size=world)
        self._emit(kind="resume", attempt=1, step=20, world_size=world)
        for s in range(21, self.steps + 1):
            self._emit(kind="step", attempt=1, step=s, world_size=world)
        self._emit(kind="finish", attempt=1, ok=True)
        return {"training": {"steps_completed": self.steps, "steps_target": self.steps,
                             "samples": {"consumed": self.steps * 840, "duplicates": 0, "missing": 0}}}

    def report(self, error=None) -> dict:
        return {"training": {"steps_completed": 0, "steps_target": self.steps,
                             "samples": {"consumed": 0, "duplicates": 0, "missing": 0}}}


def _drive(tmp_path, scenario, lost):
    from spotfill.sim.runner import _drive as drive
    cluster = FakeCluster(8)
    job = FakeJob(os.path.join(tmp_path, "events.jsonl"), cluster, lost)
    said: list[str] = []
    report = drive(cluster, scenario, job, None, said.append)
    assert not [t for t in threading.enumerate() if t.name == "spotfill-fit"]
    return report, cluster, said


@pytest.mark.timeout(60)
def test_the_runner_fires_five_nodes_in_one_pass_and_reports_each(tmp_path):
    s = _scenario({"at_step": 25, "min_world": 8, "action": "preempt_nodes", "count": 5, "notice": False})
    report, cluster, said = _drive(tmp_path, s, lost=5)
    assert report["ok"], report["invariants"]
    kills = [c for c in cluster.calls if c[0] == "kill_workers"]
    assert [c[1] for c in kills] == [0, 1, 2, 3, 4] and cluster.calls.index(kills[-1]) < 5
    pre = report["preemptions"]
    assert [(p["node"], p["kind"], p["event_index"]) for p in pre] == [(i, "hard", 0) for i in range(5)]
    assert all(p["gone_at"] is not None and p["world_size_before"] == 8 and p["resumed_from_step"] == 20
               for p in pre)
    (entry,) = report["events"]
    assert entry["fired"] and entry["nodes"] == [0, 1, 2, 3, 4] and entry["fire_spread_s"] >= 0
    assert entry["gpus_left"] == 3 and entry["world_size_after"] == 3 and entry["stepped_again"]
    assert report["invariants"]["mass_preemption_no_committed_checkpoint_lost"]["ok"]
    assert report["invariants"]["mass_preemption_training_continues"]["ok"]
    assert any("nodes [0, 1, 2, 3, 4] preempted within" in line for line in said)


@pytest.mark.timeout(60)
def test_the_runner_drains_each_node_and_removes_it_at_its_deadline(tmp_path):
    s = _scenario({"at_step": 25, "min_world": 8, "action": "preempt_nodes", "nodes": [1, 6], "notice": True,
                   "deadline_s": 1})
    report, cluster, _ = _drive(tmp_path, s, lost=2)
    assert [c for c in cluster.calls if c[0] == "drain_node"] == [("drain_node", 1, 1.0), ("drain_node", 6, 1.0)]
    assert sorted(c[1] for c in cluster.calls if c[0] == "remove_node") == [1, 6]
    pre = report["preemptions"]
    assert [(p["node"], p["kind"]) for p in pre] == [(1, "announced"), (6, "announced")]
    assert all(p["gone_at"] >= p["at"] + 1.0 for p in pre)
    assert report["events"][0]["deadline_s"] == 1.0 and report["events"][0]["gpus_left"] == 6


@pytest.mark.timeout(60)
def test_the_runner_skips_an_action_that_would_leave_no_node_and_says_why(tmp_path):
    s = _scenario({"at_step": 25, "action": "kill_node", "node": 7},
                  {"at_step": 26, "after": 0, "action": "preempt_nodes", "nodes": list(range(7)), "notice": False})
    report, cluster, said = _drive(tmp_path, s, lost=1)
    assert "would leave no GPU node alive" in report["events"][1]["skipped"] and not report["events"][1]["fired"]
    assert not [c for c in cluster.calls if c[0] == "kill_workers" and c[1] != 7]
    assert any(line.startswith("skipped: preempt nodes 0, 1") for line in said)
