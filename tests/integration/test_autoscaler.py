"""Ray's own autoscaler in the loop: autoscaler v2 with its fake multi-node provider (every launched node is a
real raylet on this machine carrying logical GPU slots), driven by the scenario runner on a head-only cluster.

One run (shared by the tests below), worker types like cluster.yaml's: `gpu_spot` (priority 10) and an
on-demand fallback `gpu_ondemand` (priority 0), 2 GPU_SLOT each. Training asks for workers [1, 4]:
  a) the autoscaler launches spot nodes for the request and training grows onto them, to 4 workers;
  b) a spot node gets a notice (drain, deadline) and is taken at the deadline: the autoscaler launches a
     spot replacement and training grows back to 4; then the spot market closes (the fake cloud accepts
     spot requests and never fulfils them, as an open spot request) and the other spot node is taken: the
     autoscaler times the spot request out and launches the on-demand type, and training grows back onto it;
  c) after training, the idle nodes are scaled down after the idle timeout; nothing spotfill made (placement
     group, actor, resource request) is left to keep a node alive.
How long it takes on this machine is printed (pytest -s) and is in report.json's `seconds`.
"""
from __future__ import annotations

import contextlib
import io
import json

import pytest

# Slow for now: with warm grows (train.readiness) each grow back waits for the new node's spares, and this
# scenario's timeline (two losses, a closed spot market, the on-demand fallback) no longer fits its steps
# and deadlines on a 2-core CI machine; re-tuning it is part of issue 31's remaining work. Run: -m slow.
pytestmark = pytest.mark.slow

from spotfill.sim.outcomes import digest
from spotfill.sim.runner import run_scenario
from spotfill.sim.scenario import parse_scenario
from spotfill.telemetry.events import read_events

# 1000: each grow (the first, and back to 4 after each loss) waits for the new node's spares to warm up
# (train.readiness: 20-40 s here while training steps on the same 2 cores); with 240 training finished at 2
# workers before it grew back
STEPS = 1000
IDLE_TIMEOUT_S = 5
SCENARIO = {
    "cluster": {"gpu_resource": "GPU_SLOT", "autoscaler": {
        # at most 2 worker nodes at a time (cluster.yaml's top-level max_workers): without the cap, the
        # moment of a grow (the new group's placement group pending while the old group's slots are
        # still reported held) is a demand the autoscaler answers with a third node
        "max_workers": 2, "idle_timeout_s": IDLE_TIMEOUT_S, "allocate_timeout_s": 8, "node_types": {
            "gpu_spot": {"gpus": 2, "market": "spot", "max_workers": 2, "priority": 10},
            "gpu_ondemand": {"gpus": 2, "market": "on-demand", "max_workers": 1, "priority": 0}}}},
    "training": {"model": "tiny", "workers": [1, 4], "steps": STEPS, "global_batch": 12, "max_micro_batch": 3,
                 "checkpoint_every": 20, "zero_stage": 2, "warmup_steps": 10},
    # deadline 20 s: an emergency save must commit by deadline - 5 s (SPOTFILL_EMERGENCY_MARGIN_S), and Ray
    # Train's watcher saw a notice here 2.4-4.6 s after the drain while the autoscaler started the replacement
    # node's raylet on the same 2 cores, 9.5 s once while new spares warmed up beside them: with 8 s both
    # saves were abandoned as "no time", with 12 s one (a real notice: 120 s on AWS, 30 s on GCP)
    "events": [
        # node indices: launched nodes in launch order (the first two are the spot nodes of the first launch)
        {"at_step": 20, "min_world": 4, "action": "drain_node", "node": 0, "deadline_s": 20},
        {"at_step": 40, "min_world": 4, "action": "market", "node_type": "gpu_spot", "available": False},
        {"at_step": 40, "min_world": 4, "action": "drain_node", "node": 1, "deadline_s": 20},
    ],
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("autoscale")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):   # what Ray's driver prints while nodes die on purpose
        report = run_scenario(parse_scenario(SCENARIO, "autoscale"), str(out), quiet=True)
    (out / "stdout.txt").write_text(printed.getvalue())
    print(f"\nautoscaler scenario: {report.get('seconds')} s; world sizes "
          f"{[n for _, n in report['training']['world_size_timeline']]}")
    events = list(read_events(str(out / "events.jsonl")))
    return report, events, out


def _launched(report, node_type=None):
    return [n for n in report["cluster"]["nodes"] if n["launched_by"] == "autoscaler"
            and (node_type is None or n["type"] == node_type)]


def _resumes(events):
    return [e for e in events if e["kind"] == "resume"]


def _grows(events):
    """(planned grow exit, the resume that followed) pairs."""
    out = []
    for e in events:
        if e["kind"] == "planned_exit" and e["reason"] == "grow":
            nxt = next(r for r in events if r["kind"] == "resume" and r["attempt"] == e["attempt"] + 1)
            out.append((e, nxt))
    return out


def test_every_invariant_holds(run):
    report, _, out = run
    assert report["ok"], digest(report)
    assert json.loads((out / "report.json").read_text())["ok"]
    assert report["training"]["steps_completed"] == STEPS
    assert report["training"]["samples"] == {"consumed": STEPS * 12, "duplicates": 0, "missing": 0,
                                             "source": "checkpoint-ledger"}


def test_autoscaler_launches_nodes_and_training_grows_onto_them(run):
    report, events, _ = run
    # the head carries no GPU slots: every worker ran on a node the autoscaler launched, spot first
    first = _launched(report)[:2]
    assert [n["type"] for n in first] == ["gpu_spot", "gpu_spot"] and all(n["market"] == "spot" for n in first)
    sizes = [n for _, n in report["training"]["world_size_timeline"]]
    assert max(sizes) == 4 and sizes[-1] == 4
    grows = _grows(events)
    assert len(grows) >= 2                      # at least one regrow after each spot loss
    for exit_, resume in grows:                 # graceful: the group restarts larger where it left, no step lost
        assert resume["world_size"] > exit_["world_size"]
        assert resume["step"] == exit_["step"]


def test_training_asks_for_what_max_needs(run):
    report, _, _ = run
    requests = report["autoscaler"]["requests"]
    # Ray Train's elastic policy asks, through its autoscaling coordinator (ray.autoscaler.sdk.request_resources),
    # for max workers of one worker's resources -- while it runs on fewer
    during = [r["request"] for r in requests if r["request"]]
    assert during and all(r == [{"bundle": {"CPU": 1.0, "GPU_SLOT": 1.0}, "count": 4}] for r in during), requests
    # asked for before any node existed (the head has no GPU slots), and it is the whole request
    assert next(r for r in requests if r["request"])["step"] == 0
    assert report["autoscaler"]["scale_down"]["request_after"] == []


def test_spot_loss_is_replaced_and_training_grows_back(run):
    report, events, _ = run
    first_notice = report["preemptions"][0]
    assert first_notice["kind"] == "announced" and first_notice["lost_steps"] == 0
    spot = _launched(report, "gpu_spot")
    replacement = [n for n in spot if n["started"] > first_notice["at"]]
    assert replacement, report["cluster"]["nodes"]
    drained = next(n for n in spot if n["started"] < first_notice["at"] and n["ended"]
                   and n["ended"] < replacement[0]["started"] + 30)
    assert drained["death_reason"].startswith(("AUTOSCALER_DRAIN_PREEMPTED", "UNEXPECTED_TERMINATION"))
    # training ran on 4 workers again after the replacement started (a restart straight back at 4 is no
    # change in world_size_timeline: read the restarts themselves)
    assert any(e["t"] > replacement[0]["started"] and e["world_size"] == 4 for e in _resumes(events))
    assert report["invariants"]["replaced_and_grown_back"]["ok"]


def test_on_demand_fallback_when_spot_cannot_be_had(run):
    report, events, _ = run
    closed = next(e for e in report["events"] if e["action"] == "market")
    second_notice = report["preemptions"][1]
    ondemand = _launched(report, "gpu_ondemand")
    assert len(ondemand) == 1 and ondemand[0]["market"] == "on-demand"
    assert ondemand[0]["started"] > closed["at"]
    # the spot type was tried first (priority) and never came: only then the on-demand type
    failures = report["cluster"]["launch_failures"]
    assert failures and failures[0]["type"] == "gpu_spot" and failures[0]["t"] < ondemand[0]["started"]
    assert not [n for n in _launched(report, "gpu_spot") if n["started"] > closed["at"]]
    assert any(e["t"] > ondemand[0]["started"] and e["world_size"] == 4 for e in _resumes(events))
    assert second_notice["lost_steps"] == 0


def test_idle_nodes_scale_down_and_nothing_is_left_behind(run):
    report, _, _ = run
    down = report["autoscaler"]["scale_down"]
    assert down["nodes_left"] == 0, down
    assert down["placement_groups"] == [] and down["actors_on_launched_nodes"] == []
    for n in _launched(report):
        assert n["ended"] is not None and n["death_reason"], n
    idle = [n for n in _launched(report) if n["death_reason"].startswith("AUTOSCALER_DRAIN_IDLE")]
    assert len(idle) == 2          # the two nodes training ran on at the end
